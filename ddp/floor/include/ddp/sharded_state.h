#pragma once
// A model whose parameters live in shards across the ranks (ddp::fully_shard) is checkpointed
// whole, as a model that was never sharded would be: save_checkpoint and load_checkpoint
// (checkpoint.h) gather it around their work through this interface, so the file is the same
// (loadable by Python's torch.load, and at any world size) and the checkpoint layer needs to know
// nothing of sharding.
//
// Thread-safety: the training thread's, as save_checkpoint and load_checkpoint.
#include <torch/optim/optimizer.h>

namespace ddp {

class ShardedState {
 public:
  virtual ~ShardedState() = default;
  // Collective over the model's group: the module's parameters whole (in their own dtype), and
  // every tensor of `optimizer`'s per-parameter state that is shaped like a parameter's shard.
  virtual void gather_whole(torch::optim::Optimizer* optimizer) = 0;
  // Local: back to this rank's shards. take_whole: of the values the whole tensors hold now (what
  // a load put there); otherwise the shards exactly as gather_whole found them.
  virtual void shard_again(torch::optim::Optimizer* optimizer, bool take_whole) = 0;
};

}  // namespace ddp
