#pragma once
// Data parallelism without a model wrapper, as Horovod's DistributedOptimizer: the optimizer
// averages the gradients across ranks while backward runs, and the model stays as it is (a
// function that takes `Net&` and calls `model.forward` is not touched).
//
//   ddp::init_process_group();
//   ddp::DistributedOptimizer<torch::optim::SGD> optimizer(model.parameters(), torch::optim::SGDOptions(0.01));
//   ddp::broadcast_parameters(model);              // every rank starts from rank 0's weights
//   ddp::broadcast_optimizer_state(optimizer);     // and optimizer state (after a load)
//   ... loss.backward(); optimizer.step();         // unchanged
//
// The gradients go through the same engine as DistributedDataParallel's: hooks on the gradient
// accumulators, buckets launched while backward still runs, shared memory between ranks on one
// host, comm hooks. They are averaged by the time backward() returns (as with DDP), so gradient
// clipping between backward() and step() sees the averages; Horovod's synchronize() is not needed.
// With backward_passes_per_step(N), N backward passes accumulate locally and the N-th is averaged;
// step() then follows every N-th pass. Every rank must run the same passes over the same
// parameters, and the loss must reach every parameter of the optimizer in each averaged pass:
// otherwise step() (or the next pass) throws, naming the parameters.
//
// Construction is collective (it checks that every rank has the same parameters, naming the
// first difference). Thread-safety: as the optimizer it extends (one training thread).
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ddp/comm_hooks.h>
#include <ddp/ddp_core.h>  // ReductionStats
#include <ddp/process_group.h>

namespace ddp {

struct DistributedOptimizerOptions {
  // The group the gradients are averaged over (the default group when null). The optimizer's
  // collectives run on a group split off it, so none pairs with one of the program's.
  TORCH_ARG(ProcessGroupPtr, process_group) = {};
  // Backward passes per step: the first N-1 accumulate on each rank, the N-th is averaged.
  TORCH_ARG(int, backward_passes_per_step) = 1;
  // Gradient bucket caps, as DDPOptions' (MiB).
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
};

namespace detail {
// The non-template half of DistributedOptimizer (compiled once in the library).
class GradientAverager {
 public:
  GradientAverager(const std::vector<torch::optim::OptimizerParamGroup>& groups, DistributedOptimizerOptions options);
  ~GradientAverager();
  GradientAverager(const GradientAverager&) = delete;
  GradientAverager& operator=(const GradientAverager&) = delete;
  void before_step();
  void after_step();
  void register_comm_hook(CommHook hook);
  ReductionStats stats() const;
  const DistributedOptimizerOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
}  // namespace detail

// `Base` is any torch::optim optimizer; the constructor takes Base's own arguments, optionally
// preceded by DistributedOptimizerOptions:
//   ddp::DistributedOptimizer<torch::optim::Adam> adam(model->parameters(), torch::optim::AdamOptions(1e-3));
//   ddp::DistributedOptimizer<torch::optim::SGD> sgd(ddp::DistributedOptimizerOptions().backward_passes_per_step(4),
//                                                    model->parameters(), torch::optim::SGDOptions(0.1));
template <typename Base>
class DistributedOptimizer : public Base {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Base>,
                "ddp::DistributedOptimizer<Base>: Base must be a torch::optim optimizer (SGD, Adam, ...)");

 public:
  template <typename... Args>
  explicit DistributedOptimizer(DistributedOptimizerOptions options, Args&&... args)
      : Base(std::forward<Args>(args)...), averager_(this->param_groups(), std::move(options)) {}
  template <typename First, typename... Rest,
            std::enable_if_t<!std::is_same_v<std::decay_t<First>, DistributedOptimizerOptions>, int> = 0>
  explicit DistributedOptimizer(First&& first, Rest&&... rest)
      : DistributedOptimizer(DistributedOptimizerOptions(), std::forward<First>(first), std::forward<Rest>(rest)...) {}

  // Base's step on the averaged gradients; throws first if the passes since the last step were
  // not all averaged (see above).
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    averager_.before_step();
    torch::Tensor loss = Base::step(std::move(closure));
    averager_.after_step();
    return loss;
  }

  // As DistributedDataParallel::register_comm_hook: once, before the first backward pass.
  void register_comm_hook(CommHook hook) { averager_.register_comm_hook(std::move(hook)); }
  ReductionStats reduction_stats() const { return averager_.stats(); }
  const DistributedOptimizerOptions& distributed_options() const { return averager_.options(); }

 private:
  detail::GradientAverager averager_;
};

// Rank `root`'s parameters and buffers on every rank of `group` (the default group when null), in
// place: Horovod's broadcast_parameters(model.state_dict()). Collective.
void broadcast_parameters(torch::nn::Module& module, int root = 0, const ProcessGroupPtr& group = {});
template <typename M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>, int> = 0>
void broadcast_parameters(const std::shared_ptr<M>& module, int root = 0, const ProcessGroupPtr& group = {}) {
  broadcast_parameters(*module, root, group);
}
template <typename M>
void broadcast_parameters(torch::nn::ModuleHolder<M> module, int root = 0, const ProcessGroupPtr& group = {}) {
  broadcast_parameters(*module, root, group);
}
// Rank `root`'s optimizer state (per-parameter state and every group's options: learning rate,
// momentum buffers, Adam's moments and step counts) on every rank: Horovod's
// broadcast_optimizer_state. Every rank's optimizer must be of the same kind over the same
// parameters. Collective.
void broadcast_optimizer_state(torch::optim::Optimizer& optimizer, int root = 0, const ProcessGroupPtr& group = {});

}  // namespace ddp
