// AutocastGuard: save the thread's autocast state, set ours, restore on exit - PyTorch's
// torch.autocast __enter__/__exit__ sequence, over LibTorch's at::autocast functions.
#include <ddp/autocast.h>

#include <stdexcept>
#include <string>

#include <ATen/autocast_mode.h>

#include "ddp/internal/compat/versions.h"

namespace ddp {
namespace {

c10::ScalarType checked_dtype(c10::DeviceType device_type, const AutocastOptions& options) {
  if (device_type != c10::kCPU && device_type != c10::kCUDA) {
    throw std::invalid_argument(std::string("AutocastGuard: autocast supports device types cpu and cuda, not ") +
                                c10::DeviceTypeName(device_type, /*lower_case=*/true));
  }
  const bool cpu = device_type == c10::kCPU;
  const c10::ScalarType dtype = options.dtype().value_or(cpu ? c10::kBFloat16 : c10::kHalf);
  const bool supported = dtype == c10::kBFloat16 || (dtype == c10::kHalf && (!cpu || compat::kCpuAutocastSupportsHalf));
  if (!supported) {
    throw std::invalid_argument(std::string("AutocastGuard: ") + (cpu ? "CPU" : "CUDA") + " autocast does not support " +
                                c10::toString(dtype) + "; use " +
                                (cpu && !compat::kCpuAutocastSupportsHalf ? "BFloat16 (this LibTorch's only CPU autocast dtype)"
                                                                         : "BFloat16 or Half"));
  }
  return dtype;
}

}  // namespace

AutocastGuard::AutocastGuard(c10::DeviceType device_type, const AutocastOptions& options)
    : device_type_(device_type) {
  const c10::ScalarType dtype = checked_dtype(device_type, options);
  // 1. Remember what we found, to restore it exactly (nesting).
  previous_enabled_ = compat::autocast_enabled(device_type_);
  previous_dtype_ = compat::autocast_dtype(device_type_);
  previous_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  // 2. Turn autocast on (or off) for this device type, in our dtype.
  compat::set_autocast_enabled(device_type_, options.enabled());
  compat::set_autocast_dtype(device_type_, dtype);
  // 3. Count the nesting level, so that only the outermost exit clears the cast cache.
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(options.cache_enabled());
}

AutocastGuard::~AutocastGuard() {
  // Leaving the outermost autocast region: the cached lower-precision copies of parameters are
  // stale once the optimizer steps, so drop them.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_type_, previous_enabled_);
  compat::set_autocast_dtype(device_type_, previous_dtype_);
  at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
}

bool AutocastGuard::is_enabled(c10::DeviceType device_type) { return compat::autocast_enabled(device_type); }

c10::ScalarType AutocastGuard::dtype(c10::DeviceType device_type) { return compat::autocast_dtype(device_type); }

}  // namespace ddp
