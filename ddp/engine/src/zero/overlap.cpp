// ZeroRedundancyOptimizer overlapped with DDP: the bucket assignment and the per-bucket step and
// broadcast the hook drives (overlap.h; the hook itself is ddp_zero_hook.cpp).
#include "zero/overlap.h"

#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ddp/wait_collective.h>
#include <ddp/zero_redundancy_optimizer.h>

#include "error_text.h"

namespace ddp::detail {

namespace {

constexpr char kWho[] = "ZeroRedundancyOptimizer";

// param.grad() set to the given gradients for the life of the guard, then put back: the local
// optimizer reads gradients there, and DDP writes its own into them when backward ends.
class LendGradients {
 public:
  LendGradients(const std::vector<at::Tensor>& params, std::vector<at::Tensor> grads) : params_(params) {
    for (size_t k = 0; k < params_.size(); ++k) {
      at::Tensor& grad = params_[k].mutable_grad();
      kept_.push_back(std::exchange(grad, std::move(grads[k])));
    }
  }
  ~LendGradients() {
    for (size_t k = 0; k < params_.size(); ++k) params_[k].mutable_grad() = std::move(kept_[k]);
  }
  LendGradients(const LendGradients&) = delete;
  LendGradients& operator=(const LendGradients&) = delete;

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> kept_;
};

}  // namespace

ZeroRedundancyOptimizerBase& ZeroOverlap::zero() const {
  if (zero_ == nullptr) {
    raise<std::runtime_error>(kWho, "the optimizer this hook_with_zero_step steps was destroyed while the "
                                    "DistributedDataParallel model it is registered on still trains; keep the "
                                    "optimizer alive as long as the model");
  }
  return *zero_;
}

std::shared_ptr<ZeroOverlap> ZeroOverlap::of(ZeroRedundancyOptimizerBase& zero) {
  if (!zero.overlap_) raise<std::invalid_argument>(kWho, "constructed without overlap_with_ddp(true)");
  return zero.overlap_;
}

void ZeroOverlap::begin_pass() {
  broadcasts_.clear();
  broadcast_buckets_.clear();
}

void ZeroOverlap::attach_hook(const std::string& hook_name) {
  if (!hook_name_.empty()) {
    raise<std::invalid_argument>(kWho, "a " + hook_name_ + " hook was already made for this optimizer; one "
                                       "optimizer steps one model's buckets (make one hook per optimizer)");
  }
  hook_name_ = hook_name;
}

// The partition starts empty: this rank's local optimizer gets its buckets' parameters as they come.
void ZeroOverlap::start_assignment() {
  ZeroRedundancyOptimizerBase& z = zero();
  buckets_.clear();
  for (auto& params : z.params_per_rank_) params.clear();
  for (auto& groups : z.params_per_group_per_rank_) groups[0].clear();
  z.local_->param_groups()[0].params().clear();
  z.local_->state().clear();
  status_ = Status::kAssigning;
}

void ZeroOverlap::assign(const GradBucket& bucket) {
  if (status_ == Status::kUninitialized || (status_ == Status::kAssigning && bucket.index() == 0)) {
    start_assignment();
  }
  if (status_ != Status::kAssigning) return;
  ZeroRedundancyOptimizerBase& z = zero();
  if (bucket.index() != buckets_.size()) {
    raise<std::logic_error>(kWho, "DDP bucket " + std::to_string(bucket.index()) + " came before bucket " +
                                      std::to_string(buckets_.size()) + " (a bug: buckets come in order)");
  }
  // PyTorch's rule: bucket i belongs to rank i % W.
  const int owner = static_cast<int>(bucket.index() % static_cast<size_t>(z.world_size_));
  const auto& mine = z.param_groups_[0].params();
  for (size_t k = 0; k < bucket.parameters().size(); ++k) {
    const at::Tensor& param = bucket.parameters()[k];
    bool found = false;
    for (const auto& p : mine) found = found || p.is_same(param);
    if (!found) {
      raise<std::invalid_argument>(kWho, "parameter " + std::to_string(bucket.parameter_indices()[k]) +
                                             " of the model (in DDP bucket " + std::to_string(bucket.index()) +
                                             ") is not one of the optimizer's parameters; construct it over "
                                             "model.parameters()");
    }
  }
  Assigned assigned;
  assigned.rank = owner;
  assigned.params = bucket.parameters();
  assigned.offsets = bucket.offsets();
  // The parameters become views of one flat tensor, broadcast whole from the owner (PyTorch's
  // _build_ddp_param_buckets). Their gradients are final for this pass, so nothing reads them now.
  at::NoGradGuard no_grad;
  int64_t numel = 0;
  for (const auto& param : assigned.params) numel += param.numel();
  assigned.flat = at::empty({numel}, assigned.params.front().options().requires_grad(false));
  int64_t offset = 0;
  for (auto& param : assigned.params) {
    at::Tensor view = assigned.flat.narrow(0, offset, param.numel()).view(param.sizes());
    view.copy_(param.detach());
    param.set_data(view);
    offset += param.numel();
  }
  auto& owned = z.params_per_rank_[static_cast<size_t>(owner)];
  owned.insert(owned.end(), assigned.params.begin(), assigned.params.end());
  auto& group = z.params_per_group_per_rank_[static_cast<size_t>(owner)][0];
  group.insert(group.end(), assigned.params.begin(), assigned.params.end());
  if (owner == z.rank_) {
    auto& local = z.local_->param_groups()[0].params();
    local.insert(local.end(), assigned.params.begin(), assigned.params.end());
  }
  buckets_.push_back(std::move(assigned));
}

bool ZeroOverlap::owns(size_t bucket) const { return buckets_.at(bucket).rank == zero().rank_; }

// The local optimizer steps this bucket's parameters only: its group holds them for the call (the
// state is keyed by parameter, so each keeps its own), with the group options a scheduler set.
void ZeroOverlap::step(size_t bucket, const at::Tensor& average) {
  ZeroRedundancyOptimizerBase& z = zero();
  const Assigned& assigned = buckets_.at(bucket);
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < assigned.params.size(); ++k) {
    const at::Tensor& param = assigned.params[k];
    grads.push_back(average.narrow(0, assigned.offsets[k], param.numel()).view(param.sizes()));
  }
  LendGradients lent(assigned.params, std::move(grads));
  auto& group = z.local_->param_groups()[0];
  group.set_options(z.param_groups_[0].options().clone());
  std::vector<at::Tensor> all = std::exchange(group.params(), assigned.params);
  struct Restore {
    std::vector<at::Tensor>& params;
    std::vector<at::Tensor>& all;
    ~Restore() { params = std::move(all); }
  } restore{group.params(), all};
  z.local_->step();
}

