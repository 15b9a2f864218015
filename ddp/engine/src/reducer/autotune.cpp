#include "ddp/engine/src/reducer/autotune.h"

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

std::vector<int64_t> distinct_layout_caps(const std::vector<BucketParam>& params, const std::vector<size_t>& order,
                                          int64_t first_bucket_bytes) {
  std::vector<int64_t> caps;
  std::vector<std::vector<std::vector<size_t>>> layouts;
  for (double mb : kAutotuneCandidatesMb) {
    const auto cap = static_cast<int64_t>(mb * 1024 * 1024);
    auto layout = assign_buckets(params, order, first_bucket_bytes, cap);
    if (std::find(layouts.begin(), layouts.end(), layout) != layouts.end()) continue;
    layouts.push_back(std::move(layout));
    caps.push_back(cap);
  }
  return caps;
}

std::string describe_choice(const BucketAutotuner& tuner) {
  std::string tried;
  for (size_t c = 0; c < tuner.candidates().size(); ++c) {
    tried += (c ? ", " : "") + std::to_string(tuner.candidates()[c] >> 20) + " MiB: " +
             std::to_string(tuner.agreed_times()[c] / 1000) + " us";
  }
  return "bucket_cap_mb_auto chose " + std::to_string(tuner.chosen_cap() >> 20) + " MiB (" + tried + ")";
}

}  // namespace ddp::detail
