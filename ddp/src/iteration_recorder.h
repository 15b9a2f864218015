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
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "timeline.h"

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
  void skip() { recording_ = false; }  // this pass is not one to book (ddp::Join's shadowing)
  bool recording() const { return recording_; }
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
  bool recording_ = false;
  int64_t iteration_ = 0;
  int64_t forward_begin_ = 0, forward_end_ = 0, all_ready_ = 0, wait_begin_ = 0;
  std::vector<int64_t> fill_begin_, launched_;
  std::unique_ptr<std::atomic<int64_t>[]> reduced_;
  // Sums over the sampled iterations.
  RuntimeAverages sums_;
};

}  // namespace ddp::detail
