// Subgroups (new_group over some ranks, new_subgroups, get_global_rank) and the device mesh, at a
// world of 4: membership and rank maps against the layout computed here, collectives over a
// subgroup against the sum of its members' known inputs, DDP and ZeRO over a subgroup against one
// process on the members' whole batch, and every bad input named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/ddp.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// The default group's ranks of `group`'s members, gathered over `group` (null: not a member).
std::vector<int64_t> members_of(const ddp::ProcessGroupPtr& group) {
  std::vector<int64_t> members;
  for (const auto& rank : ddp::all_gather(torch::tensor({static_cast<int64_t>(ddp::get_rank())}), group)) {
    members.push_back(rank.item<int64_t>());
  }
  return members;
}

DDP_WORKER(subgroup_layout) {
  worker_init();
  const int rank = ddp::get_rank();
  // Listed unsorted: group rank i is the i-th smallest, as PyTorch sorts them.
  ddp::ProcessGroupPtr evens = ddp::new_group(ddp::NewGroupOptions().ranks({2, 0}));
  require((evens != nullptr) == (rank % 2 == 0), "membership of {0, 2} on rank " + std::to_string(rank));
  if (evens) {
    require(evens->getSize() == 2 && evens->getRank() == rank / 2, "group rank " + std::to_string(evens->getRank()));
    require(members_of(evens) == std::vector<int64_t>{0, 2}, "members of evens");
    require(ddp::get_global_rank(evens, 1) == 2 && ddp::get_group_rank(evens, 2) == 1 &&
                ddp::get_group_rank(evens, 1) == -1,
            "rank maps of evens");
    double value = rank + 1;
    ddp::all_reduce(value, c10d::ReduceOp::SUM, evens);
    require(value == 4, "sum over {0, 2}: " + std::to_string(value));
    require(ddp::transport(evens) == "gloo+shm", "evens' transport: " + ddp::transport(evens));
    // A group of a subgroup: global ranks carry through.
    auto last = ddp::new_group(ddp::NewGroupOptions().parent(evens).ranks({1}));
    require((last != nullptr) == (rank == 2), "membership of evens' {1}");
    if (last) require(ddp::get_global_rank(last, 0) == 2, "global rank through two levels");
  }
  // The world still works after groups that left some ranks out.
  double all = 1;
  ddp::all_reduce(all);
  require(all == 4, "world sum after subgroups");

  ddp::ProcessGroupPtr pair = ddp::new_subgroups(2);
  const int64_t first = rank / 2 * 2;
  require(members_of(pair) == std::vector<int64_t>{first, first + 1}, "new_subgroups(2) block of rank " + std::to_string(rank));

  ddp::DeviceMesh mesh = ddp::init_device_mesh({2, 2}, {"replicate", "shard"});
  require(mesh.coordinate() == std::vector<int>{rank / 2, rank % 2}, "coordinate of rank " + std::to_string(rank));
  require(members_of(mesh.group("shard")) == std::vector<int64_t>{first, first + 1}, "shard group");
  require(members_of(mesh.group("replicate")) == std::vector<int64_t>{rank % 2, rank % 2 + 2}, "replicate group");
  require(mesh.size("shard") == 2 && mesh.size(0) == 2 && mesh.ndim() == 2, "mesh sizes");
  ddp::DeviceMesh line = ddp::init_device_mesh({4});
  require(line.coordinate() == std::vector<int>{rank} && members_of(line.group(0)) == std::vector<int64_t>{0, 1, 2, 3},
          "1-D mesh");
  ddp::DeviceMesh flat = ddp::init_device_mesh({1, 4}, {"a", "b"});
  require(flat.size("a") == 1 && members_of(flat.group("a")) == std::vector<int64_t>{rank}, "extent-1 dimension");
}
TEST(Subgroups, MembershipRankMapsAndTheMeshFollowPyTorchsLayout) {
  EXPECT_WORKERS_OK(run_workers("subgroup_layout", 4));
}

// DDP and ZeRO over new_group({0, 2}) at a world of 4 train as one process on the two members'
// whole batch (the same training as a world of 2); ranks 1 and 3 train nothing meanwhile.
DDP_WORKER(subgroup_training) {
  worker_init();
  const int rank = ddp::get_rank();
  ddp::ProcessGroupPtr evens = ddp::new_group(ddp::NewGroupOptions().ranks({0, 2}));
  if (!evens) return;
  const int member = evens->getRank();
  torch::manual_seed(rank + 1);  // rank 0's weights must reach rank 2
  MLP net;
  ddp::DistributedDataParallel model(net, evens);
  MLP reference;
  copy_parameters(*net, *reference);
  ddp::ZeroRedundancyOptimizer<torch::optim::Adam> optimizer(
      model.parameters(), ddp::ZeroRedundancyOptimizerOptions().process_group(evens), torch::optim::AdamOptions(0.01));
  torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(300 + step);
    auto x = torch::randn({8, 10}), y = torch::randn({8, 5});
    optimizer.zero_grad();
    torch::mse_loss(model.forward(x.narrow(0, 4 * member, 4)), y.narrow(0, 4 * member, 4)).backward();
    optimizer.step();
    reference_optimizer.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    reference_optimizer.step();
  }
  const auto got = net->parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    require(torch::allclose(got[i], want[i], 1e-5, 1e-6), "parameter " + std::to_string(i) + " after 3 steps");
  }
}
TEST(Subgroups, DDPAndZeroOverASubgroupTrainAsAWorldOfItsMembers) {
  EXPECT_WORKERS_OK(run_workers("subgroup_training", 4));
}

DDP_WORKER(subgroup_bad_input) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  require_throws([] { ddp::new_group(ddp::NewGroupOptions().ranks({0, 5})); },
                  "rank 5 of ranks {0, 5} is not a rank of the parent group, whose ranks are 0 to 3", "an out-of-range rank");
  require_throws([] { ddp::new_group(ddp::NewGroupOptions().ranks({1, 1})); }, "rank 1 appears twice", "a repeated rank");
  require_throws([&] { ddp::new_group(ddp::NewGroupOptions().ranks({0, rank == 3 ? 3 : 1})); },
                  "the ranks of the parent group passed different member lists", "lists that differ across ranks");
  require_throws([] { ddp::new_subgroups(3); }, "group_size 3 does not divide the world size 4", "new_subgroups(3)");
  require_throws([] { ddp::init_device_mesh({3}); }, "shape {3} holds 3 ranks, but the world has 4", "a mesh too small");
  require_throws([] { ddp::init_device_mesh({2, 2}, {"x", "x"}); }, "'x' is used twice", "a repeated name");
  ddp::DeviceMesh mesh = ddp::init_device_mesh({2, 2}, {"dp", "tp"});
  require_throws([&] { mesh.group("pp"); }, "no dimension is named 'pp' (its dimensions: 'dp', 'tp')", "an unknown name");
  require_throws([&] { ddp::get_global_rank(mesh.group("tp"), 2); }, "rank 2 is not a rank of the group", "get_global_rank");
  // After every refusal the world still agrees.
  int one = 1;
  ddp::all_reduce(one);
  require(one == 4, "world sum after the refusals");
}
TEST(Subgroups, BadInputIsNamedOnEveryRank) { EXPECT_WORKERS_OK(run_workers("subgroup_bad_input", 4)); }

}  // namespace
