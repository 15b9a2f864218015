// Process groups: rendezvous over every init_method, the free collectives, and bad input.
#include <cstdlib>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/process_group.h>

#include "multiprocess.h"

namespace {

using ddp::test::require;

DDP_WORKER(collectives) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  const int world = ddp::get_world_size();
  require(pg->getRank() == rank && world == ddp::test::worker_world_size(), "rank/world mismatch");
  auto value = torch::full({3}, static_cast<float>(rank + 1));
  ddp::all_reduce(value);
  const float expected = world * (world + 1) / 2.0f;
  require(torch::allclose(value, torch::full({3}, expected)), "all_reduce sum wrong");
  auto max = torch::full({1}, static_cast<float>(rank));
  ddp::all_reduce(max, c10d::ReduceOp::MAX);
  require(max.item<float>() == world - 1, "all_reduce max wrong");
  auto root = torch::full({2}, rank == 1 ? 42.0f : -1.0f);
  ddp::broadcast(root, 1);
  require(torch::equal(root, torch::full({2}, 42.0f)), "broadcast from rank 1 wrong");
  auto gathered = ddp::all_gather(torch::full({2}, static_cast<float>(rank * 10)));
  require(static_cast<int>(gathered.size()) == world, "all_gather size");
  for (int r = 0; r < world; ++r) {
    require(torch::equal(gathered[r], torch::full({2}, static_cast<float>(r * 10))), "all_gather value");
  }
  ddp::barrier();
  ddp::destroy_process_group();
  require(!ddp::is_initialized(), "destroy_process_group left a default group");
}

TEST(ProcessGroup, FileStoreCollectivesWorld3) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("collectives", 3));
}

TEST(ProcessGroup, EnvTcpStoreCollectivesWorld2) {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())}};
  EXPECT_WORKERS_OK(ddp::test::run_workers("collectives", 2, options));
}

DDP_WORKER(tcp_init_method) {
  ddp::InitOptions options;
  options.backend = "gloo";
  options.init_method = std::string("tcp://127.0.0.1:") + std::getenv("TEST_PORT");
  auto pg = ddp::init_process_group(options);
  auto value = torch::ones({1});
  ddp::all_reduce(value);
  require(value.item<float>() == ddp::get_world_size(), "tcp:// all_reduce wrong");
}

TEST(ProcessGroup, TcpInitMethod) {
  ddp::test::RunOptions options;
  options.env = {{"TEST_PORT", std::to_string(ddp::test::free_port())}};
  EXPECT_WORKERS_OK(ddp::test::run_workers("tcp_init_method", 2, options));
}

// A rank that never arrives: the others fail with a message naming it, within the timeout.
DDP_WORKER(missing_rank) {
  if (ddp::test::worker_rank() == 1) return;  // rank 1 never joins
  try {
    ddp::test::worker_init(std::chrono::milliseconds(1500));
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("for ranks [1]") != std::string::npos, "message lacks missing rank: " + message);
    require(message.find("never joined") != std::string::npos, "message: " + message);
    return;
  }
  ddp::test::fail("init_process_group succeeded without rank 1");
}

TEST(ProcessGroup, MissingRankTimesOutNamingIt) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("missing_rank", 2));
}

DDP_WORKER(unreachable_master) {
  ddp::InitOptions options;
  options.backend = "gloo";
  options.rank = 1;
  options.world_size = 2;
  options.timeout = std::chrono::milliseconds(1500);
  options.init_method = "tcp://127.0.0.1:" + std::to_string(ddp::test::free_port());  // nobody listens
  try {
    ddp::init_process_group(options);
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("rank 1 could not reach the master store at 127.0.0.1") != std::string::npos,
            "message: " + message);
    return;
  }
  ddp::test::fail("connected to a master that does not exist");
}

TEST(ProcessGroup, UnreachableMasterIsAClearErrorNotAHang) {
  ddp::test::RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(ddp::test::run_workers("unreachable_master", 1, options));
}

// --- bad input, checked in-process (no collective is ever reached) -------------------------------
std::string init_error(ddp::InitOptions options, std::map<std::string, const char*> env) {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(name);
  for (const auto& [key, value] : env) setenv(key.c_str(), value, 1);
  try {
    ddp::new_process_group(options);
  } catch (const std::exception& error) {
    return error.what();
  }
  return "no error";
}

TEST(ProcessGroupBadInput, MissingRank) {
  auto message = init_error({}, {{"WORLD_SIZE", "2"}});
  EXPECT_NE(message.find("RANK is not set"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, InvalidWorldSize) {
  auto message = init_error({}, {{"WORLD_SIZE", "two"}, {"RANK", "0"}});
  EXPECT_NE(message.find("WORLD_SIZE='two' is not an integer"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, RankNotBelowWorldSize) {
  auto message = init_error({}, {{"WORLD_SIZE", "2"}, {"RANK", "2"}});
  EXPECT_NE(message.find("rank 2 is out of range for world_size 2 (valid ranks: 0..1)"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, MissingMasterAddr) {
  auto message = init_error({"gloo"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"MASTER_PORT", "29500"}});
  EXPECT_NE(message.find("MASTER_ADDR is not set"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, InvalidMasterPort) {
  auto message = init_error({"gloo"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", "70000"}});
  EXPECT_NE(message.find("MASTER_PORT=70000 is out of range [1, 65535]"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, UnknownBackend) {
  auto message = init_error({"mpi"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  EXPECT_NE(message.find("unknown backend 'mpi'"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, UnknownScheme) {
  auto message = init_error({"gloo", "udp://x:1"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  EXPECT_NE(message.find("unknown init_method scheme in 'udp://x:1'"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, NcclWithoutNccl) {
#ifdef DDP_HAVE_NCCL
  GTEST_SKIP() << "this LibTorch has NCCL; the error path is for CPU-only builds";
#else
  auto message = init_error({"nccl"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  EXPECT_NE(message.find("backend \"nccl\" is not available"), std::string::npos) << message;
#endif
}

TEST(ProcessGroupBadInput, NoDefaultGroup) {
  ddp::destroy_process_group();
  try {
    ddp::get_rank();
    FAIL() << "get_rank without a group did not throw";
  } catch (const std::logic_error& error) {
    EXPECT_NE(std::string(error.what()).find("call ddp::init_process_group() first"), std::string::npos);
  }
}

}  // namespace
