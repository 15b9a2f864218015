#pragma once
// What both halves of ZeRO (the step() path and the overlap hook) do with a shard's tensors:
// lay parameters out in one flat tensor, and broadcast shards from their owners.
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/process_group.h>

namespace ddp::detail {

// One flat tensor holding `params`' values, in order; each parameter's data becomes a view of it
// (so one broadcast of the flat tensor updates them all). The parameters keep their autograd
// identity (set_data).
at::Tensor flatten_as_views(std::vector<at::Tensor>& params);

// Broadcasts launched in an order every rank shares, then waited on in that order, each through
// wait_collective: a dead or stuck peer is a CollectiveError naming what the broadcast carried.
class BroadcastBatch {
 public:
  // Launches the broadcast of `tensor` from `root` (a rank of `group`). A tensor that is not
  // contiguous travels as a contiguous copy, written back into it by wait_all(). `what` names the
  // broadcast in an error, built only then.
  void launch(const ProcessGroupPtr& group, const at::Tensor& tensor, int root, std::function<std::string()> what);
  // Waits for every launched broadcast, in launch order, then forgets them.
  void wait_all();
  // Forgets what a pass that failed half-way launched.
  void clear() { launched_.clear(); }

 private:
  struct Launched {
    at::Tensor target;
    at::Tensor sent;  // `target`, or its contiguous copy
    std::function<std::string()> what;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<Launched> launched_;
};

}  // namespace ddp::detail
