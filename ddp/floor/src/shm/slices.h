#pragma once
// How the ranks split an array into slices (the sliced allreduce's chunks, allreduce_shared's
// arrays: the part each rank reduces). Internal to the core.
#include <algorithm>
#include <cstddef>
#include <utility>

namespace ddp::detail::shm {

// [begin, end) of `rank`'s slice of n elements among `size` ranks: nearly equal parts in rank
// order, cut at multiples of 64 bytes (whole cache lines, aligned vectors) where there are enough
// elements.
inline std::pair<std::size_t, std::size_t> slice(int rank, int size, std::size_t n, std::size_t element_size) {
  const std::size_t unit = std::max<std::size_t>(1, 64 / element_size);
  const std::size_t units = (n + unit - 1) / unit;
  const auto cut = [&](int r) { return std::min(n, units * static_cast<std::size_t>(r) / static_cast<std::size_t>(size) * unit); };
  return {cut(rank), cut(rank + 1)};
}

}  // namespace ddp::detail::shm
