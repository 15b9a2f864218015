// Point-to-point messages through shared memory (mailbox.h). Read top to bottom: the shared
// layout, setup, the callers' side, the thread's loop (sends out, arrivals in), then failure.
#include "ddp/floor/src/shm/mailbox.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <new>

#include "ddp/floor/src/shm/process.h"
#include "ddp/floor/src/shm/reduce_kernels.h"
#include "ddp/floor/src/shm/wait.h"

namespace ddp::detail::shm {
namespace {

using MailClock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::uint64_t kMailboxMagic = 0x746f7263686d6278ull;  // "torchmbx"
constexpr std::uint32_t kMailboxVersion = 2;  // 2: the pid namespace
constexpr std::size_t kMailboxHeaderBytes = 4096;
constexpr std::size_t kRingControlBytes = 128;
constexpr std::size_t kSlotHeaderBytes = 64;
constexpr auto kMailboxSleepSlice = 50ms;  // longest sleep: then look at the deadlines and the peers
constexpr auto kMailboxPidCheckEvery = 100ms;

}  // namespace

// --- What lives in shared memory ---------------------------------------------------------------

// The first page of a rank's segment: written before the rendezvous publishes it, except `closed`
// (the owner, at the end) and the doorbell (everyone).
struct Mailbox::Header : SegmentIdentity {
  std::uint64_t slot_bytes;
  std::uint32_t slots;
  char pid_space[160];  // process.h's pid_space(): a peer's pid means something here only if it is ours
  alignas(64) std::atomic<std::uint32_t> closed;  // the owner destroyed its mailbox
  alignas(64) Progress doorbell;                  // bumped by whoever has news for the owner
};
static_assert(sizeof(Mailbox::Header) <= kMailboxHeaderBytes, "the header must fit its page");

// An outbox: chunks the owner wrote, chunks its receiver took; the slots follow.
struct Mailbox::Ring {
  alignas(64) std::atomic<std::uint32_t> written;   // by the sender only
  alignas(64) std::atomic<std::uint32_t> consumed;  // by the receiver only
};
static_assert(sizeof(Mailbox::Ring) <= kRingControlBytes, "the ring's counters must fit their lines");

// One chunk of a message; its data follows the header's 64 bytes.
struct Mailbox::Slot {
  std::int32_t tag;
  std::uint32_t lane;
  std::uint64_t total;  // the message's bytes
  std::uint64_t bytes;  // this chunk's
  std::uint32_t first;  // the message's first chunk
};
static_assert(sizeof(Mailbox::Slot) <= kSlotHeaderBytes, "a slot's header must fit its line");

// A send, a receive, or a message taken before its receive (unexpected: its data in `buffer`).
struct Mailbox::Operation {
  Operation() = default;
  Operation(bool is_send, unsigned char* data, std::size_t bytes, int peer, int tag, Lane lane, Done done)
      : is_send(is_send), data(data), bytes(bytes), peer(peer), tag(tag), lane(lane), done(std::move(done)) {}

