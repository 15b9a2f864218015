// The shared-memory channel (channel.h): agreeing whether it serves a group, then c10d Works run
// one after another on the channel's thread.
#include "ddp/floor/src/shm/channel.h"

#ifdef _WIN32
// No POSIX shared memory: every group runs on Gloo alone (CMakeLists.txt leaves the core out).
namespace ddp::detail::shm {
class Communicator {};
class Hierarchical {};
class Mailbox {};
std::unique_ptr<Channel> Channel::open(const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds,
                                       const std::string&, bool, bool, const std::shared_ptr<::gloo::transport::Device>&) {
  return nullptr;
}
Channel::~Channel() = default;
std::string Channel::name() const { return "shm"; }
bool Channel::serves(const std::vector<at::Tensor>&) const { return false; }
bool Channel::serves_barrier() const { return false; }
bool Channel::serves_allreduce(const std::vector<at::Tensor>&, c10d::ReduceOp) const { return false; }
bool Channel::serves_scaled_sum(const std::vector<at::Tensor>&) const { return false; }
bool Channel::serves_allgather(const std::vector<std::vector<at::Tensor>>&, const std::vector<at::Tensor>&) const {
  return false;
}
bool Channel::serves_reduce_scatter(const at::Tensor&, const at::Tensor&, c10d::ReduceOp) const { return false; }
bool Channel::serves_allgather_into(const at::Tensor&, const at::Tensor&) const { return false; }
#define DDP_NO_SHM_CHANNEL(name) TORCH_INTERNAL_ASSERT(false, "shared memory is not available on Windows: " name)
c10::intrusive_ptr<c10d::Work> Channel::allreduce(std::vector<at::Tensor>&, c10d::ReduceOp, double) {
  DDP_NO_SHM_CHANNEL("allreduce");
}
c10::intrusive_ptr<c10d::Work> Channel::broadcast(std::vector<at::Tensor>&, int) { DDP_NO_SHM_CHANNEL("broadcast"); }
c10::intrusive_ptr<c10d::Work> Channel::allgather(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&) {
  DDP_NO_SHM_CHANNEL("allgather");
}
c10::intrusive_ptr<c10d::Work> Channel::reduce_scatter(at::Tensor&, at::Tensor&, c10d::ReduceOp) {
  DDP_NO_SHM_CHANNEL("reduce_scatter");
}
c10::intrusive_ptr<c10d::Work> Channel::allgather_into(at::Tensor&, at::Tensor&) { DDP_NO_SHM_CHANNEL("allgather_into"); }
c10::intrusive_ptr<c10d::Work> Channel::barrier() { DDP_NO_SHM_CHANNEL("barrier"); }
bool Channel::serves_point_to_point(const std::vector<at::Tensor>&) const { return false; }
bool Channel::serves_all_to_all(const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&,
                                const std::vector<int64_t>&) const {
  return false;
}
c10::intrusive_ptr<c10d::Work> Channel::all_to_all(at::Tensor&, at::Tensor&, const std::vector<int64_t>&,
                                                   const std::vector<int64_t>&) {
  DDP_NO_SHM_CHANNEL("all_to_all");
}
c10::intrusive_ptr<c10d::Work> Channel::send(const at::Tensor&, int, int) { DDP_NO_SHM_CHANNEL("send"); }
c10::intrusive_ptr<c10d::Work> Channel::recv(const at::Tensor&, int, int) { DDP_NO_SHM_CHANNEL("recv"); }
std::shared_ptr<SharedArray> Channel::share(std::size_t) { return nullptr; }
void* Channel::mine(const SharedArray&) { return nullptr; }
bool Channel::serves_shared_sum(c10::ScalarType) const { return false; }
c10::intrusive_ptr<c10d::Work> Channel::shared_sum(std::shared_ptr<SharedArray>, std::size_t, const at::Tensor&, double) {
  DDP_NO_SHM_CHANNEL("shared_sum");
}
}  // namespace ddp::detail::shm
#else

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <optional>
#include <random>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <ddp/wait_collective.h>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/store_text.h"
#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/hierarchical.h"
#include "ddp/floor/src/shm/host_layout.h"
#include "ddp/floor/src/shm/mailbox.h"
#include "ddp/floor/src/shm/peers.h"
#include "ddp/floor/src/shm/process.h"
#include "ddp/floor/src/shm/reduce_kernels.h"

