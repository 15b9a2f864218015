#pragma once
// Starting an allreduce of one tensor in place: the one place the library builds c10d's vector and
// options for it (DDP's usage exchange, its autotune agreement and Join's last-joiner choice reduce
// with MAX). The caller waits through wait_collective, which names the collective when it fails.
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ddp/process_group.h>

namespace ddp::detail {

inline c10::intrusive_ptr<c10d::Work> start_allreduce(const ProcessGroupPtr& group, const at::Tensor& tensor,
                                                      c10d::ReduceOp op = c10d::ReduceOp::SUM) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  return group->allreduce(tensors, options);
}

inline c10::intrusive_ptr<c10d::Work> start_allreduce_max(const ProcessGroupPtr& group, const at::Tensor& tensor) {
  return start_allreduce(group, tensor, c10d::ReduceOp::MAX);
}

}  // namespace ddp::detail
