#pragma once
// SyncBatchNorm: BatchNorm whose statistics are those of the whole global batch (every rank's
// samples), not of this rank's shard. PyTorch's torch.nn.SyncBatchNorm, for LibTorch, on any
// device the group's backend serves (CPU with Gloo, CUDA with NCCL).
//
// Training forward (input x of shape (N, C, ...), N may differ per rank and may be 0):
//   1. per channel, this rank's mean, biased variance and count n = numel / C
//        - the only statistics needed to combine batches exactly (Chan's parallel variance);
//        - taken from BatchNorm's own kernel in its training form with eps 0 (its invstd then
//          gives the variance), on any device;
//   2. one allgather of [header, n, mean, var] (float64, 2C + 3 values) from every rank
//        - one collective per forward; the header (x's dimensionality and channels) lets every
//          rank see a rank whose input does not fit and fail with the same message, no hang;
//   3. global count N = sum n_r, mean = sum n_r mean_r / N,
//      var = sum n_r (var_r + (mean_r - mean)^2) / N, weighted by count
//        - ranks with an empty batch (n = 0) drop out of the sums but still joined step 2;
//   4. running_mean/var move towards mean and the unbiased var * N / (N - 1) (momentum, or the
//      cumulative average when momentum is unset), as BatchNorm on the global batch would;
//   5. y = (x - mean) * invstd * weight + bias, invstd = 1 / sqrt(var + eps).
// Backward (dy):
//   6. per channel, this rank's sum_dy = sum dy and sum_dy_xmu = sum dy * (x - mean);
//      weight.grad += sum_dy_xmu * invstd, bias.grad += sum_dy from this rank's shard alone
//        - DistributedDataParallel averages parameter gradients itself, as for any layer;
//   7. one allreduce (sum) of [sum_dy, sum_dy_xmu] (float64, 2C values), only when x needs a
//      gradient
//        - the input gradient depends on every rank's dy through the shared mean and variance;
//   8. dx = (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) * invstd * weight.
// What differs from PyTorch's arithmetic: step 2 gathers the variance instead of invstd (the same
// combination without a round trip through eps), in float64 whatever the input's dtype. ATen's
// SyncBatchNorm kernels (batch_norm_stats, batch_norm_elemt, ...) exist for CUDA only in LibTorch
// 1.13 and 2.6; instead the per-element passes (steps 5, 6 and the bulk of 8) run in BatchNorm's
// own kernels in their inference form, which take a given mean and variance, on any device.
//
// Not synchronized, exactly like torch::nn::BatchNorm2d (no communication at all): eval mode
// (running statistics, or this rank's batch when track_running_stats is false, as PyTorch does),
// a world of one, and no process group (none given and ddp::init_process_group not called).
//
// Every rank must run the same SyncBatchNorm forwards and backwards in the same order, in the same
// mode, as for any collective; a rank that skips one leaves the others waiting until the group's
// timeout, then every rank fails with a CollectiveError naming the SyncBatchNorm step.
//
// Thread-safety: as any module, one thread runs forward/backward; every forward in training is a
// collective on its group.
#include <memory>
#include <string>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <ddp/process_group.h>

namespace ddp {

// torch::nn::BatchNormOptions plus the group. Defaults are PyTorch's.
struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  // From a BatchNorm's options (convert_sync_batchnorm); the group is null (the default group).
  static SyncBatchNormOptions from(const torch::nn::BatchNormOptions& options);

  TORCH_ARG(int64_t, num_features);
  TORCH_ARG(double, eps) = 1e-5;
  // Null: the cumulative average over all batches so far (PyTorch's momentum=None).
  TORCH_ARG(c10::optional<double>, momentum) = 0.1;
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, track_running_stats) = true;
  // The ranks whose batches form the global batch. Null: ddp::default_group() at each forward (a
  // plain BatchNorm while ddp::init_process_group has not been called).
  TORCH_ARG(ProcessGroupPtr, process_group) = {};
};