  bool is_send = false;
  unsigned char* data = nullptr;
  std::size_t bytes = 0;
  int peer = kAnySource;  // the destination, the source asked for, or the unexpected message's sender
  int tag = 0;
  Lane lane = Lane::kUser;
  Done done;
  std::size_t moved = 0;  // bytes written or taken so far
  bool started = false;   // a send's first chunk is in the ring
  MailClock::time_point last_move = MailClock::now();
  int source = kAnySource;   // a receive's sender, once matched
  std::exception_ptr error;  // a receive's message of another size (found when it began)
  std::vector<unsigned char> buffer;
};

struct Mailbox::Incoming {
  std::unique_ptr<Operation> target;  // the receive it goes to, or the unexpected message
  bool unexpected = false;
  bool discard = false;  // the receive's size differs: the data is dropped
  std::uint64_t total = 0;
  std::uint64_t taken = 0;
  int tag = 0;
  Lane lane = Lane::kUser;
};

MailboxOptions MailboxOptions::for_group(int size, std::chrono::milliseconds timeout) {
  MailboxOptions options;
  options.timeout = timeout;
  const std::size_t per_slot = (std::size_t{256} << 10) / static_cast<std::size_t>(std::max(1, size - 1));
  options.slot_bytes = std::clamp<std::size_t>(per_slot, std::size_t{16} << 10, std::size_t{256} << 10);
  options.slots = 4;
  return options;
}

Mailbox::Ring& Mailbox::outbox(int owner, int to) const {
  const int index = to < owner ? to : to - 1;
  auto* base = static_cast<unsigned char*>(peers_[owner].segment.data()) + kMailboxHeaderBytes;
  return *reinterpret_cast<Ring*>(base + static_cast<std::size_t>(index) * ring_bytes_);
}

namespace {
Mailbox::Slot& slot_at(Mailbox::Ring& ring, std::uint32_t chunk, const MailboxOptions& options) {
  auto* base = reinterpret_cast<unsigned char*>(&ring) + kRingControlBytes;
  const std::size_t index = chunk % static_cast<std::uint32_t>(options.slots);
  return *reinterpret_cast<Mailbox::Slot*>(base + index * (kSlotHeaderBytes + options.slot_bytes));
}
unsigned char* slot_data(Mailbox::Slot& slot) { return reinterpret_cast<unsigned char*>(&slot) + kSlotHeaderBytes; }
}  // namespace

// --- Setup ---------------------------------------------------------------------------------------

Mailbox::Mailbox(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, MailboxOptions options)
    : options_(options), prefix_(name_prefix), rank_(rank), size_(size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("shm::Mailbox: rank " + std::to_string(rank) + " of " + std::to_string(size) + " is not a rank");
  }
  if (options_.timeout.count() <= 0 || options_.slots < 1) {
    throw std::invalid_argument("shm::Mailbox: the timeout and the slots per ring must be positive");
  }
  options_.slot_bytes = (std::max<std::size_t>(options_.slot_bytes, 64) + 63) / 64 * 64;
  ring_bytes_ = kRingControlBytes + static_cast<std::size_t>(options_.slots) * (kSlotHeaderBytes + options_.slot_bytes);
  pid_ = static_cast<std::int32_t>(::getpid());
  sends_.resize(size_);
  broken_.resize(size_);
  writing_.resize(size_);
  incoming_.resize(size_);
  if (size_ == 1) return;  // nobody to write to
  spin_ = options_.spin.count() >= 0 ? options_.spin : cpus_available() >= size_ ? 20us : 2us;
  peers_.resize(size_);
  set_up(rendezvous);
}

// Create, publish, map, agree, unlink: every group's set-up (peers.h: set_up_segments).
void Mailbox::set_up(Rendezvous& rendezvous) {
  SegmentsSetUp set_up;
  set_up.key_prefix = "torchddp/mailbox" + prefix_ + "/";
  set_up.name_prefix = prefix_;
  set_up.bytes = kMailboxHeaderBytes + static_cast<std::size_t>(size_ - 1) * ring_bytes_;
  set_up.magic = kMailboxMagic;
  set_up.version = kMailboxVersion;
  set_up.fill = [this](void* memory) -> SegmentIdentity& {
    auto* header = new (memory) Header{};
    header->slot_bytes = options_.slot_bytes;
    header->slots = static_cast<std::uint32_t>(options_.slots);
    pid_space().copy(header->pid_space, sizeof header->pid_space - 1);
    return *header;
  };
  set_up.identity = [](const void* memory) -> const SegmentIdentity& { return *static_cast<const Header*>(memory); };
  set_up.matches = [this](const void* memory, int) {
    const auto* header = static_cast<const Header*>(memory);
    return header->slot_bytes == options_.slot_bytes && header->slots == static_cast<std::uint32_t>(options_.slots);
  };
  set_up.mismatch = "mailbox of this group";
  set_up.create_failed = "create its mailbox";
  set_up.map_failed = "map the mailboxes";
  std::vector<Segment> segments = set_up_segments(rendezvous, rank_, size_, set_up);
  for (int p = 0; p < size_; ++p) {
    peers_[p].segment = std::move(segments[p]);
    peers_[p].header = static_cast<Header*>(peers_[p].segment.data());
    // Its pid is watched when it is a pid of this pid namespace - even if the peer already exited.
    const Header& header = *peers_[p].header;
    const std::string space(header.pid_space, strnlen(header.pid_space, sizeof header.pid_space));
    peers_[p].check_pid = p != rank_ && !space.empty() && space == pid_space();
  }
}

