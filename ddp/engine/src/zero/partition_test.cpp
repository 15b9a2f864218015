// ZeRO's partition on sizes alone, against assignments worked out by hand from PyTorch's rule.
#include <gtest/gtest.h>

#include "zero/partition.h"

namespace {

using Owners = std::vector<std::vector<int>>;

TEST(ZeroPartition, LargestFirstToTheLeastLoadedRank) {
  // Sorted: 100 (i0) -> 0; 60 (i2) -> 1; 60 (i3) -> 1 (60 < 100); 10 (i1) -> 0 (100 < 120);
  // 5 (i4) -> 0 (110 < 120). Loads 115 | 120.
  EXPECT_EQ(ddp::detail::partition_parameters({{100, 10, 60, 60, 5}}, 2), (Owners{{0, 0, 1, 1, 0}}));
}

TEST(ZeroPartition, LoadCarriesAcrossGroupsAndTiesGoToTheLowestRank) {
  // Group 0: 8 -> 0, 4 -> 1 (loads 8 4 0). Group 1: 4 -> 2 (8 4 4), then 4 -> 1, the lowest of
  // the two ranks at 4.
  EXPECT_EQ(ddp::detail::partition_parameters({{8, 4}, {4, 4}}, 3), (Owners{{0, 1}, {2, 1}}));
}

TEST(ZeroPartition, EqualSizesKeepTheirOrder) {
  EXPECT_EQ(ddp::detail::partition_parameters({{3, 3, 3, 3}}, 2), (Owners{{0, 1, 0, 1}}));
}

TEST(ZeroPartition, MoreRanksThanParametersLeavesSomeEmpty) {
  EXPECT_EQ(ddp::detail::partition_parameters({{7, 9}}, 4), (Owners{{1, 0}}));
}

TEST(ZeroPartition, AddingAGroupKeepsTheEarlierOwners) {
  const auto before = ddp::detail::partition_parameters({{50, 20, 20, 10}}, 3);
  const auto after = ddp::detail::partition_parameters({{50, 20, 20, 10}, {30, 5}}, 3);
  EXPECT_EQ(after.front(), before.front());
  // Group 0: 50 -> 0, 20 -> 1, 20 -> 2, 10 -> 1: loads 50 | 30 | 20. Then 30 -> 2 (50 | 30 | 50)
  // and 5 -> 1.
  EXPECT_EQ(after.back(), (std::vector<int>{2, 1}));
}

}  // namespace
