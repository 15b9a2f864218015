// ZeroRedundancyOptimizer: the partition, the local optimizer over this rank's shard, and the step
// (local update, then every shard broadcast from its owner). Consolidation, save and load are in
// consolidate.cpp.
#include <ddp/zero_redundancy_optimizer.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>


#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/floor/src/desync.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/internal/compat/optimizer_state.h"
#include "ddp/engine/src/zero/overlap.h"
#include "ddp/engine/src/zero/partition.h"
#include "ddp/engine/src/zero/shard_tensors.h"
#include "ddp/engine/src/zero/who.h"

namespace ddp {

namespace {

using detail::kZeroWho;

// PyTorch's torch.typename of a tensor (its legacy type name), which its messages print.
std::string type_name(const at::Tensor& tensor) {
  const std::string scalar = c10::toString(tensor.scalar_type());
  const std::string device = tensor.is_cuda() ? "cuda." : "";
  const std::string layout = tensor.is_sparse() ? "sparse." : "";
  return "torch." + device + layout + scalar + "Tensor";
}

// The checks PyTorch's constructor and torch.optim.Optimizer.add_param_group make, on every group
// given so far (`existing`) plus `added`. Throws std::invalid_argument naming the parameter.
void check_parameters(const std::vector<torch::optim::OptimizerParamGroup>& existing,
                      const std::vector<torch::optim::OptimizerParamGroup>& added) {
  const at::Tensor* first = nullptr;
  std::set<const c10::TensorImpl*> seen;
  size_t g = 0;
  for (const auto* groups : {&existing, &added}) {
    for (const auto& group : *groups) {
      for (size_t i = 0; i < group.params().size(); ++i) {
        const at::Tensor& param = group.params()[i];
        const std::string where = "parameter " + std::to_string(i) + " of group " + std::to_string(g);
        if (!param.defined()) raise<std::invalid_argument>(kZeroWho, where + " is an undefined tensor");
        if (first == nullptr) first = &param;
        if (param.is_sparse()) {
          raise<std::invalid_argument>(kZeroWho, "only supports using the same dense type for all parameters but got " +
                                                     type_name(param) + " (" + where + ")");
        }
        if (type_name(param) != type_name(*first)) {
          raise<std::invalid_argument>(
              kZeroWho, "only supports using the same dense type for all parameters but got both " + type_name(*first) +
                            " and " + type_name(param) + " (" + where + "); convert the model to one dtype first");
        }
        if (!seen.insert(param.unsafeGetTensorImpl()).second) {
          raise<std::invalid_argument>(kZeroWho, "some parameters appear in more than one parameter group (" + where +
                                                     " was given before); list each parameter once");
        }
      }
      ++g;
    }
  }
  if (first == nullptr) raise<std::invalid_argument>(kZeroWho, "got an empty parameter list");
}

std::vector<torch::optim::OptimizerParamGroup> checked(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                       const ZeroRedundancyOptimizerOptions& options) {
  check_parameters({}, groups);
  if (options.overlap_with_ddp() && groups.size() != 1) {
    raise<std::invalid_argument>(kZeroWho, "with `overlap_with_ddp=True` only supports a single parameter group (got " +
                                               std::to_string(groups.size()) +
                                               "); pass one list of parameters, or "
                                               "construct with overlap_with_ddp(false) for several groups");
  }
  return groups;
}

ProcessGroupPtr resolve(const ProcessGroupPtr& group) { return group ? group : default_group(); }

}  // namespace

// parameters_as_bucket_view: per device, per rank, one flat tensor holding that rank's trainable
// parameters (their data are views of it), broadcast from that rank.
struct ZeroRedundancyOptimizerBase::Buckets {
  struct Bucket {
    int root;
    at::Tensor flat;
  };
  std::vector<Bucket> buckets;
};

// What the overlap half (zero/overlap.h) may do to this optimizer: here the partition and the local
// optimizer's group change together.
class ZeroRedundancyOptimizerBase::OverlapHost final : public detail::ZeroOverlapHost {
 public:
  explicit OverlapHost(ZeroRedundancyOptimizerBase& zero) : zero_(zero) {}

