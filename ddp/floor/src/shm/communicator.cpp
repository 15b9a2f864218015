// Shared-memory collectives for the ranks of one host (communicator.h). Read top to bottom:
// the shared layout, setup, the step machinery (post, wait, failure), then the collectives.
#include "communicator.h"

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <new>
#include <sstream>
#include <thread>

#include "process.h"
#include "steps.h"
#include "wait.h"

namespace ddp::detail::shm {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::uint64_t kMagic = 0x746f726368646470ull;  // "torchddp"
constexpr std::uint32_t kVersion = 5;  // 2: descriptors carry an offset (allreduce_shared); 3: no reduce_scatter; 4: away;
                                       // 5: reduce_scatter again (steps.h)
constexpr std::size_t kControlBytes = 4096;  // the control block's page; the data buffers follow
constexpr std::size_t kMessageBytes = 1024;
constexpr auto kSleepSlice = 50ms;      // longest futex sleep: then look at the deadline and the peers
constexpr auto kPidCheckEvery = 100ms;  // how often a waiting rank asks whether lagging peers still live

// CPUs this process may run on: fewer than ranks means the rank we wait for may need our core.
int cpus_available() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

// --- What lives in shared memory ---------------------------------------------------------------


// The first page of every rank's segment. The owner writes everything but `sleepers` (peers
// count themselves in and out there). Setup fields are written before the rendezvous that
// publishes the segment; the descriptors before the post that makes them visible; the message
// before the `failed` flag (release) that makes it visible.
struct Communicator::ControlBlock {
  std::uint64_t magic;
  std::uint32_t version;
  std::int32_t rank;
  std::int32_t size;
  std::int32_t pid;
  std::uint64_t start_time;
  std::uint64_t chunk_bytes;
  std::uint64_t one_step_bytes;

  alignas(64) Progress progress;

  alignas(64) std::atomic<std::uint32_t> failed;
  std::atomic<std::uint32_t> closed;  // the owner destroyed its Communicator
  std::atomic<std::uint32_t> away;    // the owner waits for the other hosts (a Relay), within their own timeout
  std::int32_t culprit;  // the rank the failure names
  char message[kMessageBytes];