struct SyncBatchNormConverter;

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(SyncBatchNormOptions options);

  // Registers weight, bias (parameters; undefined without affine), running_mean, running_var,
  // num_batches_tracked (buffers; undefined without track_running_stats): BatchNorm2d's names,
  // order and initial values, so state dicts and checkpoints are interchangeable with it.
  void reset() override;
  void reset_running_stats();
  void reset_parameters();

  // input: (N, C, ...) with 2 to 5 dimensions, C == num_features; N may be 0 on some ranks
  // (not on all: as BatchNorm, training needs more than one value per channel in the global
  // batch). In training mode (and a world of more than one) this is a collective on the group:
  // see the algorithm above. Throws std::invalid_argument for a bad input — on every rank when
  // any rank's input is bad (the message names each rank's channels) — and CollectiveError when
  // a collective fails.
  torch::Tensor forward(const torch::Tensor& input);

  void pretty_print(std::ostream& stream) const override;

  SyncBatchNormOptions options;
  torch::Tensor weight, bias;
  torch::Tensor running_mean, running_var, num_batches_tracked;

 private:
  friend struct SyncBatchNormConverter;
  // For convert_sync_batchnorm: no tensors registered yet (it registers a BatchNorm's own).
  struct Empty {};
  SyncBatchNormImpl(SyncBatchNormOptions options, Empty) : options(std::move(options)) {}
  // Registers the five tensors under BatchNorm's names (reset(), and convert_sync_batchnorm,
  // which passes a BatchNorm's own tensors).
  void register_state(torch::Tensor weight, torch::Tensor bias, torch::Tensor running_mean,
                      torch::Tensor running_var, torch::Tensor num_batches_tracked);
  // The group to synchronize over in this forward, or null: train mode, and a group of more
  // than one rank.
  ProcessGroupPtr sync_group() const;
  // Before the first synchronized forward on `group`: one allgather of num_features.
  void agree_on_num_features(const ProcessGroupPtr& group);
  // The group the ranks already agreed num_features on (a one-off check before the first
  // synchronized forward on a group: the gathered tensors must have the same size everywhere).
  const c10d::ProcessGroup* agreed_group_ = nullptr;
};

TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm1d/2d/3d in `module`'s tree with a SyncBatchNorm on `group`
// (null: the default group at each forward) that takes over the BatchNorm's own weight, bias and
// buffer tensors (the same tensor objects: an optimizer built before still holds them), options
// and training mode. Parameter and buffer names are unchanged, so checkpoints load either way.
// Returns `module` itself. Nothing is changed when it throws.
//
// It reaches a BatchNorm held by a torch::nn::Sequential (forward runs the new module), a
// ModuleList or ModuleDict (code that fetched it with as<torch::nn::BatchNorm2d>() now gets
// nullptr: fetch as<ddp::SyncBatchNorm>()), or a custom module that registered it and calls it
// only through its registered children. It cannot reach a member field: C++ has no setattr, so in
//     struct Block : torch::nn::Module { torch::nn::BatchNorm2d bn{nullptr}; ... bn = register_module("bn", ...); }
// `bn` would go on pointing at (and forward would go on running) the plain BatchNorm. Such a
// BatchNorm is still held by something besides its parent's list of children, and that is
// detected: std::invalid_argument naming its path (e.g. "block1.bn"), before anything is changed.
// Declare such fields as ddp::SyncBatchNorm (same parameter names: old checkpoints load), or
// hold the BatchNorm in a Sequential; drop other handles of it before converting.
// A `module` that is itself a BatchNorm is refused the same way: build a ddp::SyncBatchNorm.
void convert_sync_batchnorm_in_place(torch::nn::Module& module, const ProcessGroupPtr& group = {});

template <typename M>
std::shared_ptr<M> convert_sync_batchnorm(std::shared_ptr<M> module, const ProcessGroupPtr& group = {}) {
  if (!module) throw std::invalid_argument("ddp::convert_sync_batchnorm: the module is null");
  convert_sync_batchnorm_in_place(*module, group);
  return module;
}
template <typename M>
torch::nn::ModuleHolder<M> convert_sync_batchnorm(torch::nn::ModuleHolder<M> holder, const ProcessGroupPtr& group = {}) {
  convert_sync_batchnorm(holder.ptr(), group);
  return holder;
}

}  // namespace ddp
