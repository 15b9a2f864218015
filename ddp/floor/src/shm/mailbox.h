#pragma once
// Point-to-point messages between the processes of one group on one host, through POSIX shared
// memory (torch.distributed's send/recv/isend/irecv, and the all-to-all built on them): no kernel
// network stack, one copy into shared memory by the sender and one out by the receiver.
//
// Layout. Every rank creates one segment "<prefix>-<rank>": a header (its pid, a "closed" flag and
// its doorbell, below) and, for every peer, its outbox to that peer - a ring of `slots` slots of
// `slot_bytes` each. A message is cut into chunks of at most slot_bytes (one chunk for an empty
// message); each chunk's slot says its tag, its lane (the users' messages or the library's own),
// the message's total size and whether it is the message's first chunk. The sender counts the
// chunks it wrote into the ring (`written`), the receiver those it took out (`consumed`, in the
// sender's segment but written by the receiver only): a slot is free once consumed has passed
// it. Whatever the message's size, shared memory per rank is bounded by (size - 1) rings.
// Setup is the Communicator's (communicator.h): create, tell the peers through the rendezvous,
// map theirs, agree that everyone mapped everything, unlink: after the constructor /dev/shm holds
// nothing of the mailbox, so a SIGKILL at any moment later leaves nothing behind.
//
// Progress. One thread per mailbox (started at the first send or receive) moves every message:
// it writes the head send of each destination into that destination's ring while there is room,
// and takes every chunk that has arrived from every source. It never waits for one peer in
// particular: when nothing can move it sleeps on its doorbell, a counter in its own segment that
// a peer bumps (wait.h's post(): a count of events, by any process) after writing a chunk for it
// or taking one of its chunks, and that this process bumps when a caller adds a send or receive.
// A send with nothing queued before it whose message fits in the free slots of its ring is
// written by the caller's thread instead, and done when send() returns (a small message does not
// wait for the mailbox's thread to wake). A message nobody has asked for yet is taken all the
// same, into private memory ("unexpected"), where a later receive finds it. So a send completes
// once its data is in the receiver's ring or private memory, without waiting for a matching
// receive, and no pattern of sends and receives that would finish with unlimited buffers can
// deadlock here: two ranks that each send first and receive second both finish, a rank blocked in
// a receive still drains every peer's sends, and the collectives issued by other threads (the
// channel's own thread, channel.h) never wait behind a receive, which runs on this thread only.
//
// Matching, as PyTorch: a message goes to the oldest receive still waiting whose source is its
// sender (or any source) and whose tag and lane are its own, else it waits, in arrival order,
// for the next such receive. Messages from one sender with one tag arrive in the order sent. A
// receive whose size differs from the message's fails, naming both sizes (the message is
// discarded); the sender's side completes.
//
// Failure. Every wait is bounded by the timeout: a send whose data the receiver does not take, or
// a receive that nothing arrives for, within the timeout, fails with a PeerError naming the peer
// (and whether it is stopped); a receive from any source names no one. While anything waits for a
// peer, its pid is looked at every ~100 ms: a peer that exited, or destroyed its mailbox, fails
// every send to it and receive from it at once, naming it. A message cut off in the middle (its
// sender died, or timed out) leaves the pair unusable: later operations with that peer fail
// with the same error.
//
// Thread-safety: send(), recv() and progress() may be called from any thread. Their `done`
// callbacks run on the mailbox's thread (or on a caller's: a send written there, a receive whose
// message was already there, what a progress() call finished), and must not block on other
// messages of this mailbox. A child forked after setup
// must not use the mailbox (destroying it there is harmless).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/segment.h"

namespace ddp::detail::shm {

struct MailboxOptions {
  // Longest wait for a peer to take or send a chunk.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Bytes per slot, rounded up to a multiple of 64, and slots per ring (per ordered pair of ranks).
  std::size_t slot_bytes = std::size_t{256} << 10;
  int slots = 4;
  // How long the mailbox's thread polls before it sleeps on its doorbell; negative: 20 us, or
  // 2 us when the process may use fewer CPUs than there are ranks.
  std::chrono::microseconds spin{-1};

  // A group of `size` ranks: 4 slots per ring, about 1 MiB of rings per rank in all (256 KiB slots
  // at two ranks, down to 16 KiB ones at 17 ranks and more).
  static MailboxOptions for_group(int size, std::chrono::milliseconds timeout);
};

class Mailbox {
 public:
  // Called once per operation: `source` is the sender (a receive's; a send's is its own rank),
  // `error` null on success.
  using Done = std::function<void(int source, std::exception_ptr error)>;
  static constexpr int kAnySource = -1;
  // The library's own messages (an all-to-all) never meet the users'.
  enum class Lane : std::uint32_t { kUser = 0, kAllToAll = 1 };