  const std::vector<at::Tensor>& params() const override { return zero_.param_groups_[0].params(); }

  void unassign_all() override {
    zero_.partition();  // with overlap_with_ddp: every parameter unowned
    zero_.local_->param_groups()[0].params().clear();
    zero_.local_->state().clear();
  }

  void assign(const std::vector<size_t>& positions, int rank) override {
    auto& local = zero_.local_->param_groups()[0].params();
    for (size_t i : positions) {
      zero_.partition_->assign({0, i}, rank);
      if (rank == zero_.rank_) local.push_back(params()[i]);
    }
  }

  // The group holds `params` for the call (the state is keyed by parameter, so each keeps its
  // own), with the options a scheduler set.
  void step_only(const std::vector<at::Tensor>& params) override {
    auto& group = zero_.local_->param_groups()[0];
    group.set_options(zero_.param_groups_[0].options().clone());
    std::vector<at::Tensor> all = std::exchange(group.params(), params);
    struct Restore {
      std::vector<at::Tensor>& params;
      std::vector<at::Tensor>& all;
      ~Restore() { params = std::move(all); }
    } restore{group.params(), all};
    zero_.local_->step();
  }

  int64_t steps() const override { return zero_.steps_; }
  void count_step() override { ++zero_.steps_; }

 private:
  ZeroRedundancyOptimizerBase& zero_;
};

ZeroRedundancyOptimizerBase::ZeroRedundancyOptimizerBase(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                                         std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                                         ZeroRedundancyOptimizerOptions options,
                                                         OptimizerFactory make_optimizer)
    : torch::optim::Optimizer(checked(std::move(param_groups), options), std::move(defaults)),
      options_(std::move(options)),
      make_optimizer_(std::move(make_optimizer)),
      group_(resolve(options_.process_group())),
      rank_(group_->getRank()),
      world_size_(group_->getSize()) {
  if (options_.overlap_with_ddp()) {
    overlap_ = std::make_shared<detail::ZeroOverlap>(std::make_unique<OverlapHost>(*this), group_);
  }
  partition();
  local_ = make_optimizer_(groups_of_rank(rank_));
  build_buckets();
}

ZeroRedundancyOptimizerBase::~ZeroRedundancyOptimizerBase() {
  if (overlap_) overlap_->forget_optimizer();  // its hook may outlive it
}

// Every rank computes the same partition from the same parameters (zero/partition.h).
void ZeroRedundancyOptimizerBase::partition() {
  std::vector<std::vector<int64_t>> numels;
  std::vector<size_t> sizes;
  for (const auto& group : param_groups_) {
    numels.emplace_back();
    for (const auto& param : group.params()) numels.back().push_back(param.numel());
    sizes.push_back(group.params().size());
  }
  // overlap_with_ddp: nothing is owned until the hook assigns DDP's buckets (zero/overlap.h).
  partition_ = std::make_unique<detail::Partition>(overlap_ ? detail::Partition(sizes)
                                                            : detail::Partition::greedy(numels, world_size_));
}

// Rank `rank`'s parameters in the order it updates them: all of them, or group `group`'s.
std::vector<at::Tensor> ZeroRedundancyOptimizerBase::params_of(int rank) const {
  std::vector<at::Tensor> params;
  for (const auto& place : partition_->of_rank(rank)) {
    params.push_back(param_groups_[place.group].params()[place.position]);
  }
  return params;
}

std::vector<at::Tensor> ZeroRedundancyOptimizerBase::params_of(int rank, size_t group) const {
  std::vector<at::Tensor> params;
  for (size_t i : partition_->of_rank(rank, group)) params.push_back(param_groups_[group].params()[i]);
  return params;
}

std::vector<std::vector<at::Tensor>> ZeroRedundancyOptimizerBase::params_per_rank() const {
  std::vector<std::vector<at::Tensor>> per_rank;
  for (int r = 0; r < world_size_; ++r) per_rank.push_back(params_of(r));
  return per_rank;
}

// Rank `rank`'s groups, each with its group's current options (a rank may own none of a group's
// parameters: its group is then empty, so group g is group g on every rank).
std::vector<torch::optim::OptimizerParamGroup> ZeroRedundancyOptimizerBase::groups_of_rank(int rank) const {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    groups.emplace_back(params_of(rank, g), param_groups_[g].options().clone());
  }
  return groups;
}

