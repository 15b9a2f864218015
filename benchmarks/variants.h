#pragma once
// The variants ddp_bench times: the same training step (zero_grad, forward, cross-entropy
// backward, SGD step) with different ways of synchronizing gradients. README.md describes each.
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ddp/ddp.h>

#include "models.h"

namespace bench {

enum class Kind {
  local,       // no communication: the lower bound
  naive,       // after backward, one blocking c10d allreduce per gradient (what C++ users hand-roll)
  naive_flat,  // after backward, cat all gradients, one c10d allreduce, copy back
  naive_check, // naive as ddp_bench once measured it: each allreduce after a fingerprint
               // allgather (ddp::all_reduce checked every call then); kept to show the difference
  reducer,     // PyTorch's c10d::Reducer, driven like torch/nn/parallel/distributed.py 1.13
  ours,        // ddp::DistributedDataParallel
  ours_gloo,   // ours over Gloo alone (shared memory off): what the shared-memory channel saves
  ours_view,   // ours with gradient_as_bucket_view(true)
  // The costs of features, each against ours at the same cap:
  ours_join,    // ours inside ddp::Join, every rank with the same number of batches
  ours_detail,  // ours under TORCH_DISTRIBUTED_DEBUG=DETAIL (every collective checked first)
  ours_auto,    // ours with bucket_cap_mb_auto(true), no fixed cap
  ours_optimizer,  // no model wrapper: ddp::DistributedOptimizer over SGD (Horovod's path)
  // Communication hooks (ddp/comm_hooks.h), each against the reducer at the same cap:
  ours_fp16,       // ours+fp16: ddp::hooks::fp16_compress()
  ours_bf16,       // ours+bf16: ddp::hooks::bf16_compress()
  ours_powersgd1,  // ours+powersgd1: ddp::hooks::powersgd, rank 1, from the third step
  ours_powersgd4,  // ours+powersgd4: rank 4
  reducer_fp16,    // reducer+fp16: c10d's built-in FP16_COMPRESS hook, the fair peer of ours+fp16
  ours_syncbn,  // ours on the model with ddp::SyncBatchNorm for every BatchNorm (models with BatchNorm)
  // The optimizer: ours with Adam instead of SGD, with Adam sharded by
  // ddp::ZeroRedundancyOptimizer (bucket views on), and sharded and stepped inside DDP's backward
  // (overlap_with_ddp, ddp::hooks::hook_with_zero_step_interleaved); their ratios are ZeRO's cost
  // per step, their memory rows the optimizer state each rank holds.
  ours_adam,               // ours+adam
  ours_zero_adam,          // ours+zero_adam
  ours_zero_adam_overlap,  // ours+zero_adam_overlap
  // Fully sharded data parallel (ddp::fully_shard on every block and the root) with Adam: against
  // ours+adam, its step time and its memory (parameters, gradients and Adam's state all 1/W).
  // Set for a model that outgrows a rank: forward_prefetch(false), BackwardPrefetch::kNone, at
  // most one block unsharded at once (fully_shard's memory bound: 16/W bytes per parameter plus
  // one block's parameters and gradients).
  fsdp_adam,
  // fully_shard's defaults (FSDP2's prefetching): the next block's gather and the previous one's
  // reduction overlap compute, holding up to about four blocks at once.
  fsdp_adam_prefetch,  // fsdp_adam+prefetch
};

struct VariantSpec {
  Kind kind = Kind::local;
  double bucket_cap_mb = -1;  // reducer/ours only; 0 means one bucket per parameter
  bool has_buckets() const { return bucket_cap_mb >= 0; }
  std::string kind_name() const;
  std::string id() const;  // e.g. "ours@25", "local"
};

// Every kind once, and reducer and ours at each bucket size; ours_view at `view_caps`; with
// `features`, ours_join and ours_detail at the first view cap, ours_auto, ours_optimizer, ours+adam,
// ours+zero_adam and ours+zero_adam_overlap at the hook cap, and for a model
// with BatchNorm (`batchnorm`) ours_syncbn at the first view cap; with `hooks`, the hook variants
// at 25 MiB (or the largest cap without 25).
std::vector<VariantSpec> all_variants(const std::vector<double>& caps, const std::vector<double>& view_caps,
                                      bool features, bool hooks, bool batchnorm = false);
// The cap the hook variants run at.
double hook_cap(const std::vector<double>& caps);
VariantSpec parse_variant(const std::string& id);

struct Variant {
  VariantSpec spec;
  std::function<void()> step;
  std::function<int64_t()> collectives;  // gradient collectives per step (after any rebuild)
  // Runs a block of steps (a round's timed steps, the warm-up); ours_join runs it inside
  // ddp::Join, whose one-off end (a check and a broadcast of the parameters) is outside the
  // steps' times, as it is once per epoch in training.
  std::function<void(const std::function<void()>&)> run_block = [](const std::function<void()>& block) { block(); };
  // ours_auto: true once the autotuner has chosen (the bench warms up until then).
  std::function<bool()> settled = [] { return true; };
  // What the report prints beside the variant, e.g. ours_auto's chosen cap.
  std::function<std::string()> note = [] { return std::string(); };
  // The bytes of optimizer state this rank holds (ddp::optimizer_state_bytes), for the memory pass.
  std::function<int64_t()> optimizer_state_bytes = [] { return int64_t{0}; };
  // Bytes the library accounts for (fsdp_adam: its memory_stats), by name, for the memory pass.
  std::function<std::vector<std::pair<std::string, int64_t>>()> library_bytes = [] {
    return std::vector<std::pair<std::string, int64_t>>{};
  };
};

// ours_syncbn trains the SyncBatchNorm model (make_model's sync_batchnorm).
bool uses_sync_batchnorm(const VariantSpec& spec);
// The Adam variants: the memory pass reports their optimizer state at every world size.
bool holds_adam_state(const VariantSpec& spec);

// The groups a rank's variants synchronize over: ours* over the default group (shared memory when
// the ranks share this host), the peers - naive*, reducer*, ours_gloo - over Gloo alone, as
// PyTorch's CPU DDP and hand-rolled code run.
struct Groups {
  ddp::ProcessGroupPtr ours;
  ddp::ProcessGroupPtr gloo;
};

// The step works on `model` (which it takes over) and `batch`.
Variant make_variant(const VariantSpec& spec, std::shared_ptr<BenchNet> model, const Batch& batch,
                     const Groups& groups);

}  // namespace bench
