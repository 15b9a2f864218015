#pragma once
// ZeroRedundancyOptimizer's overlap_with_ddp half (PyTorch's _OverlapInfo): which rank owns which
// DDP bucket, the flat tensor each bucket's parameters live in, and the per-pass work the hook
// (ddp_zero_hook.cpp) drives:
//
//   assign(bucket)         first pass after DDP's rebuild: bucket b -> rank b % W; its parameters
//                          become views of one flat tensor (what the owner broadcasts)
//   step(b, average)       the owner: the local optimizer steps bucket b's parameters with `average`
//   broadcast(b)           every rank: launch bucket b's broadcast from its owner
//   finish_pass()          last bucket: wait for every broadcast; the assignment is complete
//
// Thread-safety: the hook thread calls everything above during backward; the training thread only
// between backward passes (status(), through the optimizer's methods). The hook runner's handoff
// orders the two.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/comm_hooks.h>
#include <ddp/process_group.h>

#include "ddp/engine/src/zero/shard_tensors.h"

namespace ddp::detail {

// What the overlap half may do to its optimizer. ZeroRedundancyOptimizerBase implements it in a
// private class of its own, so the optimizer alone keeps its partition and its local optimizer in
// agreement.
class ZeroOverlapHost {
 public:
  virtual ~ZeroOverlapHost() = default;
  // The optimizer's one parameter group's parameters.
  virtual const std::vector<at::Tensor>& params() const = 0;
  // A new assignment: no parameter has an owner; the local optimizer holds none, and no state.
  virtual void unassign_all() = 0;
  // The parameters at `positions` of the group to `rank`, after those it has (the local optimizer
  // gains this rank's).
  virtual void assign(const std::vector<size_t>& positions, int rank) = 0;
  // The local optimizer steps `params` (this rank's) alone, with the group's current options.
  virtual void step_only(const std::vector<at::Tensor>& params) = 0;
  // The optimizer's step count (what save() checks a consolidation against); a pass adds one.
  virtual int64_t steps() const = 0;
  virtual void count_step() = 0;
};

class ZeroOverlap {
 public:
  // PyTorch's _OverlapStatus; its middle state (DDP_HAS_REBUILT_BUCKETS) is our first pass after
  // the rebuild, which assigns each bucket as it comes by, or, with shard_buckets, only records them.
  enum class Status {
    kUninitialized,  // DDP has not rebuilt its buckets: the hook only averages (warm-up)
    kAssigning,      // the first pass on the rebuilt buckets: each is assigned as it comes by
    kRecording,      // shard_buckets: the first pass records the buckets; assigned at its end
    kInitialized,    // every bucket has its owner(s)
  };

  // `group`: the optimizer's, whose ranks own the buckets.
  ZeroOverlap(std::unique_ptr<ZeroOverlapHost> host, ProcessGroupPtr group)
      : host_(std::move(host)), group_(std::move(group)) {}

  // The optimizer is being destroyed (its hook may outlive it): later passes throw.
  void forget_optimizer() { host_.reset(); }
  // One hook per optimizer: the first call marks it taken; later ones throw std::invalid_argument.
  void attach_hook(const std::string& hook_name, bool shard_buckets);
  bool hook_attached() const { return !hook_name_.empty(); }

  Status status() const { return status_; }
  // Called for each bucket once DDP's buckets are rebuilt, in bucket order; assigns (or records) it
  // in the first such pass (a pass that starts at bucket 0 before the end of that starts over).
  // Returns whether this pass steps and broadcasts the bucket (false in shard_buckets' recording pass).
  bool assign(const GradBucket& bucket);
  // A pass starts (bucket 0): drops what a pass that failed half-way left behind.
  void begin_pass();
  // The owner(s) of bucket b's parameters step them with the bucket's `average`.
  void step(size_t bucket, const at::Tensor& average);
  // Every rank: the broadcast of each piece of bucket b from its owner, owners in ascending order.
  void broadcast(size_t bucket);
  void finish_pass();

 private:
  // A bucket's parameters params[first, first + params.size()) owned by one rank (the whole bucket
  // unless shard_buckets splits it), and the flat tensor their data live in.
  struct Piece {
    int rank = 0;
    size_t first = 0;
    std::vector<at::Tensor> params;
    at::Tensor flat;
  };
  struct Bucket {
    std::vector<at::Tensor> params;
    std::vector<size_t> positions;  // of each parameter in the optimizer's group
    std::vector<int64_t> offsets;   // of each parameter's gradient in the bucket's flat buffer
    std::vector<Piece> pieces;      // by ascending rank
  };
  void start_assignment();
  void give(size_t bucket, int rank, size_t first, size_t end);
  void shard_recorded_buckets();
  // The optimizer's side, or a std::runtime_error when it was destroyed while its hook lives on.
  ZeroOverlapHost& host() const;

  std::unique_ptr<ZeroOverlapHost> host_;
  ProcessGroupPtr group_;
  std::string hook_name_;
  bool shard_buckets_ = false;
  Status status_ = Status::kUninitialized;
  std::vector<Bucket> buckets_;
  BroadcastBatch broadcasts_;  // this pass's, in launch order
};

}  // namespace ddp::detail
