#include "ddp/engine/src/observe/iteration_recorder.h"

#include <algorithm>
#include <string>

namespace ddp::detail {

IterationRecorder::IterationRecorder() : reduced_(std::make_shared<Marks>()) {}

void IterationRecorder::set_buckets(std::vector<int64_t> bucket_bytes) {
  bucket_bytes_ = std::move(bucket_bytes);
  fill_begin_.assign(bucket_bytes_.size(), 0);
  launched_.assign(bucket_bytes_.size(), 0);
  // A new array, not a resized one: a late callback may still hold the old one.
  std::atomic_store(&reduced_, std::make_shared<Marks>(bucket_bytes_.size()));
  recording_.store(false, std::memory_order_relaxed);  // an iteration in flight while buckets change is not booked
}

void IterationRecorder::begin(int64_t iteration) {
  iteration_ = iteration;
  const bool record = timeline_ != nullptr || iteration < 10 || iteration % 100 == 0;
  recording_.store(record, std::memory_order_relaxed);
  if (!record) return;
  forward_begin_ = now_ns();
  forward_end_ = all_ready_ = wait_begin_ = 0;
  std::fill(fill_begin_.begin(), fill_begin_.end(), 0);
  std::fill(launched_.begin(), launched_.end(), 0);
  for (auto& mark : *reduced_) mark.store(0, std::memory_order_relaxed);
}

void IterationRecorder::forward_done() {
  if (recording()) forward_end_ = now_ns();
}

void IterationRecorder::gradient_into(size_t bucket) {
  if (recording() && fill_begin_[bucket] == 0) fill_begin_[bucket] = now_ns();
}

void IterationRecorder::launched(size_t bucket) {
  if (recording()) launched_[bucket] = now_ns();
}

void IterationRecorder::reduced(size_t bucket) {
  if (!recording_.load(std::memory_order_relaxed)) return;
  const std::shared_ptr<Marks> marks = std::atomic_load(&reduced_);
  if (bucket < marks->size()) (*marks)[bucket].store(now_ns(), std::memory_order_release);
}

void IterationRecorder::all_ready() {
  if (recording()) all_ready_ = now_ns();
}

void IterationRecorder::wait_begin() {
  if (recording()) wait_begin_ = now_ns();
}

void IterationRecorder::end() {
  if (!recording() || forward_end_ == 0) return;  // e.g. the forward ran before the hook was set up
  recording_.store(false, std::memory_order_relaxed);
  const int64_t done = now_ns();
  int64_t first_launch = done, last_reduced = 0;
  std::vector<int64_t> reduced(bucket_bytes_.size());
  for (size_t b = 0; b < reduced.size(); ++b) {
    // A reduction whose completion callback has not run yet finished before the wait returned.
    const int64_t at = (*reduced_)[b].load(std::memory_order_acquire);
    reduced[b] = at == 0 || at > done ? done : at;
    if (launched_[b] != 0) first_launch = std::min(first_launch, launched_[b]);
    last_reduced = std::max(last_reduced, reduced[b]);
  }
  const int64_t ready = all_ready_ != 0 ? all_ready_ : wait_begin_;
  sums_.forward += forward_end_ - forward_begin_;
  sums_.backward_compute += ready - forward_end_;
  sums_.backward_comm += last_reduced > first_launch ? last_reduced - first_launch : 0;
  sums_.overlap += ready > first_launch ? ready - first_launch : 0;
  ++sums_.samples;
  if (timeline_ == nullptr) return;
  const std::string iteration = "\"iteration\": " + std::to_string(iteration_);
  timeline_->span(Timeline::kTraining, "forward", forward_begin_, forward_end_, iteration);
  timeline_->span(Timeline::kTraining, "backward", forward_end_, done, iteration);
  if (wait_begin_ != 0) timeline_->span(Timeline::kTraining, "wait for reductions", wait_begin_, done, iteration);
  for (size_t b = 0; b < bucket_bytes_.size(); ++b) {
    if (launched_[b] == 0) continue;
    const std::string args = iteration + ", \"bucket\": " + std::to_string(b) + ", \"bytes\": " +
                             std::to_string(bucket_bytes_[b]);
    const std::string name = "bucket " + std::to_string(b);
    if (fill_begin_[b] != 0) timeline_->span(Timeline::kBucketFill, name.c_str(), fill_begin_[b], launched_[b], args);
    timeline_->span(Timeline::kCommunication, ("reduce " + name).c_str(), launched_[b], reduced[b], args);
  }
  timeline_->flush();
}

RuntimeAverages IterationRecorder::averages() const {
  RuntimeAverages out;
  if (sums_.samples == 0) return out;
  out.samples = sums_.samples;
  out.forward = sums_.forward / sums_.samples;
  out.backward_compute = sums_.backward_compute / sums_.samples;
  out.backward_comm = sums_.backward_comm / sums_.samples;
  out.overlap = sums_.overlap / sums_.samples;
  return out;
}

}  // namespace ddp::detail