  // By sequence % 2: a peer reads the descriptor of collective n after its first wait in n, and
  // by then no rank can have begun n + 2 (that needs this peer's first post of n + 1).
  alignas(64) Descriptor descriptors[2];
};
static_assert(sizeof(Communicator::ControlBlock) <= kControlBytes, "the control block must fit its page");


// --- Setup ---------------------------------------------------------------------------------------

Communicator::Communicator(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, Options options)
    : options_(options), prefix_(name_prefix), rank_(rank), size_(size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("shm::Communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) + " is not a rank");
  }
  if (options_.timeout.count() <= 0) throw std::invalid_argument("shm::Communicator: the timeout must be positive");
  if (!options_.rank_names.empty() && options_.rank_names.size() != static_cast<std::size_t>(size)) {
    throw std::invalid_argument("shm::Communicator: rank_names has " + std::to_string(options_.rank_names.size()) +
                                " entries for " + std::to_string(size) + " ranks");
  }
  options_.chunk_bytes = (std::max<std::size_t>(options_.chunk_bytes, 64) + 63) / 64 * 64;
  options_.one_step_bytes = std::min(options_.one_step_bytes, options_.chunk_bytes);
  if (size_ == 1) return;  // nothing to share

  // Oversubscribed, the rank we wait for may need our core: spin only briefly before sleeping.
  spin_ = options_.spin.count() >= 0 ? options_.spin : cpus_available() >= size_ ? 20us : 2us;
  peers_.resize(size_);
  sources_.resize(size_);
  const std::size_t segment_bytes = kControlBytes + 2 * options_.chunk_bytes;
  const auto name_of = [&](int r) { return name_prefix + "-" + std::to_string(r); };
  const std::string key = "torchddp/shm" + name_prefix + "/";
  const std::string me = std::to_string(rank_);
  const auto get = [&](const std::string& what, int peer) {
    try {
      return rendezvous.get(key + what + "/" + std::to_string(peer));
    } catch (const std::exception& e) {
      throw ShmUnavailable("rank " + me + ": waiting for rank " + std::to_string(peer) + " (" + what + "): " + e.what());
    }
  };
  const auto set = [&](const std::string& what, const std::string& value) {
    try {
      rendezvous.set(key + what + "/" + me, value);
    } catch (const std::exception& e) {
      throw ShmUnavailable("rank " + me + ": publishing \"" + what + "\": " + e.what());
    }
  };

  // 1. Create my segment and fill in its control block; tell the peers it exists, or why not, so
  //    they fail at once instead of waiting for the rendezvous timeout.
  try {
    Peer& self = peers_[rank_];
    self.segment = Segment::create(name_of(rank_), segment_bytes);
    auto* control = new (self.segment.data()) ControlBlock{};
    control->magic = kMagic;
    control->version = kVersion;
    control->rank = rank_;
    control->size = size_;
    control->pid = static_cast<std::int32_t>(::getpid());
    control->start_time = read_process(control->pid).start_time;
    control->chunk_bytes = options_.chunk_bytes;
    control->one_step_bytes = options_.one_step_bytes;
  } catch (const std::exception& e) {
    try {
      set("created", std::string("error: ") + e.what());
    } catch (const std::exception&) {
    }
    throw ShmUnavailable("rank " + me + ": " + e.what());
  }
  set("created", "ok");

  // 2. Learn that every peer's segment exists (all of them first, so every rank names the same
  //    failed peer), then map each one and make sure it is the one we expect.
  std::vector<int> created;  // peers whose segments exist: if setup fails, their names go too (below)
  std::string failure;
  try {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const std::string status = get("created", p);
      if (status != "ok") throw ShmUnavailable("rank " + std::to_string(p) + " could not create its segment: " + status);
      created.push_back(p);
    }
    for (int p : created) {
      peers_[p].segment = Segment::open(name_of(p), segment_bytes);
      const auto* control = static_cast<const ControlBlock*>(peers_[p].segment.data());
      if (control->magic != kMagic || control->version != kVersion || control->rank != p || control->size != size_ ||
          control->chunk_bytes != options_.chunk_bytes || control->one_step_bytes != options_.one_step_bytes) {
        throw ShmUnavailable("shared memory object " + name_of(p) + " is not rank " + std::to_string(p) +
                             "'s segment of this group (another version of the library, other options, or another group's name)");
      }
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }

  // 3. Tell everyone whether I mapped every segment; learn whether everyone did. Each rank then
  //    knows that nobody needs a name any more.
  try {
    set("mapped", failure.empty() ? std::string("ok") : "error: " + failure);
    if (!failure.empty()) throw ShmUnavailable("rank " + me + ": " + failure);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const std::string status = get("mapped", p);
      if (status != "ok") throw ShmUnavailable("rank " + std::to_string(p) + " could not map the group's segments: " + status);
    }
  } catch (...) {
    // Setup failed, so nobody will map anything again: remove the names of the peers' segments
    // too, in case a peer died before removing its own (mine goes with peers_[rank_]).
    for (int p : created) ::shm_unlink(name_of(p).c_str());
    throw;
  }

  // 4. Remove my name: from now on the memory lives exactly as long as some process maps it.
  peers_[rank_].segment.unlink();

  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    peer.control = static_cast<ControlBlock*>(peer.segment.data());
    auto* data = static_cast<unsigned char*>(peer.segment.data()) + kControlBytes;
    peer.buffers[0] = data;
    peer.buffers[1] = data + options_.chunk_bytes;
    // Watch its pid only if it is the peer's pid here too: the same process, started at the same
    // tick (ranks in another pid namespace are left to the timeout).
    const ProcessInfo info = read_process(peer.control->pid);
    peer.check_pid = p != rank_ && info.exists && !exited(info, peer.control->start_time);
  }
}

// Peers still waiting for this rank (it left in the middle of a collective, say after an
// exception of its own) learn it at once instead of at the timeout.
Communicator::~Communicator() {
  // Not in a child forked after setup (it shares the mappings but is not this rank).
  if (peers_.empty() || peers_[rank_].control->pid != static_cast<std::int32_t>(::getpid())) return;
  peers_[rank_].control->closed.store(1, std::memory_order_release);
  for (Peer& peer : peers_) wake_all(peer.control->progress);
}

// --- Steps: post, wait, fail -----------------------------------------------------------------


