#include "autotune.h"

#include <algorithm>

namespace ddp::detail {

BucketAutotuner::BucketAutotuner(std::vector<int64_t> candidates, int timed_steps)
    : candidates_(std::move(candidates)), timed_steps_(timed_steps), times_(candidates_.size()) {}

BucketAutotuner::Action BucketAutotuner::at_iteration_start(int64_t now_ns) {
  if (phase_ == Phase::kDone) return Action::kKeep;
  if (steps_on_current_ < 0) {  // put the first candidate in place
    steps_on_current_ = 0;
    last_start_ = now_ns;
    return Action::kSwitch;
  }
  // The step that just ended ran with the current candidate; the first one is its warm-up.
  if (steps_on_current_ > 0) times_[current_].push_back(now_ns - last_start_);
  last_start_ = now_ns;
  if (++steps_on_current_ <= timed_steps_) return Action::kKeep;
  if (current_ + 1 < candidates_.size()) {
    ++current_;
    steps_on_current_ = 0;
    return Action::kSwitch;
  }
  return Action::kAgree;
}

std::vector<int64_t> BucketAutotuner::median_times() const {
  std::vector<int64_t> medians;
  for (auto times : times_) {
    std::sort(times.begin(), times.end());
    medians.push_back(times.empty() ? 0 : times[times.size() / 2]);
  }
  return medians;
}

void BucketAutotuner::choose(const std::vector<int64_t>& agreed_times) {
  agreed_ = agreed_times;
  chosen_ = static_cast<size_t>(std::min_element(agreed_.begin(), agreed_.end()) - agreed_.begin());
  phase_ = Phase::kDone;
}

}  // namespace ddp::detail