Mailbox::~Mailbox() {
  if (peers_.empty()) return;
  if (pid_ != static_cast<std::int32_t>(::getpid())) {  // a forked child: the thread is not here
    thread_.release();
    return;
  }
  if (thread_) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    shm::post(peers_[rank_].header->doorbell);
    thread_->join();
  }
  // Peers still exchanging with this rank look at their peers at once.
  peers_[rank_].header->closed.store(1, std::memory_order_release);
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) shm::post(peers_[p].header->doorbell);
  }
}

// --- The callers' side -----------------------------------------------------------------------------

void Mailbox::start_thread() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!thread_) thread_ = std::make_unique<std::thread>([this] { run(); });
}

void Mailbox::send(const void* data, std::size_t bytes, int dst, int tag, Done done, Lane lane) {
  if (dst < 0 || dst >= size_ || dst == rank_) {
    throw std::invalid_argument("shm::Mailbox::send: " + std::to_string(dst) + " is not a peer of rank " + std::to_string(rank_));
  }
  auto* from = static_cast<unsigned char*>(const_cast<void*>(data));  // only read
  add(std::make_unique<Operation>(/*is_send=*/true, from, bytes, dst, tag, lane, std::move(done)));
}

void Mailbox::recv(void* data, std::size_t bytes, int src, int tag, Done done, Lane lane) {
  if (src != kAnySource && (src < 0 || src >= size_ || src == rank_)) {
    throw std::invalid_argument("shm::Mailbox::recv: " + std::to_string(src) + " is not a peer of rank " + std::to_string(rank_));
  }
  add(std::make_unique<Operation>(/*is_send=*/false, static_cast<unsigned char*>(data), bytes, src, tag, lane,
                                  std::move(done)));
}

// Queues the operation for the thread - a receive whose message was taken already is finished
// here instead, and one with a peer whose pair is broken fails at once.
void Mailbox::add(std::unique_ptr<Operation> operation) {
  if (size_ == 1) {  // only a receive from any source gets here: there is nobody to send it
    operation->done(kAnySource, std::make_exception_ptr(std::invalid_argument("shm::Mailbox::recv: a group of one rank has no peer")));
    return;
  }
  start_thread();
  std::unique_ptr<Operation> message;  // an unexpected message this receive takes
  std::exception_ptr error;
  bool queued = false, here = false;
  const int peer = operation->peer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (peer != kAnySource && !broken_[peer].empty()) {
      error = std::make_exception_ptr(PeerError(peer, broken_[peer]));
    } else if (operation->is_send && sends_[peer].empty() && !writing_[peer]) {
      writing_[peer] = 1;  // nothing before it: this thread may write it (below)
      here = true;
    } else if (operation->is_send) {
      operation->last_move = MailClock::now();
      sends_[peer].push_back(std::move(operation));
      queued = true;
    } else if (!(message = take_unexpected(*operation))) {
      operation->last_move = MailClock::now();
      receives_.push_back(std::move(operation));
      queued = true;
    }
  }
  if (here && !send_here(*operation)) {  // too large for the free slots now: the thread sends it
    operation->last_move = MailClock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    sends_[peer].push_back(std::move(operation));
    queued = true;
  }
  if (queued) {
    shm::post(peers_[rank_].header->doorbell);  // the thread looks at the new operation
    return;
  }
  if (error || here) {
    operation->done(error ? peer : rank_, error);
    return;
  }
  if (message) {
    deliver(*operation, message->peer, message->buffer, error);
    operation->done(operation->source, error);
  }
}

// A send with nothing queued before it, written on the caller's thread when all of it fits in the
// free slots of its ring (a small message: no wait for the mailbox's thread). Says whether it was;
// either way the ring is the thread's again.
bool Mailbox::send_here(Operation& send) {
  const int dst = send.peer;
  Ring& ring = outbox(rank_, dst);
  const std::size_t chunks = std::max<std::size_t>(1, (send.bytes + options_.slot_bytes - 1) / options_.slot_bytes);
  const std::uint32_t in_use = ring.written.load(std::memory_order_relaxed) - ring.consumed.load(std::memory_order_acquire);
  const bool fits = chunks <= static_cast<std::size_t>(options_.slots) - in_use;
  if (fits) move_send(dst, send);
  std::lock_guard<std::mutex> lock(mutex_);
  writing_[dst] = 0;
  return fits;
}

