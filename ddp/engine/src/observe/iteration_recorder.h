#pragma once
// Timestamps of DDP iterations: averaged for logging_data() on sampled iterations (the first 10,
// then every 100th, as PyTorch samples), and written to the TORCHDDP_TIMELINE trace on every
// iteration when there is one. Not recording costs one branch per event.
//
//   begin(i)            before forward of synchronized iteration i: record this one?
//   forward_done()      forward returned; backward's compute starts
//   gradient_into(b)    a gradient was copied into bucket b (its first starts the bucket's fill)
//   launched(b)         bucket b's reduction started
//   reduced(b)          bucket b's reduction finished (on whichever thread finished it)
//   all_ready()         the last gradient arrived: backward's compute is over
//   wait_begin(), end() the end of backward waits for the reductions; end() books the iteration
//
// Threads: every call but reduced() comes from the training thread (the reducer's). reduced() runs
// on the backend's completion thread or DDP's hook thread, possibly late: c10d wakes the waiter of
// a future before it runs the future's callbacks, so a callback of iteration i may still run while
// the training thread begins iteration i+1 or rebuilds the buckets. It therefore reads only atomics
// and the marks array it loads atomically, which set_buckets() replaces instead of reallocating.
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "ddp/engine/src/observe/timeline.h"

namespace ddp::detail {

struct RuntimeAverages {  // nanoseconds
  int64_t forward = 0, backward_compute = 0, backward_comm = 0, overlap = 0, samples = 0;
};

class IterationRecorder {
 public:
  IterationRecorder();
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }
  // After every bucket (re)build.
  void set_buckets(std::vector<int64_t> bucket_bytes);

  void begin(int64_t iteration);
  void skip() { recording_.store(false, std::memory_order_relaxed); }  // ddp::Join's shadowing: not booked
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  void forward_done();
  void gradient_into(size_t bucket);
  void launched(size_t bucket);
  void reduced(size_t bucket);  // thread-safe
  void all_ready();
  void wait_begin();
  void end();

  RuntimeAverages averages() const;

 private:
  Timeline* timeline_ = nullptr;
  std::vector<int64_t> bucket_bytes_;
  std::atomic<bool> recording_{false};
  int64_t iteration_ = 0;
  int64_t forward_begin_ = 0, forward_end_ = 0, all_ready_ = 0, wait_begin_ = 0;
  std::vector<int64_t> fill_begin_, launched_;
  // When each bucket's reduction finished, shared with late callbacks (std::atomic_load/store).
  using Marks = std::vector<std::atomic<int64_t>>;
  std::shared_ptr<Marks> reduced_;
  // Sums over the sampled iterations.
  RuntimeAverages sums_;
};

}  // namespace ddp::detail
