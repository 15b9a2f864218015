// The rest of torch.distributed's collectives (process_group.h): reduce_scatter_tensor,
// all_gather_into_tensor, all_to_all_single, reduce, gather, scatter, point to point and
// monitored_barrier, each checked for bad input on every rank before it runs, then one c10d call
// on the group (through shared memory where the group's channel serves it; owned_group.h) and a
// bounded wait.
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <ddp/process_group.h>
#include <ddp/wait_collective.h>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/free_collective.h"

namespace ddp {
namespace {

bool is_nccl(const ProcessGroupPtr& pg) { return pg->getBackendName() == "nccl"; }

void require(bool condition, const char* who, const std::string& what) {
  if (!condition) raise<std::invalid_argument>(who, what);
}

void require_contiguous(const at::Tensor& tensor, const char* who, const char* name) {
  require(tensor.defined() && tensor.is_contiguous(), who,
          std::string(name) + " must be a defined, contiguous tensor (call .contiguous() on it first)");
}

// "6 Float": a tensor's size as the size checks name it.
std::string counted(const at::Tensor& tensor) {
  return std::to_string(tensor.numel()) + " " + c10::toString(tensor.scalar_type());
}

void require_rank(int rank, const ProcessGroupPtr& pg, const char* who, const char* name) {
  require(rank >= 0 && rank < pg->getSize(), who,
          std::string(name) + " " + std::to_string(rank) + " is not a rank of the group, whose ranks are 0 to " +
              std::to_string(pg->getSize() - 1) + " (ranks of the group, not of the world: see get_global_rank)");
}

void require_split(std::vector<int64_t>& splits, const at::Tensor& tensor, int world, const char* who,
                   const char* name) {
  const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
  if (splits.empty()) {
    require(rows % world == 0, who, std::string(name) + "'s first dimension (" + std::to_string(rows) +
                                        ") does not split into " + std::to_string(world) +
                                        " equal blocks; pass split sizes");
    splits.assign(static_cast<size_t>(world), rows / world);
    return;
  }
  require(static_cast<int>(splits.size()) == world, who,
          std::string(name) + "_split_sizes has " + std::to_string(splits.size()) + " entries for " +
              std::to_string(world) + " ranks");
  int64_t sum = 0;
  for (int64_t rows_of_block : splits) {
    require(rows_of_block >= 0, who, std::string(name) + "_split_sizes has a negative entry");
    sum += rows_of_block;
  }
  require(sum == rows, who, std::string(name) + "_split_sizes sum to " + std::to_string(sum) + ", but " + name +
                                " has " + std::to_string(rows) + " rows");
}

}  // namespace

void reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  constexpr const char* who = "ddp::reduce_scatter_tensor";
  auto pg = detail::resolve(group);
  require_contiguous(output, who, "output");
  require_contiguous(input, who, "input");
  require(input.numel() == output.numel() * pg->getSize() && input.scalar_type() == output.scalar_type(), who,
          "input must hold the group's size (" + std::to_string(pg->getSize()) + ") times output's elements, of its "
          "dtype; it holds " + counted(input) + " for " + counted(output));
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kReduceScatter, input, -1, static_cast<int64_t>(op)), who);
  // The group's own (owned_group.h: shared memory on one host; over Gloo alone, what Gloo has).
  c10d::ReduceScatterOptions options;
  options.reduceOp = op;
  at::Tensor in = input;
  wait_collective(pg->_reduce_scatter_base(output, in, options), who);
}

void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const ProcessGroupPtr& group) {
  constexpr const char* who = "ddp::all_gather_into_tensor";
  auto pg = detail::resolve(group);
  require_contiguous(output, who, "output");
  require_contiguous(input, who, "input");
  require(output.numel() == input.numel() * pg->getSize() && input.scalar_type() == output.scalar_type(), who,
          "output must hold the group's size (" + std::to_string(pg->getSize()) + ") times input's elements, of its "
          "dtype; it holds " + counted(output) + " for " + counted(input));
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kAllGatherIntoTensor, input), who);
  // The group's own (owned_group.h: shared memory on one host; over Gloo alone, what Gloo has).
  at::Tensor in = input;
  wait_collective(pg->_allgather_base(output, in), who);
}

void all_to_all_single(at::Tensor& output, const at::Tensor& input, std::vector<int64_t> output_split_sizes,
                       std::vector<int64_t> input_split_sizes, const ProcessGroupPtr& group) {
  constexpr const char* who = "ddp::all_to_all_single";
  auto pg = detail::resolve(group);
  require_contiguous(output, who, "output");
  require_contiguous(input, who, "input");
  require(input.scalar_type() == output.scalar_type(), who, "input and output must have the same dtype");
  const bool even = output_split_sizes.empty() && input_split_sizes.empty();
  require_split(output_split_sizes, output, pg->getSize(), who, "output");
  require_split(input_split_sizes, input, pg->getSize(), who, "input");
  // Uneven blocks legitimately differ in size across ranks: then only the dtype is compared.
  detail::verify_if_detail(pg, {detail::CollectiveOp::kAllToAll, -1, input.scalar_type(), even ? input.numel() : -1}, who);
  at::Tensor in = input;
  c10d::AllToAllOptions options;
  wait_collective(pg->alltoall_base(output, in, output_split_sizes, input_split_sizes, options), who);
}

