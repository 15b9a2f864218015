#pragma once
// The context every shared-memory collective runs in: the ranks of one group on one host, their
// segments, and the machinery the algorithms (algorithms.h) are written in - posts and waits,
// the data buffers, failure and its naming, the desync check. Torch-free; internal to the core
// (the library's callers use Communicator, communicator.h).
//
// Setup (the constructor; once per group). Every rank creates its segment "<prefix>-<rank>": a
// control block (its progress counter, a count of sleepers on it, its pid, a failure flag and
// message, the descriptors of its current collectives) and two data buffers of chunk_bytes,
// used alternately so one chunk can be written while peers still read the other. It says so
// through the caller's Rendezvous, maps every peer's segment, waits until every rank has mapped
// every segment, and unlinks its own name. After construction /dev/shm holds nothing of the
// group: a SIGKILL at any moment later leaves nothing behind. set_up_segments() does this for
// every kind of segment (the Mailbox's too), and each step of setting up - there, and a shared
// array's in shared_array.cpp - ends in agree(): every rank learns whether it went well everywhere.
//
// A collective is a fixed sequence of steps that every rank runs in the same order. Finishing a
// step increments the rank's progress counter ("posts"), so the n-th post means the same thing on
// every rank, and "wait for every peer's post n" is how one rank waits for the others (wait.h:
// spin briefly, then sleep on a futex).
//
// Checks that cost nothing extra: every rank writes a descriptor of the collective (kind, count,
// dtype, op, root) into its control block before its first post, and compares every peer's after
// its first wait; ranks that disagree throw PeerError naming both collectives ("desync"). Every
// wait is bounded by the timeout; while waiting, a rank looks at each lagging peer's pid every
// ~100 ms, so a peer that died is named within a fraction of a second (one that destroyed its
// Communicator, at once); a rank that throws raises its failure flag and wakes every waiter of the
// group, so the others fail at once, naming the rank that caused it. The rank an error blames
// first is the one at fault: at the timeout a stopped peer before a running one, and a peer that
// said it is away (set_away(): a hierarchical allreduce's step across the hosts, which its own
// timeout bounds) is given one more timeout to fail with the rank it waits for.
//
// Thread-safety: one thread at a time (the Communicator's caller's). A child forked after setup
// must not use it (destroying it there is harmless).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/floor/src/shm/segment.h"

namespace ddp::detail::shm {

// The caller's key-value store (c10d's Store in the library, files in the tests), shared by the
// ranks of the group. Keys are written once.
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set and returns its value; throws (any std::exception) on timeout.
  virtual std::string get(const std::string& key) = 0;
};

// A collective failed because of a peer, or was not the same collective on every rank. `peer()`
// is the rank that caused it: the one that did not arrive, exited, or runs another collective.
class PeerError : public std::runtime_error {
 public:
  PeerError(int peer, const std::string& what) : std::runtime_error(what), peer_(peer) {}
  int peer() const noexcept { return peer_; }

 private:
  int peer_;
};

struct Options {
  // Longest wait for any one step of a peer (a frozen peer fails the collective after this long).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Bytes per chunk and per data buffer (two per rank), rounded up to a multiple of 64. Bounds
  // the shared memory per rank (2 x chunk_bytes plus 4 KiB) and is the unit of pipelining. About
  // a core's L2, so a chunk is still in cache when the peers read it.
  std::size_t chunk_bytes = std::size_t{512} << 10;
  // allreduce of at most this many bytes: one round trip, every rank reducing the whole tensor
  // (at two ranks every allreduce works that way, chunk by chunk). Capped at chunk_bytes.
  std::size_t one_step_bytes = std::size_t{32} << 10;
  // How long a wait polls (yielding the core now and then) before it sleeps on the futex;
  // negative: 20 us, or 2 us when the process may use fewer CPUs than there are ranks.
  std::chrono::microseconds spin{-1};
  // The numbers error messages give the ranks: rank r is "rank rank_names[r]" (a host's ranks in a
  // hierarchical allreduce are named by their rank in the whole group). Empty: r itself.
  std::vector<int> rank_names;
};

// One step of setting up, agreed by every rank: `mine` ("" when the step went well on this rank,
// else why not) goes to the peers through tell(mine); then, in rank order, each rank's verdict
// (this rank's own without asking, a peer's from hear(peer), which may wait for it) is looked at,
// and the first that failed is thrown as ShmUnavailable(blame(rank, why)) - the same rank named
// on every rank.
template <typename Tell, typename Hear, typename Blame>
void agree(int rank, int size, const std::string& mine, Tell&& tell, Hear&& hear, Blame&& blame) {
  tell(mine);
  for (int r = 0; r < size; ++r) {
    const std::string why = r == rank ? mine : hear(r);
    if (!why.empty()) throw ShmUnavailable(blame(r, why));
  }
}

