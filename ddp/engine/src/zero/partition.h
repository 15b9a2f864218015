#pragma once
// ZeRO's partition of the parameters over the ranks (PyTorch's
// ZeroRedundancyOptimizer._partition_parameters), on sizes alone so that it is testable without
// tensors or processes.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddp::detail {

// Who updates each parameter of a ZeroRedundancyOptimizer: its owner rank, by the parameter's
// place (group, position in the group), and the order each rank updates its own in. Every list of
// a rank's parameters is derived from it, so it is the only record of the partition.
class Partition {
 public:
  static constexpr int kNoOwner = -1;
  struct Place {
    size_t group = 0;
    size_t position = 0;
  };

  Partition() = default;
  // group_sizes[g] parameters in group g, none owned yet.
  explicit Partition(const std::vector<size_t>& group_sizes);
  // PyTorch's partition (partition_parameters below); each rank updates its own in group order.
  static Partition greedy(const std::vector<std::vector<int64_t>>& numels, int world_size);

  // The parameter at `place` to `rank`, updated after the ones the rank has.
  void assign(Place place, int rank);
  // The rank that updates the parameter at `place`, or kNoOwner.
  int owner(Place place) const { return slots_.at(place.group).at(place.position).owner; }
  // Rank `rank`'s parameters in the order it updates them: all of them, or group `group`'s
  // positions.
  std::vector<Place> of_rank(int rank) const;
  std::vector<size_t> of_rank(int rank, size_t group) const;

 private:
  struct Slot {
    int owner = kNoOwner;
    size_t order = 0;  // when it was assigned: its rank updates its parameters by this order
  };
  std::vector<std::vector<Slot>> slots_;
  size_t assigned_ = 0;
};

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
