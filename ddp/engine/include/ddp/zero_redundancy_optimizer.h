#pragma once
// ZeRO stage 1: optimizer state sharded across the ranks of a group (PyTorch's
// torch.distributed.optim.ZeroRedundancyOptimizer).
//
//   ddp::DistributedDataParallel model(net);
//   ddp::ZeroRedundancyOptimizer<torch::optim::Adam> opt(model.parameters(),
//       ddp::ZeroRedundancyOptimizerOptions().parameters_as_bucket_view(true),
//       torch::optim::AdamOptions(1e-3));
//   loss.backward();   // DDP averages the gradients on every rank
//   opt.step();        // this rank updates its shard, then every shard is broadcast from its owner
//   opt.zero_grad();
//
// Each rank keeps the optimizer state (Adam's exp_avg, exp_avg_sq, ...) of its own shard only: about
// 1/W of it, plus at most one parameter's share of imbalance. The partition is PyTorch's: in each
// parameter group in turn, the group's parameters sorted by numel, largest first (equal sizes keep
// their order), each to the rank with the least numel so far (counted over every group, the lowest
// rank among equals); a parameter is never split. Every rank computes the same partition from the
// same parameters, so nothing is exchanged to agree on it.
//
// One step:
//   1. the options of each parameter group (lr, ...) go to the local optimizer's group (a
//      scheduler may have changed them), as PyTorch's _sync_param_groups does
//   2. the local optimizer (an Optim over this rank's shard, PyTorch's `optim`) steps
//   3. each rank's shard is broadcast from its owner, one broadcast per parameter, or per rank and
//      device with parameters_as_bucket_view; all are launched, then all are waited on
//
// The result is that of the plain optimizer on every parameter: the updates are elementwise per
// parameter, so each owner computes exactly what Optim would have, and the broadcast copies it.
//
// Checkpoints: ZeroRedundancyOptimizer is a torch::optim::Optimizer whose save() writes the whole
// (consolidated) state in Optim's own format - what PyTorch's ZeRO state_dict() returns - and
// whose load() keeps this rank's shard of it. So ddp::save_checkpoint / load_checkpoint carry it,
// and a checkpoint written at one world size loads at another (resharded):
//   opt.consolidate_state_dict(0);                          // every rank
//   ddp::save_checkpoint(path, model, &opt, state);         // rank 0 writes the whole state
//   ddp::load_checkpoint(path, model, &opt);                // every rank keeps its shard
//
// Uneven inputs: a ZeroRedundancyOptimizer is a Joinable; give it to ddp::Join after the model
// (ddp::Join join({model, opt})): a rank that ran out of inputs steps its shard with the averaged
// gradients DDP's shadow pass gives it and broadcasts it, in every iteration the others step.
//
// overlap_with_ddp(true): the step runs inside DDP's backward, bucket by bucket, through a comm
// hook (ddp/ddp_zero_hook.h, PyTorch's ddp_zero_hook.py):
//   ddp::ZeroRedundancyOptimizer<torch::optim::Adam> opt(model.parameters(),
//       ddp::ZeroRedundancyOptimizerOptions().overlap_with_ddp(true), torch::optim::AdamOptions(1e-3));
//   model.register_comm_hook(ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), model, opt));
//   loss.backward();   // each bucket, once averaged: its owner steps it and broadcasts it
// Then DDP bucket i belongs to rank i % W (PyTorch's rule; the greedy partition above is not used),
// assigned in the first backward after DDP rebuilt its buckets. Until then nothing is updated: the
// first synchronized iteration (before the rebuild) leaves the parameters as they were (see
// ddp_zero_hook.h for the warm-up and what differs from PyTorch). step() is then a no-op (PyTorch
// logs a warning; it stays in a ported loop harmlessly). One parameter group only;
// parameters_as_bucket_view is ignored (the parameters become views of one flat tensor per DDP
// bucket instead, which the owner broadcasts). consolidate_state_dict, save and load need the
// assignment: they throw before it exists, as PyTorch's do.
//
// Thread-safety: one training thread drives it (step, zero_grad, consolidate_state_dict, save,
// load, add_param_group). step(), consolidate_state_dict() and add_param_group() are collectives:
// every rank of the group calls them, in the same order.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <ddp/join.h>
#include <ddp/process_group.h>
#include <ddp/stateful.h>

