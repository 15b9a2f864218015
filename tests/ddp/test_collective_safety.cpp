// Collectives that do not match across ranks: never a silently wrong result, never an abort the
// program cannot catch; an error on every rank that says what each rank ran.
#include <cstdlib>
#include <functional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/version.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_optimizer.h>

#include "sequence_number.h"
#include "models.h"
#include "multiprocess.h"
#include "error_of.h"

namespace {

using namespace ddp::test;

// Rank 0 all-reduces 1000 floats, rank 1 999: Gloo used to abort rank 1 in its transport thread
// ("op.preamble.length <= op.nbytes", SIGABRT). Now both ranks get a CollectiveError naming both.
DDP_WORKER(mismatched_sizes) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto tensor = torch::ones({rank == 0 ? 1000 : 999});
  auto message = error_of<ddp::CollectiveError>([&] { ddp::all_reduce(tensor); });
  require_mentions(message, "ddp::all_reduce: the ranks are not running the same collective", "sizes");
  require_mentions(message, "rank 0 runs all_reduce of 1000 Float elements", "sizes");
  require_mentions(message, "rank 1 runs all_reduce of 999 Float elements", "sizes");
  // The group is still usable afterwards: the check ran before any payload moved.
  auto ok = torch::ones({4});
  ddp::all_reduce(ok);
  require(ok.sum().item<float>() == 8, "the group is broken after the mismatch");
}
// The fingerprint check runs under TORCH_DISTRIBUTED_DEBUG=DETAIL, as PyTorch's does; on Gloo
// alone (shared memory off), where a mismatch otherwise reaches Gloo.
RunOptions detail_on_gloo() {
  RunOptions options;
  options.env = {{"TORCH_DISTRIBUTED_DEBUG", "DETAIL"}, {"TORCHDDP_SHM", "0"}};
  return options;
}
TEST(CollectiveSafety, MismatchedSizesAreAnErrorOnEveryRankNotAnAbort) {
  EXPECT_WORKERS_OK(run_workers("mismatched_sizes", 2, detail_on_gloo()));
}

// Without DETAIL a free collective is one collective, nothing more (issue 23): the group's own
// sequence number, which Gloo advances once per collective, moves by exactly one per call. Under
// DETAIL the check adds its one allgather.
DDP_WORKER(free_collective_count) {
  const bool detail = std::getenv("TORCH_DISTRIBUTED_DEBUG") != nullptr;
  ddp::InitOptions init;
  init.shared_memory(false);  // Gloo counts its collectives; the shared-memory channel does not
  init.backend = "gloo";
  init.init_method = std::string("file://") + std::getenv("DDP_TEST_STORE");
  auto pg = ddp::init_process_group(init);
  start_sequence_number(pg);
  auto tensor = torch::ones({16});
  for (const auto& [name, run] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"all_reduce", [&] { ddp::all_reduce(tensor); }},
           {"broadcast", [&] { ddp::broadcast(tensor, 0); }},
           {"all_gather", [&] { ddp::all_gather(tensor); }},
           {"barrier", [&] { ddp::barrier(); }}}) {
    const uint64_t before = pg->getSequenceNumberForGroup();
    run();
    const uint64_t issued = pg->getSequenceNumberForGroup() - before;
    require(issued == (detail ? 2u : 1u), name + " issued " + std::to_string(issued) + " collectives");
  }
}
TEST(CollectiveSafety, AFreeCollectiveIsOneCollectiveWithoutDetail) {
  EXPECT_WORKERS_OK(run_workers("free_collective_count", 2));
  RunOptions detail;
  detail.env = {{"TORCH_DISTRIBUTED_DEBUG", "DETAIL"}};
  EXPECT_WORKERS_OK(run_workers("free_collective_count", 2, detail));
}

// On shared memory the mismatch is caught without DETAIL and without an extra round trip: every
// rank compares the others' descriptors of the collective as it starts (shm/communicator.h).
DDP_WORKER(mismatched_sizes_shm) {
  worker_init(std::chrono::seconds(20));
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  const int rank = ddp::get_rank();
  auto tensor = torch::ones({rank == 0 ? 1000 : 999});
  auto message = error_of<ddp::CollectiveError>([&] { ddp::all_reduce(tensor); });
  require_mentions(message, "ddp::all_reduce failed", "sizes");
  require_mentions(message, "1000", "sizes");
  require_mentions(message, "999", "sizes");
}
TEST(CollectiveSafety, MismatchedSizesAreNamedOnSharedMemoryWithoutDetail) {
  EXPECT_WORKERS_OK(run_workers("mismatched_sizes_shm", 2));
}

// Different collectives (a broadcast against an all_reduce, different dtypes, different roots).
DDP_WORKER(mismatched_ops) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto tensor = torch::ones({8});
  auto ops = error_of<ddp::CollectiveError>([&] {
    if (rank == 0) ddp::broadcast(tensor, 0);
    else ddp::all_reduce(tensor);
  });
  require_mentions(ops, "rank 0 runs broadcast of 8 Float elements from rank 0", "ops");
  require_mentions(ops, "rank 1 runs all_reduce of 8 Float elements", "ops");
  auto dtypes = error_of<ddp::CollectiveError>([&] {
    auto typed = rank == 0 ? torch::ones({8}) : torch::ones({8}, torch::kDouble);
    ddp::all_reduce(typed);
  });
  require_mentions(dtypes, "8 Double elements", "dtypes");
  auto roots = error_of<ddp::CollectiveError>([&] { ddp::broadcast(tensor, rank); });
  require_mentions(roots, "from rank 1", "roots");
  // The operation is part of the collective (issue 28: GradScaler's MAX paired with a SUM of the
  // same size read a sum as "inf found").
  auto reduce_ops = error_of<ddp::CollectiveError>(
      [&] { ddp::all_reduce(tensor, rank == 0 ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX); });
  require_mentions(reduce_ops, "rank 0 runs all_reduce of 8 Float elements with SUM", "reduce ops");
  require_mentions(reduce_ops, "rank 1 runs all_reduce of 8 Float elements with MAX", "reduce ops");
}
TEST(CollectiveSafety, DifferentCollectivesDtypesOrRootsAreNamed) {
  EXPECT_WORKERS_OK(run_workers("mismatched_ops", 2, detail_on_gloo()));
}

