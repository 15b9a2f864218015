#pragma once
// Benchmark-only stand-in for a header Debian's libtorch-dev does not ship.
// c10d/reducer.hpp includes it for two type names only; the real class lives in libtorch and is
// never touched through this declaration (the Reducer only stores a pointer to it).
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
