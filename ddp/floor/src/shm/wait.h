#pragma once
// Waiting for another process's progress. Each rank owns one Progress in its shared segment and
// counts up every time it finishes a step; peers wait for the count to reach a step number.
//
// A wait spins for a few microseconds (a peer on another core is usually that close), then
// sleeps on a futex on the counter word - shared between processes, so not FUTEX_PRIVATE - for
// at most the time the caller allows, so the caller can look at its deadline and at its peers'
// health between sleeps. Nothing spins without bound: with 8 ranks on 2 cores, the rank we wait
// for needs our core.
//
// Counters wrap at 2^32; two counts are compared by their signed difference, valid while they
// are less than 2^31 steps apart (ranks are at most a few steps apart).
//
// Thread-safety: post() only from the owning process (one thread); wait_for() and wake_all()
// from any thread of any process.
#include <atomic>
#include <chrono>
#include <cstdint>

namespace ddp::detail::shm {

// Lives in shared memory, zero-initialized. The futex syscalls address `count` as a plain
// 32-bit word, which std::atomic<uint32_t> is on every platform we build on:
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) && std::atomic<std::uint32_t>::is_always_lock_free,
              "a futex word must be a lock-free 32-bit atomic");

struct Progress {
  std::atomic<std::uint32_t> count{0};    // steps the owner finished; written by the owner only
  std::atomic<std::uint32_t> sleepers{0};  // processes asleep on `count` (or about to be)
};

// `count` has reached `target`: count - target, as a signed 32-bit number, is not negative.
inline bool reached(std::uint32_t count, std::uint32_t target) {
  return static_cast<std::int32_t>(count - target) >= 0;
}

// Finishes a step: every write this process made before is visible to a peer whose wait sees
// the new count (release). Wakes the sleepers if there are any (a futex syscall only then).
// Returns the new count.
std::uint32_t post(Progress& progress);

// Waits until `progress.count` reaches `target`: spins up to `spin`, then sleeps on the futex
// once, for at most `max_sleep` (a post, wake_all(), a signal or a spurious wake end it early).
// Returns whether the target was reached; the caller loops, checking what it must in between.
// Seeing the target makes the poster's earlier writes visible here (acquire).
bool wait_for(Progress& progress, std::uint32_t target, std::chrono::nanoseconds spin, std::chrono::nanoseconds max_sleep);

// Wakes everyone asleep on `progress` without counting a step (a failing rank does this to every
// counter of the group, so each waiter looks at the failure flags at once).
void wake_all(Progress& progress);

}  // namespace ddp::detail::shm