namespace ddp {

namespace detail {
class Partition;
class ZeroOverlap;
}  // namespace detail

// PyTorch's keyword arguments of ZeroRedundancyOptimizer, chaining like DDPOptions.
struct ZeroRedundancyOptimizerOptions {
  // The group whose ranks share the state; null: the default group.
  TORCH_ARG(ProcessGroupPtr, process_group) = {};
  // Pack each rank's trainable parameters (per device) into one flat tensor and make every
  // parameter's data a view of it: one broadcast per rank instead of one per parameter. The
  // parameters stay the same tensors (their data moves; views of the old data do not follow).
  TORCH_ARG(bool, parameters_as_bucket_view) = false;
  // PyTorch: the step fused into DDP's communication hook (ddp/ddp_zero_hook.h): step() does
  // nothing, the hook steps each DDP bucket's parameters on the rank that owns the bucket.
  TORCH_ARG(bool, overlap_with_ddp) = false;
};

// What every ZeroRedundancyOptimizer<Optim> shares; use it through the template below.
class ZeroRedundancyOptimizerBase : public torch::optim::Optimizer, public Joinable, public KeepsStateBeyondOptimizer {
 public:
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

  ~ZeroRedundancyOptimizerBase() override;
  ZeroRedundancyOptimizerBase(const ZeroRedundancyOptimizerBase&) = delete;
  ZeroRedundancyOptimizerBase& operator=(const ZeroRedundancyOptimizerBase&) = delete;

  // Collective. Updates this rank's shard with its parameters' current gradients, then broadcasts
  // every shard from its owner: on return every rank holds the same updated parameters. `closure`
  // is passed to the local optimizer (it re-evaluates the loss). Returns the local step's result.
  // Throws CollectiveError when a broadcast fails.
  // With overlap_with_ddp(true): not collective and does nothing (the hook stepped during backward);
  // returns an undefined tensor. Throws std::logic_error when no hook_with_zero_step was made for
  // this optimizer: the parameters would never be updated.
  at::Tensor step(LossClosure closure = nullptr) override;

  // Collective. Appends a parameter group (PyTorch: frozen layers made trainable later) and
  // partitions its parameters on top of the current partition (the old groups keep their owners,
  // so no state moves). Throws std::invalid_argument for a parameter already in a group or of
  // another type than the others, and with overlap_with_ddp(true) (one group only, as PyTorch).
  // Call it on this class: through a torch::optim::Optimizer reference, LibTorch's non-virtual
  // add_param_group would skip the partition.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  // Collective. Gathers every rank's shard of the state on rank `to` (a rank of the group), which
  // keeps a snapshot of the whole state for save(). Other ranks keep nothing. With
  // overlap_with_ddp(true), throws std::runtime_error before the hook assigned the buckets.
  void consolidate_state_dict(int to = 0);

  // PyTorch's state_dict(): the state consolidated on this rank, in Optim's format, with the
  // parameter groups' current options. Throws std::runtime_error when consolidate_state_dict(to=
  // this rank) has not run ("Optimizer state has not been consolidated on this rank. ..."), or
  // when step() ran since the last consolidation (the snapshot would no longer fit the
  // parameters; PyTorch returns it silently).
  void save(torch::serialize::OutputArchive& archive) const override;
  // PyTorch's load_state_dict(): reads a whole state in Optim's format (saved by save() at any
  // world size, or by a plain Optim over the same parameter groups) and keeps this rank's shard of
  // it. Every group's options (lr, momentum, ...) become the saved ones, here and on the local
  // optimizer, as PyTorch's load_state_dict does (LibTorch's Optimizer::load keeps its own): to
  // train on with other options, set them after loading. Not collective. Throws what Optim's load
  // throws for a state of other parameter groups.
  void load(torch::serialize::InputArchive& archive) override;
  // For load_checkpoint (stateful.h): a copy of this rank's shard state and options and of the
  // consolidated snapshot, and what puts them back when the load fails after load() ran.
  std::function<void()> keep_for_restore() override;

  // The partition: for each rank, its parameters (group by group, in the order they are updated).
  // With overlap_with_ddp(true): empty lists until the hook assigned DDP's buckets, then each
  // rank's buckets' parameters in bucket order.
  std::vector<std::vector<at::Tensor>> params_per_rank() const;
  // The rank that updates `param`; throws std::invalid_argument for a tensor not optimized here.
  int rank_of(const at::Tensor& param) const;
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const ZeroRedundancyOptimizerOptions& options() const { return options_; }
  // The optimizer over this rank's shard (PyTorch: zero.optim); ZeroRedundancyOptimizer<Optim>::
  // optim() gives it as an Optim.
  torch::optim::Optimizer& local_optimizer() const { return *local_; }

