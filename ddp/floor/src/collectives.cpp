// The free collectives (torch.distributed's get_rank, barrier, all_reduce, ...) and the rules
// shared by every collective: which device it needs, how a failure reads.
#include <algorithm>
#include <type_traits>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <ddp/process_group.h>
#include <ddp/wait_collective.h>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/floor/src/desync.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/free_collective.h"
#include "ddp/floor/src/heartbeat.h"

namespace ddp {

void throw_collective_error(const std::string& what, const char* hint, const std::exception& cause) {
  const std::string stall = detail::stall_report();
  throw CollectiveError(what + " failed: " +
                        (hint != nullptr ? std::string(hint)
                                         : "a peer rank may have died, hung past the timeout, or run a different "
                                           "sequence of collectives") +
                        ". Cause: " + error_text(cause) + (stall.empty() ? "" : ". " + stall));
}

void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, const char* hint) {
  wait_collective(work, [&] { return what; }, hint);
}



c10::Device collective_device(const ProcessGroupPtr& group) {
  if (detail::resolve(group)->getBackendName() != "nccl") return c10::Device(c10::kCPU);
  const auto count = static_cast<int>(torch::cuda::device_count());
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(count > 0 ? local_rank() % count : 0));
}

int get_rank(const ProcessGroupPtr& group) { return detail::resolve(group)->getRank(); }
std::string transport(const ProcessGroupPtr& group) { return detail::transport_of(detail::resolve(group)); }
int get_world_size(const ProcessGroupPtr& group) { return detail::resolve(group)->getSize(); }


void barrier(const ProcessGroupPtr& group) {
  auto pg = detail::resolve(group);
  detail::verify_if_detail(pg, {detail::CollectiveOp::kBarrier}, "ddp::barrier");
  wait_collective(pg->barrier(), "ddp::barrier");
}

void all_reduce(at::Tensor& tensor, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  auto pg = detail::resolve(group);
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kAllReduce, tensor, -1, static_cast<int64_t>(op)), "ddp::all_reduce");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  wait_collective(pg->allreduce(tensors, options), "ddp::all_reduce");
}

namespace detail {
namespace {
// One tensor of the numbers on the group's collective device, reduced, and read back.
template <typename Wire>
void all_reduce_wire(std::vector<Wire>& values, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  if (values.empty()) return;  // nothing to exchange, on every rank alike
  auto pg = detail::resolve(group);
  const auto dtype = std::is_same_v<Wire, double> ? at::kDouble : at::kLong;
  at::Tensor tensor = at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, dtype).clone();
  const c10::Device device = ddp::collective_device(pg);
  if (!device.is_cpu()) tensor = tensor.to(device);
  ddp::all_reduce(tensor, op, pg);
  const at::Tensor result = tensor.cpu();
  std::copy_n(result.data_ptr<Wire>(), values.size(), values.begin());
}
}  // namespace

void all_reduce_numbers(std::vector<double>& values, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  all_reduce_wire(values, op, group);
}
void all_reduce_numbers(std::vector<int64_t>& values, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  all_reduce_wire(values, op, group);
}
}  // namespace detail

void broadcast(at::Tensor& tensor, int src, const ProcessGroupPtr& group) {
  auto pg = detail::resolve(group);
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kBroadcast, tensor, src), "ddp::broadcast");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = src;
  wait_collective(pg->broadcast(tensors, options), "ddp::broadcast");
}

void broadcast_bytes(std::string& bytes, int src, const ProcessGroupPtr& group) {
  auto pg = detail::resolve(group);
  const c10::Device device = collective_device(pg);
  // The length first: the other ranks need it to size their buffer.
  at::Tensor length = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong).to(device);
  broadcast(length, src, pg);
  const int64_t size = length.cpu().item<int64_t>();
  at::Tensor data = pg->getRank() == src
                        ? at::from_blob(bytes.data(), {size}, at::kByte).clone().to(device)
                        : at::empty({size}, at::TensorOptions().dtype(at::kByte).device(device));
  broadcast(data, src, pg);
  if (pg->getRank() != src) {
    const at::Tensor host = data.cpu().contiguous();
    bytes.assign(reinterpret_cast<const char*>(host.data_ptr<uint8_t>()), static_cast<size_t>(size));
  }
}

std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const ProcessGroupPtr& group) {
  auto pg = detail::resolve(group);
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kAllGather, tensor), "ddp::all_gather");
  std::vector<at::Tensor> input{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < pg->getSize(); ++r) output[0].push_back(at::empty_like(input[0]));
  wait_collective(pg->allgather(output, input), "ddp::all_gather");
  return output[0];
}

}  // namespace ddp
