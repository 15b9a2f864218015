#pragma once
// Where each parameter of one fully_shard call lives when sharded: every parameter cut along dim 0
// into W chunks of ceil(rows / W) rows (PyTorch's torch.chunk, as FSDP2 shards), rank r keeping
// chunk r. A rank's chunks of all the unit's parameters sit one after the other in one flat
// buffer, each padded to the full chunk size, so that the W padded chunks of a parameter side by
// side are the parameter row-major followed by padding: an all-gather of the chunk lands the whole
// parameter in place, and a reduce-scatter of the padded whole gives each rank its chunk.
// Small parameters (biases, norms' weights) come first in the flat buffer, packed: they travel in
// one collective together, whose latency their bytes would not pay for one by one.
// Sizes only, plus the copies; testable in one process.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace ddp::detail {

struct ShardSlot {
  std::vector<int64_t> shape;  // the parameter's full shape (a 0-dim parameter is one row of 1)
  int64_t rows = 0;            // full extent of dim 0
  int64_t row_numel = 0;       // elements per row
  int64_t chunk_rows = 0;      // ceil(rows / W): every rank's padded chunk
  int64_t local_rows = 0;      // the rows this rank really holds (fewer, or 0, at the end)
  int64_t offset = 0;          // where the padded chunk starts in the flat shard
  bool packed = false;         // in the packed prefix [0, packed_numel()) of the flat shard
  int64_t padded_numel() const { return chunk_rows * row_numel; }
  // This rank's shard as a parameter: local_rows rows of the full shape's other dims.
  std::vector<int64_t> local_shape() const;
};

class ShardLayout {
 public:
  ShardLayout() = default;
  // Parameters of fewer than `packed_below` elements are packed (0: none).
  ShardLayout(const std::vector<std::vector<int64_t>>& shapes, int world, int rank, int64_t packed_below = 0);

  const std::vector<ShardSlot>& slots() const { return slots_; }
  int64_t flat_numel() const { return flat_numel_; }  // one rank's flat shard, padding included
  int64_t packed_numel() const { return packed_numel_; }  // the packed parameters' chunks, first
  int world() const { return world_; }
  int rank() const { return rank_; }

  // This rank's rows of `full` (parameter i's full value) written into its place in `flat`.
  void copy_local_rows(const at::Tensor& full, size_t i, at::Tensor& flat) const;
  // Parameter i's shard, a view of `flat` (rank-local, unpadded).
  at::Tensor shard_view(const at::Tensor& flat, size_t i) const;
  // A packed parameter's W padded chunks inside `packed_all` (every rank's packed prefix, rank r's
  // at r * packed_numel()): a [W, padded] view, row r rank r's chunk.
  at::Tensor packed_chunks(const at::Tensor& packed_all, size_t i) const;

 private:
  std::vector<ShardSlot> slots_;
  int64_t flat_numel_ = 0;
  int64_t packed_numel_ = 0;
  int world_ = 1;
  int rank_ = 0;
};

}  // namespace ddp::detail
