// Sorted greedy: the largest parameters first, each to the least loaded rank. Partitioning group
// after group (with the load counted across groups) keeps every earlier group's owners when a
// group is added: add_param_group moves no state. Then the Partition that records the owners, and
// the overlap's cut of DDP's buckets.
#include "ddp/engine/src/zero/partition.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>

namespace ddp::detail {

std::vector<std::vector<int>> partition_parameters(const std::vector<std::vector<int64_t>>& numels, int world_size) {
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<std::vector<int>> owner;
  for (const auto& group : numels) {
    // Largest first; equal sizes keep their order (PyTorch: Python's stable sorted()).
    std::vector<size_t> order(group.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return group[a] > group[b]; });
    std::vector<int> owners(group.size(), 0);
    for (size_t i : order) {
      // The least loaded rank, the lowest one among equals.
      const auto rank = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owners[i] = static_cast<int>(rank);
      load[rank] += group[i];
    }
    owner.push_back(std::move(owners));
  }
  return owner;
}

Partition::Partition(const std::vector<size_t>& group_sizes) {
  for (size_t size : group_sizes) slots_.emplace_back(size);
}

Partition Partition::greedy(const std::vector<std::vector<int64_t>>& numels, int world_size) {
  std::vector<size_t> sizes;
  for (const auto& group : numels) sizes.push_back(group.size());
  Partition partition(sizes);
  const auto owners = partition_parameters(numels, world_size);
  for (size_t g = 0; g < owners.size(); ++g) {
    for (size_t i = 0; i < owners[g].size(); ++i) partition.assign({g, i}, owners[g][i]);
  }
  return partition;
}

void Partition::assign(Place place, int rank) {
  Slot& slot = slots_.at(place.group).at(place.position);
  slot.owner = rank;
  slot.order = assigned_++;
}

std::vector<Partition::Place> Partition::of_rank(int rank) const {
  std::vector<Place> places;
  for (size_t g = 0; g < slots_.size(); ++g) {
    for (size_t i = 0; i < slots_[g].size(); ++i) {
      if (slots_[g][i].owner == rank) places.push_back({g, i});
    }
  }
  std::sort(places.begin(), places.end(), [&](const Place& a, const Place& b) {
    return slots_[a.group][a.position].order < slots_[b.group][b.position].order;
  });
  return places;
}

std::vector<size_t> Partition::of_rank(int rank, size_t group) const {
  std::vector<size_t> positions;
  for (const Place& place : of_rank(rank)) {
    if (place.group == group) positions.push_back(place.position);
  }
  return positions;
}

std::vector<BucketPiece> shard_buckets(const std::vector<std::vector<int64_t>>& numels, int world_size) {
  // 1. The running total at every boundary between parameters (the sequence's start and end too).
  std::vector<int64_t> boundary{0};
  for (const auto& bucket : numels) {
    for (int64_t numel : bucket) boundary.push_back(boundary.back() + numel);
  }
  const int64_t total = boundary.back();
  // 2. Cut r: the boundary nearest to total * r / W (in W-ths: no rounding), the earlier on a tie.
  std::vector<size_t> cut{0};
  for (int r = 1; r < world_size; ++r) {
    const int64_t mark = total * r;  // total * r / W, times W
    size_t best = cut.back();
    for (size_t i = best; i < boundary.size(); ++i) {
      if (std::llabs(boundary[i] * world_size - mark) < std::llabs(boundary[best] * world_size - mark)) best = i;
    }
    cut.push_back(best);
  }
  cut.push_back(boundary.size() - 1);
  // 3. Rank r's run [cut r, cut r+1), one piece per bucket it touches.
  std::vector<BucketPiece> pieces;
  size_t start = 0;  // the sequence index of the bucket's first parameter
  for (size_t b = 0; b < numels.size(); ++b) {
    const size_t end = start + numels[b].size();
    for (int r = 0; r < world_size; ++r) {
      const size_t from = std::max(start, cut[static_cast<size_t>(r)]);
      const size_t to = std::min(end, cut[static_cast<size_t>(r) + 1]);
      if (from < to) pieces.push_back({b, from - start, to - start, r});
    }
    start = end;
  }
  return pieces;
}

}  // namespace ddp::detail
