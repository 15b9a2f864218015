#pragma once
// ZeRO's partition of the parameters over the ranks (PyTorch's
// ZeroRedundancyOptimizer._partition_parameters), on sizes alone so that it is testable without
// tensors or processes.
#include <cstdint>
#include <vector>

namespace ddp::detail {

// numels[g][i]: the numel of parameter i of group g. Returns owner[g][i], the rank that updates it.
// Group by group, in order: the group's parameters sorted by numel, largest first (a stable sort:
// equal sizes keep their order), each to the rank with the least numel so far, counted over all
// groups (the lowest such rank). A parameter is never split.
std::vector<std::vector<int>> partition_parameters(const std::vector<std::vector<int64_t>>& numels, int world_size);

}  // namespace ddp::detail