// What `step` threw (its what()), or "" when it went well: a rank's verdict on a step of setting up.
template <typename StepOfSetUp>
std::string verdict_of(StepOfSetUp&& step) {
  try {
    step();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// The first bytes of every segment set_up_segments() makes: what it is and whose. Each kind of
// segment's header derives from it (the Communicator's control block, the Mailbox's header);
// set_up_segments writes this rank's and checks every peer's.
struct SegmentIdentity {
  std::uint64_t magic;      // the kind of segment
  std::uint32_t version;    // of its layout: ranks of different versions refuse each other
  std::int32_t rank;
  std::int32_t size;
  std::int32_t pid;
  std::uint64_t start_time;  // of the process `pid` (process.h): a later process with that pid is another
};

// A group's segments, one per rank, "<name_prefix>-<rank>", as set_up_segments() makes them.
struct SegmentsSetUp {
  std::string key_prefix;   // the rendezvous keys: "<key_prefix><step>/<rank>"
  std::string name_prefix;
  std::size_t bytes = 0;
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  // Constructs this rank's header in its new segment and fills in what is not its identity;
  // returns its identity, which set_up_segments fills in.
  std::function<SegmentIdentity&(void* memory)> fill;
  // The identity of the header at `memory` (a peer's segment).
  std::function<const SegmentIdentity&(const void* memory)> identity;
  // Whether the rest of the header at `memory` is what `peer`'s fill wrote for this group; where it
  // or its identity is not, the segment "is not rank p's <mismatch>".
  std::function<bool(const void* memory, int peer)> matches;
  std::string mismatch;
  std::string create_failed;  // "rank p could not <create_failed>: ..."
  std::string map_failed;     // "rank p could not <map_failed>: ..."
};

// The set-up of a group's segments, agreed (agree) after each step through the rendezvous: every
// rank creates and fills its segment, maps every peer's and checks it (matches), then unlinks its
// own name - after which /dev/shm holds nothing of the group. Returns the segments by rank. Throws
// ShmUnavailable when a step failed on any rank (the same rank named everywhere), leaving nothing of
// this rank in /dev/shm, and removing the names of the peers' segments too (a peer may have died
// before removing its own).
std::vector<Segment> set_up_segments(Rendezvous& rendezvous, int rank, int size, const SegmentsSetUp& set_up);

struct Descriptor;  // steps.h
struct Step;
struct Chunk;

class Peers {
 public:
  // Sets up the group (see the top of this file; Communicator's constructor says what it takes
  // and throws).
  Peers(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, const Options& options);
  // Peers still waiting for this rank fail at once, naming it.
  ~Peers();
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const Options& options() const noexcept { return options_; }
  const std::string& prefix() const noexcept { return prefix_; }

  // --- Steps (the templates are in steps.h) ---
  // Begins the collective `descriptor` and runs body(); any exception inside fails this rank
  // (fail_with()), so its peers stop at once. Throws the kept error after a failure.
  template <typename Body>
  void run(const Descriptor& descriptor, Body&& body);
  // The same for more steps of the collective begun last (a collective taken in several calls).
  template <typename Body>
  void resume(Body&& body);
  // Calls body(chunk) for each chunk of a collective's data, each staged in the next data buffer.
  template <typename Body>
  void for_each_chunk(std::size_t total, std::size_t per_chunk, bool writes, Body&& body);
  // Ends a step: the peers waiting for this rank's post number posted() + 1 may go on.
  void post();
  std::uint32_t posted() const noexcept { return posted_; }
  // Returns when every peer has made `target` posts. Throws PeerError when a peer failed, exited,
  // or does not arrive within the timeout (see the top of this file for whom it blames).
  void wait_all(std::uint32_t target, const Step& step);
  // Data buffer `index` (0 or 1) of `rank`'s segment.
  unsigned char* buffer(int rank, int index) const;
  // Scratch for a reduction's sources, one per rank.
  const void** sources() noexcept { return sources_.data(); }
  // While `away` (this rank works outside the group, within a timeout of its own), peers that
  // wait for it give it one more timeout to fail with what it waits for.
  void set_away(bool away) noexcept;

  // --- Failure ---
  void throw_if_failed() const {
    if (error_) throw *error_;
  }
  bool failed() const noexcept { return error_ != nullptr; }
  // This rank fails with `error`: every later call throws it, and peers waiting for this rank
  // fail at once with its text. Only the first failure is kept.
  void fail(const PeerError& error) noexcept;
  // This rank fails with `error`, raised inside the current collective: a PeerError as it is,
  // anything else as this rank's own failure in that collective. Returns what it failed with.
  PeerError fail_with(const std::exception& error);
  // The error a peer failed with (its text), or "" while none has.
  std::string peer_failure() const;
  // "rank <number>", the number errors give `rank` (Options::rank_names).
  std::string name(int rank) const;

  struct ControlBlock;  // the segment's header (peers.cpp)

 private:
  struct Peer {
    Segment segment;  // this rank's own, or the mapping of a peer's
    ControlBlock* control = nullptr;
    unsigned char* buffers[2] = {nullptr, nullptr};
    bool check_pid = false;  // its pid is visible here (same pid namespace)
  };

  SegmentIdentity& fill_control_block(void* memory) const;
  void watch_peers();
  void begin(const Descriptor& descriptor);
  int acquire_buffer(const Step& step, bool will_write);
  void release_buffer(int buffer);
  const Descriptor& current() const;
  void check_descriptors();
  const ControlBlock* failed_peer() const;
  void check_failed_peers();
  void check_departed_peers(std::uint32_t target, const Step& step, bool look_at_pids);
  bool waits_for_other_hosts(int peer) const;
  [[noreturn]] void throw_timeout(std::uint32_t target, const Step& step, int late);
  int number_of(int rank) const;
  std::string describe(const Descriptor& descriptor) const;

  Options options_;
  std::string prefix_;  // the segments' names ("<prefix>-<rank>"), and shared arrays'
  int rank_;
  int size_;
  std::vector<Peer> peers_;           // by rank; peers_[rank_] is this rank's own segment
  std::vector<const void*> sources_;  // scratch: the reduction's inputs, one per rank
  std::chrono::nanoseconds spin_{0};
  std::uint32_t posted_ = 0;              // my progress counter, mirrored
  std::uint32_t sequence_ = 0;            // collectives begun
  bool compare_after_next_wait_ = false;  // the first post of a collective was made
  bool first_post_pending_ = false;       // begin() ran, no post yet
  int next_buffer_ = 0;
  std::uint32_t buffer_free_at_[2] = {0, 0};  // a buffer may be rewritten once every peer posted this
  std::unique_ptr<PeerError> error_;
};

}  // namespace ddp::detail::shm