int ZeroRedundancyOptimizerBase::rank_of(const at::Tensor& param) const {
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].is_same(param)) continue;
      const int owner = partition_->owner({g, i});
      if (owner != detail::Partition::kNoOwner) return owner;
    }
  }
  raise<std::invalid_argument>(kZeroWho, "rank_of: the tensor is not one of the optimized parameters");
}

// Flat tensors per device and rank; the trainable parameters' data become views of them. Built at
// construction, after add_param_group, and when a parameter's requires_grad changed (a frozen
// parameter is not broadcast: its data gets a copy of its own, as in PyTorch).
void ZeroRedundancyOptimizerBase::build_buckets() {
  trainable_.clear();
  for (const auto& group : param_groups_) {
    for (const auto& param : group.params()) trainable_.push_back(param.requires_grad());
  }
  // overlap_with_ddp: the hook makes one flat tensor per DDP bucket instead (PyTorch ignores
  // parameters_as_bucket_view there too).
  if (!options_.parameters_as_bucket_view() || overlap_) return;
  at::NoGradGuard no_grad;
  auto buckets = std::make_unique<Buckets>();
  std::vector<c10::Device> devices;  // in order of first appearance
  for (const auto& group : param_groups_) {
    for (const auto& param : group.params()) {
      if (std::find(devices.begin(), devices.end(), param.device()) == devices.end()) devices.push_back(param.device());
    }
  }
  for (const auto& device : devices) {
    for (int r = 0; r < world_size_; ++r) {
      std::vector<at::Tensor> members;
      int64_t numel = 0;
      for (const auto& param : params_of(r)) {
        if (param.device() != device) continue;
        if (!param.requires_grad()) {
          param.set_data(param.detach().clone());
          continue;
        }
        members.push_back(param);
        numel += param.numel();
      }
      if (members.empty()) continue;  // the same on every rank: nothing to broadcast
      buckets->buckets.push_back({r, detail::flatten_as_views(members)});
    }
  }
  buckets_ = std::move(buckets);
}

void ZeroRedundancyOptimizerBase::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  if (overlap_) {
    raise<std::invalid_argument>(kZeroWho,
                                 "with `overlap_with_ddp=True` only supports a single parameter group: "
                                 "add_param_group is refused (construct with overlap_with_ddp(false) to add "
                                 "groups later)");
  }
  check_parameters(param_groups_, {param_group});
  torch::optim::Optimizer::add_param_group(param_group);
  // The earlier groups keep their owners (partition.h), so the local optimizer keeps its groups
  // and state and only gains this rank's part of the new group.
  partition();
  const size_t g = param_groups_.size() - 1;
  local_->add_param_group(torch::optim::OptimizerParamGroup(params_of(rank_, g), param_groups_[g].options().clone()));
  consolidated_.reset();  // it has one group fewer
  build_buckets();
}

// 1. options to the local groups, 2. the local step (rebuilding the buckets first if a parameter
// was frozen or unfrozen since they were built).
at::Tensor ZeroRedundancyOptimizerBase::step_shard(const LossClosure& closure) {
  size_t k = 0;
  bool changed = false;
  for (const auto& group : param_groups_) {
    for (const auto& param : group.params()) changed |= (param.requires_grad() != trainable_[k++]);
  }
  if (changed) build_buckets();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    local_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
  return local_->step(closure);
}