namespace ddp::detail::shm {
namespace {

// The Communicator's rendezvous over the group's c10d store, and the handshake's own keys.
class StoreRendezvous final : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override { store_->set(key, bytes_of(value)); }
  std::string get(const std::string& key) override { return text_of(store_->get(key)); }  // throws on timeout

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// What two processes must share to map each other's segments: the host (name and boot), and the
// /dev/shm mount (a container or namespace with its own has another device or inode).
std::string host_identity() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat shm_dir {};
  if (stat("/dev/shm", &shm_dir) != 0) return "";  // no /dev/shm: cannot serve
  return std::string(name) + " " + boot + " " + std::to_string(shm_dir.st_dev) + ":" + std::to_string(shm_dir.st_ino);
}

// Letters and digits of the run id, at most 16: enough to tell jobs apart in `ls /dev/shm`.
std::string short_run_id(const std::string& run_id) {
  std::string out;
  for (char c : run_id) {
    if (std::isalnum(static_cast<unsigned char>(c)) && out.size() < 16) out += c;
  }
  return out.empty() ? "job" : out;
}

// The one line a process prints when its ranks span hosts the hierarchical allreduce cannot serve.
void notice_flat_gloo(const HostLayout& layout) {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  std::string counts;
  for (int host = 0; host < layout.hosts(); ++host) {
    counts += (host == 0 ? "" : "+") + std::to_string(layout.ranks_on_host(host).size());
  }
  std::fprintf(stderr, "[torchddp] this group's ranks run on %d hosts (%s ranks): the hierarchical allreduce needs the "
               "same number, two or more, on every host; its collectives use Gloo over TCP\n", layout.hosts(),
               counts.c_str());
}

std::optional<DType> dtype_of(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat: return DType::kFloat32;
    case c10::kDouble: return DType::kFloat64;
    case c10::kBFloat16: return DType::kBFloat16;
    case c10::kHalf: return DType::kFloat16;
    case c10::kInt: return DType::kInt32;
    case c10::kLong: return DType::kInt64;
    case c10::kByte: return DType::kUInt8;
    default: return std::nullopt;
  }
}

std::optional<Op> op_of(c10d::ReduceOp op) {
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::SUM: return Op::kSum;
    case c10d::ReduceOp::AVG: return Op::kAvg;
    case c10d::ReduceOp::MAX: return Op::kMax;
    case c10d::ReduceOp::MIN: return Op::kMin;
    case c10d::ReduceOp::PRODUCT: return Op::kProduct;
    default: return std::nullopt;
  }
}

bool dense_cpu(const at::Tensor& tensor) {
  return tensor.defined() && tensor.device().is_cpu() && tensor.layout() == at::kStrided && tensor.is_contiguous();
}

// `piece` is the `rank`-th of the pieces `whole` is cut into, exactly, or shares no byte with it:
// what the core's reduce_scatter and allgather accept.
bool piece_or_apart(const at::Tensor& piece, const at::Tensor& whole, int rank) {
  const auto* p = static_cast<const unsigned char*>(piece.data_ptr());
  const auto* w = static_cast<const unsigned char*>(whole.data_ptr());
  const std::size_t bytes = piece.nbytes();
  return p == w + rank * bytes || p + bytes <= w || w + whole.nbytes() <= p;
}