// Publishes this collective's descriptor; the first post() makes it visible.
void Communicator::begin(const Descriptor& descriptor) {
  Descriptor& mine = peers_[rank_].control->descriptors[(sequence_ + 1) % 2];
  mine = descriptor;
  mine.sequence = ++sequence_;
  first_post_pending_ = true;
}

void Communicator::post() {
  if (first_post_pending_) {  // the peers may compare descriptors after this post: we do it after the next wait
    first_post_pending_ = false;
    compare_after_next_wait_ = true;
  }
  posted_ = shm::post(peers_[rank_].control->progress);
}

// Returns when every peer has made `target` posts. Throws PeerError when a peer failed, exited or
// does not arrive within the timeout. A peer still waiting for the other hosts at the timeout is
// not the cause: it gets one more timeout to fail with what it waits for (its own wait there ends
// within one), so that the error names the rank at fault, not the one that waited for it.
void Communicator::wait_all(std::uint32_t target, const Step& step) {
  const auto start = Clock::now();
  const auto deadline = start + options_.timeout;
  auto give_up = deadline;
  auto next_pid_check = start + kPidCheckEvery;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Progress& progress = peers_[p].control->progress;
    for (;;) {
      const auto now = Clock::now();
      const auto sleep = std::min<Clock::duration>(kSleepSlice, std::min(give_up, next_pid_check) - now);
      if (wait_for(progress, target, spin_, sleep)) break;
      // Not there yet: did someone fail (their wake brought us here), did a lagging peer leave, is
      // time up?
      check_failed_peers();
      const auto later = Clock::now();
      const bool look_at_pids = later >= next_pid_check;
      if (look_at_pids) next_pid_check = later + kPidCheckEvery;
      check_departed_peers(target, step, look_at_pids);
      if (later < give_up || reached(progress.count.load(std::memory_order_acquire), target)) continue;
      if (give_up == deadline && waits_for_other_hosts(p)) {
        give_up += options_.timeout;
        continue;
      }
      throw_timeout(target, step, p);
    }
  }
  if (compare_after_next_wait_) {  // every peer has posted its first step: its descriptor is there
    compare_after_next_wait_ = false;
    check_descriptors();
  }
}

// Before writing a data buffer: every peer must have posted its last step on the buffer's
// previous contents. With two buffers this never actually waits - the use in between began with a
// wait for every peer's first post, which each peer made only after it was done with the use
// before - but the rule then holds on its own, whatever the steps in between. Ranks that only read
// their buffers this time skip it (a later writer waits for the newest release, which covers this).
int Communicator::acquire_buffer(const Step& step, bool will_write) {
  const int buffer = next_buffer_;
  next_buffer_ ^= 1;
  if (will_write) wait_all(buffer_free_at_[buffer], step);
  return buffer;
}

// Right after a collective's last post on `buffer`: peers that posted this far are done with it.
void Communicator::release_buffer(int buffer) { buffer_free_at_[buffer] = posted_; }

void Communicator::check_descriptors() {
  const Descriptor mine = peers_[rank_].control->descriptors[sequence_ % 2];
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const Descriptor theirs = peers_[p].control->descriptors[sequence_ % 2];
    if (theirs == mine) continue;
    // Name the lower rank first, so both ranks of the pair throw the same text.
    const int low = std::min(rank_, p), high = std::max(rank_, p);
    const Descriptor& low_runs = low == rank_ ? mine : theirs;
    const Descriptor& high_runs = low == rank_ ? theirs : mine;
    throw PeerError(p, name(low) + " and " + name(high) + " are not running the same collective: " + name(low) + " runs " +
                           describe(low_runs) + ", " + name(high) + " runs " + describe(high_runs));
  }
}

// The control block of the first peer that raised its failure flag, or null.
const Communicator::ControlBlock* Communicator::failed_peer() const {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].control->failed.load(std::memory_order_acquire) != 0) return peers_[p].control;
  }
  return nullptr;
}

// A peer that failed raised its flag and woke us: fail with its error (same text, same culprit).
void Communicator::check_failed_peers() {
  if (const ControlBlock* control = failed_peer()) {
    throw PeerError(control->culprit, std::string(control->message, strnlen(control->message, kMessageBytes)));
  }
}

