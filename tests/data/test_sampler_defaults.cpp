// num_replicas and rank left unset come from the default process group (as in PyTorch, where
// DistributedSampler asks dist.get_world_size() / dist.get_rank()).
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <ddp/distributed_sampler.h>

#include "multiprocess.h"

namespace {

using ddp::test::require;

std::string join(const std::vector<size_t>& values) {
  std::ostringstream out;
  for (size_t v : values) out << v << ' ';
  return out.str();
}

// Each rank builds one sampler with the group's values spelled out and one with them unset; both
// must agree on world, rank, size and the indices of two epochs. 11 samples over 2 ranks pads.
DDP_WORKER(sampler_defaults_from_group) {
  auto pg = ddp::test::worker_init();
  const int64_t world = ddp::get_world_size();
  const int64_t rank = ddp::get_rank();
  require(world == 2, "expected a world of 2");
  ddp::DistributedSampler implicit(11, ddp::DistributedSamplerOptions().seed(3));
  ddp::DistributedSampler explicit_(11, ddp::DistributedSamplerOptions().num_replicas(world).rank(rank).seed(3));
  require(implicit.num_replicas() == 2, "num_replicas() = " + std::to_string(implicit.num_replicas()));
  require(implicit.rank() == rank, "rank() = " + std::to_string(implicit.rank()) + ", group rank " +
                                       std::to_string(rank));
  require(implicit.size() == 6, "size() = " + std::to_string(implicit.size()) + ", expected ceil(11 / 2) = 6");
  require(implicit.size() == explicit_.size(), "size differs from the explicit sampler's");
  for (int64_t epoch : {0, 1}) {
    implicit.set_epoch(epoch);
    explicit_.set_epoch(epoch);
    require(implicit.indices() == explicit_.indices(), "epoch " + std::to_string(epoch) + ": indices " +
                                                          join(implicit.indices()) + "differ from " +
                                                          join(explicit_.indices()));
  }
  // The two ranks' shards are different (rank really is the group's, not 0 everywhere).
  ddp::test::write_shared("indices_" + std::to_string(rank), join(implicit.indices()));
}

TEST(DistributedSampler, UnsetWorldAndRankComeFromTheDefaultGroup) {
  ddp::test::RunOptions options;
  options.shared_dir = ddp::test::make_temp_dir("sampler_defaults_");
  EXPECT_WORKERS_OK(ddp::test::run_workers("sampler_defaults_from_group", 2, options));
  // Read the shards back here: the shared dir outlives the workers.
  const auto read = [&](int rank) {
    std::ifstream in(options.shared_dir + "/indices_" + std::to_string(rank));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const std::string rank0 = read(0), rank1 = read(1);
  ddp::test::remove_tree(options.shared_dir);
  EXPECT_FALSE(rank0.empty());
  EXPECT_NE(rank0, rank1) << "both ranks got the same shard";
}

}  // namespace
