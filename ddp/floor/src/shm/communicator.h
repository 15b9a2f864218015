#pragma once
// Collectives between the processes of one group on one host, through POSIX shared memory: no
// kernel network stack; each rank copies its data into shared memory once and reads the others'
// from there.
//
// Setup (the constructor; once per group). Every rank creates its segment "<prefix>-<rank>": a
// control block (its progress counter, a count of sleepers on it, its pid, a failure flag and
// message, the descriptors of its current collectives) and two data buffers of chunk_bytes,
// used alternately so one chunk can be written while peers still read the other. It says so
// through the caller's Rendezvous, maps every peer's segment, waits until every rank has mapped
// every segment, and unlinks its own name. After construction /dev/shm holds nothing of the
// group: a SIGKILL at any moment later leaves nothing behind.
//
// A collective is a fixed sequence of steps that every rank runs in the same order. Finishing a
// step increments the rank's progress counter ("posts"), so the n-th post means the same thing on
// every rank, and "wait for every peer's post n" is how one rank waits for the others (wait.h:
// spin briefly, then sleep on a futex). allreduce, per chunk of at most chunk_bytes:
//   1. copy my chunk into my buffer; post       (peers may now read it)
//   2. wait for every peer's step 1; reduce my 1/W slice of the chunk from all W buffers, in rank
//      order, into my own buffer's slice; post  (my slice of the result is ready)
//   3. wait for every peer's step 2; copy every slice from its owner's buffer to my output; post
//      (I am done reading everyone's buffer)
// reduce_scatter is step 1 and 2 alone (each rank stages only what the peers reduce, and reduces
// its own piece into its output); allgather is step 1 and 3 alone (each rank stages its piece and
// copies every peer's out).
// A buffer is written again only after every peer has posted its last step on the previous
// contents, which with two buffers lets a fast rank copy chunk k+1 in while others still work on
// chunk k. At two ranks, and for tensors of at most one_step_bytes, there are no slices: after
// step 1 every rank reduces the whole chunk from all buffers straight into its output (one round
// trip instead of two, no copy out; the same bits on every rank).
//
// Checks that cost nothing extra: every rank writes a descriptor of the collective (kind, count,
// dtype, op, root) into its control block before its first post, and compares every peer's after
// its first wait; ranks that disagree throw PeerError naming both collectives ("desync"). Every
// wait is bounded by the timeout; while waiting, a rank looks at each lagging peer's pid every
// ~100 ms, so a peer that died is named within a fraction of a second (one that destroyed its
// Communicator, at once); a rank that throws raises its failure flag and wakes every waiter of the
// group, so the others fail at once, naming the rank that caused it. The rank an error blames
// first is the one at fault: at the timeout a stopped peer before a running one, and a peer still
// inside its step across the hosts (allreduce_shared's Relay, which its own timeout bounds) is
// given one more timeout to fail with the rank it waits for.
//
// Thread-safety: a Communicator is used by one thread at a time (calls from several threads must
// be serialized by the caller). Collectives must be called in the same order with matching
// arguments on every rank of the group. A child forked after setup must not use it (destroying
// it there is harmless).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "reduce_kernels.h"
#include "segment.h"

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

// Memory every rank of a group can read and write, for one array: each rank has `bytes` of its
// own, and every peer maps it too. Made by Communicator::share(); DDP's gradient buckets live in
// one each, so allreduce_shared() reduces them where they are - each rank reads its
// 1/W slice from every rank's memory and writes the result back into every rank's memory: two
// passes over the array per rank instead of the five of an allreduce through the data buffers.
// It lives as long as its last holder (a tensor over it may outlive the Communicator); nothing of
// it is left in /dev/shm once share() has returned.
class SharedArray {
 public:
  void* mine() const noexcept { return segments_[rank_].data(); }
  void* of(int rank) const noexcept { return segments_[rank].data(); }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  friend class Communicator;
  SharedArray() = default;
  std::vector<Segment> segments_;  // by rank
  int rank_ = 0;
  std::size_t bytes_ = 0;
  std::uint32_t id_ = 0;  // the n-th share() of the group: the same on every rank
};

// `count` elements of the collective's dtype at `data`.
struct Span {
  void* data;
  std::size_t count;
};

// Calls part(pointer, at, n) for each piece of elements [first, first + count) of the spans taken
// as one array, in order: `pointer` is the piece's first byte, `at` its index counted from `first`.
template <typename Part>
inline void for_each_piece(const std::vector<Span>& spans, std::size_t element, std::size_t first, std::size_t count,
                           Part&& part) {
  const std::size_t last = first + count;
  std::size_t begin = 0;  // the current span's first element in the whole array
  for (const Span& span : spans) {
    const std::size_t end = begin + span.count;
    if (span.count > 0 && end > first && begin < last) {
      const std::size_t from = std::max(begin, first), to = std::min(end, last);
      part(static_cast<unsigned char*>(span.data) + (from - begin) * element, from - first, to - from);
    }
    if (end >= last) return;
    begin = end;
  }
}