// The oldest unexpected message `receive` takes, removed from the list (under mutex_), or null.
std::unique_ptr<Mailbox::Operation> Mailbox::take_unexpected(const Operation& receive) {
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    const Operation& message = **it;
    if (matches(receive, message.peer, message.tag, message.lane)) {
      std::unique_ptr<Operation> taken = std::move(*it);
      unexpected_.erase(it);
      return taken;
    }
  }
  return nullptr;
}

bool Mailbox::matches(const Operation& receive, int src, int tag, Lane lane) {
  return (receive.peer == kAnySource || receive.peer == src) && receive.tag == tag && receive.lane == lane;
}

// The oldest receive waiting for a message from `src` with this tag and lane, removed from the
// list (under mutex_), or null.
std::unique_ptr<Mailbox::Operation> Mailbox::take_receive(int src, int tag, Lane lane) {
  for (auto it = receives_.begin(); it != receives_.end(); ++it) {
    if (matches(**it, src, tag, lane)) {
      std::unique_ptr<Operation> taken = std::move(*it);
      receives_.erase(it);
      return taken;
    }
  }
  return nullptr;
}

std::exception_ptr Mailbox::size_error(const Operation& receive, int source, std::size_t sent) const {
  return std::make_exception_ptr(std::invalid_argument(
      describe(receive) + " got " + name(source) + "'s message of " + std::to_string(sent) + " bytes, not " +
      std::to_string(receive.bytes) + ": a receive must have the size of the message sent"));
}

// Copies a message taken earlier into the receive, or says why not (its size).
void Mailbox::deliver(Operation& receive, int source, const std::vector<unsigned char>& data, std::exception_ptr& error) const {
  receive.source = source;
  if (data.size() != receive.bytes) {
    error = size_error(receive, source, data.size());
    return;
  }
  if (!data.empty()) copy_bytes(receive.data, data.data(), data.size());
}

// The promises are shared with the callbacks: a callback may still be inside set_value() when the
// caller, woken, returns.
void Mailbox::send(const void* data, std::size_t bytes, int dst, int tag, Lane lane) {
  auto finished = std::make_shared<std::promise<void>>();
  std::future<void> result = finished->get_future();
  send(data, bytes, dst, tag, [finished](int, std::exception_ptr error) {
    if (error) {
      finished->set_exception(error);
    } else {
      finished->set_value();
    }
  }, lane);
  result.get();
}

int Mailbox::recv(void* data, std::size_t bytes, int src, int tag, Lane lane) {
  auto finished = std::make_shared<std::promise<int>>();
  std::future<int> result = finished->get_future();
  recv(data, bytes, src, tag, [finished](int source, std::exception_ptr error) {
    if (error) {
      finished->set_exception(error);
    } else {
      finished->set_value(source);
    }
  }, lane);
  return result.get();
}

// --- The thread: sends out, arrivals in, then sleep until there is news ----------------------------

void Mailbox::run() {
  Progress& doorbell = peers_[rank_].header->doorbell;
  auto next_pid_check = MailClock::now() + kMailboxPidCheckEvery;
  for (;;) {
    // The count before looking: news that comes while we look bumps it, and the wait returns.
    const std::uint32_t seen = doorbell.count.load(std::memory_order_acquire);
    std::vector<Completion> completed;
    bool moved = false, stopping = false;
    {
      std::lock_guard<std::mutex> moving(progress_mutex_);
      const bool sent = move_sends(completed);
      const bool took = take_arrivals(completed);
      moved = sent || took;
      const auto now = MailClock::now();
      const bool look_at_pids = now >= next_pid_check;
      if (look_at_pids) next_pid_check = now + kMailboxPidCheckEvery;
      if (!moved || look_at_pids) check_peers(completed, look_at_pids);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping = stopping_;
      }
      if (stopping) fail_everything(name(rank_) + "'s group was destroyed while this operation waited", completed);
    }
    // The callbacks run with no lock held: they may add operations.
    for (Completion& done : completed) {
      Operation& operation = *done.first;
      operation.done(operation.is_send ? rank_ : operation.source, done.second);
    }
    if (stopping) return;
    if (!moved) wait_for(doorbell, seen + 1, spin_, kMailboxSleepSlice);
  }
}