std::string Communicator::peer_failure() const {
  const ControlBlock* control = peers_.empty() ? nullptr : failed_peer();
  return control ? std::string(control->message, strnlen(control->message, kMessageBytes)) : "";
}

namespace {
std::string who(int rank, int pid, const ProcessInfo& info) {
  std::string text = std::to_string(rank) + " (pid " + std::to_string(pid);
  if (stopped(info)) text += ", stopped";
  return text + ")";
}

std::string where(const std::string& collective, std::size_t chunk, std::size_t chunks, const char* waiting_for) {
  std::string text = collective;
  if (chunks > 1) text += ", chunk " + std::to_string(chunk + 1) + " of " + std::to_string(chunks);
  return text + ", waiting for " + waiting_for;
}
}  // namespace

// A lagging peer that closed its communicator, or whose process is gone (looked at every
// kPidCheckEvery), will never post: name it now rather than at the timeout.
void Communicator::check_departed_peers(std::uint32_t target, const Step& step, bool look_at_pids) {
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    if (p == rank_ || reached(peer.control->progress.count.load(std::memory_order_acquire), target)) continue;
    std::string what;
    if (peer.control->closed.load(std::memory_order_acquire) != 0) {
      what = " closed its communicator";
    } else if (look_at_pids && peer.check_pid && exited(read_process(peer.control->pid), peer.control->start_time)) {
      what = " exited";
    } else {
      continue;
    }
    throw PeerError(p, name(p) + " (pid " + std::to_string(peer.control->pid) + ")" + what + "; " + name(rank_) +
                           " was in " + where(describe(current()), step.chunk, step.chunks, step.waiting_for));
  }
}

// Whether peer `p` is inside its step across the hosts (a Relay), and not stopped there itself.
bool Communicator::waits_for_other_hosts(int p) const {
  const Peer& peer = peers_[p];
  if (peer.control->away.load(std::memory_order_acquire) == 0) return false;
  return !(peer.check_pid && stopped(read_process(peer.control->pid)));
}

// No post from some peers within the timeout (`late` among them): name every one of them, and say
// which are stopped. The error blames the first named: a stopped one before one that runs.
void Communicator::throw_timeout(std::uint32_t target, const Step& step, int late) {
  // (peer, "<number> (pid <pid>[, stopped])"): the stopped ones in `lagging`, then the running ones.
  std::vector<std::pair<int, std::string>> lagging, running;
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    if (p == rank_ || reached(peer.control->progress.count.load(std::memory_order_acquire), target)) continue;
    const ProcessInfo info = peer.check_pid ? read_process(peer.control->pid) : ProcessInfo{};
    (stopped(info) ? lagging : running).emplace_back(p, who(number_of(p), peer.control->pid, info));
  }
  lagging.insert(lagging.end(), running.begin(), running.end());
  if (lagging.empty()) lagging.emplace_back(late, std::to_string(number_of(late)));  // `late` arrived just now
  std::string names;
  for (const auto& named : lagging) names += (names.empty() ? "" : ", ") + named.second;
  const std::string subject = lagging.size() == 1 ? "rank " + names + " did not arrive" : "ranks " + names + " did not arrive";
  throw PeerError(lagging.front().first, subject + " within " + std::to_string(options_.timeout.count()) + " ms; " +
                                             name(rank_) + " was in " +
                                             where(describe(current()), step.chunk, step.chunks, step.waiting_for));
}

int Communicator::number_of(int rank) const { return options_.rank_names.empty() ? rank : options_.rank_names.at(rank); }
std::string Communicator::name(int rank) const { return "rank " + std::to_string(number_of(rank)); }

// This rank is out: keep the error for every later call, publish it (message first, then the
// flag) and wake every sleeper of the group, whichever counter it sleeps on, so they see it.
void Communicator::fail(const PeerError& error) noexcept {
  if (error_) return;
  try {
    error_ = std::make_unique<PeerError>(error);
  } catch (...) {
  }
  if (peers_.empty()) return;  // a group of one: nobody to tell
  ControlBlock& mine = *peers_[rank_].control;
  mine.culprit = error.peer();
  std::strncpy(mine.message, error.what(), kMessageBytes - 1);
  mine.failed.store(1, std::memory_order_release);
  for (Peer& peer : peers_) wake_all(peer.control->progress);
}

const Communicator::Descriptor& Communicator::current() const { return peers_[rank_].control->descriptors[sequence_ % 2]; }