// A hierarchical allreduce's step across hosts (hierarchical.h), which allreduce_shared runs on this
// rank's slice between reducing it inside the host and copying it into the peers' parts, a piece
// at a time, so that a piece crosses the hosts while the next one is reduced.
class Relay {
 public:
  virtual ~Relay() = default;
  // Starts reducing `count` elements at `data` (a piece of this rank's slice, in its part of a
  // shared array) with the other hosts, in place.
  virtual void start(void* data, std::size_t count) = 0;
  // Returns once the oldest piece started is reduced; throws PeerError when that failed. Bounded
  // by the group's timeout: the peers waiting for this rank meanwhile wait for its verdict.
  virtual void finish() = 0;
};

struct Options {
  // Longest wait for any one step of a peer (a frozen peer fails the collective after this long).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Bytes per chunk and per data buffer (two per rank), rounded up to a multiple of 64. Bounds
  // the shared memory per rank (2 x chunk_bytes plus 4 KiB) and is the unit of pipelining. About
  // a core's L2, so a chunk is still in cache when the peers read it: at two ranks, 33.6 MB took
  // about 1.5x longer with 4 MiB chunks than with 256 KiB - 1 MiB ones (interleaved runs).
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

class Communicator {
 public:
  // Sets up the group (see the top of this file). `name_prefix` names the segments
  // ("<prefix>-<rank>") and the rendezvous keys: one leading '/', no other, short enough for a
  // 255-character name, and unique to this group of this job (carry the run id and the group's
  // index) and to this Communicator (the rendezvous keys are set once). All ranks pass the same
  // prefix, size and options. A group of one uses no shared memory.
  // Throws ShmUnavailable if this rank or any peer could not set up (no /dev/shm, full, a stale
  // object of that name, a peer that reported a failure, a rendezvous timeout); nothing of this
  // rank is left in /dev/shm then. Ranks that throw should agree, through the caller's store, to
  // use another transport for the whole group: a peer may have failed after this rank succeeded.
  // Throws std::invalid_argument for a bad rank, size or options.
  Communicator(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, Options options = {});
  // Unmaps the group's memory. Peers that still wait for this rank fail at once, naming it.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // In place: data (count elements of dtype) becomes the reduction over all ranks, in rank order,
  // bit-identical on every rank. Throws std::invalid_argument (before communicating, leaving the
  // communicator usable) for an unsupported dtype/op pair (AVG of integers).
  void allreduce(void* data, std::size_t count, DType dtype, Op op);
  // The same over several pieces of memory taken as one array, in order (a rank's pieces may be
  // cut differently from a peer's: only the total counts): DDP reduces a bucket's gradients where
  // they are, without gathering them into one tensor first. `scale` (SUM of floating types only;
  // see reduce_into) multiplies the sum before it is stored; it is part of the collective, so
  // ranks that would average differently fail the desync check instead of diverging.
  void allreduce(const std::vector<Span>& spans, DType dtype, Op op, double scale = 1.0);
  // `bytes` bytes from rank `root`'s data into everyone's. Throws std::invalid_argument (before
  // communicating) for a root that is not a rank.
  void broadcast(void* data, std::size_t bytes, int root);
  // out (size() * bytes_per_rank bytes) receives every rank's `in`, in rank order. `in` may be
  // this rank's part of `out`; otherwise the two must not overlap. (all_gather.cpp)
  void allgather(const void* in, std::size_t bytes_per_rank, void* out);
  // `in` holds size() pieces of `count` elements of dtype; `out` (count elements) becomes the
  // reduction over the ranks of piece rank(), in rank order: the bits allreduce gives those
  // elements. `out` may be this rank's piece of `in`; otherwise the two must not overlap. Throws
  // std::invalid_argument (before communicating) for what allreduce refuses. (reduce_scatter.cpp)
  void reduce_scatter(const void* in, std::size_t count, void* out, DType dtype, Op op);
  // Returns once every rank has called barrier().
  void barrier();

