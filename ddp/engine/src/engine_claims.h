#pragma once
// Which engine trains each parameter: DistributedDataParallel and fully_shard both rewire a
// parameter's gradient (hooks, swapped data), so each refuses a parameter the other drives.
#include <vector>

#include <ATen/core/Tensor.h>

namespace ddp::detail {

// DistributedDataParallel's parameters, from its construction to its destruction.
void claim_for_ddp(const std::vector<at::Tensor>& params);
void release_from_ddp(const std::vector<at::Tensor>& params);
// "DistributedDataParallel" when a live wrapper drives `param`, else null.
const char* engine_wrapping(const at::Tensor& param);
// Whether a fully_shard call of a live module holds `param` (fsdp/fully_shard.cpp).
bool is_fully_sharded(const at::Tensor& param);

}  // namespace ddp::detail