// The first rank whose step of setting up failed, and why, the same on every rank; none when every
// rank's went well. `failure` is this rank's ("" when it went well); the verdicts travel through
// the store under "<step>/<rank>" (peers.h, agree: the one agreement of every set-up).
struct Failure {
  int rank;
  std::string why;
};
std::optional<Failure> first_failure(Rendezvous& keys, const std::string& step, int rank, int size,
                                     const std::string& failure) {
  std::optional<Failure> first;
  try {
    agree(
        rank, size, failure,
        [&](const std::string& mine) { keys.set(step + "/" + std::to_string(rank), mine.empty() ? "ok" : mine); },
        [&](int r) {
          const std::string theirs = keys.get(step + "/" + std::to_string(r));
          return theirs == "ok" ? std::string() : theirs;
        },
        [&](int r, const std::string& why) {
          first = Failure{r, why};
          return why;
        });
  } catch (const ShmUnavailable&) {
    // `first` says who
  }
  return first;
}

// The group's mailbox (point to point; collective, after the Communicator), or null on every rank
// alike when a rank could not set it up (said once per process on stderr): then point to point
// uses Gloo, and the collectives shared memory all the same.
std::unique_ptr<Mailbox> open_mailbox(Rendezvous& keys, const std::string& prefix, int rank, int size,
                                      std::chrono::milliseconds timeout) {
  std::unique_ptr<Mailbox> mailbox;
  std::string failure;
  try {
    mailbox = std::make_unique<Mailbox>(keys, prefix + "-m", rank, size, MailboxOptions::for_group(size, timeout));
  } catch (const std::exception& error) {
    failure = error_text(error);
  }
  const std::optional<Failure> failed = first_failure(keys, "mailbox", rank, size, failure);
  if (!failed) return mailbox;
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr, "[torchddp] point to point does not use shared memory in this group (rank %d: %s); it uses "
                 "Gloo over TCP\n", failed->rank, failed->why.c_str());
  }
  return nullptr;
}

// 1. Where each rank runs, whether it wants shared memory, and whether across hosts: the same
//    answer on every rank ("off", or "<hierarchical: 1|0> <host identity>"). The hosts' layout,
//    or none when shared memory does not serve the group.
std::optional<HostLayout> agree_on_layout(Rendezvous& keys, int rank, int size, bool wanted, bool hierarchical) {
  const std::string where = wanted ? host_identity() : "";
  keys.set("where/" + std::to_string(rank), where.empty() ? "off" : (hierarchical ? "1 " : "0 ") + where);
  std::vector<std::string> identities;
  bool all_across = true;
  for (int r = 0; r < size; ++r) {
    const std::string theirs = keys.get("where/" + std::to_string(r));
    if (theirs == "off") return std::nullopt;
    all_across = all_across && theirs[0] == '1';
    identities.push_back(theirs.substr(2));
  }
  HostLayout layout(identities);
  if (layout.hosts() > 1) {
    if (!all_across) return std::nullopt;  // switched off: Gloo, as asked
    if (!layout.hierarchical()) {
      if (rank == 0) notice_flat_gloo(layout);
      return std::nullopt;
    }
  }
  return layout;
}

// 2. Segment names no other job or group can meet: the run id and a nonce rank 0 draws (and, on
//    several hosts, the host's index: each host's ranks make a Communicator of their own).
std::string segment_prefix(Rendezvous& keys, int rank, const std::string& run_id, const HostLayout& layout) {
  if (rank == 0) {
    std::random_device random;
    keys.set("nonce", std::to_string(random()) + std::to_string(random()));
  }
  std::string prefix = "/torchddp-" + short_run_id(run_id) + "-" + keys.get("nonce").substr(0, 12);
  if (layout.hosts() > 1) prefix += "-h" + std::to_string(layout.host_of(rank));
  return prefix;
}

}  // namespace

// A c10d Work finished by the channel's thread: its future holds the collective's tensors (as
// Gloo's does), and wait() returns once the future is complete.
class Channel::Work final : public c10d::Work {
 public:
  Work(c10d::OpType type, std::vector<at::Tensor> result)
      : c10d::Work(-1, type),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
    finish(error);  // wakes wait(), after the future: a waiter may read the future at once
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return result_; }

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