// Issue 17, item 6: a collective that times out says which rank did not come, and why. Rank 1 is
// alive but never calls the collective; rank 0's error names it (heartbeat.h). The frozen case
// (SIGSTOP: "rank 1 stopped") is TrainFashionMnist.AFrozenRankEndsTheJobWithinTimeout.
DDP_WORKER(stalled_rank) {
  worker_init(std::chrono::seconds(3));
  if (ddp::get_rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(9));  // past rank 0's timeout and its stall check
    return;
  }
  auto tensor = torch::ones({4});
  const std::string message = error_of<ddp::CollectiveError>([&] { ddp::all_reduce(tensor); });
  require_mentions(message, "Stall check: rank 1 is running but in no collective", "stall check");
}
TEST(CollectiveSafety, ATimedOutCollectiveNamesTheRankThatDidNotCome) {
  EXPECT_WORKERS_OK(run_workers("stalled_rank", 2));
}

// Issue 17's silent wrong answer: rank 0 trains 4 DDP steps, rank 1 trains 3 and then all-reduces
// a tensor exactly the size of the gradient bucket. That all_reduce used to pair with rank 0's 4th
// bucket: rank 0 took rank 1's tensor as gradient, both "succeeded" with diverged replicas. DDP's
// collectives now run on a group of their own, so nothing pairs: both ranks get an error.
DDP_WORKER(ddp_never_pairs_with_user) {
  worker_init(std::chrono::seconds(4));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  MLP net;
  ddp::DistributedDataParallel model(net, ddp::DDPOptions().bucket_cap_mb(100).first_bucket_cap_mb(100));
  require(model.reduction_stats().buckets.size() == 1, "the test wants one bucket");
  int64_t bucket_numel = 0;
  for (const auto& p : model.parameters()) bucket_numel += p.numel();
  const int steps = rank == 0 ? 4 : 3;
  std::string message;
  for (int step = 0; step < steps && message.empty(); ++step) {
    auto [x, y] = batch(step);
    message = error_of<ddp::CollectiveError>([&] {
      torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    });
  }
  if (rank == 1) {
    require(message.empty(), "rank 1's 3 steps failed: " + message);
    auto impostor = torch::full({bucket_numel}, 1e6);
    message = error_of<ddp::CollectiveError>([&] { ddp::all_reduce(impostor); });
  }
  require(!message.empty(), "rank " + std::to_string(rank) + " finished without an error: its collective paired "
                            "with the other rank's unrelated one");
  if (rank == 0) require_mentions(message, "gradient bucket 0", "rank 0");
  if (rank == 1) require_mentions(message, "ddp::all_reduce", "rank 1");
}
TEST(CollectiveSafety, DdpCollectivesNeverPairWithTheProgramsOwn) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("ddp_never_pairs_with_user", 2, options));
}

// The same program on a group built with c10d directly used to end with both ranks "succeeding"
// and diverged replicas (DDP shared the group, so rank 1's impostor stood in for the bucket).
// Such a group cannot be split: DDP refuses it, saying how to make one it can use.
// A Gloo group built with c10d directly, over a store of its own.
ddp::ProcessGroupPtr c10d_gloo_group() {
  const int rank = worker_rank(), world = worker_world_size();
  auto store = c10::make_intrusive<c10d::FileStore>(std::string(std::getenv("DDP_TEST_STORE")) + ".c10d", world);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
#if TORCH_VERSION_MAJOR >= 2  // a Backend, dispatched to by a ProcessGroup (2.6's constructor)
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  return group;
#else
  return gloo;
#endif
}

DDP_WORKER(ddp_refuses_a_c10d_group) {
  const int rank = worker_rank();
  const ddp::ProcessGroupPtr group = c10d_gloo_group();
  MLP net;
  const std::string message = error_of<std::invalid_argument>(
      [&] { ddp::DistributedDataParallel model(net, ddp::DDPOptions().process_group(group)); });
  require_mentions(message, "built with c10d directly", "rank " + std::to_string(rank));
  require_mentions(message, "ddp::init_process_group (the default group) or ddp::new_group", "rank " + std::to_string(rank));
  // Horovod's path splits off a group of its own as DDP does: the same refusal, in its own name.
  const std::string optimizer = error_of<std::invalid_argument>([&] {
    ddp::DistributedOptimizer<torch::optim::SGD> distributed(ddp::DistributedOptimizerOptions().process_group(group),
                                                             net->parameters(), torch::optim::SGDOptions(0.1));
  });
  require_mentions(optimizer, "DistributedOptimizer: the process group was built with c10d directly",
                   "rank " + std::to_string(rank));
  require_mentions(optimizer, "ddp::new_group", "rank " + std::to_string(rank));
}
TEST(CollectiveSafety, DdpRefusesAGroupBuiltWithC10dDirectly) {
  EXPECT_WORKERS_OK(run_workers("ddp_refuses_a_c10d_group", 2));
}

}  // namespace
