#pragma once
// Dynamic loss scaling for mixed-precision training, like torch.cuda.amp.GradScaler (same option
// names and defaults, same call sequence, same errors), for any device, under DDP.
//
//   ddp::GradScaler scaler;                              // GradScalerOptions(): PyTorch's defaults
//   for (...) {
//     optimizer.zero_grad();
//     torch::Tensor loss;
//     {
//       ddp::AutocastGuard autocast;                     // forward in reduced precision (autocast.h)
//       loss = loss_fn(model.forward(x), y);
//     }
//     scaler.scale(loss).backward();                     // gradients are scaled by get_scale()
//     scaler.unscale_(optimizer);                        // optional: to clip the true gradients
//     torch::nn::utils::clip_grad_norm_(model.parameters(), 1.0);
//     scaler.step(optimizer);                            // skipped when a gradient is inf/NaN
//     scaler.update();                                   // back off after a skip, grow after many clean steps
//   }
//
// Why scale: a reduced-precision backward underflows small gradients to zero. Multiplying the loss
// by a large factor S moves them into range; unscale_ divides them by S again before the optimizer
// sees them. If S was too large some gradient overflows to inf (or is NaN): that step is skipped
// and S is multiplied by backoff_factor; after growth_interval steps in a row without one, S is
// multiplied by growth_factor.
//
// Under DDP (and with any process group): the skip decision is the same on every rank. Gradients
// may differ between ranks - inside no_sync(), or after a comm hook such as fp16_compress, whose
// fp16 buffer overflows to inf when scaled gradients exceed 65504 - so each rank's found-inf flag
// is combined with one small allreduce (MAX) before step() decides. Every rank therefore skips the
// same steps and holds the same scale. Consequence: unscale_ and step are collectives on the
// scaler's group - every rank calls them for the same optimizers in the same order (as every rank
// runs the same training loop anyway).
//
// Unlike PyTorch's CUDA kernels, this works on plain tensor ops and decides on the host (one
// device-to-host read of the flag per optimizer per step), so it serves CPU and CUDA alike.
//
// Thread-safety: a GradScaler belongs to the training thread; step() is a collective on its group.
#include <torch/arg.h>
#include <cstdint>
#include <map>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <ddp/process_group.h>
#include <ddp/stateful.h>

namespace ddp {

struct GradScalerOptions {
  // The scale before the first update (PyTorch: init_scale=2.**16).
  TORCH_ARG(double, init_scale) = 65536.0;
  // Factor applied after growth_interval consecutive steps without inf/NaN (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  // Factor applied after a step with inf/NaN gradients (< 1, > 0).
  TORCH_ARG(double, backoff_factor) = 0.5;
  // Consecutive clean steps before the scale grows (>= 1).
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // false: every method is a pass-through (scale returns the loss, step just steps), so one
  // training loop serves both fp32 and mixed precision.
  TORCH_ARG(bool, enabled) = true;
  // The group whose ranks agree on every skip; null: the default group if initialized, else this
  // process alone.
  TORCH_ARG(ProcessGroupPtr, group) = {};
};

class GradScaler : public Stateful {
 public:
  // Throws std::invalid_argument naming the first bad option. The group (when null, the default
  // group) is looked up at each unscale_/step, so the scaler may be made before init_process_group.
  explicit GradScaler(GradScalerOptions options = {});

  // Returns `loss * get_scale()` (a new tensor; the caller calls backward() on it). The scale is a
  // 0-dim float32 tensor on loss's device, so a reduced-precision loss is scaled in float32.
  // Disabled: returns `loss` itself.
  at::Tensor scale(const at::Tensor& loss);

  // Divides, in place, the gradient of every parameter of `optimizer` by the scale and records
  // whether any of them holds inf/NaN on any rank (collective: one allreduce on the group). Call it
  // between backward() and step() when something needs the true gradients (clipping, logging);
  // step() then does not unscale again. Once per optimizer between update()s: a second call throws
  // std::runtime_error "unscale_() has already been called on this optimizer since the last
  // update()"; after step(): "unscale_() is being called after step()". fp16 gradients are refused
  // (std::invalid_argument; as PyTorch, parameters and so gradients should be fp32 - autocast keeps
  // them so). Parameters without a gradient are skipped. The optimizer stays the caller's; the
  // scaler keeps only its address until update(). Disabled: does nothing.
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales (if unscale_ was not called for this optimizer since update()), then calls
  // optimizer.step() unless a gradient held inf/NaN on some rank. Returns whether it stepped: the
  // same on every rank. A second step() for the same optimizer before update() throws
  // std::runtime_error "step() has already been called since the last update()". Disabled: calls
  // optimizer.step() and returns true.
  bool step(torch::optim::Optimizer& optimizer);

  // Ends the iteration: after a step with inf/NaN (on any optimizer) multiplies the scale by
  // backoff_factor and restarts the count of clean steps; otherwise counts a clean step and, at
  // growth_interval of them, multiplies the scale by growth_factor (unless that would overflow
  // float32) and restarts the count. Call it once per iteration, after step() for every optimizer;
  // without a step() or unscale_() since the last update() it throws std::runtime_error.
  // Disabled: does nothing.
  void update();
  // Sets the scale to `new_scale` (> 0 and finite, else std::invalid_argument) instead; the count
  // of clean steps is kept, as in PyTorch.
  void update(double new_scale);

  // The current scale (a float32 value); 1.0 when disabled.
  double get_scale() const;
  bool is_enabled() const { return options_.enabled(); }
  int64_t growth_tracker() const { return growth_tracker_; }  // clean steps since the last change
  const GradScalerOptions& options() const { return options_; }

  // Stateful (checkpoint.h: CheckpointOptions().state("scaler", &scaler)). PyTorch's keys:
  // "scale", "growth_factor", "backoff_factor" (0-dim float64), "growth_interval",
  // "_growth_tracker" (0-dim int64); a round trip is bitwise. Disabled: state_dict() is empty and
  // load_state_dict() does nothing. Loading an empty dict into an enabled scaler throws
  // std::invalid_argument (it was saved from a disabled scaler); a missing key or a bad value
  // throws std::invalid_argument naming it. Call between iterations (after update()).
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

 private:
  // Where each optimizer is in the current iteration (keyed by address; reset by update()).
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    bool found_inf = false;  // on any rank
  };

  // Unscales and checks the gradients of `optimizer`; returns whether any rank found inf/NaN.
  bool unscale_and_check(torch::optim::Optimizer& optimizer);
  // This rank's flag, max over the group's ranks.
  bool any_rank(bool found_inf_here) const;

  GradScalerOptions options_;
  float scale_;            // float32, as PyTorch's scale tensor
  int64_t growth_tracker_ = 0;
  bool scale_used_ = false;  // scale() was called at least once (else unscale_ would unscale nothing)
  std::map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

}  // namespace ddp
