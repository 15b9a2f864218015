#pragma once
// The reducer: averages gradients across ranks while backward is still running.
//
//   prepare_for_backward()   forward ran; expect one gradient per parameter
//   on_gradient_ready(i)     autograd hook: hand grad i to its bucket (GradientBuffer::take)
//     -> launch_ready_buckets()  every bucket whose members are all ready, in bucket order:
//                                GradientBuffer::start_average, or the comm hook on its thread
//   finalize()               end of backward: wait for the averages, write them back into .grad
//
// Where a bucket lives and how it is averaged is the floor's choice, made once per bucket when the
// buckets are built (gradient_buffers.h): copied into private memory and allreduced (Gloo, NCCL),
// reduced where each gradient lies (shared memory), or the bucket itself in memory every rank
// maps (shared memory, every rank building at once). The reducer only asks a buffer whether its
// reduction writes every rank's slots (shared()), which decides whether a slot may become the
// gradient itself (adopts_slots). With a communication hook the buffers copy raw gradients in,
// "launch" hands the bucket to the hook thread (hook_runner.h), and hooks::allreduce() averages
// the bucket through its buffer as it would have been without the hook.
//
// Threads. The training thread calls everything public but on_gradient_ready (forward, the
// optimizer's side, stats); autograd's threads call on_gradient_ready -> mark_ready ->
// launch_ready_buckets, and finalize() from the engine's final callback; the hook thread runs the
// hooks and touches only the GradBuckets it was handed. Every member below the mutex is guarded
// by it, except rebuilt_ (atomic, read by hooks during backward) and what set-up fixes before the
// first forward (params_, names_, group_, options_ but bucket_bytes, check_collectives_).
//
// Bucket assignment (which parameters share a bucket) is a separate pure function
// (bucket_assignment.h); this class owns the per-iteration state machine and the buckets.
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include "ddp/internal/compat/versions.h"
#include "ddp/engine/src/reducer/bucket.h"
#include <ddp/comm_hooks.h>
#include <ddp/ddp_core.h>  // ReductionStats
#include <ddp/process_group.h>
#include "ddp/engine/src/reducer/autotune.h"
#include "ddp/floor/src/desync.h"
#include "ddp/engine/src/reducer/hook_runner.h"
#include "ddp/engine/src/observe/iteration_recorder.h"

namespace ddp::detail {

// What announces each backward pass to the reducer.
enum class PassTrigger {
  kForward,        // DistributedDataParallel: prepare_for_backward() after each forward
  kFirstGradient,  // DistributedOptimizer (no model wrapper): the pass's first gradient; every
                   // passes_per_step-th pass is reduced, the others accumulate locally
};

// DDPOptions, in the units the reducer works in (DDPCore fills every field).
struct ReducerOptions {
  int64_t first_bucket_bytes;
  int64_t bucket_bytes;
  bool find_unused_parameters;
  bool gradient_as_bucket_view;
  bool static_graph;
  bool bucket_cap_auto;
  PassTrigger trigger = PassTrigger::kForward;
  int passes_per_step = 1;  // kFirstGradient: backward passes between two optimizer steps
  // The API the user called, which begins every error message: "DistributedDataParallel" or
  // "ddp::DistributedOptimizer".
  std::string owner = "DistributedDataParallel";
};

struct ReducerStats {
  int64_t collectives_launched = 0;          // gradient allreduces, all iterations
  int64_t iterations_reduced = 0;            // synced backward passes that completed
  bool buckets_rebuilt = false;
  std::vector<std::vector<size_t>> buckets;  // parameter indices of each bucket, launch order
  std::vector<int64_t> first_bucket_bytes;   // as first built
  std::vector<int64_t> rebuilt_bucket_bytes; // after the one rebuild (empty before)
  int64_t unused_parameter_bytes = 0;        // no rank produced a gradient, last iteration
  int64_t bucket_bytes = 0;                  // the cap in effect
  std::vector<int64_t> autotune_candidates;  // caps tried (bytes), once autotuning finished
  std::vector<int64_t> autotune_times;       // their agreed median step times (ns)
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  static std::shared_ptr<Reducer> create(std::vector<at::Tensor> params, std::vector<std::string> names,
                                         ProcessGroupPtr group, ReducerOptions options);
  // Removes the reducer's hooks from the gradient accumulators: a module wrapped again (or used
  // bare) after its wrapper is gone carries no dead hooks.
  ~Reducer();

  // Before each forward: reports what went wrong in the previous iteration, rebuilds buckets once.
  // (PassTrigger::kFirstGradient: after each optimizer step.)
  void prepare_for_forward();
  // PassTrigger::kFirstGradient, before each optimizer step: throws unless the backward passes
  // since the last step were a whole number of passes_per_step (the last one reduced) and
  // finished; then counts passes afresh.
  void check_passes_before_step();
  // After a forward with grad mode on. `sync` false (no_sync): gradients accumulate locally.
  // `outputs` are searched for unused parameters when find_unused_parameters is on.
  void prepare_for_backward(bool sync, const std::vector<at::Tensor>& outputs);
  // Whether prepare_for_backward needs the forward's outputs.
  bool wants_outputs() const;
  // Re-allocates bucket storage and re-hooks replaced gradient accumulators after the
  // parameters moved (module.to(device/dtype)).
  void reallocate_buckets();
  // The number gradients are averaged over from the next backward on (the world size unless
  // ddp::Join says otherwise). Ignored with a hook: hooks average as they please.
  void set_divisor(int divisor);
  // A rank that ran out of inputs (ddp::Join) takes part in the other ranks' synchronized backward
  // pass: every bucket reduced with zeros, through the same collectives in the same order.
  void shadow_backward();
  // Reduces every bucket through `hook` from now on. Once, before training starts.
  void register_comm_hook(CommHook hook);
  // The registered hook, or null.
  const CommHook* comm_hook() const;