void reduce(at::Tensor& tensor, int dst, c10d::ReduceOp op, const ProcessGroupPtr& group) {
  constexpr const char* who = "ddp::reduce";
  auto pg = detail::resolve(group);
  require_contiguous(tensor, who, "tensor");
  require_rank(dst, pg, who, "dst");
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kReduce, tensor, dst, static_cast<int64_t>(op)), who);
  std::vector<at::Tensor> tensors{tensor};
  c10d::ReduceOptions options;
  options.rootRank = dst;
  options.reduceOp = op;
  wait_collective(pg->reduce(tensors, options), who);
}

std::vector<at::Tensor> gather(const at::Tensor& tensor, int dst, const ProcessGroupPtr& group) {
  constexpr const char* who = "ddp::gather";
  auto pg = detail::resolve(group);
  require_contiguous(tensor, who, "tensor");
  require_rank(dst, pg, who, "dst");
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kGather, tensor, dst), who);
  std::vector<at::Tensor> inputs{tensor};
  std::vector<std::vector<at::Tensor>> outputs;  // the backend wants none off the root
  if (pg->getRank() == dst) {
    outputs.emplace_back();
    for (int r = 0; r < pg->getSize(); ++r) outputs[0].push_back(at::empty_like(tensor));
  }
  c10d::GatherOptions options;
  options.rootRank = dst;
  wait_collective(pg->gather(outputs, inputs, options), who);
  return outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
}

void scatter(at::Tensor& tensor, const std::vector<at::Tensor>& scatter_list, int src, const ProcessGroupPtr& group) {
  constexpr const char* who = "ddp::scatter";
  auto pg = detail::resolve(group);
  require_contiguous(tensor, who, "tensor");
  require_rank(src, pg, who, "src");
  std::vector<std::vector<at::Tensor>> inputs;  // read on the root only
  if (pg->getRank() == src) {
    require(static_cast<int>(scatter_list.size()) == pg->getSize(), who,
            "scatter_list holds " + std::to_string(scatter_list.size()) + " tensors on the source rank, one per rank (" +
                std::to_string(pg->getSize()) + ") is needed");
    for (const auto& piece : scatter_list) {
      require(piece.sizes() == tensor.sizes() && piece.scalar_type() == tensor.scalar_type(), who,
              "every tensor of scatter_list must have the receiving tensor's shape and dtype");
    }
    inputs.emplace_back();
    for (const auto& piece : scatter_list) inputs[0].push_back(piece.contiguous());
  }
  detail::verify_if_detail(pg, detail::fingerprint(detail::CollectiveOp::kScatter, tensor, src), who);
  std::vector<at::Tensor> outputs{tensor};
  c10d::ScatterOptions options;
  options.rootRank = src;
  wait_collective(pg->scatter(outputs, inputs, options), who);
}

c10::intrusive_ptr<c10d::Work> isend(const at::Tensor& tensor, int dst, const ProcessGroupPtr& group, int tag) {
  constexpr const char* who = "ddp::send";
  auto pg = detail::resolve(group);
  require_contiguous(tensor, who, "tensor");
  require_rank(dst, pg, who, "dst");
  require(dst != pg->getRank(), who, "dst " + std::to_string(dst) + " is this rank itself");
  std::vector<at::Tensor> tensors{tensor};
  return pg->send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> irecv(at::Tensor& tensor, int src, const ProcessGroupPtr& group, int tag) {
  constexpr const char* who = "ddp::recv";
  auto pg = detail::resolve(group);
  require_contiguous(tensor, who, "tensor");
  std::vector<at::Tensor> tensors{tensor};
  if (src == -1) return pg->recvAnysource(tensors, tag);
  require_rank(src, pg, who, "src");
  require(src != pg->getRank(), who, "src " + std::to_string(src) + " is this rank itself");
  return pg->recv(tensors, src, tag);
}

void send(const at::Tensor& tensor, int dst, const ProcessGroupPtr& group, int tag) {
  wait_collective(isend(tensor, dst, group, tag), "ddp::send to rank " + std::to_string(dst));
}

int recv(at::Tensor& tensor, int src, const ProcessGroupPtr& group, int tag) {
  auto work = irecv(tensor, src, group, tag);
  wait_collective(work, src == -1 ? std::string("ddp::recv from any rank") : "ddp::recv from rank " + std::to_string(src));
  return src == -1 ? work->sourceRank() : src;
}

void monitored_barrier(const ProcessGroupPtr& group, std::chrono::milliseconds timeout) {
  constexpr const char* who = "ddp::monitored_barrier";
  auto pg = detail::resolve(group);
  require(!is_nccl(pg), who, "NCCL groups have none (as in PyTorch): use a Gloo group (ddp::new_group of the CPU)");
  c10d::BarrierOptions options;
  options.timeout = timeout.count() > 0 ? timeout : detail::timeout_of(pg);
  try {
    pg->monitoredBarrier(options, /*wait_all_ranks=*/true);
  } catch (const std::exception& error) {
    throw CollectiveError(std::string(who) + ": not every rank arrived within " + std::to_string(options.timeout.count()) +
                          " ms. " + error_text(error));
  }
}

}  // namespace ddp
