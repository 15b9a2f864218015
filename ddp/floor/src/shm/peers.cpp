// The shared-memory collectives' context (peers.h). Read top to bottom: the shared layout,
// setup, the step machinery (post, wait, failure).
#include "ddp/floor/src/shm/peers.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <sstream>

#include "ddp/floor/src/shm/process.h"
#include "ddp/floor/src/shm/steps.h"
#include "ddp/floor/src/shm/wait.h"

namespace ddp::detail::shm {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::uint64_t kMagic = 0x746f726368646470ull;  // "torchddp"
constexpr std::uint32_t kVersion = 5;  // of the layout below: peers of another version refuse each other
constexpr std::size_t kControlBytes = 4096;  // the control block's page; the data buffers follow
constexpr std::size_t kMessageBytes = 1024;
constexpr auto kSleepSlice = 50ms;      // longest futex sleep: then look at the deadline and the peers
constexpr auto kPidCheckEvery = 100ms;  // how often a waiting rank asks whether lagging peers still live

// The options every rank of a group works with: checked, chunk_bytes a multiple of 64.
Options checked_options(Options options, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("shm::Communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) + " is not a rank");
  }
  if (options.timeout.count() <= 0) throw std::invalid_argument("shm::Communicator: the timeout must be positive");
  if (!options.rank_names.empty() && options.rank_names.size() != static_cast<std::size_t>(size)) {
    throw std::invalid_argument("shm::Communicator: rank_names has " + std::to_string(options.rank_names.size()) +
                                " entries for " + std::to_string(size) + " ranks");
  }
  options.chunk_bytes = (std::max<std::size_t>(options.chunk_bytes, 64) + 63) / 64 * 64;
  options.one_step_bytes = std::min(options.one_step_bytes, options.chunk_bytes);
  return options;
}

}  // namespace

// --- What lives in shared memory ---------------------------------------------------------------

// The first page of every rank's segment. The owner writes everything but `sleepers` (peers
// count themselves in and out there). Setup fields are written before the rendezvous that
// publishes the segment; the descriptors before the post that makes them visible; the message
// before the `failed` flag (release) that makes it visible.
struct Peers::ControlBlock : SegmentIdentity {
  std::uint64_t chunk_bytes;
  std::uint64_t one_step_bytes;

  alignas(64) Progress progress;

  alignas(64) std::atomic<std::uint32_t> failed;
  std::atomic<std::uint32_t> closed;  // the owner destroyed its Communicator
  std::atomic<std::uint32_t> away;    // the owner works outside the group (set_away), within a timeout of its own
  std::int32_t culprit;  // the rank the failure names
  char message[kMessageBytes];

  // By sequence % 2: a peer reads the descriptor of collective n after its first wait in n, and
  // by then no rank can have begun n + 2 (that needs this peer's first post of n + 1).
  alignas(64) Descriptor descriptors[2];
};
static_assert(sizeof(Peers::ControlBlock) <= kControlBytes, "the control block must fit its page");

// --- Setup ---------------------------------------------------------------------------------------

namespace {

// Each rank's verdicts on the steps of setting up, through the caller's Rendezvous (before any
// shared memory exists): under "<key_prefix><step>/<rank>", "ok" or "error: " and why not. The
// tell and hear of agree() in set_up_segments.
class SetupVerdicts {
 public:
  SetupVerdicts(Rendezvous& rendezvous, const std::string& key_prefix, int rank)
      : rendezvous_(rendezvous), key_(key_prefix), me_(std::to_string(rank)) {}

  // Publishes this rank's verdict on `step` ("" when it went well, else why not).
  void tell(const char* step, const std::string& failure) {
    try {
      rendezvous_.set(key_ + step + "/" + me_, failure.empty() ? std::string("ok") : "error: " + failure);
    } catch (const std::exception& e) {
      throw ShmUnavailable("rank " + me_ + ": publishing \"" + step + "\": " + e.what());
    }
  }
  // `peer`'s verdict on `step`, once it is published: "" when it went well, else what it said.
  // Throws ShmUnavailable when the rendezvous cannot say (its timeout).
  std::string hear(const char* step, int peer) {
    std::string status;
    try {
      status = rendezvous_.get(key_ + step + "/" + std::to_string(peer));
    } catch (const std::exception& e) {
      throw ShmUnavailable("rank " + me_ + ": waiting for rank " + std::to_string(peer) + " (" + step + "): " + e.what());
    }
    return status == "ok" ? "" : status;
  }
  const std::string& me() const noexcept { return me_; }