void ZeroOverlap::broadcast(size_t bucket) {
  ZeroRedundancyOptimizerBase& z = zero();
  const Assigned& assigned = buckets_.at(bucket);
  std::vector<at::Tensor> tensors{assigned.flat};
  c10d::BroadcastOptions options;
  options.rootRank = assigned.rank;
  broadcasts_.push_back(z.group_->broadcast(tensors, options));
  broadcast_buckets_.push_back(bucket);
}

// Every broadcast of the pass, waited on (a dead or stuck peer is an error naming the bucket).
void ZeroOverlap::finish_pass() {
  ZeroRedundancyOptimizerBase& z = zero();
  std::vector<c10::intrusive_ptr<c10d::Work>> works = std::move(broadcasts_);
  std::vector<size_t> which = std::move(broadcast_buckets_);
  broadcasts_.clear();
  broadcast_buckets_.clear();
  for (size_t i = 0; i < works.size(); ++i) {
    wait_collective(works[i], [&] {
      return std::string(kWho) + ": broadcast of DDP bucket " + std::to_string(which[i]) + "'s parameters from rank " +
             std::to_string(buckets_.at(which[i]).rank) + " (overlap_with_ddp, step " + std::to_string(z.steps_ + 1) + ")";
    });
  }
  status_ = Status::kInitialized;
  ++z.steps_;
}

}  // namespace ddp::detail