bool Mailbox::progress() {
  std::vector<Completion> completed;
  bool moved = false;
  {
    std::unique_lock<std::mutex> moving(progress_mutex_, std::try_to_lock);
    if (!moving.owns_lock()) return false;  // the mailbox's thread (or another waiter) is at it
    const bool sent = move_sends(completed);
    const bool took = take_arrivals(completed);
    moved = sent || took;
  }
  for (Completion& done : completed) {
    Operation& operation = *done.first;
    operation.done(operation.is_send ? rank_ : operation.source, done.second);
  }
  return moved;
}

bool Mailbox::move_sends(std::vector<Completion>& completed) {
  bool moved = false;
  for (int dst = 0; dst < size_; ++dst) {
    if (dst == rank_) continue;
    Operation* head = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!sends_[dst].empty() && !writing_[dst]) {  // a caller writing a send of its own goes first
        head = sends_[dst].front().get();
        writing_[dst] = 1;
      }
    }
    if (head == nullptr) continue;
    const bool wrote = move_send(dst, *head);
    std::lock_guard<std::mutex> lock(mutex_);
    writing_[dst] = 0;
    if (!wrote) continue;
    moved = true;
    if (head->moved < head->bytes) continue;
    // All of it is in the ring: done. Only this thread removes sends, so the head is still `head`.
    completed.emplace_back(std::move(sends_[dst].front()), nullptr);
    sends_[dst].pop_front();
    if (!sends_[dst].empty()) sends_[dst].front()->last_move = MailClock::now();  // its wait begins now
  }
  return moved;
}

// Writes chunks of `send` into the ring to `dst` while there are free slots; says whether any.
bool Mailbox::move_send(int dst, Operation& send) {
  Ring& ring = outbox(rank_, dst);
  bool moved = false;
  while (!send.started || send.moved < send.bytes) {
    const std::uint32_t written = ring.written.load(std::memory_order_relaxed);
    // The receiver's release of a slot (acquire): it is done reading the slot's old chunk.
    if (written - ring.consumed.load(std::memory_order_acquire) >= static_cast<std::uint32_t>(options_.slots)) break;
    Slot& slot = slot_at(ring, written, options_);
    const std::size_t n = std::min(options_.slot_bytes, send.bytes - send.moved);
    slot.tag = send.tag;
    slot.lane = static_cast<std::uint32_t>(send.lane);
    slot.total = send.bytes;
    slot.bytes = n;
    slot.first = send.started ? 0 : 1;
    if (n > 0) copy_bytes(slot_data(slot), send.data + send.moved, n);
    // Publish the chunk (release), then ring the receiver's doorbell.
    ring.written.store(written + 1, std::memory_order_release);
    shm::post(peers_[dst].header->doorbell);
    send.started = true;
    send.moved += n;
    send.last_move = MailClock::now();
    moved = true;
  }
  return moved;
}

bool Mailbox::take_arrivals(std::vector<Completion>& completed) {
  bool moved = false;
  for (int src = 0; src < size_; ++src) {
    if (src == rank_) continue;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!broken_[src].empty()) continue;  // a cut-off message: the ring is unreadable
    }
    while (take_chunk(src, completed)) moved = true;
  }
  return moved;
}

// Takes the next chunk from `src`'s ring, if one is there, into its receive or unexpected message.
bool Mailbox::take_chunk(int src, std::vector<Completion>& completed) {
  Ring& ring = outbox(src, rank_);
  const std::uint32_t consumed = ring.consumed.load(std::memory_order_relaxed);
  if (consumed == ring.written.load(std::memory_order_acquire)) return false;
  Slot& slot = slot_at(ring, consumed, options_);
  if (!incoming_[src]) begin_message(src, slot);
  Incoming& in = *incoming_[src];
  const std::uint64_t n = std::min<std::uint64_t>(slot.bytes, in.total - in.taken);
  if (!in.discard && n > 0) copy_bytes(in.target->data + in.taken, slot_data(slot), n);
  in.taken += n;
  in.target->last_move = MailClock::now();
  // Give the slot back (release: our reads of it are done), then ring the sender's doorbell.
  ring.consumed.store(consumed + 1, std::memory_order_release);
  shm::post(peers_[src].header->doorbell);
  if (in.taken == in.total) end_message(src, completed);
  return true;
}

