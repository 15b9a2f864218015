// Spin, then futex-sleep, on a progress counter in shared memory (wait.h).
#include "ddp/floor/src/shm/wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ddp::detail::shm {
namespace {

using Clock = std::chrono::steady_clock;

// Tells the core we are spinning (frees the sibling hyperthread, saves power).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

std::uint32_t* word(Progress& progress) {
  // The futex syscall wants the address of the 32-bit value itself (static_assert in wait.h).
  return reinterpret_cast<std::uint32_t*>(&progress.count);
}

// Shared (not FUTEX_PRIVATE_FLAG): the kernel keys the futex on the mapped object and offset, so
// processes that mapped the segment at different addresses meet on the same word.
long futex(std::uint32_t* address, int operation, std::uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, address, operation, value, timeout, nullptr, 0);
}

}  // namespace

std::uint32_t post(Progress& progress) {
  // seq_cst (a locked add on x86, a full barrier elsewhere): the increment must be ordered before
  // the load of `sleepers` below. A waiter raises `sleepers` before it checks the count for the
  // last time, so either it sees our increment or we see it and wake it - never neither.
  const std::uint32_t count = progress.count.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (progress.sleepers.load(std::memory_order_seq_cst) != 0) futex(word(progress), FUTEX_WAKE, INT_MAX, nullptr);
  return count;
}

void wake_all(Progress& progress) { futex(word(progress), FUTEX_WAKE, INT_MAX, nullptr); }

bool wait_for(Progress& progress, std::uint32_t target, std::chrono::nanoseconds spin, std::chrono::nanoseconds max_sleep) {
  // 1. Spin: a peer on another core usually posts within microseconds. Every 64 polls, look at the
  //    clock (the bound holds however long a pause takes) and yield the core: the scheduler likes
  //    to put a process that wakes another on the waker's core, and oversubscribed, the rank we
  //    wait for may be queued behind us. Yielding to nobody costs a fraction of a microsecond.
  if (reached(progress.count.load(std::memory_order_acquire), target)) return true;
  if (spin.count() > 0) {
    const auto spin_until = Clock::now() + spin;
    for (unsigned polls = 1;; ++polls) {
      if (reached(progress.count.load(std::memory_order_acquire), target)) return true;
      if (polls % 64 == 0) {
        if (Clock::now() >= spin_until) break;
        ::sched_yield();
      } else {
        cpu_relax();
      }
    }
  }
  if (max_sleep.count() <= 0) return reached(progress.count.load(std::memory_order_acquire), target);

  // 2. Sleep: announce ourselves, then look one last time (seq_cst, pairs with post()), then
  //    sleep only if the count is still what we saw - the kernel checks that atomically, so a post
  //    between our look and the sleep returns at once (EAGAIN) instead of being missed.
  progress.sleepers.fetch_add(1, std::memory_order_seq_cst);
  const std::uint32_t seen = progress.count.load(std::memory_order_seq_cst);
  if (!reached(seen, target)) {
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(max_sleep);
    const timespec timeout{static_cast<time_t>(seconds.count()), static_cast<long>((max_sleep - seconds).count())};
    futex(word(progress), FUTEX_WAIT, seen, &timeout);  // returns 0, or ETIMEDOUT / EAGAIN / EINTR: all mean "look again"
  }
  progress.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return reached(progress.count.load(std::memory_order_acquire), target);
}

}  // namespace ddp::detail::shm
