// non_finite: a pass over a tensor in chunks, so the temporary mask stays small for any size.
#include "checkpoint/src/tensor_check.h"

#include <algorithm>
#include <sstream>

namespace ddp {

std::optional<std::string> non_finite(const at::Tensor& tensor) {
  // A meta tensor has no values to check.
  if (!tensor.defined() || tensor.is_meta() || !(tensor.is_floating_point() || tensor.is_complex())) return std::nullopt;
  constexpr int64_t kChunk = int64_t{1} << 22;
  const at::Tensor flat = tensor.reshape({-1});
  for (int64_t start = 0; start < flat.numel(); start += kChunk) {
    const at::Tensor chunk = flat.narrow(0, start, std::min(kChunk, flat.numel() - start));
    if (chunk.isfinite().all().item<bool>()) continue;
    return chunk.isnan().any().item<bool>() ? "NaN" : "an infinity";
  }
  return std::nullopt;
}

std::string shape_of(const at::Tensor& tensor) {
  std::ostringstream text;
  text << tensor.sizes();
  return text.str();
}

}  // namespace ddp
