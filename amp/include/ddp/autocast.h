#pragma once
// Autocast as a scope, like Python's `with torch.autocast(device_type, dtype=...)`: inside it,
// LibTorch runs eligible ops (matmul, linear, convolutions, ...) in a lower precision - bfloat16
// on the CPU, float16 on CUDA by default - and keeps precision-sensitive ones (losses, softmax,
// norms) in float32. Parameters stay float32; so do their gradients.
//
//   ddp::DistributedDataParallel model(net);
//   ddp::GradScaler scaler;                      // grad_scaler.h
//   torch::Tensor loss;
//   {
//     ddp::AutocastGuard autocast;               // CPU, bfloat16 (CUDA: AutocastGuard(torch::kCUDA))
//     loss = torch::cross_entropy_loss(model.forward(x), y);
//   }                                            // previous autocast state restored here
//   scaler.scale(loss).backward();               // outside the guard, as PyTorch recommends
//   scaler.step(optimizer);
//   scaler.update();
//
// With DDP: put the forward (and the loss) under the guard and backward outside it. Backward runs
// each op in the dtype its forward used; the casts' backward converts gradients back, so every
// parameter's gradient arrives at DDP's hooks in float32 and DDP's buckets, the allreduce and the
// averaging are unchanged. A comm hook sees float32 buckets too: bf16_compress()/fp16_compress()
// compress those for the wire as without autocast. fp16_compress() on gradients scaled by a
// GradScaler can overflow (fp16 tops out at 65504); the scaler then sees inf, skips the step on
// every rank and backs off - the intended dynamic-scaling behaviour. bf16_compress() has float32's
// range and does not overflow.
//
// Nesting: each guard saves the autocast state it found (enabled, dtype, cache setting) and
// restores it when destroyed, so an inner AutocastGuard(kCPU, AutocastOptions().enabled(false))
// runs a region in float32 and the outer region continues in bfloat16 afterwards. When the
// outermost guard ends, the cache of casted parameters is cleared (as PyTorch's autocast exit
// does), so no bfloat16 copy of a weight outlives the forward. The state is per thread: a guard
// affects only ops on the thread that made it (DDP's forward runs on the caller's thread).
#include <torch/arg.h>
#include <optional>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace ddp {

struct AutocastOptions {
  // The lower precision: kBFloat16 (the CPU default) or kHalf (the CUDA default). LibTorch 1.13's
  // CPU autocast supports only kBFloat16.
  TORCH_ARG(std::optional<c10::ScalarType>, dtype) = std::nullopt;
  // false: autocast is off inside the guard (a float32 region within an autocast one).
  TORCH_ARG(bool, enabled) = true;
  // Reuse the lower-precision copy of a parameter within the outermost guard (PyTorch's default).
  TORCH_ARG(bool, cache_enabled) = true;
};

class AutocastGuard {
 public:
  // Turns autocast on (or off, per options) for `device_type` (kCPU or kCUDA) on this thread.
  // Throws std::invalid_argument naming an unsupported device type or dtype.
  explicit AutocastGuard(c10::DeviceType device_type = c10::kCPU, const AutocastOptions& options = {});
  // Restores the state found at construction; clears the cast cache when leaving the outermost guard.
  ~AutocastGuard();

  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

  // Whether autocast is on for `device_type` on this thread right now, and its dtype.
  static bool is_enabled(c10::DeviceType device_type = c10::kCPU);
  static c10::ScalarType dtype(c10::DeviceType device_type = c10::kCPU);

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_enabled_;
};

}  // namespace ddp
