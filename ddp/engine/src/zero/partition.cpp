// Sorted greedy: the largest parameters first, each to the least loaded rank. Partitioning group
// after group (with the load counted across groups) keeps every earlier group's owners when a
// group is added: add_param_group moves no state.
#include "zero/partition.h"

#include <algorithm>
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

}  // namespace ddp::detail
