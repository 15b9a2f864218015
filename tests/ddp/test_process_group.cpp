// Process groups: rendezvous over every init_method, the free collectives, and bad input.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/per_rank.h>
#include <ddp/process_group.h>
#ifdef DDP_HAVE_NCCL
#include <link.h>  // dl_iterate_phdr

#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#endif

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

// A write to a connection whose peer died raises SIGPIPE; Gloo does not guard its writes, so at
// its default the signal would end a rank silently before any error named the peer. After
// init_process_group a write to a closed pipe fails with EPIPE instead, and a handler the program
// installed itself is left as it was.
void own_sigpipe_handler(int) {}
DDP_WORKER(sigpipe) {
  const bool own = std::string(std::getenv("RANK")) == "1";  // rank 1 installs its own handler
  if (own) std::signal(SIGPIPE, own_sigpipe_handler);
  ddp::test::worker_init();
  struct sigaction now {};
  sigaction(SIGPIPE, nullptr, &now);
  if (own) {
    require(now.sa_handler == own_sigpipe_handler, "init_process_group replaced the program's SIGPIPE handler");
    return;
  }
  int fds[2];
  require(pipe(fds) == 0, "pipe");
  close(fds[0]);
  errno = 0;
  const ssize_t written = write(fds[1], "x", 1);  // at SIGPIPE's default this ends the process
  require(written == -1 && errno == EPIPE, "a write to a closed pipe did not fail with EPIPE");
  close(fds[1]);
}
TEST(ProcessGroup, ADeadPeersSigpipeBecomesAnErrorNotASilentExit) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("sigpipe", 2));
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

// backend "auto" without CUDA is Gloo: the group says so (getBackendName exists on 1.13's
// ProcessGroupGloo and on 2.x's dispatching ProcessGroup) and a collective works.
DDP_WORKER(auto_backend) {
  ddp::InitOptions options;  // backend "auto" is the default
  options.init_method = "file://" + std::string(std::getenv("DDP_TEST_STORE"));
  options.timeout = std::chrono::seconds(60);
  auto pg = ddp::init_process_group(options);
  require(pg->getBackendName() == "gloo", "backend auto on CPU gave " + pg->getBackendName());
  auto value = torch::full({2}, static_cast<float>(ddp::get_rank() + 1));
  ddp::all_reduce(value);
  require(torch::equal(value, torch::full({2}, 3.0f)), "all_reduce over the auto backend is wrong");
}

TEST(ProcessGroup, AutoBackendOnCpuIsGloo) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA is available: auto may pick nccl here; this tests the CPU case";
  EXPECT_WORKERS_OK(ddp::test::run_workers("auto_backend", 2));
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

// While ranks are missing, the ranks that wait name them on stderr every few seconds (the first
// time after 5 s), instead of silence until the timeout; ranks that arrive together print nothing.
DDP_WORKER(arrive_after_delay) {
  if (const char* delay = std::getenv("DELAY_MS")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
  }
  ddp::test::worker_init(std::chrono::seconds(30));
  ddp::barrier();
  ddp::destroy_process_group();
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t count = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++count;
  return count;
}

TEST(ProcessGroup, WaitingRanksNameTheMissingOnesEveryFewSeconds) {
  const std::string port = std::to_string(ddp::test::free_port());
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
  options.rank_env = {{1, {{"DELAY_MS", "7000"}}}};  // rank 0 waits 7 s: one notice, at 5 s (the next is due at 15 s)
  const auto results = ddp::test::run_workers("arrive_after_delay", 2, options);
  EXPECT_WORKERS_OK(results);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_NE(results[0].output.find("[torchddp] rank 0: waiting for ranks [1] at env:// (127.0.0.1:" + port +
                                   "), 1/2 joined ("),
            std::string::npos) << results[0].output;
  EXPECT_NE(results[0].output.find(" s of the 30 s timeout)"), std::string::npos) << results[0].output;
  EXPECT_EQ(count_of(results[0].output, "waiting for ranks"), 1u) << results[0].output;
  EXPECT_EQ(count_of(results[1].output, "waiting for ranks"), 0u) << results[1].output;  // it waited for no one
}

TEST(ProcessGroup, RanksArrivingTogetherPrintNoWaitingNotice) {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())}};
  const auto results = ddp::test::run_workers("arrive_after_delay", 3, options);
  EXPECT_WORKERS_OK(results);
  for (const auto& result : results) EXPECT_EQ(count_of(result.output, "waiting for ranks"), 0u) << result.output;
}