  // Collective: `bytes` of zeroed memory for this rank that every peer maps, and theirs (see
  // SharedArray). Throws ShmUnavailable on every rank alike when the ranks ask for different sizes,
  // or any rank could not create or map its part (/dev/shm full: its size is the tmpfs mount's or
  // the container's --shm-size); the communicator stays usable then, and nothing is left in
  // /dev/shm.
  std::shared_ptr<SharedArray> share(std::size_t bytes);
  // In place, like allreduce: the `count` elements of `dtype` at byte `offset` of every rank's
  // part of `array` (a multiple of the element size) become their reduction over the ranks, in
  // rank order, times `scale`, bit-identical on every rank. Every rank passes the same array,
  // offset and count (the desync check names a rank that does not). The caller writes its part
  // before the call and leaves all of it alone until the call returns.
  // With a `relay` (hierarchical.h; every rank of the host passes one, or none): between reducing
  // its slice and copying it to the peers, each rank has the relay reduce it across the hosts, in
  // pieces of kRelayPieceBytes, at most kRelayPiecesInFlight at a time. Then the result is the
  // host's reduction (op, times scale) reduced across the hosts as the relay does it.
  void allreduce_shared(const SharedArray& array, std::size_t offset, std::size_t count, DType dtype, Op op,
                        double scale = 1.0, Relay* relay = nullptr);
  static constexpr std::size_t kRelayPieceBytes = std::size_t{1} << 20;
  static constexpr int kRelayPiecesInFlight = 2;

  // Rank `rank`'s slice of an array of `count` elements of `dtype` in allreduce_shared (the part of
  // the array it reduces, and with a relay sends across the hosts): elements [first, second). The
  // parts are consecutive in rank order and cover the array; each starts at a multiple of 64 bytes
  // and holds at most 1/size of the array plus 128 bytes (some are empty for arrays under 64 bytes
  // per rank). The same on every rank of the group.
  std::pair<std::size_t, std::size_t> part(int rank, std::size_t count, DType dtype) const;

  // The collectives above throw PeerError when a peer fails them (see the top of this file);
  // after that every call throws the same error again.
  bool failed() const noexcept { return error_ != nullptr; }
  // This rank fails with `error`, which happened outside the communicator (a hierarchical
  // allreduce's step across hosts): every later call throws it, and peers waiting for this rank
  // fail at once with its text. Only the first failure is kept.
  void fail(const PeerError& error) noexcept;
  // The error a peer failed with (its text), or "" while none has: what a rank whose work outside
  // the communicator failed names first, when its host's peers already know the cause.
  std::string peer_failure() const;
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const Options& options() const noexcept { return options_; }

  struct ControlBlock;  // the segment's header (communicator.cpp)

 private:
  struct Peer {
    Segment segment;  // this rank's own, or the mapping of a peer's
    ControlBlock* control = nullptr;
    unsigned char* buffers[2] = {nullptr, nullptr};
    bool check_pid = false;  // its pid is visible here (same pid namespace)
  };
  struct Descriptor;
  struct Step;

  template <typename Body>
  void run(const Descriptor& descriptor, Body&& body);
  void begin(const Descriptor& descriptor);
  void post();
  void wait_all(std::uint32_t target, const Step& step);
  int acquire_buffer(const Step& step, bool will_write);
  void release_buffer(int buffer);
  unsigned char* buffer(int rank, int index) const;
  std::pair<std::size_t, std::size_t> slice(int rank, std::size_t n, std::size_t element_size) const;
  const Descriptor& current() const;
  void check_descriptors();
  const ControlBlock* failed_peer() const;
  void check_failed_peers();
  void check_departed_peers(std::uint32_t target, const Step& step, bool look_at_pids);
  bool waits_for_other_hosts(int peer) const;
  [[noreturn]] void throw_timeout(std::uint32_t target, const Step& step, int late);
  int number_of(int rank) const;     // the number errors give `rank` (Options::rank_names)
  std::string name(int rank) const;  // "rank <number>"
  std::string describe(const Descriptor& descriptor) const;

  void allreduce_direct(const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale);
  void allreduce_sliced(const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale);
  static void check_reduction(const char* collective, DType dtype, Op op, double scale);
  std::size_t reduce_scatter_slot_bytes(std::size_t element) const;

  Options options_;
  std::string prefix_;                // the segments' names ("<prefix>-<rank>"), and shared arrays'
  std::uint32_t arrays_shared_ = 0;   // share() calls made
  int rank_;
  int size_;
  std::vector<Peer> peers_;  // by rank; peers_[rank_] is this rank's own segment
  std::vector<const void*> sources_;  // scratch: the reduction's inputs, one per rank
  std::chrono::nanoseconds spin_{0};
  std::uint32_t posted_ = 0;               // my progress counter, mirrored
  std::uint32_t sequence_ = 0;             // collectives begun
  bool compare_after_next_wait_ = false;   // the first post of a collective was made
  bool first_post_pending_ = false;        // begin() ran, no post yet
  int next_buffer_ = 0;
  std::uint32_t buffer_free_at_[2] = {0, 0};  // a buffer may be rewritten once every peer posted this
  std::unique_ptr<PeerError> error_;
};

}  // namespace ddp::detail::shm
