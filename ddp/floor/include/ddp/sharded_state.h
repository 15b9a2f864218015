#pragma once
// A model whose parameters live in shards across the ranks (ddp::fully_shard), as
// save_checkpoint and load_checkpoint (checkpoint.h) see it, so that the checkpoint layer needs to
// know nothing of sharding. Two formats:
//   - full (CheckpointOptions::full_state_dict, the default): the model gathered whole around the
//     save or load (gather_whole, shard_again), so the file is what the same model unsharded
//     would write (loadable by Python's torch.load, and at any world size);
//   - sharded: every rank writes and reads its own rows (local_shards), nothing gathered.
//
// Thread-safety: the training thread's, as save_checkpoint and load_checkpoint.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include <ddp/process_group.h>

namespace ddp {

// One parameter as this rank holds it: rows [first_row, first_row + rows) of dim 0 of the whole
// parameter (a 0-dim parameter is one row of one element).
struct LocalShard {
  std::string name;            // as the model's named_parameters() calls it
  at::Tensor tensor;           // the model's own parameter, now this rank's rows: a load writes into it in place
  std::vector<int64_t> shape;  // the whole parameter's
  int64_t first_row = 0;
  int64_t rows = 0;
};

class ShardedState {
 public:
  virtual ~ShardedState() = default;
  // Collective over the model's group: the module's parameters whole (in their own dtype), and
  // every tensor of `optimizer`'s per-parameter state that is shaped like a parameter's shard.
  virtual void gather_whole(torch::optim::Optimizer* optimizer) = 0;
  // Local: back to this rank's shards. take_whole: of the values the whole tensors hold now (what
  // a load put there); otherwise the shards exactly as gather_whole found them.
  virtual void shard_again(torch::optim::Optimizer* optimizer, bool take_whole) = 0;
  // Local: every sharded parameter's shard on this rank, in the model's parameter order (the
  // model's full parameters, if unsharded, are freed first: the parameters are the shards then).
  virtual std::vector<LocalShard> local_shards() = 0;
  // The groups whose ranks hold the model: the one it is sharded over, then (HSDP) the one its
  // shards are copied across. A collective over each in turn reaches every rank of the model, as a
  // load must before it changes anything (every rank read the checkpoint, or none loads it).
  virtual std::vector<ProcessGroupPtr> groups() const = 0;
};

}  // namespace ddp