// A message's first chunk: it goes to the oldest receive waiting for it, else it is unexpected.
void Mailbox::begin_message(int src, const Slot& slot) {
  auto in = std::make_unique<Incoming>();
  in->total = slot.total;
  in->tag = slot.tag;
  in->lane = static_cast<Lane>(slot.lane);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in->target = take_receive(src, in->tag, in->lane);
  }
  if (in->target) {
    Operation& receive = *in->target;
    receive.source = src;
    if (receive.bytes != in->total) {  // dropped: the receive fails once the message has passed
      receive.error = size_error(receive, src, in->total);
      in->discard = true;
    }
  } else {
    in->unexpected = true;
    in->target = std::make_unique<Operation>();
    in->target->peer = src;
    in->target->tag = in->tag;
    in->target->lane = in->lane;
    in->target->buffer.resize(in->total);
    in->target->data = in->target->buffer.data();
    in->target->bytes = in->total;
  }
  incoming_[src] = std::move(in);
}

// A message's last chunk: its receive is done, or it waits for one - unless one came meanwhile.
void Mailbox::end_message(int src, std::vector<Completion>& completed) {
  std::unique_ptr<Incoming> in = std::move(incoming_[src]);
  if (!in->unexpected) {
    std::exception_ptr error = in->target->error;
    completed.emplace_back(std::move(in->target), error);
    return;
  }
  std::unique_ptr<Operation> receive;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    receive = take_receive(src, in->tag, in->lane);
    if (!receive) {
      unexpected_.push_back(std::move(in->target));
      return;
    }
  }
  std::exception_ptr error;
  deliver(*receive, src, in->target->buffer, error);
  completed.emplace_back(std::move(receive), error);
}

// --- Failure: peers that left, deadlines ----------------------------------------------------------

// Peers that anything waits for and that left (destroyed their mailbox, or exited: looked at every
// kMailboxPidCheckEvery) fail what waits for them; then the deadlines.
void Mailbox::check_peers(std::vector<Completion>& completed, bool look_at_pids) {
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || !waits_on(p)) continue;
    const std::string gone = departed(p, look_at_pids);
    if (!gone.empty()) fail_with_peer(p, gone, completed);
  }
  check_deadlines(completed);
}

// Whether a send to `peer`, a receive from it (or from any rank) or a message from it is pending.
bool Mailbox::waits_on(int peer) {
  if (incoming_[peer]) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_[peer].empty()) return false;
  if (!sends_[peer].empty()) return true;
  return std::any_of(receives_.begin(), receives_.end(),
                     [&](const std::unique_ptr<Operation>& r) { return r->peer == peer || r->peer == kAnySource; });
}

// "rank 1 (pid 42) exited" when the peer left and nothing it sent is left to take, else "".
std::string Mailbox::departed(int peer, bool look_at_pids) const {
  const Ring& ring = outbox(peer, rank_);
  if (ring.written.load(std::memory_order_acquire) != ring.consumed.load(std::memory_order_relaxed)) return "";
  const Header& header = *peers_[peer].header;
  const std::string pid = name(peer) + " (pid " + std::to_string(header.pid) + ")";
  if (header.closed.load(std::memory_order_acquire) != 0) return pid + " destroyed its group";
  if (look_at_pids && peers_[peer].check_pid && exited(read_process(header.pid), header.start_time)) return pid + " exited";
  return "";
}

