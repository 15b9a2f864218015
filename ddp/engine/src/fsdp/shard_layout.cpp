#include "ddp/engine/src/fsdp/shard_layout.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace ddp::detail {

std::vector<int64_t> ShardSlot::local_shape() const {
  std::vector<int64_t> local = shape.empty() ? std::vector<int64_t>{1} : shape;
  local[0] = local_rows;
  return local;
}

ShardLayout::ShardLayout(const std::vector<std::vector<int64_t>>& shapes, int world, int rank, int64_t packed_below)
    : world_(world), rank_(rank) {
  for (const auto& shape : shapes) {
    ShardSlot slot;
    slot.shape = shape;
    slot.rows = shape.empty() ? 1 : shape[0];
    slot.row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) slot.row_numel *= shape[d];
    slot.chunk_rows = (slot.rows + world - 1) / world;
    slot.local_rows = std::clamp<int64_t>(slot.rows - rank * slot.chunk_rows, 0, slot.chunk_rows);
    slot.packed = slot.rows * slot.row_numel < packed_below;
    if (slot.packed) packed_numel_ += slot.padded_numel();
    slots_.push_back(std::move(slot));
  }
  // The packed ones first, then the others, each group in parameter order.
  for (const bool packed : {true, false}) {
    for (auto& slot : slots_) {
      if (slot.packed != packed) continue;
      slot.offset = flat_numel_;
      flat_numel_ += slot.padded_numel();
    }
  }
}

at::Tensor ShardLayout::packed_chunks(const at::Tensor& packed_all, size_t i) const {
  const ShardSlot& slot = slots_[i];
  return packed_all.view({world_, packed_numel_}).narrow(1, slot.offset, slot.padded_numel());
}

void ShardLayout::copy_local_rows(const at::Tensor& full, size_t i, at::Tensor& flat) const {
  const ShardSlot& slot = slots_[i];
  const int64_t n = slot.local_rows * slot.row_numel;
  flat.narrow(0, slot.offset, slot.padded_numel()).zero_();
  if (n > 0) flat.narrow(0, slot.offset, n).copy_(full.reshape(-1).narrow(0, rank_ * slot.padded_numel(), n));
}

at::Tensor ShardLayout::shard_view(const at::Tensor& flat, size_t i) const {
  const ShardSlot& slot = slots_[i];
  return flat.narrow(0, slot.offset, slot.local_rows * slot.row_numel).view(slot.local_shape());
}

}  // namespace ddp::detail