 private:
  Rendezvous& rendezvous_;
  const std::string key_;
  const std::string me_;
};

}  // namespace

std::vector<Segment> set_up_segments(Rendezvous& rendezvous, int rank, int size, const SegmentsSetUp& set_up) {
  std::vector<Segment> segments(size);
  const auto name_of = [&](int r) { return set_up.name_prefix + "-" + std::to_string(r); };
  SetupVerdicts verdicts(rendezvous, set_up.key_prefix, rank);
  const auto blame = [&](const std::string& failed_to) {
    return [&verdicts, rank, failed_to](int r, const std::string& why) {
      return r == rank ? "rank " + verdicts.me() + ": " + why : "rank " + std::to_string(r) + " could not " + failed_to + ": " + why;
    };
  };
  std::vector<int> created;  // peers whose segments exist: if setup fails, their names go too (below)
  const auto hear_created = [&](int p) {
    std::string why = verdicts.hear("created", p);
    if (why.empty()) created.push_back(p);
    return why;
  };
  // 1. Create my segment and tell the peers, so that they fail at once if I could not; learn that
  //    every peer's exists.
  const std::string creating = verdict_of([&] {
    segments[rank] = Segment::create(name_of(rank), set_up.bytes);
    SegmentIdentity& mine = set_up.fill(segments[rank].data());
    mine.magic = set_up.magic;
    mine.version = set_up.version;
    mine.rank = rank;
    mine.size = size;
    mine.pid = static_cast<std::int32_t>(::getpid());
    mine.start_time = read_process(mine.pid).start_time;
  });
  const auto is_peers = [&](const void* memory, int p) {
    const SegmentIdentity& theirs = set_up.identity(memory);
    return theirs.magic == set_up.magic && theirs.version == set_up.version && theirs.rank == p && theirs.size == size &&
           set_up.matches(memory, p);
  };
  try {
    agree(rank, size, creating, [&](const std::string& mine) { verdicts.tell("created", mine); }, hear_created,
          blame(set_up.create_failed));
    // 2. Map each one and check it is the one we expect; learn that every rank mapped every segment.
    const std::string mapping = verdict_of([&] {
      for (int p : created) {
        segments[p] = Segment::open(name_of(p), set_up.bytes);
        if (!is_peers(segments[p].data(), p)) {
          throw ShmUnavailable("shared memory object " + name_of(p) + " is not rank " + std::to_string(p) + "'s " + set_up.mismatch);
        }
      }
    });
    agree(rank, size, mapping, [&](const std::string& mine) { verdicts.tell("mapped", mine); },
          [&](int p) { return verdicts.hear("mapped", p); }, blame(set_up.map_failed));
  } catch (...) {
    // Setup failed, so nobody will map anything again: remove the names of the peers' segments
    // too, in case a peer died before removing its own (mine goes with segments[rank]).
    for (int p : created) ::shm_unlink(name_of(p).c_str());
    throw;
  }
  // 3. Nobody needs a name any more: remove mine. From now on the memory lives exactly as long as
  //    some process maps it.
  segments[rank].unlink();
  return segments;
}

