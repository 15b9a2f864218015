#include "fsdp/shard_layout.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace ddp::detail {

std::vector<int64_t> ShardSlot::local_shape() const {
  std::vector<int64_t> local = shape.empty() ? std::vector<int64_t>{1} : shape;
  local[0] = local_rows;
  return local;
}

ShardLayout::ShardLayout(const std::vector<std::vector<int64_t>>& shapes, int world, int rank)
    : world_(world), rank_(rank) {
  for (const auto& shape : shapes) {
    ShardSlot slot;
    slot.shape = shape;
    slot.rows = shape.empty() ? 1 : shape[0];
    slot.row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) slot.row_numel *= shape[d];
    slot.chunk_rows = (slot.rows + world - 1) / world;
    slot.local_rows = std::clamp<int64_t>(slot.rows - rank * slot.chunk_rows, 0, slot.chunk_rows);
    slot.offset = flat_numel_;
    flat_numel_ += slot.padded_numel();
    slots_.push_back(std::move(slot));
  }
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

at::Tensor ShardLayout::full_from_gathered(const at::Tensor& gathered, size_t i) const {
  const ShardSlot& slot = slots_[i];
  // Segment r holds rank r's chunk at the same offset: the W chunks side by side are the padded
  // parameter, row-major, once the [W, chunk] block is made contiguous (the one copy).
  at::Tensor chunks = gathered.view({world_, flat_numel_}).narrow(1, slot.offset, slot.padded_numel());
  at::Tensor padded = chunks.contiguous().view({world_ * slot.chunk_rows, slot.row_numel});
  return padded.narrow(0, 0, slot.rows).view(slot.shape);
}

void ShardLayout::place_in_segments(const at::Tensor& full, size_t i, at::Tensor& scatter_input) const {
  const ShardSlot& slot = slots_[i];
  at::Tensor segments = scatter_input.view({world_, flat_numel_});
  at::Tensor rows = full.reshape(-1);
  for (int r = 0; r < world_; ++r) {
    const int64_t held = std::clamp<int64_t>(slot.rows - r * slot.chunk_rows, 0, slot.chunk_rows) * slot.row_numel;
    at::Tensor segment = segments[r].narrow(0, slot.offset, slot.padded_numel());
    if (held > 0) segment.narrow(0, 0, held).copy_(rows.narrow(0, r * slot.padded_numel(), held));
    if (held < slot.padded_numel()) segment.narrow(0, held, slot.padded_numel() - held).zero_();
  }
}

}  // namespace ddp::detail
