// ZeroRedundancyOptimizer overlapped with DDP: the bucket assignment and the per-bucket step and
// broadcast the hook drives (overlap.h; the hook itself is ddp_zero_hook.cpp).
#include "ddp/engine/src/zero/overlap.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/engine/src/zero/partition.h"
#include "ddp/engine/src/zero/shard_tensors.h"
#include "ddp/engine/src/zero/who.h"

namespace ddp::detail {

namespace {

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

ZeroOverlapHost& ZeroOverlap::host() const {
  if (!host_) {
    raise<std::runtime_error>(kZeroWho,
                              "the optimizer this hook_with_zero_step steps was destroyed while the "
                              "DistributedDataParallel model it is registered on still trains; keep the "
                              "optimizer alive as long as the model");
  }
  return *host_;
}

void ZeroOverlap::begin_pass() { broadcasts_.clear(); }

void ZeroOverlap::attach_hook(const std::string& hook_name, bool shard_buckets) {
  if (!hook_name_.empty()) {
    raise<std::invalid_argument>(kZeroWho, "a " + hook_name_ +
                                               " hook was already made for this optimizer; one "
                                               "optimizer steps one model's buckets (make one hook per optimizer)");
  }
  hook_name_ = hook_name;
  shard_buckets_ = shard_buckets;
}

// The partition starts empty: this rank's local optimizer gets its pieces' parameters as they come.
void ZeroOverlap::start_assignment() {
  host().unassign_all();
  buckets_.clear();
  status_ = shard_buckets_ ? Status::kRecording : Status::kAssigning;
}

bool ZeroOverlap::assign(const GradBucket& bucket) {
  const bool first_pass = status_ == Status::kAssigning || status_ == Status::kRecording;
  if (status_ == Status::kUninitialized || (first_pass && bucket.index() == 0)) start_assignment();
  if (status_ == Status::kInitialized) return true;
  if (bucket.index() != buckets_.size()) {
    raise<std::logic_error>(kZeroWho, "DDP bucket " + std::to_string(bucket.index()) + " came before bucket " +
                                          std::to_string(buckets_.size()) + " (a bug: buckets come in order)");
  }
  const auto& mine = host().params();
  std::vector<size_t> positions;
  for (size_t k = 0; k < bucket.parameters().size(); ++k) {
    const auto found = std::find_if(mine.begin(), mine.end(),
                                    [&](const at::Tensor& p) { return p.is_same(bucket.parameters()[k]); });
    if (found == mine.end()) {
      raise<std::invalid_argument>(kZeroWho, "parameter " + std::to_string(bucket.parameter_indices()[k]) +
                                                 " of the model (in DDP bucket " + std::to_string(bucket.index()) +
                                                 ") is not one of the optimizer's parameters; construct it over "
                                                 "model.parameters()");
    }
    positions.push_back(static_cast<size_t>(found - mine.begin()));
  }
  buckets_.push_back({bucket.parameters(), std::move(positions), bucket.offsets(), {}});
  if (status_ == Status::kAssigning) {
    // PyTorch's rule: bucket i belongs to rank i % W.
    give(bucket.index(), static_cast<int>(bucket.index() % static_cast<size_t>(group_->getSize())), 0,
         bucket.parameters().size());
    return true;
  }
  if (bucket.is_last()) {  // every bucket recorded: shard them; the next pass steps
    shard_recorded_buckets();
    status_ = Status::kInitialized;
  }
  return false;
}

// shard_buckets (zero/partition.h): the buckets' parameters in contiguous runs, one per rank, each
// within total / W plus one parameter whatever the layout. (PyTorch's own rule cuts each bucket
// below total / W and could leave a rank almost nothing: 0.28 against 9.10 MiB of Adam's state on
// resnet_b32 at 2 ranks.)
void ZeroOverlap::shard_recorded_buckets() {
  std::vector<std::vector<int64_t>> numels;
  for (const Bucket& bucket : buckets_) {
    numels.emplace_back();
    for (const auto& param : bucket.params) numels.back().push_back(param.numel());
  }
  for (const BucketPiece& piece : shard_buckets(numels, group_->getSize())) {
    give(piece.bucket, piece.rank, piece.first, piece.end);
  }
}

// Bucket b's parameters [first, end) to `rank`: their data become views of one flat tensor,
// broadcast whole from `rank` (PyTorch's _build_ddp_param_buckets); `rank`'s shard gains them.
// Their gradients are final for this pass, so nothing reads their data now.
void ZeroOverlap::give(size_t b, int rank, size_t first, size_t end) {
  ZeroOverlapHost& optimizer = host();
  Bucket& bucket = buckets_[b];
  Piece piece;
  piece.rank = rank;
  piece.first = first;
  piece.params.assign(bucket.params.begin() + static_cast<std::ptrdiff_t>(first),
                      bucket.params.begin() + static_cast<std::ptrdiff_t>(end));
  piece.flat = flatten_as_views(piece.params);
  optimizer.assign({bucket.positions.begin() + static_cast<std::ptrdiff_t>(first),
                    bucket.positions.begin() + static_cast<std::ptrdiff_t>(end)},
                   rank);
  auto at = std::find_if(bucket.pieces.begin(), bucket.pieces.end(), [&](const Piece& p) { return p.rank > rank; });
  bucket.pieces.insert(at, std::move(piece));
}

// The local optimizer steps this rank's piece(s) of the bucket only, each with its slice of the
// bucket's average lent as its parameters' gradients.
void ZeroOverlap::step(size_t b, const at::Tensor& average) {
  ZeroOverlapHost& optimizer = host();
  const Bucket& bucket = buckets_.at(b);
  for (const Piece& piece : bucket.pieces) {
    if (piece.rank != group_->getRank()) continue;
    std::vector<at::Tensor> grads;
    for (size_t k = 0; k < piece.params.size(); ++k) {
      const at::Tensor& param = piece.params[k];
      grads.push_back(average.narrow(0, bucket.offsets[piece.first + k], param.numel()).view(param.sizes()));
    }
    LendGradients lent(piece.params, std::move(grads));
    optimizer.step_only(piece.params);
  }
}

void ZeroOverlap::broadcast(size_t b) {
  const int64_t step = host().steps() + 1;
  for (const Piece& piece : buckets_.at(b).pieces) {
    broadcasts_.launch(group_, piece.flat, piece.rank, [b, root = piece.rank, step] {
      return std::string(kZeroWho) + ": broadcast of DDP bucket " + std::to_string(b) + "'s parameters from rank " +
             std::to_string(root) + " (overlap_with_ddp, step " + std::to_string(step) + ")";
    });
  }
}

// Every broadcast of the pass, waited on (a dead or stuck peer is an error naming the bucket).
void ZeroOverlap::finish_pass() {
  broadcasts_.wait_all();
  status_ = Status::kInitialized;
  host().count_step();
}

}  // namespace ddp::detail