std::string Communicator::describe(const Descriptor& d) const {
  const std::string number = " #" + std::to_string(d.sequence);
  switch (d.kind) {
    case Kind::kAllreduce:
    case Kind::kAllreduceShared: {
      std::string op = op_name(d.op);
      if (d.scale != 1.0) {
        std::ostringstream factor;
        factor << " x " << d.scale;
        op += factor.str();
      }
      if (d.kind == Kind::kAllreduceShared) {
        return "allreduce_shared" + number + " (" + std::to_string(d.count) + " x " + dtype_name(d.dtype) + ", " + op +
               ", shared array " + std::to_string(d.root) + " at byte " + std::to_string(d.offset) + ")";
      }
      return "allreduce" + number + " (" + std::to_string(d.count) + " x " + dtype_name(d.dtype) + ", " + op + ")";
    }
    case Kind::kBroadcast: return "broadcast" + number + " (" + std::to_string(d.count) + " bytes from rank " + std::to_string(d.root) + ")";
    case Kind::kAllgather: return "allgather" + number + " (" + std::to_string(d.count) + " bytes per rank)";
    case Kind::kReduceScatter:
      return "reduce_scatter" + number + " (" + std::to_string(d.count) + " x " + dtype_name(d.dtype) + " per rank, " +
             op_name(d.op) + ")";
    case Kind::kBarrier: return "barrier" + number;
  }
  return "unknown collective" + number;
}

unsigned char* Communicator::buffer(int rank, int index) const { return peers_[rank].buffers[index]; }

// --- The collectives -----------------------------------------------------------------------------

void Communicator::allreduce(void* data, std::size_t count, DType dtype, Op op) {
  allreduce(std::vector<Span>{{data, count}}, dtype, op);
}

// The reductions allreduce and allreduce_shared accept; throws std::invalid_argument for others.
void Communicator::check_reduction(const char* collective, DType dtype, Op op, double scale) {
  if (!supported(dtype, op)) {
    throw std::invalid_argument(std::string("shm::Communicator::") + collective + ": " + op_name(op) + " of " +
                                dtype_name(dtype) + " is not supported");
  }
  if (scale != 1.0 && !scales(dtype, op)) {
    throw std::invalid_argument(std::string("shm::Communicator::") + collective + ": " + op_name(op) + " of " +
                                dtype_name(dtype) + " cannot be scaled");
  }
}

void Communicator::allreduce(const std::vector<Span>& spans, DType dtype, Op op, double scale) {
  check_reduction("allreduce", dtype, op, scale);
  if (error_) throw *error_;
  std::size_t count = 0;
  for (const Span& span : spans) count += span.count;
  if (size_ == 1) {  // the reduction of one array is itself (AVG divides by 1), scaled
    if (scale != 1.0) {
      for (const Span& span : spans) {
        const void* source = span.data;
        reduce_into(span.data, &source, 1, span.count, dtype, op, scale);
      }
    }
    return;
  }
  run(Descriptor::reduction(Kind::kAllreduce, count, dtype, op, scale), [&] {
    // Two ranks, or a small array: every rank reduces everything (see allreduce_direct). Otherwise
    // each reduces only its slice, and copies the others' slices.
    if (size_ == 2 || count * dtype_size(dtype) <= options_.one_step_bytes) {
      allreduce_direct(spans, count, dtype, op, scale);
    } else {
      allreduce_sliced(spans, count, dtype, op, scale);
    }
  });
}