Peers::Peers(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, const Options& options)
    : options_(checked_options(options, rank, size)), prefix_(name_prefix), rank_(rank), size_(size) {
  sources_.resize(size_);
  if (size_ == 1) return;  // nothing to share
  // Oversubscribed, the rank we wait for may need our core: spin only briefly before sleeping.
  spin_ = options_.spin.count() >= 0 ? options_.spin : cpus_available() >= size_ ? 20us : 2us;
  SegmentsSetUp set_up;
  set_up.key_prefix = "torchddp/shm" + name_prefix + "/";
  set_up.name_prefix = name_prefix;
  set_up.bytes = kControlBytes + 2 * options_.chunk_bytes;
  set_up.magic = kMagic;
  set_up.version = kVersion;
  set_up.fill = [this](void* memory) -> SegmentIdentity& { return fill_control_block(memory); };
  set_up.identity = [](const void* memory) -> const SegmentIdentity& { return *static_cast<const ControlBlock*>(memory); };
  set_up.matches = [this](const void* memory, int) {
    const auto* control = static_cast<const ControlBlock*>(memory);
    return control->chunk_bytes == options_.chunk_bytes && control->one_step_bytes == options_.one_step_bytes;
  };
  set_up.mismatch = "segment of this group (another version of the library, other options, or another group's name)";
  set_up.create_failed = "create its segment";
  set_up.map_failed = "map the group's segments";
  std::vector<Segment> segments = set_up_segments(rendezvous, rank_, size_, set_up);
  peers_.resize(size_);
  for (int p = 0; p < size_; ++p) peers_[p].segment = std::move(segments[p]);
  watch_peers();
}

SegmentIdentity& Peers::fill_control_block(void* memory) const {
  auto* control = new (memory) ControlBlock{};
  control->chunk_bytes = options_.chunk_bytes;
  control->one_step_bytes = options_.one_step_bytes;
  return *control;
}

// Every segment mapped: where each peer's control block and buffers are, and whether its pid can
// be watched here - only if it is the peer's pid here too: the same process, started at the same
// tick (ranks in another pid namespace are left to the timeout).
void Peers::watch_peers() {
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    peer.control = static_cast<ControlBlock*>(peer.segment.data());
    auto* data = static_cast<unsigned char*>(peer.segment.data()) + kControlBytes;
    peer.buffers[0] = data;
    peer.buffers[1] = data + options_.chunk_bytes;
    const ProcessInfo info = read_process(peer.control->pid);
    peer.check_pid = p != rank_ && info.exists && !exited(info, peer.control->start_time);
  }
}

// Peers still waiting for this rank (it left in the middle of a collective, say after an
// exception of its own) learn it at once instead of at the timeout.
Peers::~Peers() {
  // Not in a child forked after setup (it shares the mappings but is not this rank).
  if (peers_.empty() || peers_[rank_].control->pid != static_cast<std::int32_t>(::getpid())) return;
  peers_[rank_].control->closed.store(1, std::memory_order_release);
  for (Peer& peer : peers_) wake_all(peer.control->progress);
}


// --- Steps: post, wait, fail -----------------------------------------------------------------

// Publishes this collective's descriptor; the first post() makes it visible.
void Peers::begin(const Descriptor& descriptor) {
  Descriptor& mine = peers_[rank_].control->descriptors[(sequence_ + 1) % 2];
  mine = descriptor;
  mine.sequence = ++sequence_;
  first_post_pending_ = true;
}

void Peers::post() {
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
void Peers::wait_all(std::uint32_t target, const Step& step) {
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
int Peers::acquire_buffer(const Step& step, bool will_write) {
  const int buffer = next_buffer_;
  next_buffer_ ^= 1;
  if (will_write) wait_all(buffer_free_at_[buffer], step);
  return buffer;
}

// Right after a collective's last post on `buffer`: peers that posted this far are done with it.
void Peers::release_buffer(int buffer) { buffer_free_at_[buffer] = posted_; }

void Peers::check_descriptors() {
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
const Peers::ControlBlock* Peers::failed_peer() const {
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && peers_[p].control->failed.load(std::memory_order_acquire) != 0) return peers_[p].control;
  }
  return nullptr;
}

// A peer that failed raised its flag and woke us: fail with its error (same text, same culprit).
void Peers::check_failed_peers() {
  if (const ControlBlock* control = failed_peer()) {
    throw PeerError(control->culprit, std::string(control->message, strnlen(control->message, kMessageBytes)));
  }
}

std::string Peers::peer_failure() const {
  const ControlBlock* control = peers_.empty() ? nullptr : failed_peer();
  return control ? std::string(control->message, strnlen(control->message, kMessageBytes)) : "";
}

namespace {
std::string who_lags(int rank, int pid, const ProcessInfo& info) {
  std::string text = std::to_string(rank) + " (pid " + std::to_string(pid);
  if (stopped(info)) text += ", stopped";
  return text + ")";
}

std::string where_waiting(const std::string& collective, std::size_t chunk, std::size_t chunks, const char* waiting_for) {
  std::string text = collective;
  if (chunks > 1) text += ", chunk " + std::to_string(chunk + 1) + " of " + std::to_string(chunks);
  return text + ", waiting for " + waiting_for;
}
}  // namespace

// A lagging peer that closed its communicator, or whose process is gone (looked at every
// kPidCheckEvery), will never post: name it now rather than at the timeout.
void Peers::check_departed_peers(std::uint32_t target, const Step& step, bool look_at_pids) {
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
                           " was in " + where_waiting(describe(current()), step.chunk, step.chunks, step.waiting_for));
  }
}

