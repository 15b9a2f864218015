#pragma once
// Training state that is neither the model nor the optimizer (a GradScaler's scale, a comm hook's
// error-feedback matrices): anything that implements Stateful is saved by save_checkpoint and
// restored by load_checkpoint (checkpoint.h: CheckpointOptions::state / LoadOptions::state).
//
// Thread-safety: state_dict()/load_state_dict() are called by the checkpoint functions on the
// calling (training) thread.
#include <functional>
#include <map>
#include <string>

#include <ATen/core/Tensor.h>

namespace ddp {

// Named tensors. Scalars are 0-dim tensors (int64 counters, double factors), so that they
// round-trip bitwise.
using TensorDict = std::map<std::string, at::Tensor>;

class Stateful {
 public:
  virtual ~Stateful() = default;
  // A snapshot of the state. Tensors may live on any device; a checkpoint stores them on the CPU.
  virtual TensorDict state_dict() const = 0;
  // Restores a snapshot taken by state_dict() (its tensors may be on the CPU: move them where they
  // belong). Throws std::invalid_argument naming a missing or misshaped entry.
  virtual void load_state_dict(const TensorDict& state) = 0;
};

// An optimizer that holds state where torch::optim::Optimizer's state() and param_groups() do not
// show it (ZeroRedundancyOptimizer: its shard's own optimizer, the consolidated snapshot).
// load_checkpoint keeps a copy before it changes the optimizer and, when the load fails later
// (another state refuses what it read), puts it back, so that a failed load changes nothing.
class KeepsStateBeyondOptimizer {
 public:
  virtual ~KeepsStateBeyondOptimizer() = default;
  // A deep copy of that state, and what puts it back bitwise (called at most once, on failure).
  virtual std::function<void()> keep_for_restore() = 0;
};

}  // namespace ddp
