// The hierarchical allreduce (hierarchical.h): shared memory inside each host, Gloo across them.
#ifndef _WIN32  // no POSIX shared memory: channel.cpp never makes one

#include "shm/hierarchical.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "error_text.h"
#include "store_text.h"

namespace ddp::detail::shm {
namespace {

// Gloo's reduction for part l across the hosts; AVG is a SUM there (the host's step scaled it).
c10d::ReduceOp across_op(Op op) {
  switch (op) {
    case Op::kMax: return c10d::ReduceOp::MAX;
    case Op::kMin: return c10d::ReduceOp::MIN;
    case Op::kProduct: return c10d::ReduceOp::PRODUCT;
    case Op::kSum:
    case Op::kAvg: break;
  }
  return c10d::ReduceOp::SUM;
}

// The reduction inside the host, before the step across the hosts: AVG divides by the whole
// group's size there and is summed across the hosts (they run the same number of ranks).
std::pair<Op, double> host_reduction(Op op, double scale, int group_size) {
  if (op == Op::kAvg) return {Op::kSum, 1.0 / group_size};
  return {op, scale};
}

c10::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return c10::kDouble;
    case DType::kInt32: return c10::kInt;
    case DType::kInt64: return c10::kLong;
    default: break;  // serves() admits no other
  }
  return c10::kFloat;
}

}  // namespace

// Communicator::allreduce_shared's step across the hosts: each piece of my slice a Gloo allreduce
// with the ranks of my local rank, over the shared memory where it lies (the tensor keeps the
// array mapped while Gloo may still use it, even after a failure).
class Hierarchical::Across final : public Relay {
 public:
  Across(Hierarchical& owner, std::shared_ptr<SharedArray> array, DType dtype, Op op)
      : owner_(owner), array_(std::move(array)), type_(scalar_type_of(dtype)), op_(op) {}
  void start(void* data, std::size_t count) override {
    at::Tensor piece = at::from_blob(data, {static_cast<int64_t>(count)}, [array = array_](void*) {}, at::TensorOptions(type_));
    works_.push_back(owner_.start_part(piece, op_));
  }
  void finish() override {
    c10::intrusive_ptr<c10d::Work> work = std::move(works_.front());
    works_.pop_front();
    owner_.finish_part(work);
  }

 private:
  Hierarchical& owner_;
  std::shared_ptr<SharedArray> array_;
  c10::ScalarType type_;
  Op op_;
  std::deque<c10::intrusive_ptr<c10d::Work>> works_;
};

Hierarchical::Hierarchical(HostLayout layout, int rank, std::unique_ptr<Communicator> local,
                           const c10::intrusive_ptr<c10d::Store>& store,
                           const std::shared_ptr<::gloo::transport::Device>& device, std::chrono::milliseconds timeout)
    : layout_(std::move(layout)), rank_(rank), local_(std::move(local)), store_(store) {
  // The ranks of my local rank on every host, numbered by host: their own keys under the store.
  const int local_rank = layout_.local_rank_of(rank_);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  across_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("across/" + std::to_string(local_rank), store), layout_.host_of(rank_),
      layout_.hosts(), options);
}

Hierarchical::~Hierarchical() = default;

bool Hierarchical::serves(DType dtype, Op op) {
  const bool types = dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kInt32 || dtype == DType::kInt64;
  return types && supported(dtype, op);
}

std::string Hierarchical::name() const {
  return "hierarchical (" + std::to_string(layout_.hosts()) + " hosts x " + std::to_string(local_->size()) + ")";
}

void Hierarchical::allreduce(const std::vector<at::Tensor>& tensors, DType dtype, Op op, double scale) {
  try {
    run(tensors, dtype, op, scale);
  } catch (const PeerError& error) {
    tell_other_hosts(error.what());
    throw;
  }
}

void Hierarchical::run(const std::vector<at::Tensor>& tensors, DType dtype, Op op, double scale) {
  // One array: the tensor itself, or the list (a bucket's gradients where they lie) copied into one.
  std::vector<at::Tensor> flattened;
  for (const at::Tensor& tensor : tensors) flattened.push_back(tensor.view(-1));
  at::Tensor array = flattened.size() == 1 ? flattened[0] : at::cat(flattened);
  const auto count = static_cast<std::size_t>(array.numel());
  auto* base = static_cast<char*>(array.data_ptr());
  const auto element = static_cast<std::size_t>(array.element_size());

  const auto [local_op, local_scale] = host_reduction(op, scale, layout_.size());

  // The array goes through the three steps in chunks, as a pipeline: while chunk k crosses the
  // hosts (Gloo, in the background), this rank reduces chunk k+1 inside the host, then gathers
  // chunk k-1, so the link is not idle while the host works. Every local rank cuts the same chunks
  // and calls its Communicator in the same order: RS 0, RS 1, AG 0, RS 2, AG 1, ...
  struct Crossing {
    std::size_t first = 0, count = 0;
    c10::intrusive_ptr<c10d::Work> work;  // null: my part of the chunk is empty (on every host alike)
  };
  std::optional<Crossing> on_link;  // the chunk whose parts are crossing
  auto gather = [&](const Crossing& chunk) {
    if (chunk.work) finish_part(chunk.work);
    local_->allgather_parts(base + chunk.first * element, chunk.count, dtype);
  };
  const std::size_t step = std::max<std::size_t>(1, kChunkBytes / element);
  for (std::size_t first = 0; first < count; first += step) {
    Crossing chunk{first, std::min(step, count - first), {}};
    // 1. Inside the host: my part of the chunk's host reduction.
    local_->reduce_scatter(base + first * element, chunk.count, dtype, local_op, local_scale);
    // 2. Across the hosts, started: my part, with the ranks of my local rank (an empty part on
    //    every one of them alike, for chunks of under 64 bytes per local rank).
    const std::pair<std::size_t, std::size_t> part = local_->part(local_->rank(), chunk.count, dtype);
    if (part.second > part.first) {
      chunk.work = start_part(
          array.narrow(0, static_cast<int64_t>(first + part.first), static_cast<int64_t>(part.second - part.first)), op);
    }
    // 3. Inside the host: every local rank's part of the chunk before, once it has crossed.
    if (on_link) gather(*on_link);
    on_link = std::move(chunk);
  }
  if (on_link) gather(*on_link);

  if (flattened.size() > 1) {
    int64_t offset = 0;
    for (at::Tensor& piece : flattened) {
      piece.copy_(array.narrow(0, offset, piece.numel()));
      offset += piece.numel();
    }
  }
}

