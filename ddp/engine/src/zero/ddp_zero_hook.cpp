// hook_with_zero_step and hook_with_zero_step_interleaved (ddp/ddp_zero_hook.h): the comm hook that
// runs ZeroRedundancyOptimizer's step bucket by bucket inside DDP's backward.
#include <ddp/ddp_zero_hook.h>
#include <ddp/logging.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/engine/src/observe/timeline.h"
#include "ddp/engine/src/reducer/hook_runner.h"
#include "ddp/engine/src/zero/overlap.h"

namespace ddp::detail {

namespace {

constexpr char kHookWho[] = "hook_with_zero_step";

struct ZeroHookState {
  CommHook inner;
  const DDPCore* ddp;
  std::shared_ptr<ZeroOverlap> overlap;
  bool interleaved;
  std::chrono::milliseconds timeout;  // for the wrapped hook's futures
  std::vector<FuturePtr> averaged;    // hook_with_zero_step: this pass's futures, by bucket
};

// Bucket b's average, once the wrapped hook's future is done (on the hook thread, so this rank's
// next collective is the broadcast); the owner steps with it; every rank joins the broadcast.
void step_and_broadcast(ZeroHookState& s, size_t b, const FuturePtr& future) {
  wait_for_future(future, s.timeout);
  if (future->hasError()) std::rethrow_exception(future->exception_ptr());
  {
    // A TORCHDDP_TIMELINE row: the hook thread's share. Its name built only for a timeline: this
    // runs for every bucket of every step.
    std::optional<TimelineSpan> span;
    if (Timeline::get() != nullptr) span.emplace("ZeRO step, bucket " + std::to_string(b));
    s.overlap->step(b, future_tensor(*future));  // this rank's piece(s) of it, if any
  }
  s.overlap->broadcast(b);
}

FuturePtr run(ZeroHookState& s, GradBucket& bucket) {
  // 1. The wrapped hook averages the bucket (starts its collectives).
  FuturePtr future = s.inner(bucket);
  // Warm-up (PyTorch's rule): until DDP has rebuilt its buckets, no bucket has an owner yet.
  if (!s.ddp->buckets_rebuilt()) return future;
  ZeroOverlap& overlap = *s.overlap;
  const size_t b = bucket.index();
  if (b == 0) overlap.begin_pass();
  // The first pass after the rebuild: bucket b -> rank b % W (shard_buckets: recorded, not stepped).
  if (!overlap.assign(bucket)) return future;
  if (s.interleaved) {
    // 2-3. Right away, while backward computes the next buckets.
    step_and_broadcast(s, b, future);
  } else {
    // 2-3. At the last bucket, every bucket in order (the earlier futures are done: DDP's hook
    // thread waited for each before it called the next hook), once the last bucket is averaged
    // too: a step run while its allreduce is in flight takes the CPU that allreduce needs on a
    // machine whose ranks fill every core, and delays it on every rank (resnet_b32, 2 ranks on
    // 2 cores: the last allreduce took 2-3 ms instead of 0.3).
    if (b == 0) s.averaged.clear();
    s.averaged.push_back(future);
    if (!bucket.is_last()) return future;
    wait_for_future(future, s.timeout);
    for (size_t i = 0; i < s.averaged.size(); ++i) step_and_broadcast(s, i, s.averaged[i]);
    s.averaged.clear();
  }
  // 4. Backward ends with every rank's parameters updated.
  if (bucket.is_last()) {
    TimelineSpan span("ZeRO broadcasts");
    overlap.finish_pass();
  }
  return future;
}

}  // namespace

CommHook zero_step_hook(CommHook hook, const DDPCore& ddp, ZeroRedundancyOptimizerBase& zero, bool interleaved,
                        bool shard_buckets) {
  const std::string name = std::string(interleaved ? "hook_with_zero_step_interleaved" : "hook_with_zero_step") +
                           "(" + hook.name() + (shard_buckets ? ", shard_buckets" : "") + ")";
  if (!zero.options().overlap_with_ddp()) {
    raise<std::invalid_argument>(kHookWho,
                                 "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to "
                                 "use this hook properly: construct it with "
                                 "ZeroRedundancyOptimizerOptions().overlap_with_ddp(true), or register no such "
                                 "hook and call step() after backward()");
  }
  const ProcessGroupPtr& group = ddp.process_group();
  if (group->getSize() != zero.world_size() || group->getRank() != zero.rank()) {
    raise<std::invalid_argument>(kHookWho, "the optimizer's group (rank " + std::to_string(zero.rank()) + " of " +
                                               std::to_string(zero.world_size()) + ") is not the model's (rank " +
                                               std::to_string(group->getRank()) + " of " +
                                               std::to_string(group->getSize()) + "): give both the same group");
  }
  if (ddp.options().bucket_cap_mb_auto()) {
    raise<std::invalid_argument>(kHookWho,
                                 "bucket_cap_mb_auto changes DDP's buckets after their rebuild, and each "
                                 "bucket's parameters belong to one rank: use a fixed bucket_cap_mb");
  }
  auto overlap = zero.overlap_half();  // present: overlap_with_ddp was checked above
  overlap->attach_hook(name, shard_buckets);
  auto state = std::make_shared<ZeroHookState>(
      ZeroHookState{hook, &ddp, std::move(overlap), interleaved, timeout_of(group), {}});
  return CommHook([state](GradBucket& bucket) { return run(*state, bucket); }, name, hook.state(), hook.settings());
}

}  // namespace ddp::detail