// Operations waiting longer than the timeout fail, naming the peer; a message cut off in the
// middle breaks its pair.
void Mailbox::check_deadlines(std::vector<Completion>& completed) {
  const auto now = MailClock::now();
  const auto late = [&](const Operation& operation) { return now - operation.last_move > options_.timeout; };
  const std::string within = " within " + std::to_string(options_.timeout.count()) + " ms";
  std::vector<std::pair<int, std::string>> cut_off;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int dst = 0; dst < size_; ++dst) {
      if (sends_[dst].empty() || !late(*sends_[dst].front())) continue;
      const std::string what = who(dst) + " did not take the data of " + describe(*sends_[dst].front()) + within;
      if (sends_[dst].front()->started) {
        cut_off.emplace_back(dst, what);
        continue;
      }
      completed.emplace_back(std::move(sends_[dst].front()), std::make_exception_ptr(PeerError(dst, what)));
      sends_[dst].pop_front();
      if (!sends_[dst].empty()) sends_[dst].front()->last_move = now;
    }
    for (auto it = receives_.begin(); it != receives_.end();) {
      if (!late(**it)) {
        ++it;
        continue;
      }
      const int peer = (*it)->peer;
      const std::string nothing = peer == kAnySource ? "no rank sent a message for " : who(peer) + " sent no message for ";
      auto error = std::make_exception_ptr(PeerError(peer, nothing + describe(**it) + within));
      completed.emplace_back(std::move(*it), error);
      it = receives_.erase(it);
    }
  }
  for (int src = 0; src < size_; ++src) {
    const Incoming* in = incoming_[src].get();
    if (in == nullptr || in->unexpected || !late(*in->target)) continue;
    cut_off.emplace_back(src, who(src) + " did not send the rest of its message (" + std::to_string(in->taken) + " of " +
                                  std::to_string(in->total) + " bytes) for " + describe(*in->target) + within);
  }
  for (const auto& [peer, what] : cut_off) fail_with_peer(peer, what, completed);
}

// The pair with `peer` is unusable from now on: what waits for it fails, and what comes later.
void Mailbox::fail_with_peer(int peer, const std::string& what, std::vector<Completion>& completed) {
  const auto fail = [&](std::unique_ptr<Operation> operation) {
    auto error = std::make_exception_ptr(PeerError(peer, what + "; " + describe(*operation) + " cannot finish"));
    completed.emplace_back(std::move(operation), error);
  };
  std::unique_ptr<Incoming> in = std::move(incoming_[peer]);
  if (in && !in->unexpected) fail(std::move(in->target));
  std::lock_guard<std::mutex> lock(mutex_);
  broken_[peer] = what;
  for (auto& send : sends_[peer]) fail(std::move(send));
  sends_[peer].clear();
  // A receive from any rank fails once no peer is left to send it.
  int left = 0;
  for (int p = 0; p < size_; ++p) left += p != rank_ && broken_[p].empty() ? 1 : 0;
  const bool none_left = left == 0;
  for (auto it = receives_.begin(); it != receives_.end();) {
    if ((*it)->peer == peer || ((*it)->peer == kAnySource && none_left)) {
      fail(std::move(*it));
      it = receives_.erase(it);
    } else {
      ++it;
    }
  }
}

// Stopping: whatever waits fails with `why`.
void Mailbox::fail_everything(const std::string& why, std::vector<Completion>& completed) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto fail = [&](std::unique_ptr<Operation> operation) {
    const int peer = operation->peer;
    auto error = std::make_exception_ptr(PeerError(peer, why + "; " + describe(*operation) + " cannot finish"));
    completed.emplace_back(std::move(operation), error);
  };
  for (int p = 0; p < size_; ++p) {
    if (incoming_[p] && !incoming_[p]->unexpected) fail(std::move(incoming_[p]->target));
    incoming_[p].reset();
    for (auto& send : sends_[p]) fail(std::move(send));
    sends_[p].clear();
  }
  for (auto& receive : receives_) fail(std::move(receive));
  receives_.clear();
}

// "rank 1 (pid 42, stopped)".
std::string Mailbox::who(int peer) const {
  const Peer& p = peers_[peer];
  const ProcessInfo info = p.check_pid ? read_process(p.header->pid) : ProcessInfo{};
  return name(peer) + " (pid " + std::to_string(p.header->pid) + (stopped(info) ? ", stopped)" : ")");
}

// "rank 0's send to rank 1 (tag 7, 4096 bytes)".
std::string Mailbox::describe(const Operation& operation) const {
  const std::string peer = operation.peer == kAnySource ? std::string("any rank") : name(operation.peer);
  const std::string size = std::to_string(operation.bytes) + " bytes";
  if (operation.lane == Lane::kAllToAll) {
    return name(rank_) + "'s all_to_all piece " + (operation.is_send ? "to " : "from ") + peer + " (" + size + ")";
  }
  return name(rank_) + "'s " + (operation.is_send ? "send to " : "receive from ") + peer + " (tag " +
         std::to_string(operation.tag) + ", " + size + ")";
}

std::string Mailbox::name(int peer) const { return "rank " + std::to_string(peer); }

}  // namespace ddp::detail::shm
