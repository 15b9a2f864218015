// keep_freed_memory_for_reuse() on its own, in forked children (its setting is for the whole
// process): a step's worth of blocks freed and allocated again faults its pages in afresh with
// glibc's initial thresholds, and does not once the library has asked glibc to keep them.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <gtest/gtest.h>

#include "ddp/floor/src/heap_reuse.h"

namespace {

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// A "step": 64 blocks of 256 KiB (16 MiB) allocated, written, all freed. Returns the page faults
// of steps 2 to 5 (the first maps the memory in any case).
long faults_of_later_steps() {
  long before = 0;
  for (int step = 0; step < 5; ++step) {
    if (step == 1) before = minor_faults();
    std::vector<char*> blocks;
    for (int b = 0; b < 64; ++b) {
      blocks.push_back(static_cast<char*>(std::malloc(256 << 10)));
      std::memset(blocks.back(), step + 1, 256 << 10);
    }
    for (char* block : blocks) std::free(block);
  }
  return minor_faults() - before;
}

// Runs `child` in a forked process; returns its exit code (child's return value, 0-255).
int in_child(const std::function<int()>& child) {
  const pid_t pid = fork();
  if (pid == 0) _exit(child());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 255;
}

#if defined(__GLIBC__)
TEST(HeapReuse, FreedBlocksAreReusedWithoutFaultingAgain) {
  // glibc's initial thresholds (128 KiB each; this test process may have changed them): every
  // 256 KiB block is mapped and unmapped again, 64 pages faulted each time.
  const int untuned = in_child([] {
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    mallopt(M_TRIM_THRESHOLD, 128 << 10);
    return faults_of_later_steps() > 4 * 64 * 64 / 2 ? 0 : 1;
  });
  EXPECT_EQ(untuned, 0) << "the untuned steps did not fault: the test shows nothing here";
  const int tuned = in_child([] {
    unsetenv("TORCHDDP_MALLOC_TUNING");
    unsetenv("GLIBC_TUNABLES");
    unsetenv("MALLOC_MMAP_THRESHOLD_");
    unsetenv("MALLOC_TRIM_THRESHOLD_");
    if (!ddp::detail::keep_freed_memory_for_reuse()) return 2;
    return faults_of_later_steps() < 64 ? 0 : 1;
  });
  EXPECT_EQ(tuned, 0) << (tuned == 2 ? "glibc was not asked" : "the steps after the first still fault");
}

TEST(HeapReuse, TheUsersOwnSettingWins) {
  for (const char* variable : {"TORCHDDP_MALLOC_TUNING=0", "GLIBC_TUNABLES=glibc.malloc.arena_max=2",
                               "MALLOC_TRIM_THRESHOLD_=1000000"}) {
    const int asked = in_child([variable] {
      putenv(const_cast<char*>(variable));
      return ddp::detail::keep_freed_memory_for_reuse() ? 1 : 0;
    });
    EXPECT_EQ(asked, 0) << "glibc was asked despite " << variable;
  }
}
#endif

}  // namespace
