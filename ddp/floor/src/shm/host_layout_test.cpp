// HostLayout (host_layout.h): layouts written out by hand, one per case a job can have.
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddp/floor/src/shm/host_layout.h"

namespace shm = ddp::detail::shm;
using Ranks = std::vector<int>;

TEST(HostLayout, TwoHostsTwoRanksEachInterleaved) {
  // Ranks 0 and 2 on host "a", 1 and 3 on "b" (a launcher that deals ranks round-robin).
  const shm::HostLayout layout({"a", "b", "a", "b"});
  EXPECT_EQ(layout.size(), 4);
  EXPECT_EQ(layout.hosts(), 2);
  EXPECT_EQ((Ranks{layout.host_of(0), layout.host_of(1), layout.host_of(2), layout.host_of(3)}), (Ranks{0, 1, 0, 1}));
  EXPECT_EQ((Ranks{layout.local_rank_of(0), layout.local_rank_of(1), layout.local_rank_of(2), layout.local_rank_of(3)}),
            (Ranks{0, 0, 1, 1}));
  EXPECT_EQ(layout.ranks_on_host(0), (Ranks{0, 2}));
  EXPECT_EQ(layout.ranks_on_host(1), (Ranks{1, 3}));
  EXPECT_EQ(layout.ranks_with_local_rank(0), (Ranks{0, 1}));
  EXPECT_EQ(layout.ranks_with_local_rank(1), (Ranks{2, 3}));
  EXPECT_TRUE(layout.uniform());
  EXPECT_TRUE(layout.hierarchical());
}

TEST(HostLayout, ThreeHostsInBlocks) {
  // ddprun's order: node n holds ranks n*L .. n*L + L - 1.
  const shm::HostLayout layout({"x", "x", "y", "y", "z", "z"});
  EXPECT_EQ(layout.hosts(), 3);
  EXPECT_EQ(layout.ranks_on_host(2), (Ranks{4, 5}));
  EXPECT_EQ(layout.ranks_with_local_rank(0), (Ranks{0, 2, 4}));
  EXPECT_EQ(layout.ranks_with_local_rank(1), (Ranks{1, 3, 5}));
  EXPECT_EQ(layout.local_rank_of(5), 1);
  EXPECT_TRUE(layout.hierarchical());
  EXPECT_THROW(layout.ranks_with_local_rank(2), std::out_of_range);
}

TEST(HostLayout, WhereHierarchicalDoesNotApply) {
  const shm::HostLayout one_host({"a", "a", "a"});
  EXPECT_EQ(one_host.hosts(), 1);
  EXPECT_TRUE(one_host.uniform());
  EXPECT_FALSE(one_host.hierarchical());  // all shared memory already

  const shm::HostLayout one_rank_each({"a", "b", "c"});
  EXPECT_TRUE(one_rank_each.uniform());
  EXPECT_FALSE(one_rank_each.hierarchical());  // nothing to reduce inside a host

  const shm::HostLayout uneven({"a", "a", "a", "b"});  // 3 + 1: flat Gloo, with a notice
  EXPECT_FALSE(uneven.uniform());
  EXPECT_FALSE(uneven.hierarchical());
  EXPECT_EQ(uneven.ranks_on_host(0), (Ranks{0, 1, 2}));
  EXPECT_THROW(uneven.ranks_with_local_rank(1), std::out_of_range);

  const shm::HostLayout alone({"a"});
  EXPECT_EQ(alone.hosts(), 1);
  EXPECT_FALSE(alone.hierarchical());
}

TEST(HostLayout, BadIdentitiesAreRefusedNamingTheRank) {
  EXPECT_THROW(shm::HostLayout(std::vector<std::string>{}), std::invalid_argument);
  try {
    shm::HostLayout({"a", ""});
    FAIL() << "accepted an empty identity";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "HostLayout: rank 1 has no host identity");
  }
}