std::unique_ptr<Channel> Channel::open(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       std::chrono::milliseconds timeout, const std::string& run_id, bool wanted,
                                       bool hierarchical, const std::shared_ptr<::gloo::transport::Device>& device) {
  if (size < 2) return nullptr;  // nothing to share
  StoreRendezvous keys(store);
  const std::optional<HostLayout> layout = agree_on_layout(keys, rank, size, wanted, hierarchical);
  if (!layout) return nullptr;
  const std::string prefix = segment_prefix(keys, rank, run_id, *layout);

  // 3. Set up, then agree: a rank may fail after a peer succeeded, and all must use one transport.
  std::unique_ptr<Communicator> communicator;
  std::shared_ptr<SharedArray> scratch;  // several hosts: the hierarchical allreduce's window
  std::string failure;
  try {
    Options options;
    options.timeout = timeout;
    if (layout->hosts() > 1) {
      options.rank_names = layout->ranks_on_host(layout->host_of(rank));  // errors name the group's ranks
      communicator = std::make_unique<Communicator>(keys, prefix, layout->local_rank_of(rank),
                                                    static_cast<int>(options.rank_names.size()), options);
      scratch = communicator->share(Hierarchical::kScratchBytes);
    } else {
      communicator = std::make_unique<Communicator>(keys, prefix, rank, size, options);
    }
  } catch (const std::exception& error) {
    failure = error_text(error);
  }
  if (const std::optional<Failure> failed = first_failure(keys, "setup", rank, size, failure)) {
    if (failed->rank == rank || (rank == 0 && failure.empty())) {
      std::fprintf(stderr, "[torchddp] shared memory does not serve this group (rank %d: %s); its collectives use "
                   "Gloo over TCP\n", failed->rank, failed->why.c_str());
    }
    return nullptr;
  }
  if (layout->hosts() == 1) {
    std::unique_ptr<Channel> channel(new Channel(std::move(communicator), nullptr));
    channel->mailbox_ = open_mailbox(keys, prefix, rank, size, timeout);
    return channel;
  }
  // 4. Several hosts: this rank's Gloo group across them, with the ranks of its local rank.
  auto steps = std::make_unique<Hierarchical>(*layout, rank, std::move(communicator), std::move(scratch), store, device,
                                              timeout);
  return std::unique_ptr<Channel>(new Channel(nullptr, std::move(steps)));
}

Channel::Channel(std::unique_ptr<Communicator> communicator, std::unique_ptr<Hierarchical> hierarchical)
    : communicator_(std::move(communicator)), hierarchical_(std::move(hierarchical)), thread_([this] { run(); }) {}

Channel::~Channel() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

// --- what it serves ----------------------------------------------------------------------------

std::string Channel::name() const { return hierarchical_ ? "shm " + hierarchical_->name() : "shm"; }

bool Channel::serves(const std::vector<at::Tensor>& tensors) const {
  return !hierarchical_ && tensors.size() == 1 && dense_cpu(tensors[0]);
}

bool Channel::serves_barrier() const { return !hierarchical_; }

bool Channel::serves_allreduce(const std::vector<at::Tensor>& tensors, c10d::ReduceOp op) const {
  if (tensors.empty() || !dtype_of(tensors[0].scalar_type()) || !op_of(op)) return false;
  for (const at::Tensor& tensor : tensors) {
    if (!dense_cpu(tensor) || tensor.scalar_type() != tensors[0].scalar_type()) return false;
  }
  const DType dtype = *dtype_of(tensors[0].scalar_type());
  return hierarchical_ ? Hierarchical::serves(dtype, *op_of(op)) : supported(dtype, *op_of(op));
}

bool Channel::serves_scaled_sum(const std::vector<at::Tensor>& tensors) const {
  return serves_allreduce(tensors, c10d::ReduceOp::SUM) && at::isFloatingType(tensors[0].scalar_type());
}
bool Channel::serves_allgather(const std::vector<std::vector<at::Tensor>>& outputs,
                               const std::vector<at::Tensor>& inputs) const {
  if (!serves(inputs) || outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(communicator_->size())) {
    return false;
  }
  for (const at::Tensor& output : outputs[0]) {
    if (!output.defined() || !output.device().is_cpu() || output.scalar_type() != inputs[0].scalar_type() ||
        output.numel() != inputs[0].numel()) {
      return false;
    }
  }
  return true;
}

