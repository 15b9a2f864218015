// The free collectives (torch.distributed's get_rank, barrier, all_reduce, ...) and the rules
// shared by every collective: which device it needs, how a failure reads.
#include <torch/cuda.h>

#include "collective.h"
#include "desync.h"
#include "error_text.h"
#include "ddp/process_group.h"

namespace ddp {
namespace detail {

void throw_collective_error(const std::string& what, const char* hint, const std::exception& cause) {
  const std::string stall = stall_report();
  throw CollectiveError(what + " failed: " +
                        (hint != nullptr ? std::string(hint)
                                         : "a peer rank may have died, hung past the timeout, or run a different "
                                           "sequence of collectives") +
                        ". Cause: " + error_text(cause) + (stall.empty() ? "" : ". " + stall));
}

void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, const char* hint) {
  wait_collective(work, [&] { return what; }, hint);
}

}  // namespace detail

namespace {
ProcessGroupPtr resolve(const ProcessGroupPtr& group) { return group ? group : default_group(); }
}  // namespace

c10::Device collective_device(const ProcessGroupPtr& group) {
  if (resolve(group)->getBackendName() != "nccl") return c10::Device(c10::kCPU);
  const auto count = static_cast<int>(torch::cuda::device_count());
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(count > 0 ? local_rank() % count : 0));
}

int get_rank(const ProcessGroupPtr& group) { return resolve(group)->getRank(); }
int get_world_size(const ProcessGroupPtr& group) { return resolve(group)->getSize(); }

// Each free collective first checks that every rank runs the same one (desync.h): a mismatch is a
// CollectiveError on every rank instead of mismatched buffers paired inside the backend.
namespace {
detail::CollectiveFingerprint fingerprint(detail::CollectiveOp op, const at::Tensor& tensor, int root = -1) {
  return {op, -1, tensor.scalar_type(), tensor.numel(), root};
}
}  // namespace

void barrier(const ProcessGroupPtr& group) {
  auto pg = resolve(group);
  detail::verify_same_collective(pg, {detail::CollectiveOp::kBarrier}, "ddp::barrier");
  detail::wait_collective(pg->barrier(), "ddp::barrier");
}

void all_reduce(at::Tensor& tensor, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  auto pg = resolve(group);
  detail::verify_same_collective(pg, fingerprint(detail::CollectiveOp::kAllReduce, tensor), "ddp::all_reduce");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  detail::wait_collective(pg->allreduce(tensors, options), "ddp::all_reduce");
}

void broadcast(at::Tensor& tensor, int src, const ProcessGroupPtr& group) {
  auto pg = resolve(group);
  detail::verify_same_collective(pg, fingerprint(detail::CollectiveOp::kBroadcast, tensor, src), "ddp::broadcast");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = src;
  detail::wait_collective(pg->broadcast(tensors, options), "ddp::broadcast");
}

std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const ProcessGroupPtr& group) {
  auto pg = resolve(group);
  detail::verify_same_collective(pg, fingerprint(detail::CollectiveOp::kAllGather, tensor), "ddp::all_gather");
  std::vector<at::Tensor> input{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < pg->getSize(); ++r) output[0].push_back(at::empty_like(input[0]));
  detail::wait_collective(pg->allgather(output, input), "ddp::all_gather");
  return output[0];
}

}  // namespace ddp
