// The hierarchical allreduce (hierarchical.h): shared memory inside each host, Gloo across them.
#ifndef _WIN32  // no POSIX shared memory: channel.cpp never makes one

#include "ddp/floor/src/shm/hierarchical.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/store_text.h"
#include "ddp/floor/src/shm/reduce_kernels.h"

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

// `work`, once: the caller's work for while the link is busy.
void run_once(std::function<void()>& work) {
  if (!work) return;
  std::function<void()> now = std::move(work);
  work = nullptr;
  now();
}

}  // namespace

Hierarchical::Hierarchical(HostLayout layout, int rank, std::unique_ptr<Communicator> local,
                           std::shared_ptr<SharedArray> scratch, const c10::intrusive_ptr<c10d::Store>& store,
                           const std::shared_ptr<::gloo::transport::Device>& device, std::chrono::milliseconds timeout)
    : layout_(std::move(layout)), rank_(rank), local_(std::move(local)), scratch_(std::move(scratch)), store_(store) {
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
  // The list as one array, a window at a time through the two halves of my scratch array in turn:
  // while a window's slices cross the hosts, the window before is copied out of the other half and
  // the window after copied in (once allreduce_shared has returned, no peer reads or writes my part
  // of its half any more), so the link does not wait for the copies. Copied by this thread: ATen's
  // copies would start threads of their own on a host whose cores the ranks already share.
  const std::size_t element = dtype_size(dtype);
  std::vector<Span> spans;
  std::size_t count = 0;
  for (const at::Tensor& tensor : tensors) {
    spans.push_back({tensor.data_ptr(), static_cast<std::size_t>(tensor.numel())});
    count += spans.back().count;
  }
  grow_scratch(count * element);
  const std::size_t half_bytes = scratch_->bytes() / 2, window = half_bytes / element;
  const std::size_t windows = (count + window - 1) / window;
  const auto first_of = [&](std::size_t k) { return k * window; };
  const auto size_of = [&](std::size_t k) { return std::min(window, count - k * window); };
  const auto half_of = [&](std::size_t k) { return (k % 2) * half_bytes; };  // bytes into the scratch array
  // Window k of the list into its half of my part, or back out of it.
  const auto move = [&](std::size_t k, bool into) {
    unsigned char* mine = static_cast<unsigned char*>(scratch_->mine()) + half_of(k);
    for_each_piece(spans, element, first_of(k), size_of(k), [&](unsigned char* ours, std::size_t at, std::size_t n) {
      unsigned char* theirs = mine + at * element;
      copy_bytes(into ? theirs : ours, into ? ours : theirs, n * element);
    });
  };
  if (windows == 0) return;
  move(0, true);
  for (std::size_t k = 0; k < windows; ++k) {
    allreduce_shared(scratch_, half_of(k), size_of(k), dtype, op, scale, [&, k] {
      if (k > 0) move(k - 1, false);
      if (k + 1 < windows) move(k + 1, true);
    });
  }
  move(windows - 1, false);
}