// is_main_process(): rank 0 of the default group, and any process without one. manual_seed(s):
// torch::manual_seed(s + rank), checked against LibTorch's own generator seeded by hand, so that
// the ranks draw different numbers (dropout, augmentation).
DDP_WORKER(per_rank_helpers) {
  require(ddp::is_main_process(), "is_main_process() is false before init_process_group");
  require(ddp::manual_seed(7) == 7, "manual_seed(7) without a group did not use 7");
  const auto alone = torch::rand({4});
  torch::manual_seed(7);
  require(torch::equal(alone, torch::rand({4})), "manual_seed(7) without a group differs from torch::manual_seed(7)");

  ddp::test::worker_init();
  const int rank = ddp::get_rank();
  require(ddp::is_main_process() == (rank == 0), "is_main_process() on rank " + std::to_string(rank));
  require(ddp::manual_seed(7) == static_cast<uint64_t>(7 + rank), "manual_seed(7) did not return 7 + rank");
  const auto mine = torch::rand({4});
  torch::manual_seed(7 + rank);
  require(torch::equal(mine, torch::rand({4})), "manual_seed(7) on rank " + std::to_string(rank) +
                                                    " differs from torch::manual_seed(7 + rank)");
  const auto all = ddp::all_gather(mine);
  require(!torch::equal(all[0], all[1]), "both ranks drew the same numbers after manual_seed(7)");
  ddp::destroy_process_group();
  require(ddp::is_main_process(), "is_main_process() is false after destroy_process_group");
}

TEST(ProcessGroup, MainProcessIsRankZeroAndManualSeedAddsTheRank) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("per_rank_helpers", 2));
}

// A mis-started job fails at the rendezvous on every rank with a message naming the fault, long
// before the (20 s) timeout: each rank checks that init_process_group throws a message holding
// EXPECTED (or, where set for its rank, EXPECTED_<rank>) within 10 s.
DDP_WORKER(rendezvous_fault) {
  const int rank = ddp::test::worker_rank();
  if (const char* delay = std::getenv("DELAY_MS")) {  // arrive after the others
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(delay)));
  }
  if (std::getenv("EXIT_AFTER_MS")) {  // the store's host goes away while the others wait
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(std::getenv("EXIT_AFTER_MS"))));
      std::_Exit(0);
    }).detach();
  }
  const char* own = std::getenv(("EXPECTED_" + std::to_string(rank)).c_str());
  const std::string expected = own ? own : std::getenv("EXPECTED");
  const auto start = std::chrono::steady_clock::now();
  try {
    ddp::test::worker_init(std::chrono::seconds(20));
  } catch (const std::exception& error) {
    const std::string message = error.what();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    require(message.find(expected) != std::string::npos, "expected '" + expected + "' in: " + message);
    require(seconds < 10, "the fault was named only after " + std::to_string(seconds) + " s: " + message);
    std::cout << "rank " << rank << " after " << seconds << " s: " << message << std::endl;
    return;
  }
  ddp::test::fail("init_process_group succeeded in a mis-started job");
}

// RANK=1 given to two processes (world 3, the third process also gets RANK=1): rank 2 never
// comes, and without the check rank 0 and both ranks 1 would wait out the timeout.
TEST(ProcessGroup, DuplicateRankIsNamedOnEveryRank) {
  ddp::test::RunOptions options;
  options.env = {{"EXPECTED", "RANK=1 was given to 2 processes: each of the ranks 0..2 must be started exactly once"}};
  options.rank_env = {{2, {{"RANK", "1"}}}};
  EXPECT_WORKERS_OK(ddp::test::run_workers("rendezvous_fault", 3, options));
}

