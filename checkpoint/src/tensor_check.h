#pragma once
// Values a checkpoint must not hand a training run: a model or optimizer state that holds NaN or
// an infinity trains on to NaN (or came from a damaged file), so it is refused at load.
#include <optional>
#include <string>

#include <ATen/ATen.h>

namespace ddp {

// "NaN" or "an infinity" when a floating-point or complex `tensor` holds one; nullopt when every
// element is finite, and for integer, boolean, meta and undefined tensors.
std::optional<std::string> non_finite(const at::Tensor& tensor);

// "[10, 10]"
std::string shape_of(const at::Tensor& tensor);

}  // namespace ddp
