#pragma once
// Bucket autotuning (DDPOptions().bucket_cap_mb_auto(true); Horovod autotunes its fusion buffer,
// PyTorch has nothing): tries candidate bucket caps on the live model, one after another, and
// keeps the fastest.
//
//   after the one bucket rebuild, for each candidate cap (only caps that give a different bucket
//   layout): rebuild the buckets with it, let one step pass (warm-up), time the next few steps
//   then the ranks agree: one allreduce (MAX) of every candidate's median step time, so every rank
//   sees the slowest rank's times and picks the same cap; buckets are rebuilt once more with it
//
// The schedule counts iterations, not time, so every rank switches buckets in the same iteration.
// A step's time is from one forward to the next (it includes the optimizer step and data loading,
// which the cap does not change, so the differences are the cap's).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ddp/engine/src/reducer/bucket_assignment.h"

namespace ddp::detail {

class BucketAutotuner {
 public:
  // `candidates`: caps in bytes, already reduced to those giving distinct layouts.
  BucketAutotuner(std::vector<int64_t> candidates, int timed_steps = 4);

  enum class Action { kKeep, kSwitch, kAgree };
  // At the start of each synchronized iteration (before forward), with the time now. kSwitch:
  // rebuild the buckets with next_cap() before this iteration; kAgree: run the agreement
  // (median_times() -> allreduce MAX -> choose()) and rebuild with chosen_cap().
  Action at_iteration_start(int64_t now_ns);
  int64_t next_cap() const { return candidates_[current_]; }
  std::vector<int64_t> median_times() const;  // one per candidate, ns
  void choose(const std::vector<int64_t>& agreed_times);
  bool done() const { return phase_ == Phase::kDone; }
  int64_t chosen_cap() const { return candidates_[chosen_]; }
  const std::vector<int64_t>& candidates() const { return candidates_; }
  const std::vector<int64_t>& agreed_times() const { return agreed_; }

 private:
  enum class Phase { kTrying, kDone };
  std::vector<int64_t> candidates_;
  int timed_steps_;
  Phase phase_ = Phase::kTrying;
  size_t current_ = 0;
  int steps_on_current_ = -1;  // -1: the candidate is not in place yet
  int64_t last_start_ = 0;
  std::vector<std::vector<int64_t>> times_;
  std::vector<int64_t> agreed_;
  size_t chosen_ = 0;
};

// The default candidates, in MiB.
inline const std::vector<double> kAutotuneCandidatesMb = {1, 5, 10, 25, 50, 100};

// The candidates (bytes) worth a try for these parameters in this order: each gives a bucket
// layout none of the smaller ones gives (beyond the model's size, every cap is one bucket).
std::vector<int64_t> distinct_layout_caps(const std::vector<BucketParam>& params, const std::vector<size_t>& order,
                                          int64_t first_bucket_bytes);

// "bucket_cap_mb_auto chose 5 MiB (1 MiB: 812 us, 5 MiB: 790 us)", once chosen.
std::string describe_choice(const BucketAutotuner& tuner);

}  // namespace ddp::detail
