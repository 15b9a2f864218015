#pragma once
// Making every rank start from, and stay at, rank 0's state: the cross-rank parameter check and
// the broadcast of parameters and buffers.
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <ddp/process_group.h>

namespace ddp::detail {

// Throws on every rank (naming the first mismatch) unless all ranks have the same number, order,
// shapes and dtypes of parameters. `who` begins the message ("DistributedDataParallel").
void verify_same_parameters(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                            const ProcessGroupPtr& group, const char* who = "DistributedDataParallel");

// Throws CollectiveError on every rank, listing each rank's buckets, unless all ranks built the
// same gradient buckets (count, sizes, dtypes): buckets that differ would pair mismatched data in
// every reduction. `buckets[b]` = {elements, dtype}.
void verify_same_buckets(const std::vector<std::pair<int64_t, c10::ScalarType>>& buckets, const ProcessGroupPtr& group);

// Throws CollectiveError on every rank, listing each rank's hook, unless all ranks registered the
// same communication hook: `hook` is this rank's name and settings ("" for none). A hook on one rank
// and none (or another) on the next would pair collectives of different sizes, which Gloo answers
// by aborting the process.
void verify_same_comm_hook(const std::string& hook, const ProcessGroupPtr& group);

// Broadcasts a fixed list of tensors from a root rank, packed into one flat buffer per
// (device, dtype) so that many small tensors cost a few collectives. Buffers are allocated once.
class TensorBroadcaster {
 public:
  TensorBroadcaster(std::vector<at::Tensor> tensors, ProcessGroupPtr group);
  void broadcast_from(int root);

 private:
  struct Group {
    std::vector<size_t> members;
    at::Tensor flat;
    std::vector<at::Tensor> views;
    std::vector<at::Tensor> collective;
  };
  std::vector<at::Tensor> tensors_;
  std::vector<Group> groups_;
  ProcessGroupPtr group_;
  bool check_collectives_;  // TORCH_DISTRIBUTED_DEBUG=DETAIL
};

}  // namespace ddp::detail