  // Collective: every rank of the group, with the same prefix (unique to this mailbox: it names
  // the segments and the rendezvous keys), size and options. Throws ShmUnavailable when this rank
  // or a peer could not set up (nothing of this rank is left in /dev/shm then), or
  // std::invalid_argument for a bad rank, size or options. A group of one has no mailbox memory.
  Mailbox(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, MailboxOptions options);
  // Fails whatever is still waiting ("destroyed"), stops the thread; peers still exchanging with
  // this rank fail at once, naming it.
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Starts sending `bytes` at `data` to `dst` (not this rank); `data` must stay valid and
  // unchanged until `done` has been called.
  void send(const void* data, std::size_t bytes, int dst, int tag, Done done, Lane lane = Lane::kUser);
  // Starts receiving a message of exactly `bytes` from `src` (kAnySource: any peer) into `data`,
  // which must stay valid until `done` has been called.
  void recv(void* data, std::size_t bytes, int src, int tag, Done done, Lane lane = Lane::kUser);
  // The same, returning when done: throws what `done` would get; recv returns the sender.
  void send(const void* data, std::size_t bytes, int dst, int tag, Lane lane = Lane::kUser);
  int recv(void* data, std::size_t bytes, int src, int tag, Lane lane = Lane::kUser);

  // One pass of the mailbox's thread's work (sends out, arrivals in) on the caller's thread, unless
  // another thread is at it; callbacks of what finished run here. A caller about to sleep until
  // its message is in calls this meanwhile: the message lands without waking another thread.
  // Returns whether anything moved.
  bool progress();

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const MailboxOptions& options() const noexcept { return options_; }

  struct Header;  // mailbox.cpp
  struct Ring;
  struct Slot;

 private:
  struct Operation;
  struct Incoming;  // the message being taken from one source
  struct Peer {
    Segment segment;
    Header* header = nullptr;
    bool check_pid = false;
  };
  using Completion = std::pair<std::unique_ptr<Operation>, std::exception_ptr>;

  void set_up(Rendezvous& rendezvous);
  void start_thread();
  void add(std::unique_ptr<Operation> operation);
  bool send_here(Operation& send);
  void run();
  bool move_sends(std::vector<Completion>& completed);
  bool move_send(int dst, Operation& send);
  bool take_arrivals(std::vector<Completion>& completed);
  bool take_chunk(int src, std::vector<Completion>& completed);
  void begin_message(int src, const Slot& slot);
  void end_message(int src, std::vector<Completion>& completed);
  static bool matches(const Operation& receive, int src, int tag, Lane lane);
  std::unique_ptr<Operation> take_receive(int src, int tag, Lane lane);
  std::unique_ptr<Operation> take_unexpected(const Operation& receive);
  std::exception_ptr size_error(const Operation& receive, int source, std::size_t sent) const;
  void deliver(Operation& receive, int source, const std::vector<unsigned char>& data, std::exception_ptr& error) const;
  void check_peers(std::vector<Completion>& completed, bool look_at_pids);
  void check_deadlines(std::vector<Completion>& completed);
  void fail_with_peer(int peer, const std::string& what, std::vector<Completion>& completed);
  void fail_everything(const std::string& why, std::vector<Completion>& completed);
  bool waits_on(int peer);
  std::string departed(int peer, bool look_at_pids) const;
  std::string who(int peer) const;
  std::string describe(const Operation& operation) const;
  std::string name(int peer) const;
  Ring& outbox(int owner, int to) const;

  MailboxOptions options_;
  std::string prefix_;
  int rank_;
  int size_;
  std::vector<Peer> peers_;  // by rank; peers_[rank_] is this rank's own segment
  std::size_t ring_bytes_ = 0;
  std::chrono::nanoseconds spin_{0};
  std::int32_t pid_ = 0;  // the process that set up (a forked child is another)

  // Guarded by mutex_: what callers added and the thread has not finished.
  std::mutex mutex_;
  std::vector<std::deque<std::unique_ptr<Operation>>> sends_;  // by destination, oldest first
  std::deque<std::unique_ptr<Operation>> receives_;            // waiting for a message, oldest first
  std::deque<std::unique_ptr<Operation>> unexpected_;          // messages taken before their receive
  std::vector<std::string> broken_;                            // by peer: why the pair is unusable, or ""
  std::vector<char> writing_;  // by destination: a thread writes into its ring (the mailbox's, or a caller's)
  bool stopping_ = false;
  // Held by whoever moves messages (the mailbox's thread, or a caller in progress()); guards
  // incoming_, the message being taken from each source.
  std::mutex progress_mutex_;
  std::vector<std::unique_ptr<Incoming>> incoming_;
  std::unique_ptr<std::thread> thread_;
};

}  // namespace ddp::detail::shm