// Whether peer `p` said it is away (set_away: a step across the hosts), and is not stopped there itself.
bool Peers::waits_for_other_hosts(int p) const {
  const Peer& peer = peers_[p];
  if (peer.control->away.load(std::memory_order_acquire) == 0) return false;
  return !(peer.check_pid && stopped(read_process(peer.control->pid)));
}

// No post from some peers within the timeout (`late` among them): name every one of them, and say
// which are stopped. The error blames the first named: a stopped one before one that runs.
void Peers::throw_timeout(std::uint32_t target, const Step& step, int late) {
  // (peer, "<number> (pid <pid>[, stopped])"): the stopped ones in `lagging`, then the running ones.
  std::vector<std::pair<int, std::string>> lagging, running;
  for (int p = 0; p < size_; ++p) {
    const Peer& peer = peers_[p];
    if (p == rank_ || reached(peer.control->progress.count.load(std::memory_order_acquire), target)) continue;
    const ProcessInfo info = peer.check_pid ? read_process(peer.control->pid) : ProcessInfo{};
    (stopped(info) ? lagging : running).emplace_back(p, who_lags(number_of(p), peer.control->pid, info));
  }
  lagging.insert(lagging.end(), running.begin(), running.end());
  if (lagging.empty()) lagging.emplace_back(late, std::to_string(number_of(late)));  // `late` arrived just now
  std::string names;
  for (const auto& named : lagging) names += (names.empty() ? "" : ", ") + named.second;
  const std::string subject = lagging.size() == 1 ? "rank " + names + " did not arrive" : "ranks " + names + " did not arrive";
  throw PeerError(lagging.front().first, subject + " within " + std::to_string(options_.timeout.count()) + " ms; " +
                                             name(rank_) + " was in " +
                                             where_waiting(describe(current()), step.chunk, step.chunks, step.waiting_for));
}

// This rank is out: keep the error for every later call, publish it (message first, then the
// flag) and wake every sleeper of the group, whichever counter it sleeps on, so they see it.
void Peers::fail(const PeerError& error) noexcept {
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

const Descriptor& Peers::current() const { return peers_[rank_].control->descriptors[sequence_ % 2]; }

std::string Peers::describe(const Descriptor& d) const {
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
    case Kind::kAllToAll: return "all_to_all" + number;
  }
  return "unknown collective" + number;
}


int Peers::number_of(int rank) const { return options_.rank_names.empty() ? rank : options_.rank_names.at(rank); }
std::string Peers::name(int rank) const { return "rank " + std::to_string(number_of(rank)); }

unsigned char* Peers::buffer(int rank, int index) const { return peers_[rank].buffers[index]; }

void Peers::set_away(bool away) noexcept {
  if (!peers_.empty()) peers_[rank_].control->away.store(away ? 1 : 0, std::memory_order_release);
}

PeerError Peers::fail_with(const std::exception& error) {
  if (const auto* peer_error = dynamic_cast<const PeerError*>(&error)) {
    fail(*peer_error);
    return *peer_error;
  }
  const std::string collective = peers_.empty() ? "a collective" : describe(current());
  const PeerError failure(rank_, name(rank_) + " failed in " + collective + ": " + error.what());
  fail(failure);
  return failure;
}

}  // namespace ddp::detail::shm