// Windows as large as `bytes`, up to the largest: a larger scratch array (a collective, as the
// allreduce that asks is: every rank asks for the same size), or, where a host cannot make one,
// the one there is, from then on.
void Hierarchical::grow_scratch(std::size_t bytes) {
  const std::size_t wanted = std::min(2 * bytes, scratch_limit_);
  if (wanted <= scratch_->bytes()) return;
  constexpr std::size_t kTwoMiB = std::size_t{2} << 20;  // two windows of whole MiB
  const std::size_t grown = (std::max(wanted, 2 * scratch_->bytes()) + kTwoMiB - 1) / kTwoMiB * kTwoMiB;
  try {
    scratch_ = share(std::min(grown, scratch_limit_));
  } catch (const ShmUnavailable&) {
    scratch_limit_ = scratch_->bytes();
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
                                    DType dtype, Op op, double scale, std::function<void()> meanwhile) {
  const auto [local_op, local_scale] = host_reduction(op, scale, layout_.size());
  try {
    // 1. Once every part of my host holds its data: my slice is mine. While it crosses the hosts,
    //    my host's peers waiting for me wait for my verdict (Communicator::start_shared's `away`).
    SharedSlice slice = local_->start_shared(*array, offset, count, dtype, local_op, local_scale, true);
    try {
      cross(slice, array, dtype, op, meanwhile);
    } catch (const std::exception& error) {
      throw local_->fail_with(error);  // my host's peers stop at once
    }
    // 3. Once every slice of my host is everywhere: done.
    local_->finish_shared();
  } catch (const PeerError& error) {
    tell_other_hosts(error.what());
    throw;
  }
  run_once(meanwhile);  // if no piece of mine crossed (an empty slice), now
}

// 2. My slice piece by piece: reduced inside the host, sent across the hosts (a Gloo allreduce with
// the ranks of my local rank, over the shared memory where it lies: the tensor keeps the array
// mapped while Gloo may still use it, even after a failure), and copied into my host's peers' parts
// once it is back, while the next pieces are reduced and cross.
void Hierarchical::cross(SharedSlice& slice, const std::shared_ptr<SharedArray>& array, DType dtype, Op op,
                         std::function<void()>& meanwhile) {
  const std::size_t piece = std::max<std::size_t>(1, kPieceBytes / dtype_size(dtype));
  struct Crossing {
    std::size_t first, n;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::deque<Crossing> crossing;  // pieces started, oldest first
  const auto land_oldest = [&] {
    run_once(meanwhile);  // while the pieces in flight cross
    finish_part(crossing.front().work);
    slice.copy_to_peers(crossing.front().first, crossing.front().n);
    crossing.pop_front();
  };
  for (std::size_t first = slice.begin(); first < slice.end(); first += piece) {
    const std::size_t n = std::min(piece, slice.end() - first);
    slice.reduce(first, n);
    if (crossing.size() == static_cast<std::size_t>(kPiecesInFlight)) land_oldest();
    at::Tensor part = at::from_blob(slice.mine(first), {static_cast<int64_t>(n)}, [array](void*) {},
                                    at::TensorOptions(scalar_type_of(dtype)));
    crossing.push_back({first, n, start_part(part, op)});
  }
  while (!crossing.empty()) land_oldest();
}

c10::intrusive_ptr<c10d::Work> Hierarchical::start_part(const at::Tensor& part, Op op) {
  std::vector<at::Tensor> tensors{part};
  c10d::AllreduceOptions options;
  options.reduceOp = across_op(op);
  return across_->allreduce(tensors, options);
}

void Hierarchical::finish_part(const c10::intrusive_ptr<c10d::Work>& work, const char* collective) {
  std::string told = wait_watching(work);
  try {
    work->wait();  // done (wait_watching): throws Gloo's error, if any
  } catch (const std::exception& error) {
    // Blame the rank at fault first: the failure my host's peers or another rank told of (my
    // partners may only have waited for it, as I did - or for me), else my partners across the
    // hosts. Then fail my host's Communicator with that text: my host's peers wait for my next
    // step and would otherwise wait until the timeout.
    if (told.empty()) told = local_->peer_failure();
    if (told.empty()) told = failure_told_within(kTellingGrace);
    const std::string mine = "rank " + std::to_string(rank_) + "'s " + collective + " across hosts";
    // Nobody told of a failure: the partners may be alive but in another collective across the
    // hosts (an allreduce here, a reduce-scatter there: only the reduce-scatter and the all-gather
    // compare what they run first), which the check of DETAIL names before any data moves.
    const std::string cause =
        told.empty() ? partners() + " did not complete " + mine +
                           " (if it is alive, it may be running another collective: TORCH_DISTRIBUTED_DEBUG=DETAIL names it)"
                     : told + "; then " + mine + " with " + partners() + " failed";
    const PeerError failure(local_->rank(), cause + ": " + error_text(error));
    local_->fail(failure);
    throw failure;
  }
}

// --- what the reduce-scatter and the all-gather across hosts share ---------------------------------

std::string Hierarchical::describe(const Across& what) {
  if (what.kind == kAllgather) return "all_gather_into_tensor (" + std::to_string(what.count) + " bytes per rank)";
  return "reduce_scatter_tensor (" + std::to_string(what.count) + " x " + dtype_name(static_cast<DType>(what.dtype)) +
         " per rank, " + op_name(static_cast<Op>(what.op)) + ")";
}

void Hierarchical::run_across(const Across& what, const std::function<void()>& body) {
  try {
    try {
      local_->throw_if_failed();  // after a failure, every call throws it
      check_same_across(what);
      body();
    } catch (const std::exception& error) {
      throw local_->fail_with(error);  // my host's peers stop at once
    }
  } catch (const PeerError& error) {
    tell_other_hosts(error.what());
    throw;
  }
}

// Every rank of my local rank says what it runs (a Gloo allgather across the hosts, the same first
// step in both collectives, so that one pairs with the other and is named instead of mismatching).
void Hierarchical::check_same_across(const Across& what) {
  const int hosts = layout_.hosts();
  std::vector<at::Tensor> mine{at::tensor(std::vector<int64_t>{what.kind, what.count, what.dtype, what.op})};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int h = 0; h < hosts; ++h) all[0].push_back(at::empty({4}, at::kLong));
  land(across_->allgather(all, mine), what.kind == kAllgather ? "all-gather" : "reduce-scatter");
  const std::vector<int> partners = layout_.ranks_with_local_rank(layout_.local_rank_of(rank_));
  for (int h = 0; h < hosts; ++h) {
    const auto* theirs = all[0][h].data_ptr<int64_t>();
    if (theirs[0] == what.kind && theirs[1] == what.count && theirs[2] == what.dtype && theirs[3] == what.op) continue;
    const Across other{theirs[0], theirs[1], theirs[2], theirs[3]};
    // The lower rank first, so both ranks of the pair throw the same text.
    const int low = std::min(rank_, partners[h]), high = std::max(rank_, partners[h]);
    const Across& low_runs = low == rank_ ? what : other;
    const Across& high_runs = low == rank_ ? other : what;
    throw PeerError(local_->rank(), "rank " + std::to_string(low) + " and rank " + std::to_string(high) +
                                        " are not running the same collective across hosts: rank " + std::to_string(low) +
                                        " runs " + describe(low_runs) + ", rank " + std::to_string(high) + " runs " +
                                        describe(high_runs));
  }
}

at::Tensor Hierarchical::crossing_buffer(std::size_t bytes) {
  if (!crossing_.defined() || static_cast<std::size_t>(crossing_.numel()) < bytes) {
    crossing_ = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  }
  return crossing_;
}

void Hierarchical::land(const c10::intrusive_ptr<c10d::Work>& work, const char* collective) {
  local_->set_away(true);
  try {
    finish_part(work, collective);
  } catch (...) {
    local_->set_away(false);
    throw;
  }
  local_->set_away(false);
}

// Block h of `sent` to the rank of my local rank on host h; block h of `received` from it.
c10::intrusive_ptr<c10d::Work> Hierarchical::exchange(at::Tensor& received, at::Tensor& sent) {
  std::vector<int64_t> equal_blocks;
  return across_->alltoall_base(received, sent, equal_blocks, equal_blocks);
}

// "rank 3", "ranks 3, 5": the ranks of my local rank on the other hosts.
std::string Hierarchical::partners() const {
  std::vector<std::string> numbers;
  for (int rank : layout_.ranks_with_local_rank(layout_.local_rank_of(rank_))) {
    if (rank != rank_) numbers.push_back(std::to_string(rank));
  }
  std::string text = numbers.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < numbers.size(); ++i) text += (i == 0 ? "" : ", ") + numbers[i];
  return text;
}

// A failure another rank tells within `grace`: its own timeout may end a moment after mine.
std::string Hierarchical::failure_told_within(std::chrono::milliseconds grace) const noexcept {
  const auto until = std::chrono::steady_clock::now() + grace;
  for (;;) {
    std::string told = failure_told();
    if (!told.empty() || std::chrono::steady_clock::now() >= until) return told;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
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