// Every rank reduces the whole chunk from all buffers straight into its output: one round trip
// per chunk and no copy out. Each element is read W times instead of about twice, which pays at
// two ranks (5 passes over the chunk per rank instead of 5.5) and for tensors of a few KiB (the
// second round trip costs more than the extra reads).
void Communicator::allreduce_direct(const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale) {
  const std::size_t element = dtype_size(dtype);
  const std::size_t chunk_elements = options_.chunk_bytes / element;
  const std::size_t chunks = std::max<std::size_t>(1, (count + chunk_elements - 1) / chunk_elements);
  for (std::size_t k = 0; k < chunks; ++k) {
    const std::size_t first = k * chunk_elements, n = std::min(chunk_elements, count - first);
    // 1. Copy my chunk into a free buffer of mine (the other one may still be read by peers that are
    //    on the previous chunk); post: the peers may read it.
    const int b = acquire_buffer({"the peers to finish reading this buffer", k, chunks}, true);
    unsigned char* staged = buffer(rank_, b);
    for_each_piece(spans, element, first, n, [&](unsigned char* piece, std::size_t at, std::size_t len) {
      copy_bytes(staged + at * element, piece, len * element);
    });
    post();
    // 2. Once every peer's chunk is in: reduce all of them, in rank order, into my output (mine read
    //    in place: the same bytes as my buffer's copy). Every rank reduces the same bytes in the same
    //    order: the same bits everywhere.
    wait_all(posted_, {"the peers' chunks", k, chunks});
    for_each_piece(spans, element, first, n, [&](unsigned char* piece, std::size_t at, std::size_t len) {
      for (int q = 0; q < size_; ++q) sources_[q] = q == rank_ ? piece : buffer(q, b) + at * element;
      reduce_into(piece, sources_.data(), size_, len, dtype, op, scale);
    });
    // 3. Post that I am done reading the peers' buffers.
    post();
    release_buffer(b);
  }
}

// [begin, end) of `rank`'s slice of n elements: W nearly equal parts, cut at multiples of 64 bytes
// (whole cache lines, aligned vectors) where there are enough elements.
std::pair<std::size_t, std::size_t> Communicator::slice(int rank, std::size_t n, std::size_t element_size) const {
  const std::size_t unit = std::max<std::size_t>(1, 64 / element_size);
  const std::size_t units = (n + unit - 1) / unit;
  const auto cut = [&](int r) { return std::min(n, units * static_cast<std::size_t>(r) / static_cast<std::size_t>(size_) * unit); };
  return {cut(rank), cut(rank + 1)};
}

void Communicator::allreduce_sliced(const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale) {
  const std::size_t element = dtype_size(dtype);
  const std::size_t chunk_elements = options_.chunk_bytes / element;
  const std::size_t chunks = (count + chunk_elements - 1) / chunk_elements;
  for (std::size_t k = 0; k < chunks; ++k) {
    const std::size_t first = k * chunk_elements, n = std::min(chunk_elements, count - first);
    // 1. Copy my chunk into a free buffer of mine (the other one may still be read by peers that are
    //    on the previous chunk); post: the peers may read it.
    const int b = acquire_buffer({"the peers to finish reading this buffer", k, chunks}, true);
    unsigned char* staged = buffer(rank_, b);
    for_each_piece(spans, element, first, n, [&](unsigned char* piece, std::size_t at, std::size_t len) {
      copy_bytes(staged + at * element, piece, len * element);
    });
    post();
    // 2. Once every peer's chunk is in: reduce my slice from all W buffers, in rank order, into my
    //    own buffer's slice (reduce_into reads a block of every source before writing it); post.
    wait_all(posted_, {"the peers' chunks", k, chunks});
    const auto [begin, end] = slice(rank_, n, element);
    for (int q = 0; q < size_; ++q) sources_[q] = buffer(q, b) + begin * element;
    reduce_into(staged + begin * element, sources_.data(), size_, end - begin, dtype, op, scale);
    post();
    // 3. Once every slice is reduced: copy each from its owner's buffer into my output; post that I
    //    am done reading the peers' buffers.
    wait_all(posted_, {"the peers' reduced slices", k, chunks});
    for (int q = 0; q < size_; ++q) {
      const auto [from, to] = slice(q, n, element);
      const unsigned char* reduced = buffer(q, b) + from * element;
      for_each_piece(spans, element, first + from, to - from, [&](unsigned char* piece, std::size_t at, std::size_t len) {
        copy_bytes(piece, reduced + at * element, len * element);
      });
    }
    post();
    release_buffer(b);
  }
}