// Across hosts too (hierarchical.h): the reduce-scatter and all-gather reduce and copy where shared
// memory does, with every dtype and reduction it takes.
bool Channel::serves_reduce_scatter(const at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op) const {
  if (!dense_cpu(output) || !dense_cpu(input) || output.scalar_type() != input.scalar_type()) return false;
  const std::optional<DType> dtype = dtype_of(input.scalar_type());
  return dtype && op_of(op) && supported(*dtype, *op_of(op)) && input.numel() == output.numel() * group_size() &&
         piece_or_apart(output, input, group_rank());
}

bool Channel::serves_allgather_into(const at::Tensor& output, const at::Tensor& input) const {
  return dense_cpu(output) && dense_cpu(input) && output.scalar_type() == input.scalar_type() &&
         output.numel() == input.numel() * group_size() && piece_or_apart(input, output, group_rank());
}

int Channel::group_size() const { return hierarchical_ ? hierarchical_->size() : communicator_->size(); }
int Channel::group_rank() const { return hierarchical_ ? hierarchical_->rank() : communicator_->rank(); }

// --- the collectives: queued, run in order on the channel's thread ------------------------------

c10::intrusive_ptr<c10d::Work> Channel::allreduce(std::vector<at::Tensor>& tensors, c10d::ReduceOp op, double scale) {
  const DType dtype = *dtype_of(tensors[0].scalar_type());
  const Op reduce = *op_of(op);
  const auto type = tensors.size() == 1 ? c10d::OpType::ALLREDUCE : c10d::OpType::ALLREDUCE_COALESCED;
  std::size_t bytes = 0;
  for (const at::Tensor& tensor : tensors) bytes += tensor.nbytes();
  return issue(type, tensors, where_for(bytes), [this, tensors, dtype, reduce, scale] {
    if (hierarchical_) {
      hierarchical_->allreduce(tensors, dtype, reduce, scale);
      return;
    }
    std::vector<Span> spans;
    spans.reserve(tensors.size());
    for (const at::Tensor& tensor : tensors) spans.push_back({tensor.data_ptr(), static_cast<std::size_t>(tensor.numel())});
    communicator_->allreduce(spans, dtype, reduce, scale);
  });
}

c10::intrusive_ptr<c10d::Work> Channel::broadcast(std::vector<at::Tensor>& tensors, int root) {
  at::Tensor tensor = tensors[0];
  return issue(c10d::OpType::BROADCAST, tensors, where_for(tensor.nbytes()), [this, tensor, root] {
    communicator_->broadcast(tensor.data_ptr(), tensor.nbytes(), root);
  });
}