  // Timings (iteration_recorder.h): DDPCore marks the forward, the reducer the rest.
  void begin_iteration();
  void forward_done();
  RuntimeAverages runtime_averages() const;
  void set_timeline(Timeline* timeline);

  ReducerStats stats() const;
  // The same for users: each bucket's parameters by the names the reducer was given.
  ReductionStats reduction_stats() const;
  // Whether the one rebuild in observed gradient order has happened. Takes no lock, so a comm hook
  // may ask during backward (finalize() holds the lock while it waits for the hooks).
  bool buckets_rebuilt() const noexcept { return rebuilt_.load(); }
  // stats().iterations_reduced without building the rest (per iteration: allocates nothing).
  int64_t iterations_reduced() const;

 private:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, ProcessGroupPtr group,
          ReducerOptions options);
  void register_hooks();

  // --- the per-iteration path -------------------------------------------------------------------
  void on_gradient_ready(size_t param);
  // PassTrigger::kFirstGradient: the first gradient of a pass arms it (or lets it accumulate).
  void begin_pass_on_first_gradient();
  void mark_ready(size_t param, bool used);
  void launch_ready_buckets();
  void arm_pass();
  void finalize();
  void finalize_pass();
  void wait_for_buckets();
  void wait_for_bucket(size_t bucket);
  std::string describe_bucket(size_t bucket) const;  // "<owner>: allreduce of gradient bucket b of n"
  [[noreturn]] void fail(const std::string& message) const;  // std::runtime_error "<owner>: <message>"
  c10::intrusive_ptr<c10d::Work> launch_usage_exchange();
  void read_usage_exchange(const c10::intrusive_ptr<c10d::Work>& work);
  void write_back_gradients();

  // --- set-up -----------------------------------------------------------------------------------
  // Whether every rank builds its buckets at this point (construction, the rebuild, autotuning),
  // so that they may be put in shared memory, a collective; or this rank alone (module.to()).
  enum class Builders { kEveryRank, kThisRankAlone };
  void build_buckets(const std::vector<size_t>& order, Builders builders = Builders::kEveryRank);
  bool adopts_slots(const GradientBuffer& buffer) const;
  std::vector<GradBucket> hook_buckets() const;
  void rebuild_buckets_in_observed_order();
  void autotune_step();
  std::vector<BucketParam> bucket_params() const;
  void verify_buckets_match_across_ranks() const;
  // TORCH_DISTRIBUTED_DEBUG=DETAIL: every rank checks that all run this collective (desync.h).
  void check_collective(CollectiveOp op, int64_t index, const at::Tensor& tensor, int64_t root = -1) const;
  std::vector<size_t> find_unused(const std::vector<at::Tensor>& outputs) const;
  void discard_iteration();
  void raise_pending_error();

  enum class State {
    kIdle,          // no forward since the last reduction: a gradient now is an error
    kAccumulating,  // forward ran under no_sync(): gradients stay local
    kExpecting,     // forward ran: waiting for the first gradient
    kReducing,      // backward is running and buckets are being launched
  };

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  ProcessGroupPtr group_;
  ReducerOptions options_;
  // Strong references: autograd only holds gradient accumulators weakly, and a new accumulator
  // would not carry our hook.
  std::vector<compat::GradAccumulatorPtr> grad_accumulators_;
  std::vector<uintptr_t> hook_keys_;  // hook_keys_[param]: our hook on grad_accumulators_[param]
  std::unordered_map<const torch::autograd::Node*, size_t> param_of_accumulator_;

  std::vector<Bucket> buckets_;
  std::vector<BucketPlace> place_;    // place_[param]: where its gradient lives
  std::vector<size_t> bucket_order_;  // the parameter order buckets were last built from

  mutable std::mutex mutex_;
  State state_ = State::kIdle;
  std::vector<char> ready_;           // ready_[param] in this iteration
  size_t next_bucket_ = 0;            // first bucket not launched yet
  std::vector<size_t> unused_;        // found unused at forward (static_graph: in iteration one),
                                      // marked when backward starts
  bool track_usage_ = false;          // this iteration learns which parameters any rank used
  at::Tensor used_host_;              // int32 per parameter: 1 where this rank produced a gradient
  at::Tensor used_device_;            // the same on the parameters' device, for the collective
  std::vector<char> globally_unused_; // no rank produced a gradient: leave param.grad() alone
  bool graph_learnt_ = false;
  std::vector<size_t> ready_order_;   // first iteration's gradient order, for the one rebuild
  std::atomic<bool> rebuilt_{false};
  std::string error_;                 // raised at the next forward
  std::unique_ptr<HookRunner> hook_runner_;  // set by register_comm_hook
  int64_t training_forwards_ = 0;     // forwards that armed the reducer (training has begun)
  int passes_since_step_ = 0;         // PassTrigger::kFirstGradient: backward passes since the last step
  bool hooks_compared_ = false;       // the ranks checked they reduce through the same hook
  int divisor_ = 1;                   // gradients are averaged over this many ranks
  bool check_collectives_ = false;    // TORCH_DISTRIBUTED_DEBUG=DETAIL
  IterationRecorder recorder_;        // timings for logging_data() and the timeline
  std::unique_ptr<BucketAutotuner> autotuner_;  // bucket_cap_mb_auto, from the rebuild on
  std::vector<int64_t> first_bucket_bytes_;  // as first built, and after the rebuild
  std::vector<int64_t> rebuilt_bucket_bytes_;
  int64_t collectives_launched_ = 0;
  int64_t iterations_reduced_ = 0;
};

}  // namespace ddp::detail