// RANK=1 given twice, the second process arriving after the world of 2 is complete: it is refused
// at once, and the running ranks, which cannot be refused any more (the job is whole), name it on
// their stderr within a few of their heartbeats instead of never hearing of it. Worker 2 (the late
// RANK=1) starts once rank 0 says the world is up; ranks 0 and 1 then run on for 5 s.
DDP_WORKER(late_duplicate) {
  if (std::getenv("LATE")) {
    for (int i = 0; i < 300 && !std::filesystem::exists(ddp::test::shared_dir() + "/world_up"); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    try {
      ddp::test::worker_init(std::chrono::seconds(20));
    } catch (const std::exception& error) {
      const std::string message = error.what();
      require(message.find("RANK=1 was given to 2 processes") != std::string::npos, message);
      return;
    }
    ddp::test::fail("the late RANK=1 joined the job");
  }
  ddp::test::worker_init(std::chrono::seconds(20));
  if (ddp::test::worker_rank() == 0) ddp::test::write_shared("world_up", "1");
  std::this_thread::sleep_for(std::chrono::seconds(5));
  ddp::barrier();
  ddp::destroy_process_group();
}
TEST(ProcessGroup, ALateDuplicateRankIsNamedByTheRunningRanks) {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())}};
  options.rank_env = {{0, {{"WORLD_SIZE", "2"}}}, {1, {{"WORLD_SIZE", "2"}}},
                      {2, {{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LATE", "1"}}}};
  const auto results = ddp::test::run_workers("late_duplicate", 3, options);
  EXPECT_WORKERS_OK(results);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(results[rank].output.find("[torchddp] rank " + std::to_string(rank) +
                                        ": a process that reached this job's store later was refused (this job "
                                        "goes on): ddp::init_process_group: RANK=1 was given to 2 processes"),
              std::string::npos)
        << results[rank].output;
  }
}

// WORLD_SIZE 2 on rank 0, 3 on rank 1 (which arrives second): both fail naming the disagreement.
TEST(ProcessGroup, MismatchedWorldSizeIsNamedOnEveryRank) {
  ddp::test::RunOptions options;
  options.env = {{"EXPECTED", "the ranks disagree on WORLD_SIZE: rank 1 was started with 3, a rank that arrived "
                              "before it with 2. Start every rank with the same WORLD_SIZE"}};
  options.rank_env = {{1, {{"WORLD_SIZE", "3"}, {"DELAY_MS", "500"}}}};
  EXPECT_WORKERS_OK(ddp::test::run_workers("rendezvous_fault", 2, options));
}

// A rank of another job reaching this job's store (two jobs on one MASTER_PORT) is refused; it
// leaves this job's keys alone, so this job's rank 0 merely misses its rank 1 (short timeout here).
DDP_WORKER(other_job) {
  const int rank = ddp::test::worker_rank();
  if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));  // job A's rank 0 is first
  try {
    ddp::test::worker_init(std::chrono::seconds(3));
  } catch (const std::exception& error) {
    const std::string message = error.what();
    const std::string expected = rank == 1 ? "that belongs to another job (run id 'job-a', this rank's is 'job-b'): "
                                             "two jobs are using the same MASTER_PORT"
                                           : "for ranks [1] of world_size 2, which never joined";
    require(message.find(expected) != std::string::npos, "expected '" + expected + "' in: " + message);
    return;
  }
  ddp::test::fail("a rank of another job joined this one");
}
TEST(ProcessGroup, ARankOfAnotherJobIsRefused) {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())},
                 {"TORCHDDP_RUN_ID", "job-a"}};
  options.rank_env = {{1, {{"TORCHDDP_RUN_ID", "job-b"}}}};
  EXPECT_WORKERS_OK(ddp::test::run_workers("other_job", 2, options));
}

// Rank 0 hosts the TCP store and exits after 1.5 s while rank 1 waits for the absent rank 2: rank 1
// says it lost the store (not "waited 20 s", not a list of missing ranks that includes itself).
TEST(ProcessGroup, LosingTheStoreHostIsNamedAtOnce) {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())},
                 {"EXPECTED", "(never checked: rank 0 exits)"},
                 {"EXPECTED_1", "rank 1 lost the store at env:// (127.0.0.1:"}};
  options.rank_env = {{0, {{"EXIT_AFTER_MS", "1500"}}}, {1, {{"WORLD_SIZE", "3"}}}};
  options.rank_env[0]["WORLD_SIZE"] = "3";
  auto results = ddp::test::run_workers("rendezvous_fault", 2, options);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].exit_code, 0) << results[1].output;
  EXPECT_NE(results[1].output.find("the process hosting it (rank 0, or the launcher) exited, crashed or froze"),
            std::string::npos) << results[1].output;
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
// Runs new_process_group with exactly `env` as torchrun's variables, then restores them, so that
// no later test (or worker it starts) inherits a bad MASTER_PORT.
std::string init_error(ddp::InitOptions options, std::map<std::string, const char*> env) {
  const char* names[] = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                         "OMPI_COMM_WORLD_SIZE"};
  std::map<std::string, std::string> saved;
  for (const char* name : names) {
    if (const char* value = std::getenv(name)) saved[name] = value;
    unsetenv(name);
  }
  for (const auto& [key, value] : env) setenv(key.c_str(), value, 1);
  std::string message = "no error";
  try {
    ddp::new_process_group(options);
  } catch (const std::exception& error) {
    message = error.what();
  }
  for (const char* name : names) unsetenv(name);
  for (const auto& [key, value] : saved) setenv(key.c_str(), value.c_str(), 1);
  return message;
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
  EXPECT_NE(message.find("RANK=2 is out of range for WORLD_SIZE=2 (valid ranks: 0..1)"), std::string::npos) << message;
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