  // With overlap_with_ddp(true): whether the hook has assigned DDP's buckets to ranks (from then on
  // each backward updates the parameters).
  bool overlap_initialized() const;
  // For the library's own hook (ddp::hooks::hook_with_zero_step): the overlap_with_ddp half, which
  // works on this optimizer through an interface of its own (zero/overlap.h); null without
  // overlap_with_ddp(true).
  const std::shared_ptr<detail::ZeroOverlap>& overlap_half() const { return overlap_; }

  // Joinable (ddp::Join): list the DDP model first, then this optimizer. With overlap_with_ddp(true)
  // its shadowing is DDP's: the hook runs in DDP's shadow pass too, so this does nothing.
  ProcessGroupPtr join_process_group() const override { return group_; }
  void join_attach(Join* join, size_t index) override;
  void join_shadow(const JoinStatus& status) override;
  void join_finish(const JoinStatus&, int) override {}

 protected:
  // `make_optimizer` builds an Optim over given groups (the local shard, or the whole state for
  // save/load). Validates the parameters: throws std::invalid_argument naming the problem.
  ZeroRedundancyOptimizerBase(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                              std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                              ZeroRedundancyOptimizerOptions options, OptimizerFactory make_optimizer);

 private:
  struct Buckets;
  class OverlapHost;  // what the overlap half may do to this optimizer (zero/overlap.h)
  void require_overlap_initialized(const char* method) const;
  void partition();
  void build_buckets();
  void broadcast_shards();
  at::Tensor step_shard(const LossClosure& closure);
  std::vector<torch::optim::OptimizerParamGroup> groups_of_rank(int rank) const;
  std::vector<at::Tensor> params_of(int rank) const;
  std::vector<at::Tensor> params_of(int rank, size_t group) const;
  std::unique_ptr<torch::optim::Optimizer> whole_state_optimizer() const;

  ZeroRedundancyOptimizerOptions options_;
  OptimizerFactory make_optimizer_;
  ProcessGroupPtr group_;
  int rank_ = 0;
  int world_size_ = 1;
  // The owner of every parameter of param_groups_ (zero/partition.h).
  std::unique_ptr<detail::Partition> partition_;
  std::vector<bool> trainable_;  // requires_grad of every parameter when the buckets were built
  std::unique_ptr<Buckets> buckets_;
  std::unique_ptr<torch::optim::Optimizer> local_;
  // The whole state, on the rank it was consolidated to, and the step count it was taken at.
  std::unique_ptr<torch::optim::Optimizer> consolidated_;
  int64_t consolidated_at_ = -1;
  int64_t steps_ = 0;
  Join* join_ = nullptr;
  size_t join_index_ = 0;
  std::shared_ptr<detail::ZeroOverlap> overlap_;  // overlap_with_ddp(true) only; shared with its hook
};

// ZeroRedundancyOptimizer over any torch::optim optimizer (SGD, Adam, AdamW, Adagrad, RMSprop):
//   ddp::ZeroRedundancyOptimizer<torch::optim::SGD> opt(params, {}, torch::optim::SGDOptions(0.1));
// `defaults` are Optim's options, as PyTorch's **defaults. Construction is not collective: every
// rank must pass the same parameters (same order, shapes and dtype; the model's, broadcast by DDP).
template <typename Optim>
class ZeroRedundancyOptimizer : public ZeroRedundancyOptimizerBase {
 public:
  // One parameter group. Throws std::invalid_argument for an empty list, parameters of different
  // types (dtype, device type, layout), a tensor listed twice, or several groups with
  // overlap_with_ddp(true).
  template <typename Options>
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, ZeroRedundancyOptimizerOptions options, Options defaults)
      : ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup>{
                                    torch::optim::OptimizerParamGroup(std::move(params))},
                                std::move(options), std::move(defaults)) {}
  // Several parameter groups, each with its own options or Optim's `defaults`.
  template <typename Options>
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          ZeroRedundancyOptimizerOptions options, Options defaults)
      : ZeroRedundancyOptimizerBase(std::move(param_groups), std::make_unique<Options>(defaults), std::move(options),
                                    [defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
                                      return std::make_unique<Optim>(std::move(groups), defaults);
                                    }) {}

  // The optimizer over this rank's shard (PyTorch: zero.optim): its param_groups() hold this
  // rank's parameters, its state() their state.
  Optim& optim() const { return static_cast<Optim&>(local_optimizer()); }
};

// The bytes of optimizer state `optimizer` holds in this process (Adam: exp_avg and exp_avg_sq of
// every parameter it has stepped), for memory reports; for a ZeroRedundancyOptimizer, its shard's.
// Counts the state of LibTorch's optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS); another
// optimizer's state counts as 0. Grows at the first step, when the optimizer creates its state.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace ddp
