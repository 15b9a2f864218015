// IterationRecorder's one cross-thread call, reduced(), against the training thread's calls. c10d
// runs a future's callbacks after it wakes the waiter, so a reduction's callback of one iteration
// can still run while the next begins and while the buckets are rebuilt. Under ThreadSanitizer
// (scripts/sanitize.sh thread) this test reported a data race on the recorder as it was (a plain
// bool read by the callback, and an array reallocated under it); a plain build runs it too.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "ddp/engine/src/observe/iteration_recorder.h"

namespace ddp::detail {
namespace {

TEST(IterationRecorder, LateReductionCallbacksRaceWithNothing) {
  IterationRecorder recorder;
  recorder.set_buckets({64, 64, 64});
  std::atomic<bool> stop{false};
  // The backend's completion thread: marks buckets reduced whenever it likes, as late callbacks do.
  std::thread callbacks([&] {
    for (size_t b = 0; !stop.load(); b = (b + 1) % 5) recorder.reduced(b);
  });
  // The training thread: iterations, and a bucket rebuild with another count every few of them.
  for (int64_t i = 0; i < 2000; ++i) {
    if (i % 50 == 49) recorder.set_buckets(std::vector<int64_t>(1 + i % 4, 128));
    recorder.begin(i % 10);  // iterations below 10 are all recorded
    recorder.forward_done();
    recorder.launched(0);
    recorder.all_ready();
    recorder.wait_begin();
    recorder.end();
  }
  stop = true;
  callbacks.join();
  EXPECT_GT(recorder.averages().samples, 0);
}

}  // namespace
}  // namespace ddp::detail