c10::intrusive_ptr<c10d::Work> Channel::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs) {
  at::Tensor input = inputs[0];
  std::vector<at::Tensor> out = outputs[0];
  return issue(c10d::OpType::ALLGATHER, out, where_for(input.nbytes() * out.size()), [this, input, out] {
    // Every rank's part lands in one contiguous buffer, then in the caller's tensors.
    at::Tensor gathered = at::empty({static_cast<int64_t>(out.size()), input.numel()}, input.options());
    communicator_->allgather(input.data_ptr(), input.nbytes(), gathered.data_ptr());
    for (size_t r = 0; r < out.size(); ++r) out[r].copy_(gathered[static_cast<int64_t>(r)].view(out[r].sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> Channel::reduce_scatter(at::Tensor& output, at::Tensor& input, c10d::ReduceOp op) {
  const DType dtype = *dtype_of(input.scalar_type());
  const Op reduce = *op_of(op);
  return issue(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, where_for(input.nbytes()), [this, output, input, dtype, reduce] {
    const auto count = static_cast<std::size_t>(output.numel());
    if (hierarchical_) {
      hierarchical_->reduce_scatter(input.data_ptr(), count, output.data_ptr(), dtype, reduce);
    } else {
      communicator_->reduce_scatter(input.data_ptr(), count, output.data_ptr(), dtype, reduce);
    }
  });
}

c10::intrusive_ptr<c10d::Work> Channel::allgather_into(at::Tensor& output, at::Tensor& input) {
  // Every rank's piece straight into its place in `output`: no gathering buffer.
  return issue(c10d::OpType::_ALLGATHER_BASE, {output}, where_for(output.nbytes()), [this, output, input] {
    if (hierarchical_) {
      hierarchical_->allgather(input.data_ptr(), input.nbytes(), output.data_ptr());
    } else {
      communicator_->allgather(input.data_ptr(), input.nbytes(), output.data_ptr());
    }
  });
}

c10::intrusive_ptr<c10d::Work> Channel::barrier() {
  return issue(c10d::OpType::BARRIER, {}, Where::kCallerIfIdle, [this] { communicator_->barrier(); });
}

// --- all-to-all (queued, like the collectives) and point to point (the mailbox's thread) ----------

namespace {

// Whether `splits` cut `tensor`'s rows into one block per rank: empty for equal blocks, else one
// entry per rank, none negative, summing to the rows.
bool splits_fit(const at::Tensor& tensor, const std::vector<int64_t>& splits, int size) {
  if (tensor.dim() == 0) return false;
  const int64_t rows = tensor.size(0);
  if (splits.empty()) return rows % size == 0;
  if (splits.size() != static_cast<std::size_t>(size)) return false;
  int64_t sum = 0;
  for (int64_t block : splits) {
    if (block < 0) return false;
    sum += block;
  }
  return sum == rows;
}

// Each rank's block of `tensor` in bytes (splits_fit holds).
std::vector<Piece> pieces_of_splits(const at::Tensor& tensor, const std::vector<int64_t>& splits, int size) {
  const int64_t rows = tensor.size(0);
  const std::size_t row_bytes = rows > 0 ? tensor.nbytes() / static_cast<std::size_t>(rows) : 0;
  std::vector<Piece> pieces;
  std::size_t offset = 0;
  for (int q = 0; q < size; ++q) {
    const std::size_t bytes = static_cast<std::size_t>(splits.empty() ? rows / size : splits[q]) * row_bytes;
    pieces.push_back({offset, bytes});
    offset += bytes;
  }
  return pieces;
}

// A point-to-point Work, finished on the mailbox's thread: its future holds the tensor (as Gloo's
// does), sourceRank() the sender.
class MailboxWork final : public c10d::Work {
 public:
  MailboxWork(c10d::OpType type, at::Tensor tensor, Mailbox* mailbox)
      : c10d::Work(-1, type),
        mailbox_(mailbox),
        result_{std::move(tensor)},
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  void complete(int source, std::exception_ptr error) {
    source_.store(source);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
    finish(error);  // wakes wait(), after the future
    finished_.store(true, std::memory_order_release);
  }
  // A small message is usually microseconds away: for a while, move messages on this thread (the
  // mailbox's thread may be asleep, or have no core) before sleeping on the condition variable,
  // whose wake-up would cost more than that. A large one is left to the mailbox's thread: a waiter
  // preempted while it moves a chunk would hold the thread up. The group outlives its Works' waits.
  bool wait(std::chrono::milliseconds timeout) override {
    constexpr std::size_t kMoveHereBytes = 64 * 1024;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    for (unsigned polls = 1; result_[0].nbytes() <= kMoveHereBytes && !finished_.load(std::memory_order_acquire); ++polls) {
      if (!mailbox_->progress() && polls % 16 == 0 && std::chrono::steady_clock::now() >= until) break;
    }
    return c10d::Work::wait(timeout);
  }
  int sourceRank() const override { return source_.load(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return result_; }

 private:
  Mailbox* mailbox_;
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> source_{-1};
  std::atomic<bool> finished_{false};
};

}  // namespace

bool Channel::serves_point_to_point(const std::vector<at::Tensor>& tensors) const {
  return mailbox_ && tensors.size() == 1 && dense_cpu(tensors[0]);
}

bool Channel::serves_all_to_all(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits) const {
  if (hierarchical_ || !dense_cpu(output) || !dense_cpu(input) || output.scalar_type() != input.scalar_type()) return false;
  const int size = communicator_->size();
  const auto* in = static_cast<const unsigned char*>(input.data_ptr());
  const auto* out = static_cast<const unsigned char*>(output.data_ptr());
  const bool apart = in + input.nbytes() <= out || out + output.nbytes() <= in || input.nbytes() == 0 || output.nbytes() == 0;
  return apart && splits_fit(output, output_splits, size) && splits_fit(input, input_splits, size);
}

c10::intrusive_ptr<c10d::Work> Channel::all_to_all(at::Tensor& output, at::Tensor& input,
                                                   const std::vector<int64_t>& output_splits,
                                                   const std::vector<int64_t>& input_splits) {
  const int size = communicator_->size();
  std::vector<Piece> sends = pieces_of_splits(input, input_splits, size);
  std::vector<Piece> receives = pieces_of_splits(output, output_splits, size);
  // A large one where no core is spare besides one per rank here runs on the caller too: split
  // between two threads, its copies would only share the rank's core (at 33.6 MB and 2 ranks on 2
  // cores: 2.43-2.61 ms whole on the caller, 2.71-2.90 split).
  Where where = where_for(input.nbytes() + output.nbytes());
  if (where == Where::kChannelThread && cpus_available() < 2 * size) where = Where::kCallerIfIdle;
  if (where != Where::kChannelThread) {
    return issue(c10d::OpType::ALLTOALL_BASE, {output}, where, [this, output, input, sends, receives] {
      communicator_->all_to_all(input.data_ptr(), sends, output.data_ptr(), receives);
    });
  }
  // Large, with a core to spare: this thread copies this rank's piece for itself while the
  // channel's thread exchanges the others' (one copy fewer on its path), and the Work completes
  // once both are done.
  auto own_copied = std::make_shared<std::promise<void>>();
  std::shared_future<void> own_done = own_copied->get_future().share();
  auto work = issue(c10d::OpType::ALLTOALL_BASE, {output}, where, [this, output, input, sends, receives, own_done] {
    communicator_->all_to_all(input.data_ptr(), sends, output.data_ptr(), receives, /*own_piece=*/false);
    own_done.wait();
  });
  const int rank = communicator_->rank();
  const std::size_t own = std::min(sends[rank].bytes, receives[rank].bytes);  // all_to_all names sizes that differ
  if (own > 0) {
    stream_bytes(static_cast<unsigned char*>(output.data_ptr()) + receives[rank].offset,
                 static_cast<const unsigned char*>(input.data_ptr()) + sends[rank].offset, own);
  }
  own_copied->set_value();
  return work;
}

c10::intrusive_ptr<c10d::Work> Channel::send(const at::Tensor& tensor, int dst, int tag) {
  auto work = c10::make_intrusive<MailboxWork>(c10d::OpType::SEND, tensor, mailbox_.get());
  at::Tensor held = tensor;  // alive until the data is in shared memory
  void* data = held.nbytes() > 0 ? held.data_ptr() : nullptr;
  mailbox_->send(data, held.nbytes(), dst, tag, [work, held](int source, std::exception_ptr error) mutable {
    held = at::Tensor();  // dropped before the waiter wakes: then the caller's thread owns it alone
    work->complete(source, error);
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> Channel::recv(const at::Tensor& tensor, int src, int tag) {
  auto work = c10::make_intrusive<MailboxWork>(src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, tensor,
                                               mailbox_.get());
  at::Tensor held = tensor;
  void* data = held.nbytes() > 0 ? held.data_ptr() : nullptr;
  mailbox_->recv(data, held.nbytes(), src < 0 ? Mailbox::kAnySource : src, tag,
                 [work, held](int source, std::exception_ptr error) mutable {
                   held = at::Tensor();
                   work->complete(source, error);
                 });
  return work;
}

// --- DDP's buckets in shared memory -----------------------------------------------------------

bool Channel::serves_shared_sum(c10::ScalarType dtype) const {
  const std::optional<DType> type = dtype_of(dtype);
  return type && (!hierarchical_ || Hierarchical::serves(*type, Op::kSum));
}

std::shared_ptr<SharedArray> Channel::share(std::size_t bytes) {
  std::shared_ptr<SharedArray> array;
  std::string refused;
  // On the channel's thread, in order with the collectives issued before it.
  issue(c10d::OpType::UNKNOWN, {}, Where::kChannelThread, [this, bytes, &array, &refused] {
    try {
      array = hierarchical_ ? hierarchical_->share(bytes) : communicator_->share(bytes);
    } catch (const ShmUnavailable& e) {
      refused = e.what();
    }
  })->wait();  // a peer's failure comes out of wait() as its PeerError
  if (!array) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      std::fprintf(stderr, "[torchddp] DDP's gradient buckets stay in private memory (%s); shared memory reduces them "
                   "all the same, with more copies\n", refused.c_str());
    }
  }
  return array;
}

void* Channel::mine(const SharedArray& array) { return array.mine(); }

c10::intrusive_ptr<c10d::Work> Channel::shared_sum(std::shared_ptr<SharedArray> array, std::size_t offset,
                                                   const at::Tensor& tensor, double scale) {
  const DType dtype = *dtype_of(tensor.scalar_type());
  const auto count = static_cast<std::size_t>(tensor.numel());
  // On the channel's thread always: a bucket's sum overlaps the rest of backward.
  return issue(c10d::OpType::ALLREDUCE, {tensor}, Where::kChannelThread,
               [this, array = std::move(array), offset, count, dtype, scale] {
                 if (hierarchical_) {
                   hierarchical_->allreduce_shared(array, offset, count, dtype, Op::kSum, scale);
                 } else {
                   communicator_->allreduce_shared(*array, offset, count, dtype, Op::kSum, scale);
                 }
               });
}

Channel::Where Channel::where_for(std::size_t bytes) {
  // Up to here a collective takes about as long as the two thread switches it saves; a longer one
  // is left to the channel's thread, so its caller goes on while it runs.
  constexpr std::size_t kRunHereBytes = 64 * 1024;
  return bytes <= kRunHereBytes ? Where::kCallerIfIdle : Where::kChannelThread;
}

c10::intrusive_ptr<c10d::Work> Channel::issue(c10d::OpType type, std::vector<at::Tensor> result, Where where,
                                              std::function<void()> body) {
  auto work = c10::make_intrusive<Work>(type, std::move(result));
  // Runs the collective, then frees the channel before the Work completes: a caller that hears
  // it is done finds the channel idle, and its next small collective may run at once.
  auto job = [this, work, body = std::move(body)]() mutable {
    std::exception_ptr error;
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    // Drop the body's tensor references before the waiter wakes: afterwards the caller's thread
    // owns them alone (ThreadSanitizer saw this thread's release race with the caller's free).
    body = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
    }
    wake_.notify_one();  // for what was queued meanwhile
    work->complete(error);
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Idle: nothing running and nothing queued, so running it now keeps the order of the calls.
    const bool here = where == Where::kCallerIfIdle && !running_ && queue_.empty();
    if (!here) {
      queue_.push_back(std::move(job));
      wake_.notify_one();
      return work;
    }
    running_ = true;  // what is issued meanwhile queues behind it
  }
  ddp::detail::WaitingInCollective waiting;  // the heartbeat says so while the caller runs it
  job();
  return work;
}

void Channel::run() {
  for (;;) {
    std::function<void()> next;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return !running_ && (stopping_ || !queue_.empty()); });
      if (queue_.empty()) return;  // stopping, and everything issued has run
      next = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    next();  // clears running_ when its collective is done
  }
}

}  // namespace ddp::detail::shm
#endif  // _WIN32