// env:// reads everything from torchrun's variables: each bad one is named, with its value and a fix.
TEST(ProcessGroupBadInput, EnvMissingWorldSize) {
  auto message = init_error({"gloo"}, {{"RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_NE(message.find("WORLD_SIZE is not set, but RANK is: set both (ddprun and torchrun do), or pass "
                         "InitOptions.rank and world_size"),
            std::string::npos) << message;
}

TEST(ProcessGroupBadInput, EnvNonIntegerRank) {
  auto message = init_error({"gloo"}, {{"WORLD_SIZE", "2"}, {"RANK", "one"}, {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", "29500"}});
  EXPECT_NE(message.find("RANK='one' is not an integer"), std::string::npos) << message;
  EXPECT_NE(message.find("(expected a whole number in [0, "), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, EnvNegativeRank) {
  auto message = init_error({"gloo"}, {{"WORLD_SIZE", "2"}, {"RANK", "-1"}, {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", "29500"}});
  EXPECT_NE(message.find("RANK=-1 is out of range [0, "), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, EnvMissingMasterPort) {
  auto message = init_error({"gloo"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}});
  EXPECT_NE(message.find("MASTER_PORT is not set: a free TCP port on rank 0's host, e.g. 29500"), std::string::npos)
      << message;
}

// Under mpirun, env:// has no master unless one is exported: the error says how.
TEST(ProcessGroupBadInput, OpenMpiWithoutMasterAddrSaysHowToExportIt) {
  auto message = init_error({"gloo"}, {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_NE(message.find("MASTER_ADDR is not set"), std::string::npos) << message;
  EXPECT_NE(message.find("mpirun -x MASTER_ADDR="), std::string::npos) << message;
}

// A MASTER_ADDR that no resolver knows (the .invalid TLD is reserved for this): an error naming it
// at once, not the store's "could not reach the master" after the (2 s) timeout. Run as a worker so
// a hang would be a failure, not a stall.
DDP_WORKER(unresolvable_master) {
  const std::string port = std::to_string(ddp::test::free_port());
  setenv("MASTER_ADDR", "torchddp-no-such-host.invalid", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  ddp::InitOptions options;
  options.backend = "gloo";
  options.timeout = std::chrono::seconds(2);
  try {
    ddp::init_process_group(options);
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("MASTER_ADDR='torchddp-no-such-host.invalid' cannot be resolved") != std::string::npos,
            "message: " + message);
    require(message.find("set it to the host name or IP address of rank 0's machine") != std::string::npos,
            "no hint: " + message);
    return;
  }
  ddp::test::fail("init_process_group resolved a .invalid host");
}

TEST(ProcessGroupBadInput, EnvUnresolvableMasterAddr) {
  ddp::test::RunOptions options;
  options.timeout = std::chrono::seconds(30);
  EXPECT_WORKERS_OK(ddp::test::run_workers("unresolvable_master", 1, options));
}

// The same check for tcp://host:port: the host is named with the init_method it came from.
TEST(ProcessGroupBadInput, TcpUnresolvableHost) {
  ddp::InitOptions options{"gloo", "tcp://torchddp-no-such-host.invalid:29500"};
  options.rank = 1;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(2);  // bounds the test should the resolver only time out
  auto message = init_error(options, {});
  EXPECT_NE(message.find("host 'torchddp-no-such-host.invalid' of init_method "
                         "'tcp://torchddp-no-such-host.invalid:29500' cannot be resolved"),
            std::string::npos) << message;
  EXPECT_NE(message.find("use the host name or IP address of rank 0's machine"), std::string::npos) << message;
}

TEST(ProcessGroupBadInput, ZeroTimeout) {
  ddp::InitOptions options{"gloo"};
  options.timeout = std::chrono::milliseconds(0);
  auto message = init_error(options, {{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  EXPECT_NE(message.find("InitOptions.timeout must be positive, got 0 ms: it bounds the rendezvous and every "
                         "collective"),
            std::string::npos) << message;
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

TEST(ProcessGroupBadInput, NcclWithoutAGpu) {
#ifndef DDP_HAVE_NCCL
  GTEST_SKIP() << "this LibTorch has no NCCL (CPU-only build): ProcessGroupBadInput.NcclWithoutNccl covers it";
#else
  if (torch::cuda::is_available()) GTEST_SKIP() << "this host has a CUDA device: the error path is for GPU-less ones";
  auto message = init_error({"nccl"}, {{"WORLD_SIZE", "1"}, {"RANK", "0"}});
  EXPECT_NE(message.find("backend \"nccl\" needs a CUDA device, and this process sees none"), std::string::npos)
      << message;
#endif
}

// Built against a CUDA LibTorch with c10d's ProcessGroupNCCL (the torch wheel tier), the library
// says which NCCL it was built against, and that NCCL is linked and loaded into this binary, on a
// machine with or without a GPU: nothing is created on a device.
TEST(Nccl, ReportsTheNcclItWasBuiltAgainstAndThatNcclIsLoaded) {
#ifndef DDP_HAVE_NCCL
  EXPECT_EQ(ddp::nccl_version(), "");
  GTEST_SKIP() << "this LibTorch has no ProcessGroupNCCL (CPU-only build): nccl_version() is \"\"";
#else
  // The reference: the NCCL library loaded here, asked by c10d's own code (ncclGetVersion).
  const auto [major, minor, patch] = c10d::getNcclVersionTuple();
  const std::string loaded = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  EXPECT_EQ(ddp::nccl_version(), loaded);
  // Where it came from: libnccl.so.2 among this process's loaded objects.
  std::string path;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* found) {
        const std::string name = info->dlpi_name != nullptr ? info->dlpi_name : "";
        if (name.find("/libnccl.so") != std::string::npos) *static_cast<std::string*>(found) = name;
        return 0;
      },
      &path);
  EXPECT_FALSE(path.empty()) << "libnccl.so is not among the loaded objects";
  std::cout << "built against NCCL " << ddp::nccl_version() << "; loaded NCCL " << loaded << " from " << path
            << "; CUDA device available: " << (torch::cuda::is_available() ? "yes" : "no") << std::endl;
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

namespace {

// Plain numbers and vectors of them, summed (or min/max) in place; the reference is the closed
// form of what the ranks hold. With TORCHDDP_SHM=0 the same goes over Gloo.
DDP_WORKER(numbers) {
  ddp::test::worker_init();
  const int rank = ddp::get_rank();
  const int world = ddp::get_world_size();
  double loss = rank + 0.25;
  ddp::all_reduce(loss);
  require(loss == world * (world - 1) / 2.0 + 0.25 * world, "double sum: " + std::to_string(loss));
  float half = 0.5f * static_cast<float>(rank + 1);
  ddp::all_reduce(half);
  require(half == 0.25f * static_cast<float>(world * (world + 1)), "float sum: " + std::to_string(half));
  size_t correct = 10 * static_cast<size_t>(rank) + 7;
  ddp::all_reduce(correct);
  require(correct == static_cast<size_t>(5 * world * (world - 1) + 7 * world), "size_t sum: " + std::to_string(correct));
  int64_t big = (int64_t{1} << 40) * (rank + 1);  // beyond float's and int32's exact range
  ddp::all_reduce(big);
  require(big == (int64_t{1} << 40) * world * (world + 1) / 2, "int64 sum: " + std::to_string(big));
  int lowest = rank + 3;
  ddp::all_reduce(lowest, c10d::ReduceOp::MIN);
  require(lowest == 3, "int min: " + std::to_string(lowest));
  std::vector<double> sums{static_cast<double>(rank), 1.0};
  ddp::all_reduce(sums);
  require(sums == std::vector<double>{world * (world - 1) / 2.0, static_cast<double>(world)}, "vector<double> sum");
  std::vector<size_t> highest{static_cast<size_t>(rank), 5};
  ddp::all_reduce(highest, c10d::ReduceOp::MAX);
  require(highest == std::vector<size_t>{static_cast<size_t>(world - 1), 5}, "vector<size_t> max");
  std::vector<float> none;
  ddp::all_reduce(none);  // nothing to exchange
  size_t huge = std::numeric_limits<size_t>::max();
  try {
    ddp::all_reduce(huge);
    require(false, "a size_t above INT64_MAX was summed");
  } catch (const std::out_of_range& error) {
    ddp::test::require_mentions(error.what(), "does not fit the int64", "the refusal");
  }
  // The group still agrees after the refusal (nothing was sent).
  int after = 1;
  ddp::all_reduce(after);
  require(after == world, "a collective after the refusal: " + std::to_string(after));
}
TEST(ProcessGroup, NumbersAndVectorsOfThemAllReduceInPlace) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("numbers", 2));
  EXPECT_WORKERS_OK(ddp::test::run_workers("numbers", 3));
  ddp::test::RunOptions gloo;
  gloo.env["TORCHDDP_SHM"] = "0";
  EXPECT_WORKERS_OK(ddp::test::run_workers("numbers", 3, gloo));
}

}  // namespace