void Communicator::broadcast(void* data, std::size_t bytes, int root) {
  if (root < 0 || root >= size_) throw std::invalid_argument("shm::Communicator::broadcast: root " + std::to_string(root) + " is not a rank");
  if (error_) throw *error_;
  if (size_ == 1) return;
  Descriptor descriptor;
  descriptor.kind = Kind::kBroadcast;
  descriptor.count = bytes;
  descriptor.root = root;
  run(descriptor, [&] {
    auto* out = static_cast<unsigned char*>(data);
    const std::size_t chunks = std::max<std::size_t>(1, (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes);
    for (std::size_t k = 0; k < chunks; ++k) {
      const std::size_t offset = k * options_.chunk_bytes, n = std::min(options_.chunk_bytes, bytes - offset);
      // 1. The root copies its chunk into a free buffer of its own; everyone posts (the others to
      //    say they arrived, which the desync check needs).
      const int b = acquire_buffer({"the peers to finish reading this buffer", k, chunks}, rank_ == root);
      if (rank_ == root && n > 0) copy_bytes(buffer(root, b), out + offset, n);
      post();
      // 2. Once everyone arrived, the root's chunk is in: the others copy it out; everyone posts
      //    that it is done reading.
      wait_all(posted_, {"the root's chunk", k, chunks});
      if (rank_ != root && n > 0) copy_bytes(out + offset, buffer(root, b), n);
      post();
      release_buffer(b);
    }
  });
}

void Communicator::barrier() {
  if (error_) throw *error_;
  if (size_ == 1) return;
  Descriptor descriptor;
  descriptor.kind = Kind::kBarrier;
  run(descriptor, [&] {
    // Post that I arrived; wait until everyone has.
    post();
    wait_all(posted_, {"the peers to arrive"});
  });
}

// --- Memory the ranks share: DDP's buckets -----------------------------------------------------

std::shared_ptr<SharedArray> Communicator::share(std::size_t bytes) {
  if (error_) throw *error_;
  std::shared_ptr<SharedArray> array(new SharedArray);
  array->rank_ = rank_;
  array->bytes_ = bytes;
  array->id_ = ++arrays_shared_;
  array->segments_.resize(size_);
  const auto name_of = [&](int r) { return prefix_ + "-a" + std::to_string(array->id_) + "-" + std::to_string(r); };
  const std::size_t segment_bytes = std::max<std::size_t>(bytes, 64);
  // Each rank's status after a step, gathered: empty when it went well, else why not (cut short).
  constexpr std::size_t kStatusBytes = 256;
  std::vector<char> statuses(static_cast<std::size_t>(size_) * kStatusBytes);
  const auto agree = [&](const std::string& failure, const char* step) {
    char status[kStatusBytes] = {};
    failure.copy(status, kStatusBytes - 1);
    allgather(status, kStatusBytes, statuses.data());
    for (int r = 0; r < size_; ++r) {
      const char* theirs = statuses.data() + static_cast<std::size_t>(r) * kStatusBytes;
      if (theirs[0] != '\0') {
        throw ShmUnavailable(name(r) + " could not " + step + " shared memory for an array of " + std::to_string(bytes) +
                             " bytes: " + std::string(theirs, strnlen(theirs, kStatusBytes)));
      }
    }
  };
  // 0. The same size everywhere (DDP's buckets, say, differ between ranks that disagree on them).
  std::vector<std::uint64_t> sizes(size_);
  const std::uint64_t mine = bytes;
  allgather(&mine, sizeof mine, sizes.data());
  for (int r = 0; r < size_; ++r) {
    if (sizes[r] != sizes[0]) {
      throw ShmUnavailable(name(0) + " asks for shared memory for an array of " + std::to_string(sizes[0]) + " bytes, " +
                           name(r) + " for one of " + std::to_string(sizes[r]));
    }
  }
  try {
    // 1. Create my part (zeroed, its pages allocated now); learn whether every rank could.
    std::string failure;
    try {
      array->segments_[rank_] = Segment::create(name_of(rank_), segment_bytes);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    agree(failure, "create");
    // 2. Map every peer's part; learn whether every rank could. Then nobody needs a name any more.
    for (int p = 0; p < size_ && failure.empty(); ++p) {
      if (p == rank_) continue;
      try {
        array->segments_[p] = Segment::open(name_of(p), segment_bytes);
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    agree(failure, "map");
    array->segments_[rank_].unlink();
  } catch (const PeerError&) {
    // A peer failed inside the agreement (it died, say): it may not remove its own name any more.
    for (int p = 0; p < size_; ++p) ::shm_unlink(name_of(p).c_str());
    throw;
  }
  // On ShmUnavailable the segments go with `array`, each rank's name with its creator.
  return array;
}

void Communicator::allreduce_shared(const SharedArray& array, std::size_t offset, std::size_t count, DType dtype, Op op,
                                    double scale, Relay* relay) {
  check_reduction("allreduce_shared", dtype, op, scale);
  const std::size_t element = dtype_size(dtype);
  if (offset % element != 0 || offset + count * element > array.bytes() || array.rank_ != rank_ ||
      array.segments_.size() != static_cast<std::size_t>(size_)) {
    throw std::invalid_argument("shm::Communicator::allreduce_shared: " + std::to_string(count) + " x " + dtype_name(dtype) +
                                " at byte " + std::to_string(offset) + " is not inside this group's shared array of " +
                                std::to_string(array.bytes()) + " bytes");
  }
  if (error_) throw *error_;
  const auto at = [&](int rank) { return static_cast<unsigned char*>(array.of(rank)) + offset; };
  if (size_ == 1 && relay == nullptr) {  // the reduction of one array is itself, scaled
    allreduce({{at(0), count}}, dtype, op, scale);
    return;
  }
  Descriptor descriptor = Descriptor::reduction(Kind::kAllreduceShared, count, dtype, op, scale);
  descriptor.root = static_cast<std::int32_t>(array.id_);
  descriptor.offset = offset;
  // My slice's elements [first, first + n): reduced from all W parts, in rank order, into my own
  // part; copied from my part into every peer's.
  const auto reduce = [&](std::size_t first, std::size_t n) {
    for (int q = 0; q < size_; ++q) sources_[q] = at(q) + first * element;
    reduce_into(at(rank_) + first * element, sources_.data(), size_, n, dtype, op, scale);
  };
  const auto copy_to_peers = [&](std::size_t first, std::size_t n) {
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) copy_bytes(at(q) + first * element, at(rank_) + first * element, n * element);
    }
  };
  run(descriptor, [&] {
    // 1. My part holds my data (the caller wrote it): post, so the peers may read it.
    post();
    // 2. Once every part is in: reduce my slice and copy it into every peer's part. Only this rank
    //    reads or writes this slice of any part, so nobody waits for anyone here.
    wait_all(posted_, {"the peers' data"});
    const auto [begin, end] = slice(rank_, count, element);
    const std::size_t block = std::max<std::size_t>(1, (std::size_t{16} << 10) / element);  // a few KiB: stays in L1
    if (relay == nullptr) {
      // Block by block, each copied while it is still in cache.
      for (std::size_t first = begin; first < end; first += block) {
        const std::size_t n = std::min(block, end - first);
        reduce(first, n);
        copy_to_peers(first, n);
      }
    } else {
      // Piece by piece: reduced, sent across the hosts, and copied once it is back, while the
      // next pieces are reduced and cross.
      std::deque<std::pair<std::size_t, std::size_t>> crossing;  // pieces started, oldest first
      // While the other hosts hold me up, a peer waiting for me waits for my verdict (wait_all). A
      // relay that throws leaves the flag up: run() publishes the failure at once.
      std::atomic<std::uint32_t>& away = peers_[rank_].control->away;
      away.store(1, std::memory_order_release);
      const auto land_oldest = [&] {
        relay->finish();
        copy_to_peers(crossing.front().first, crossing.front().second);
        crossing.pop_front();
      };
      const std::size_t piece = std::max<std::size_t>(1, kRelayPieceBytes / element);
      for (std::size_t first = begin; first < end; first += piece) {
        const std::size_t n = std::min(piece, end - first);
        for (std::size_t b = first; b < first + n; b += block) reduce(b, std::min(block, first + n - b));
        if (crossing.size() == static_cast<std::size_t>(kRelayPiecesInFlight)) land_oldest();
        relay->start(at(rank_) + first * element, n);
        crossing.emplace_back(first, n);
      }
      while (!crossing.empty()) land_oldest();
      away.store(0, std::memory_order_release);
    }
    // 3. Post that my slice is everywhere; once every peer has, my part holds the whole result.
    post();
    wait_all(posted_, {"the peers' reduced slices"});
  });
}

// --- A rank's part of an array (hierarchical.h: the slice each local rank sends across) --------

std::pair<std::size_t, std::size_t> Communicator::part(int rank, std::size_t count, DType dtype) const {
  return slice(rank, count, dtype_size(dtype));
}

}  // namespace ddp::detail::shm