// 3. Every shard from its owner: all broadcasts launched in one order every rank shares, then
// waited on, each through wait_collective (a dead or stuck peer is an error naming it).
void ZeroRedundancyOptimizerBase::broadcast_shards() {
  at::NoGradGuard no_grad;
  std::vector<std::pair<int, at::Tensor>> shards;  // (owner, tensor), in an order every rank shares
  if (buckets_) {
    for (const auto& bucket : buckets_->buckets) shards.emplace_back(bucket.root, bucket.flat);
  } else {
    for (int r = 0; r < world_size_; ++r) {
      for (const auto& param : params_of(r)) shards.emplace_back(r, param.detach());
    }
  }
  if (shards.empty()) return;  // every parameter frozen: the same on every rank
  if (detail::debug_level_of(group_) == detail::DebugLevel::kDetail) {
    int64_t numel = 0;
    for (const auto& shard : shards) numel += shard.second.numel();
    detail::verify_same_collective(group_,
                                   {detail::CollectiveOp::kBroadcast, steps_, shards.front().second.scalar_type(),
                                    numel, -1, steps_, -1},
                                   "ZeroRedundancyOptimizer: the broadcast of every shard");
  }
  detail::BroadcastBatch batch;
  for (size_t i = 0; i < shards.size(); ++i) {
    const int root = shards[i].first;
    batch.launch(group_, shards[i].second, root, [i, root, count = shards.size(), step = steps_ + 1] {
      return std::string(kZeroWho) + ": broadcast " + std::to_string(i + 1) + " of " + std::to_string(count) +
             " of step " + std::to_string(step) + " (rank " + std::to_string(root) + "'s shard)";
    });
  }
  batch.wait_all();
}

at::Tensor ZeroRedundancyOptimizerBase::step(LossClosure closure) {
  if (overlap_) {
    if (!overlap_->hook_attached()) {
      raise<std::logic_error>(kZeroWho,
                              "step(): constructed with overlap_with_ddp(true), so the update runs inside "
                              "DDP's backward through its comm hook, and no hook was made for this optimizer: "
                              "nothing would ever be updated. Register one before training "
                              "(model.register_comm_hook(ddp::hooks::hook_with_zero_step("
                              "ddp::hooks::allreduce(), model, optimizer))), or construct with "
                              "overlap_with_ddp(false) to update in step()");
    }
    return {};  // the hook stepped during backward (PyTorch: a no-op, with a warning)
  }
  if (join_ != nullptr) {
    if (join_index_ == 0) {
      raise<std::invalid_argument>(kZeroWho,
                                   "under ddp::Join, list the DistributedDataParallel model before the "
                                   "optimizer (ddp::Join join({model, optimizer})): the model's collectives "
                                   "run first in every iteration");
    }
    join_->notify(join_index_, /*sync=*/true);
  }
  at::Tensor loss = step_shard(closure);
  broadcast_shards();
  ++steps_;
  return loss;
}

void ZeroRedundancyOptimizerBase::join_attach(Join* join, size_t index) {
  join_ = join;
  join_index_ = index;
}

// The active ranks step after each backward that synchronized gradients; DDP's shadow pass has
// just given this rank the same averaged gradients, so stepping its shard keeps it in step.
void ZeroRedundancyOptimizerBase::join_shadow(const JoinStatus& status) {
  if (!status.sync || overlap_) return;  // overlap: the hook runs in DDP's shadow pass
  step_shard(nullptr);
  broadcast_shards();
  ++steps_;
}

bool ZeroRedundancyOptimizerBase::overlap_initialized() const {
  return overlap_ && overlap_->status() == detail::ZeroOverlap::Status::kInitialized;
}

// PyTorch's _check_overlap_initialized, before the methods that need the bucket assignment.
void ZeroRedundancyOptimizerBase::require_overlap_initialized(const char* method) const {
  if (!overlap_ || overlap_initialized()) return;
  raise<std::runtime_error>(kZeroWho,
                            std::string(method) +
                                ": This method should not be called until this "
                                "ZeroRedundancyOptimizer instance has been fully initialized (overlap_with_ddp: "
                                "its hook assigns DDP's buckets to ranks in the first backward after DDP "
                                "rebuilt its buckets, i.e. the second synchronized iteration)");
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  if (const auto* zero = dynamic_cast<const ZeroRedundancyOptimizerBase*>(&optimizer)) {
    return optimizer_state_bytes(zero->local_optimizer());
  }
  int64_t bytes = 0;
  for (const auto& entry : optimizer.state()) {
    detail::for_each_state_tensor(*entry.second, [&](const at::Tensor& tensor) {
      if (tensor.defined()) bytes += static_cast<int64_t>(tensor.nbytes());
    });
  }
  return bytes;
}

}  // namespace ddp