std::shared_ptr<SharedArray> Hierarchical::share(std::size_t bytes) {
  std::shared_ptr<SharedArray> array;
  std::string refused;
  at::Tensor least;
  try {
    try {
      array = local_->share(bytes);  // my host's ranks agree on it
    } catch (const ShmUnavailable& error) {
      refused = error.what();
    }
    // The hosts agree through each local rank's group across them: the least of (shared, bytes,
    // -bytes) over the hosts says whether every host shares, and whether all asked for one size.
    least = at::tensor(std::vector<int64_t>{array ? 1 : 0, static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)});
    finish_part(start_part(least, Op::kMin));
  } catch (const PeerError& error) {
    tell_other_hosts(error.what());
    throw;
  }
  const int64_t shared = least[0].item<int64_t>(), smallest = least[1].item<int64_t>(), largest = -least[2].item<int64_t>();
  if (shared == 0) throw ShmUnavailable(refused.empty() ? "a rank on another host could not share memory" : refused);
  if (smallest != largest) {
    throw ShmUnavailable("the hosts ask for shared arrays of different sizes (from " + std::to_string(smallest) + " to " +
                         std::to_string(largest) + " bytes)");
  }
  return array;
}

void Hierarchical::allreduce_shared(const std::shared_ptr<SharedArray>& array, std::size_t offset, std::size_t count,
                                    DType dtype, Op op, double scale) {
  const auto [local_op, local_scale] = host_reduction(op, scale, layout_.size());
  Across across(*this, array, dtype, op);
  try {
    local_->allreduce_shared(*array, offset, count, dtype, local_op, local_scale, &across);
  } catch (const PeerError& error) {
    tell_other_hosts(error.what());
    throw;
  }
}

c10::intrusive_ptr<c10d::Work> Hierarchical::start_part(const at::Tensor& part, Op op) {
  std::vector<at::Tensor> tensors{part};
  c10d::AllreduceOptions options;
  options.reduceOp = across_op(op);
  return across_->allreduce(tensors, options);
}

void Hierarchical::finish_part(const c10::intrusive_ptr<c10d::Work>& work) {
  std::string told = wait_watching(work);
  try {
    work->wait();  // done (wait_watching): throws Gloo's error, if any
  } catch (const std::exception& error) {
    // Name the ranks this one reduced with (one of them, or what stopped it, is the cause), and
    // what another rank told of its failure; then fail my host's Communicator with that text: my
    // host's peers wait for my next step and would otherwise wait until the timeout.
    if (told.empty()) told = failure_told();
    std::string partners;
    for (int rank : layout_.ranks_with_local_rank(layout_.local_rank_of(rank_))) {
      if (rank == rank_) continue;
      partners += (partners.empty() ? "rank " : ", rank ") + std::to_string(rank);
    }
    const PeerError failure(local_->rank(), "rank " + std::to_string(rank_) + ": the allreduce across hosts with " +
                                                partners + " failed" +
                                                (told.empty() ? "" : " after another rank failed (" + told + ")") + ": " +
                                                error_text(error));
    local_->fail(failure);
    throw failure;
  }
}

// Until `work` is done (Gloo bounds it by the group's timeout), looking every quarter second for a
// failure another rank told of: by the time the rank that failed leaves, and Gloo fails here
// because of it, the store may have left with it (rank 0 hosts it).
std::string Hierarchical::wait_watching(const c10::intrusive_ptr<c10d::Work>& work) const {
  struct Done {
    std::mutex mutex;
    std::condition_variable finished;
    bool done = false;
  };
  auto done = std::make_shared<Done>();  // the callback may run after this returns (it cannot here)
  work->getFuture()->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mutex);
    done->done = true;
    done->finished.notify_all();
  });
  std::string told;
  std::unique_lock<std::mutex> lock(done->mutex);
  while (!done->finished.wait_for(lock, std::chrono::milliseconds(250), [&] { return done->done; })) {
    if (!told.empty()) continue;
    lock.unlock();
    told = failure_told();
    lock.lock();
  }
  return told;
}

// The first failure of the group, under one key of its store; only the first rank to fail writes it.
void Hierarchical::tell_other_hosts(const std::string& what) noexcept {
  if (told_other_hosts_) return;
  told_other_hosts_ = true;
  try {
    if (store_->add("failure/count", 1) == 1) store_->set("failure", bytes_of(what));
  } catch (...) {  // the store is gone too (its host failed): the others learn from Gloo alone
  }
}

std::string Hierarchical::failure_told() const noexcept {
  try {
    if (store_->check({"failure"})) return text_of(store_->get("failure"));
  } catch (...) {
  }
  return "";
}

}  // namespace ddp::detail::shm

#endif  // _WIN32
