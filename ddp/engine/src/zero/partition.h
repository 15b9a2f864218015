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

// Parameters [first, end) of DDP bucket `bucket`, updated and broadcast by `rank`.
struct BucketPiece {
  size_t bucket = 0;
  size_t first = 0;
  size_t end = 0;
  int rank = 0;
};

// The overlap's shard_buckets assignment, on sizes alone: numels[b][k] is the numel of parameter k
// of DDP bucket b. The buckets' parameters, taken in bucket order as one sequence, are cut where
// the running total comes nearest to total * r / W (r = 1 .. W-1; a tie cuts earlier), and rank r
// takes the r-th run. Each cut is within half a parameter of its mark, so every rank holds at most
// total / W plus one parameter (the largest at most), whatever the layout; a run that crosses a
// bucket's end is one piece per bucket. Pieces come bucket by bucket, ranks ascending in each.
std::vector<BucketPiece> shard_buckets(const std::vector<std::vector<int64_t>>& numels, int world_size);

}  // namespace ddp::detail
