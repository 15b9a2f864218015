// ddprun end to end: the tests run the built launcher as a subprocess on launch_child and check
// exit codes, messages, what the ranks saw, and the process table (every process of a job
// carries DDPRUN_TEST_TAG=<unique tag> in its environment, so leftovers are found in /proc).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include <ddp/version.h>

#include "multiprocess.h"
#include "stranger.h"
#include "subprocess.h"

namespace {

using namespace std::chrono_literals;
using launch_test::Finished;
using launch_test::Subprocess;

const std::string kDdprun = DDPRUN_PATH;
const std::string kChild = LAUNCH_CHILD_PATH;

std::vector<std::string> ddprun(std::vector<std::string> options, std::vector<std::string> program) {
  std::vector<std::string> args{kDdprun};
  args.insert(args.end(), options.begin(), options.end());
  args.push_back("--");
  args.push_back(kChild);
  args.insert(args.end(), program.begin(), program.end());
  return args;
}

std::string describe(const Finished& f) {
  std::ostringstream out;
  out << "exit_code=" << f.exit_code << " signal=" << f.signal << " timed_out=" << f.timed_out << " after "
      << f.seconds << " s; output:\n" << f.output;
  return out.str();
}

std::map<std::string, std::string> read_result(const std::string& dir, int rank) {
  std::ifstream in(dir + "/rank_" + std::to_string(rank) + ".txt");
  std::map<std::string, std::string> values;
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) values[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return values;
}

struct TempDir {
  std::string path = ddp::test::make_temp_dir("ddprun_test_");
  ~TempDir() { ddp::test::remove_tree(path); }
};

std::string pids_text(const std::vector<int>& pids) {
  std::string text;
  for (int pid : pids) text += std::to_string(pid) + " ";
  return text;
}

#define EXPECT_NO_PROCESS_LEFT(tag)                                                  \
  do {                                                                               \
    auto left_ = launch_test::wait_until_no_tagged((tag), 3s);                       \
    EXPECT_TRUE(left_.empty()) << "processes of the job still alive: " << pids_text(left_); \
  } while (0)

// Checks every rank's result file of a world of `world` ranks.
void expect_world(const std::string& dir, int world, int local_world, int restart = 0) {
  std::string port, run_id;
  for (int rank = 0; rank < world; ++rank) {
    auto r = read_result(dir, rank);
    ASSERT_FALSE(r.empty()) << "rank " << rank << " wrote no result";
    EXPECT_EQ(r["sum"], std::to_string(world * (world + 1) / 2)) << "rank " << rank;
    EXPECT_EQ(r["pg_rank"], std::to_string(rank));
    EXPECT_EQ(r["pg_world"], std::to_string(world));
    EXPECT_EQ(r["RANK"], std::to_string(rank));
    EXPECT_EQ(r["LOCAL_RANK"], std::to_string(rank % local_world));
    EXPECT_EQ(r["WORLD_SIZE"], std::to_string(world));
    EXPECT_EQ(r["LOCAL_WORLD_SIZE"], std::to_string(local_world));
    EXPECT_EQ(r["GROUP_RANK"], std::to_string(rank / local_world));
    EXPECT_EQ(r["GROUP_WORLD_SIZE"], std::to_string(world / local_world));
    EXPECT_EQ(r["DDPRUN_RESTART_COUNT"], std::to_string(restart));
    if (rank == 0) port = r["MASTER_PORT"];
    EXPECT_EQ(r["MASTER_PORT"], port) << "ranks disagree on MASTER_PORT";
    // One job, one run id (16 hex digits), on every node.
    if (rank == 0) run_id = r["TORCHDDP_RUN_ID"];
    EXPECT_EQ(r["TORCHDDP_RUN_ID"].size(), 16u) << "rank " << rank << ": '" << r["TORCHDDP_RUN_ID"] << "'";
    EXPECT_EQ(r["TORCHDDP_RUN_ID"], run_id) << "ranks disagree on TORCHDDP_RUN_ID";
  }
}

// --- one node ----------------------------------------------------------------------------------

TEST(Launch, FourRanksAllReduceWithTorchrunEnvironment) {
  TempDir dir;
  auto tag = launch_test::unique_tag("four");
  auto env = std::map<std::string, std::string>{{"DDPRUN_TEST_TAG", tag}};
  env.erase("OMP_NUM_THREADS");
  unsetenv("OMP_NUM_THREADS");
  auto f = launch_test::run(ddprun({"--nproc-per-node", "4", "--standalone"}, {"allreduce", dir.path}), env, 120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  expect_world(dir.path, 4, 4);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(read_result(dir.path, rank)["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(read_result(dir.path, rank)["MASTER_ADDR"], "127.0.0.1");
    EXPECT_NE(f.output.find("[rank " + std::to_string(rank) + "] all_reduce ok on rank " + std::to_string(rank)),
              std::string::npos) << f.output;
  }
  EXPECT_NE(f.output.find("setting OMP_NUM_THREADS=1"), std::string::npos) << f.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, ProgramWithoutSeparatorAndUserOmpThreadsKept) {
  TempDir dir;
  auto f = launch_test::run({kDdprun, "--nproc-per-node", "2", "--standalone", kChild, "allreduce", dir.path},
                            {{"OMP_NUM_THREADS", "3"}}, 120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  expect_world(dir.path, 2, 2);
  EXPECT_EQ(read_result(dir.path, 1)["OMP_NUM_THREADS"], "3");
  EXPECT_EQ(f.output.find("setting OMP_NUM_THREADS"), std::string::npos) << f.output;
}

// A rank's printf output reaches the console as it is printed (stdio would buffer the pipe in
// blocks until exit), and a "\r" progress bar ends up as one line per rank, not 50 redraws on one.
TEST(Launch, OutputArrivesAsPrintedAndProgressLinesStayShort) {
  TempDir dir;
  launch_test::Subprocess job(ddprun({"--nproc-per-node", "2", "--standalone"}, {"print", dir.path}), {});
  ASSERT_TRUE(job.wait_for_output("first line rank=", 2, 60s)) << job.output();
  std::ofstream(std::filesystem::path(dir.path) / "go") << "go";
  auto f = job.wait(60s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(f.output.find("[rank " + std::to_string(rank) + "] done rank=" + std::to_string(rank) + "\n"),
              std::string::npos) << f.output;
  }
  EXPECT_EQ(f.output.find('\r'), std::string::npos) << "progress redraws in piped output: " << f.output;
  EXPECT_EQ(f.output.find("progress"), std::string::npos) << f.output;
}

// A rank whose progress line stops unfinished ("50%\r", then a long wait) is seen while it waits,
// not only at its exit: off a terminal ddprun writes the line's state as a whole line after a
// second, and not again when the rank ends that line; no "\r" reaches piped output.
TEST(Launch, UnfinishedProgressLineOfAnyRankIsShownWhileTheRankWaits) {
  TempDir dir;
  launch_test::Subprocess job(ddprun({"--nproc-per-node", "2", "--standalone"}, {"unfinished", dir.path}), {});
  const bool shown = job.wait_for_output("[rank 1] 50%\n", 1, 20s);
  std::ofstream(std::filesystem::path(dir.path) / "go") << "go";
  ASSERT_TRUE(shown) << "rank 1's unfinished line was not shown while it waited: " << job.output();
  auto f = job.wait(60s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  EXPECT_NE(f.output.find("[rank 1] 100%\n"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("[rank 1] done rank=1\n"), std::string::npos) << f.output;
  EXPECT_EQ(f.output.find("[rank 1] 50%"), f.output.rfind("[rank 1] 50%")) << "written twice: " << f.output;
  EXPECT_EQ(f.output.find('\r'), std::string::npos) << "a carriage return in piped output: " << f.output;
}

// --local-ranks-filter (torchrun's): only those ranks on the console; every rank still in its log.
TEST(Launch, LocalRanksFilterShowsOnlyThoseRanks) {
  TempDir dir, logs;
  std::ofstream(std::filesystem::path(dir.path) / "go") << "go";
  auto f = launch_test::run(ddprun({"--nproc-per-node", "2", "--standalone", "--local-ranks-filter", "1", "--log-dir",
                                    logs.path},
                                   {"print", dir.path}),
                            {}, 120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  EXPECT_NE(f.output.find("[rank 1] done rank=1"), std::string::npos) << f.output;
  EXPECT_EQ(f.output.find("[rank 0]"), std::string::npos) << f.output;
  std::ifstream log(std::filesystem::path(logs.path) / "rank_0.log");
  const std::string logged((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(logged.find("done rank=0"), std::string::npos) << logged;
}

TEST(Launch, RankExitCodeStopsTheOthersAndIsReported) {
  auto tag = launch_test::unique_tag("exit3");
  auto f = launch_test::run(ddprun({"--nproc-per-node", "3", "--grace-period", "2", "--standalone"}, {"fail", "1", "3"}),
                            {{"DDPRUN_TEST_TAG", tag}}, 60s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("ddprun: rank 1 (local rank 1 on node 0"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("exited with code 3"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("  | rank 1 giving up with code 3"), std::string::npos) << "no tail of the log: " << f.output;
  // The others sleep 120 s: only the launcher stopping them ends the job this early.
  EXPECT_LT(f.seconds, 10) << describe(f);
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  auto tag = launch_test::unique_tag("stubborn");
  auto f = launch_test::run(
      ddprun({"--nproc-per-node", "3", "--grace-period", "1", "--standalone"}, {"fail", "0", "7", "stubborn"}),
      {{"DDPRUN_TEST_TAG", tag}}, 60s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("rank 0 (local rank 0 on node 0"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("exited with code 7"), std::string::npos) << f.output;
  EXPECT_GE(f.seconds, 1.0) << "grace period not honoured: " << describe(f);
  EXPECT_LT(f.seconds, 10) << describe(f);
  EXPECT_NO_PROCESS_LEFT(tag);
}

// Finds "ready rank=R pid=P" lines in the launcher's output.
std::map<int, int> ready_pids(const std::string& output) {
  std::map<int, int> pids;
  static const std::regex ready("ready rank=([0-9]+) pid=([0-9]+)");
  for (std::sregex_iterator it(output.begin(), output.end(), ready), end; it != end; ++it) {
    pids[std::stoi((*it)[1])] = std::stoi((*it)[2]);
  }
  return pids;
}

TEST(Launch, SigkilledRankStopsTheJob) {
  auto tag = launch_test::unique_tag("sigkill");
  Subprocess launcher(ddprun({"--nproc-per-node", "3", "--standalone"}, {"hang", "grandchild"}),
                      {{"DDPRUN_TEST_TAG", tag}});
  ASSERT_TRUE(launcher.wait_for_output("ready rank=", 3, 60s)) << launcher.output();
  const auto pids = ready_pids(launcher.output());
  ASSERT_EQ(pids.size(), 3u) << launcher.output();
  EXPECT_GE(launch_test::tagged_processes(tag).size(), 7u) << "launcher + 3 ranks + 3 helpers expected";
  ASSERT_EQ(kill(pids.at(2), SIGKILL), 0);
  auto f = launcher.wait(30s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("rank 2 (local rank 2 on node 0, pid " + std::to_string(pids.at(2)) +
                          ") was killed by signal 9 (SIGKILL)"),
            std::string::npos)
      << f.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, SigtermToLauncherReachesEveryRankAndHelper) {
  auto tag = launch_test::unique_tag("sigterm");
  Subprocess launcher(ddprun({"--nproc-per-node", "3", "--standalone"}, {"hang", "grandchild"}),
                      {{"DDPRUN_TEST_TAG", tag}});
  ASSERT_TRUE(launcher.wait_for_output("ready rank=", 3, 60s)) << launcher.output();
  ASSERT_EQ(kill(launcher.pid(), SIGTERM), 0);
  auto f = launcher.wait(30s);
  EXPECT_EQ(f.exit_code, 128 + SIGTERM) << describe(f);
  EXPECT_NE(f.output.find("ddprun received signal 15; stopped all ranks"), std::string::npos) << f.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, SigintToLauncherStopsEveryRank) {
  auto tag = launch_test::unique_tag("sigint");
  Subprocess launcher(ddprun({"--nproc-per-node", "2", "--standalone"}, {"hang"}), {{"DDPRUN_TEST_TAG", tag}});
  ASSERT_TRUE(launcher.wait_for_output("ready rank=", 2, 60s)) << launcher.output();
  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  auto f = launcher.wait(30s);
  EXPECT_EQ(f.exit_code, 128 + SIGINT) << describe(f);
  EXPECT_NO_PROCESS_LEFT(tag);
}

// The last resort: nothing can run in a SIGKILLed launcher, so the kernel (PR_SET_PDEATHSIG)
// must take the ranks with it.
TEST(Launch, SigkilledLauncherTakesItsRanksWithIt) {
  auto tag = launch_test::unique_tag("killlauncher");
  Subprocess launcher(ddprun({"--nproc-per-node", "3", "--standalone"}, {"hang"}), {{"DDPRUN_TEST_TAG", tag}});
  ASSERT_TRUE(launcher.wait_for_output("ready rank=", 3, 60s)) << launcher.output();
  ASSERT_EQ(kill(launcher.pid(), SIGKILL), 0);
  auto f = launcher.wait(10s);
  EXPECT_EQ(f.signal, SIGKILL);
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, MaxRestartsRestartsTheGroupAfterAFailure) {
  TempDir dir;
  auto f = launch_test::run(ddprun({"--nproc-per-node", "3", "--standalone", "--max-restarts", "1"},
                                   {"fail_once", dir.path}), {}, 120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  EXPECT_NE(f.output.find("rank 1 (local rank 1 on node 0"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("exited with code 5"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("ddprun: restarting all ranks (restart 1 of 1)"), std::string::npos) << f.output;
  expect_world(dir.path, 3, 3, /*restart=*/1);
}

TEST(Launch, WithoutRestartsTheSameFailureFailsTheJob) {
  TempDir dir;
  auto f = launch_test::run(ddprun({"--nproc-per-node", "3", "--standalone"}, {"fail_once", dir.path}), {}, 120s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("exited with code 5"), std::string::npos) << f.output;
  EXPECT_EQ(f.output.find("restarting"), std::string::npos) << f.output;
}

TEST(Launch, LogDirGetsOneFilePerRankAndNoTeeKeepsTheConsoleQuiet) {
  TempDir dir;
  const std::string logs = dir.path + "/logs";
  auto f = launch_test::run(
      ddprun({"--nproc-per-node", "2", "--standalone", "--log-dir", logs, "--no-tee"}, {"allreduce", dir.path}), {},
      120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream log(logs + "/rank_" + std::to_string(rank) + ".log");
    std::stringstream text;
    text << log.rdbuf();
    EXPECT_NE(text.str().find("all_reduce ok on rank " + std::to_string(rank)), std::string::npos) << text.str();
  }
  EXPECT_EQ(f.output.find("all_reduce ok"), std::string::npos) << "--no-tee still printed rank output: " << f.output;
}

TEST(Launch, FailureReportPointsAtTheLogFile) {
  TempDir dir;
  auto f = launch_test::run(
      ddprun({"--nproc-per-node", "2", "--standalone", "--log-dir", dir.path, "--no-prefix"}, {"fail", "0", "4"}), {},
      60s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("(full log: " + dir.path + "/rank_0.log)"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("\nstarted rank 1"), std::string::npos) << "--no-prefix: " << f.output;
}

// Bad input: exit 2, the message, and no rank started.
void expect_exit_two(const std::vector<std::string>& args, const std::string& message) {
  auto tag = launch_test::unique_tag("bad");
  auto f = launch_test::run(args, {{"DDPRUN_TEST_TAG", tag}}, 30s);
  EXPECT_EQ(f.exit_code, 2) << describe(f);
  EXPECT_NE(f.output.find("ddprun: error: " + message), std::string::npos) << f.output;
  EXPECT_EQ(f.output.find("[rank"), std::string::npos) << "a rank was started: " << f.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

// --- several nodes -------------------------------------------------------------------------------

// The launchers of one job share a rendezvous token (node 0's store refuses anyone without it).
const std::string kJobToken = "launch-test-token-0123456789";
std::map<std::string, std::string> job_env(const std::string& tag) {
  return {{"DDPRUN_TEST_TAG", tag}, {"DDPRUN_RDZV_TOKEN", kJobToken}};
}

TEST(Launch, TwoNodesOnLoopbackFormOneWorld) {
  TempDir dir;
  auto tag = launch_test::unique_tag("twonode");
  const std::string port = std::to_string(ddp::test::free_port());
  std::vector<std::string> common{"--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                                  "--master-port", port, "--timeout", "60"};
  auto options = [&](const char* node) {
    auto o = common;
    o.insert(o.end(), {"--node-rank", node});
    return o;
  };
  // Node 1 first: its launcher must wait for node 0's store to come up.
  Subprocess node1(ddprun(options("1"), {"allreduce", dir.path}), job_env(tag));
  Subprocess node0(ddprun(options("0"), {"allreduce", dir.path}), job_env(tag));
  auto f0 = node0.wait(120s);
  auto f1 = node1.wait(30s);
  ASSERT_EQ(f0.exit_code, 0) << describe(f0) << "\nnode 1: " << describe(f1);
  ASSERT_EQ(f1.exit_code, 0) << describe(f1);
  expect_world(dir.path, 4, 2);
  EXPECT_NE(read_result(dir.path, 0)["MASTER_PORT"], port) << "ranks must not reuse the launchers' store port";
  EXPECT_NE(f1.output.find("[rank 3] all_reduce ok on rank 3"), std::string::npos) << f1.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, FailureOnOneNodeStopsTheOtherNode) {
  auto tag = launch_test::unique_tag("nodefail");
  const std::string port = std::to_string(ddp::test::free_port());
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "2", "--master-port", port,
                                    "--node-rank", node, "--timeout", "60", "--monitor-interval", "0.05"};
  };
  // Global rank 3 lives on node 1.
  Subprocess node0(ddprun(options("0"), {"fail", "3", "6"}), job_env(tag));
  Subprocess node1(ddprun(options("1"), {"fail", "3", "6"}), job_env(tag));
  auto f1 = node1.wait(60s);
  auto f0 = node0.wait(60s);
  EXPECT_EQ(f1.exit_code, 1) << describe(f1);
  EXPECT_NE(f1.output.find("rank 3 (local rank 1 on node 1"), std::string::npos) << f1.output;
  EXPECT_EQ(f0.exit_code, 1) << describe(f0);
  EXPECT_NE(f0.output.find("another node failed: node 1: rank 3 (local rank 1 on node 1"), std::string::npos)
      << f0.output;
  EXPECT_LT(f0.seconds, 20) << describe(f0);
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, MissingNodeIsNamedAfterTheRendezvousTimeout) {
  auto tag = launch_test::unique_tag("missingnode");
  auto f = launch_test::run(ddprun({"--nnodes", "3", "--node-rank", "0", "--master-port",
                                    std::to_string(ddp::test::free_port()), "--timeout", "1"},
                                   {"hang"}),
                            job_env(tag), 60s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("rendezvous failed: node(s) [1, 2] did not join round 0 within 1"), std::string::npos)
      << f.output;
  EXPECT_EQ(f.output.find("ready rank="), std::string::npos) << "ranks started without a full world";
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, TwoNodesRestartTogetherAfterAFailure) {
  TempDir dir;
  auto tag = launch_test::unique_tag("noderestart");
  const std::string port = std::to_string(ddp::test::free_port());
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "2", "--master-port", port, "--node-rank",
                                    node, "--timeout", "60", "--max-restarts", "1", "--monitor-interval", "0.05"};
  };
  // Rank 1 (node 0) fails on the first attempt; node 1's ranks are then stuck in the rendezvous
  // and must be stopped and restarted with node 0's.
  Subprocess node0(ddprun(options("0"), {"fail_once", dir.path}), job_env(tag));
  Subprocess node1(ddprun(options("1"), {"fail_once", dir.path}), job_env(tag));
  auto f0 = node0.wait(120s);
  auto f1 = node1.wait(30s);
  ASSERT_EQ(f0.exit_code, 0) << describe(f0) << "\nnode 1: " << describe(f1);
  ASSERT_EQ(f1.exit_code, 0) << describe(f1);
  EXPECT_NE(f1.output.find("another node failed: node 0: rank 1"), std::string::npos) << f1.output;
  EXPECT_NE(f1.output.find("restarting all ranks (restart 1 of 1)"), std::string::npos) << f1.output;
  expect_world(dir.path, 4, 2, /*restart=*/1);
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, DuplicateNodeRankIsRefused) {
  TempDir dir;
  const std::string port = std::to_string(ddp::test::free_port());
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "1", "--master-port", port,
                                    "--node-rank", node, "--timeout", "60"};
  };
  const auto env = job_env(launch_test::unique_tag("dupnode"));
  Subprocess node0(ddprun(options("0"), {"allreduce", dir.path}), env);
  Subprocess node1a(ddprun(options("1"), {"allreduce", dir.path}), env);
  Subprocess node1b(ddprun(options("1"), {"allreduce", dir.path}), env);
  auto f0 = node0.wait(120s);
  auto f1a = node1a.wait(30s);
  auto f1b = node1b.wait(30s);
  EXPECT_EQ(f0.exit_code, 0) << describe(f0);
  const std::string refused = "rendezvous failed: two launchers were started with --node-rank 1";
  const bool a_refused = f1a.output.find(refused) != std::string::npos;
  const bool b_refused = f1b.output.find(refused) != std::string::npos;
  EXPECT_NE(a_refused, b_refused) << "exactly one node-1 launcher must be refused:\n" << describe(f1a) << "\n"
                                  << describe(f1b);
  EXPECT_EQ((a_refused ? f1a : f1b).exit_code, 1);
  EXPECT_EQ((a_refused ? f1b : f1a).exit_code, 0);
  expect_world(dir.path, 2, 1);
}

TEST(Launch, UnreachableMasterNodeIsAClearError) {
  const std::string port = std::to_string(ddp::test::free_port());
  auto f = launch_test::run(
      ddprun({"--nnodes", "2", "--node-rank", "1", "--master-port", port, "--timeout", "1"}, {"hang"}),
      job_env(launch_test::unique_tag("unreachable")), 60s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("could not reach node 0's launcher at 127.0.0.1:" + port + " within 1 s"),
            std::string::npos)
      << f.output;
  EXPECT_EQ(f.output.find("ready rank="), std::string::npos) << f.output;
}

// `ddprun -H` with two "hosts" that are both this machine: the coordinator starts both node
// launchers directly (no ssh), and they meet through the usual rendezvous. Over ssh between two
// network namespaces: multihost_test.sh.
TEST(Launch, HostListOfThisMachineFormsOneWorld) {
  TempDir dir;
  auto tag = launch_test::unique_tag("hosts");
  const std::string port = std::to_string(ddp::test::free_port());
  auto f = launch_test::run(ddprun({"-H", "localhost:2,127.0.0.1:2", "--master-port", port, "--timeout", "60"},
                                   {"allreduce", dir.path}),
                            {{"DDPRUN_TEST_TAG", tag}}, 120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  expect_world(dir.path, 4, 2);
  EXPECT_EQ(read_result(dir.path, 3)["MASTER_ADDR"], "localhost") << "the first host is node 0, the master";
  for (int rank = 0; rank < 4; ++rank) {
    const std::string line = "[rank " + std::to_string(rank) + "] all_reduce ok on rank " + std::to_string(rank);
    EXPECT_NE(f.output.find(line), std::string::npos) << f.output;
  }
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(Launch, HostListFailureStopsEveryNode) {
  auto tag = launch_test::unique_tag("hostsfail");
  const std::string port = std::to_string(ddp::test::free_port());
  auto f = launch_test::run(ddprun({"-H", "localhost:2,127.0.0.1:1", "--master-port", port, "--grace-period", "1"},
                                   {"fail", "2", "6"}),
                            {{"DDPRUN_TEST_TAG", tag}}, 60s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("rank 2 (local rank 0 on node 1, pid "), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("ddprun: stopped the job on every host"), std::string::npos) << f.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

// Real cross-host traffic: each node in its own network namespace, joined by a veth pair.
struct NetnsPair {
  std::string ns[2], dev[2], addr[2];
  bool ok = false;
  std::string error;
  NetnsPair() {
    const std::string id = std::to_string(getpid() % 100000);
    const std::string subnet = "10.213." + std::to_string(getpid() % 250) + ".";
    for (int i = 0; i < 2; ++i) {
      ns[i] = "ddprun" + std::to_string(i) + "_" + id;
      dev[i] = "dv" + std::to_string(i) + "_" + id;  // interface names are at most 15 chars
      addr[i] = subnet + std::to_string(i + 1);
    }
    const std::vector<std::string> steps{
        "ip netns add " + ns[0],
        "ip netns add " + ns[1],
        "ip link add " + dev[0] + " type veth peer name " + dev[1],
        "ip link set " + dev[0] + " netns " + ns[0],
        "ip link set " + dev[1] + " netns " + ns[1],
        "ip -n " + ns[0] + " addr add " + addr[0] + "/24 dev " + dev[0],
        "ip -n " + ns[1] + " addr add " + addr[1] + "/24 dev " + dev[1],
        "ip -n " + ns[0] + " link set " + dev[0] + " up",
        "ip -n " + ns[1] + " link set " + dev[1] + " up",
        "ip -n " + ns[0] + " link set lo up",
        "ip -n " + ns[1] + " link set lo up"};
    for (const auto& step : steps) {
      if (std::system((step + " >/dev/null 2>&1").c_str()) != 0) {
        error = "'" + step + "' failed (needs root and iproute2)";
        return;
      }
    }
    ok = true;
  }
  ~NetnsPair() {
    for (const auto& name : ns) std::system(("ip netns del " + name + " >/dev/null 2>&1").c_str());
  }
};

TEST(Launch, TwoNodesInSeparateNetworkNamespaces) {
  NetnsPair net;
  if (!net.ok) GTEST_SKIP() << "cannot create network namespaces here: " << net.error;
  TempDir dir;
  auto tag = launch_test::unique_tag("netns");
  auto node = [&](int i) {
    std::vector<std::string> args{"/usr/bin/env", "ip", "netns", "exec", net.ns[i], kDdprun, "--nnodes", "2",
                                  "--node-rank", std::to_string(i), "--nproc-per-node", "2", "--master-addr",
                                  net.addr[0], "--master-port", "29400", "--timeout", "60", "--", kChild,
                                  "allreduce", dir.path};
    return args;
  };
  auto env = [&](int i) {
    auto e = job_env(tag);
    e["GLOO_SOCKET_IFNAME"] = net.dev[i];
    return e;
  };
  Subprocess node0(node(0), env(0));
  Subprocess node1(node(1), env(1));
  auto f0 = node0.wait(120s);
  auto f1 = node1.wait(30s);
  ASSERT_EQ(f0.exit_code, 0) << describe(f0) << "\nnode 1: " << describe(f1);
  ASSERT_EQ(f1.exit_code, 0) << describe(f1);
  expect_world(dir.path, 4, 2);
  EXPECT_EQ(read_result(dir.path, 3)["MASTER_ADDR"], net.addr[0]);
  EXPECT_NO_PROCESS_LEFT(tag);
}

// --- the launchers' store against strangers -------------------------------------------------------

// Any local user can reach node 0's store: without the job's token nothing they send is taken.
// The job is kept running (ranks wait for a file) while every attack is made, then must finish.
TEST(LaunchStore, StrangersCannotStopReadOrStallATwoNodeJob) {
  TempDir dir;
  auto tag = launch_test::unique_tag("stranger");
  const int port = ddp::test::free_port();
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                                    "--master-port", std::to_string(port), "--node-rank", node, "--timeout", "60",
                                    "--monitor-interval", "0.05"};
  };
  Subprocess node0(ddprun(options("0"), {"print", dir.path}), job_env(tag));
  Subprocess node1(ddprun(options("1"), {"print", dir.path}), job_env(tag));
  ASSERT_TRUE(node0.wait_for_output("first line rank=0", 1, 60s)) << node0.output();
  ASSERT_TRUE(node1.wait_for_output("first line rank=1", 1, 60s)) << node1.output();

  for (const std::string request : {"SET ddprun/r0/failed a stranger says stop", "SET ddprun/r0/nproc/1 abc",
                                    "SET ddprun/r0/nproc/1 -1", "GET ddprun/r0/run_id", "ADD ddprun/r0/done 5"}) {
    launch_test::Stranger stranger(port);
    ASSERT_TRUE(stranger.connected);
    EXPECT_EQ(stranger.line().rfind("DDPRUN-STORE 1 ", 0), 0u) << request;
    stranger.send_text(request + "\n");
    const std::string reply = stranger.line();
    EXPECT_EQ(reply.rfind("DENIED ", 0), 0u) << request << " -> " << reply;
    EXPECT_TRUE(stranger.closed_by_store(5s)) << request;
  }
  launch_test::Stranger non_reader(port);  // asks and asks, reads nothing
  std::string requests;
  for (int i = 0; i < 5000; ++i) requests += "GET ddprun/r0/run_id\n";
  non_reader.send_text(requests);
  launch_test::Stranger no_newline(port);
  no_newline.send_text(std::string(1 << 20, 'x'));
  std::vector<std::unique_ptr<launch_test::Stranger>> silent;  // more handshakes than the store keeps
  for (int i = 0; i < 80; ++i) silent.push_back(std::make_unique<launch_test::Stranger>(port));
  EXPECT_TRUE(non_reader.closed_by_store(10s));
  EXPECT_TRUE(no_newline.closed_by_store(10s));

  std::ofstream(dir.path + "/go").put('\n');
  auto f0 = node0.wait(60s);
  auto f1 = node1.wait(60s);
  EXPECT_EQ(f0.exit_code, 0) << describe(f0) << "\nnode 1: " << describe(f1);
  EXPECT_EQ(f1.exit_code, 0) << describe(f1);
  EXPECT_EQ(f0.output.find("another node failed"), std::string::npos) << f0.output;
  EXPECT_NE(f0.output.find("ddprun: the launchers' store refused a connection from 127.0.0.1:"), std::string::npos)
      << f0.output;
  EXPECT_NE(f0.output.find("(further refusals are not shown)"), std::string::npos) << f0.output;
  EXPECT_EQ(f0.output.find("stranger"), std::string::npos) << f0.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(LaunchStore, NodesGivenDifferentTokensAreToldSo) {
  auto tag = launch_test::unique_tag("twotokens");
  const std::string port = std::to_string(ddp::test::free_port());
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "1", "--master-port", port,
                                    "--node-rank", node, "--timeout", "3"};
  };
  auto other = job_env(tag);
  other["DDPRUN_RDZV_TOKEN"] = "another-token-0123456789";
  Subprocess node0(ddprun(options("0"), {"hang"}), job_env(tag));
  Subprocess node1(ddprun(options("1"), {"hang"}), other);
  auto f1 = node1.wait(60s);
  auto f0 = node0.wait(60s);
  EXPECT_EQ(f1.exit_code, 1) << describe(f1);
  EXPECT_NE(f1.output.find("ddprun: error: node 0's launcher at 127.0.0.1:" + port +
                           " refused this node's rendezvous token: every node of a job must be given the same one"),
            std::string::npos)
      << f1.output;
  EXPECT_EQ(f0.exit_code, 1) << describe(f0);
  EXPECT_NE(f0.output.find("rendezvous failed: node(s) [1] did not join round 0"), std::string::npos) << f0.output;
  EXPECT_EQ(f0.output.find("ready rank="), std::string::npos) << f0.output;
  EXPECT_NO_PROCESS_LEFT(tag);
}

// Without a token node 0 makes one and says how to start the others; they are refused without it.
TEST(LaunchStore, NodeZeroMakesATokenThatTheOtherNodesMustBeGiven) {
  TempDir dir;
  auto tag = launch_test::unique_tag("maketoken");
  const std::string port = std::to_string(ddp::test::free_port());
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "1", "--master-port", port,
                                    "--node-rank", node, "--timeout", "60"};
  };
  expect_exit_two(ddprun(options("1"), {"hang"}),
                  "node 1 needs the job's rendezvous token: node 0's ddprun printed one (or give every node the same "
                  "one): DDPRUN_RDZV_TOKEN=<token> or --rdzv-token-file FILE (mode 0600)");
  Subprocess node0(ddprun(options("0"), {"allreduce", dir.path}), {{"DDPRUN_TEST_TAG", tag}});
  const std::string said = "Start the other nodes with DDPRUN_RDZV_TOKEN=";
  ASSERT_TRUE(node0.wait_for_output(said, 1, 30s)) << node0.output();
  std::string token = node0.output().substr(node0.output().find(said) + said.size());
  token = token.substr(0, token.find(' '));
  EXPECT_EQ(token.size(), 32u) << node0.output();
  auto env = job_env(tag);
  env["DDPRUN_RDZV_TOKEN"] = token;
  Subprocess node1(ddprun(options("1"), {"allreduce", dir.path}), env);
  auto f0 = node0.wait(120s);
  auto f1 = node1.wait(30s);
  ASSERT_EQ(f0.exit_code, 0) << describe(f0) << "\nnode 1: " << describe(f1);
  ASSERT_EQ(f1.exit_code, 0) << describe(f1);
  expect_world(dir.path, 2, 1);
  // The ranks do not inherit the token (node 1's launcher had it in its environment).
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(read_result(dir.path, rank)["DDPRUN_RDZV_TOKEN"], "<unset>") << rank;
  EXPECT_NO_PROCESS_LEFT(tag);
}

TEST(LaunchStore, TokenFilesMustBePrivateAndTokensLongEnough) {
  TempDir dir;
  const std::string open_file = dir.path + "/open", short_file = dir.path + "/short";
  std::ofstream(open_file) << "0123456789abcdef0123\n";
  chmod(open_file.c_str(), 0644);
  std::ofstream(short_file) << "abc\n";
  chmod(short_file.c_str(), 0600);
  const std::vector<std::string> node1{"--nnodes", "2", "--node-rank", "1"};
  auto with = [&](std::vector<std::string> more) {
    auto o = node1;
    o.insert(o.end(), more.begin(), more.end());
    return ddprun(o, {"hang"});
  };
  expect_exit_two(with({"--rdzv-token-file", open_file}),
                  "--rdzv-token-file " + open_file + ": other users can read or change it (mode 0644): chmod 600 " +
                      open_file);
  expect_exit_two(with({"--rdzv-token-file", short_file}),
                  "--rdzv-token-file " + short_file +
                      ": the rendezvous token must be one word of 16 to 1024 characters");
  expect_exit_two(with({"--rdzv-token-file", dir.path + "/none"}),
                  "--rdzv-token-file " + dir.path + "/none: cannot open it (No such file or directory)");
  auto f = launch_test::run(with({}), {{"DDPRUN_RDZV_TOKEN", "short"}}, 30s);
  EXPECT_EQ(f.exit_code, 2) << describe(f);
  EXPECT_NE(f.output.find("DDPRUN_RDZV_TOKEN: the rendezvous token must be one word of 16"), std::string::npos)
      << f.output;
}

// Node 0's store listens on --master-addr only (127.0.0.2 here: loopback, but not 127.0.0.1), on
// every interface with --rdzv-listen-all; an address of no interface here is refused by name.
TEST(LaunchStore, ListensOnTheMasterAddressOnly) {
  for (const bool all : {false, true}) {
    auto tag = launch_test::unique_tag("listen");
    const int port = ddp::test::free_port();
    std::vector<std::string> options{"--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.2",
                                     "--master-port", std::to_string(port), "--timeout", "20"};
    if (all) options.push_back("--rdzv-listen-all");
    Subprocess node0(ddprun(options, {"hang"}), job_env(tag));
    bool reached_there = false;
    for (int i = 0; i < 100 && !reached_there; ++i) {  // until node 0's store is up
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_port = htons(static_cast<uint16_t>(port));
      inet_pton(AF_INET, "127.0.0.2", &address.sin_addr);
      reached_there = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
      close(fd);
      if (!reached_there) std::this_thread::sleep_for(50ms);
    }
    ASSERT_TRUE(reached_there) << node0.output();
    launch_test::Stranger elsewhere(port);  // 127.0.0.1
    EXPECT_EQ(elsewhere.connected, all) << (all ? "--rdzv-listen-all: 127.0.0.1 must reach the store"
                                                : "the store must not listen on 127.0.0.1");
    kill(node0.pid(), SIGTERM);
    node0.wait(30s);
    EXPECT_NO_PROCESS_LEFT(tag);
  }
  expect_exit_two(ddprun({"--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1", "--master-port",
                          std::to_string(ddp::test::free_port())},
                         {"hang"}),
                  "node 0 hosts the launchers' store at --master-addr 192.0.2.1, but cannot listen on 192.0.2.1 port");
}

// Another user can plant a link where a rank's log will be written (in a directory they own):
// ddprun must not write through it, and must leave the target as it was.
TEST(Launch, LogDirDoesNotWriteThroughAPlantedLink) {
  TempDir dir;
  const std::string logs = dir.path + "/logs", victim = dir.path + "/victim", log = logs + "/rank_0.log";
  std::filesystem::create_directories(logs);
  std::ofstream(victim) << "precious\n";
  chmod(victim.c_str(), 0600);
  auto read_victim = [&] {
    std::ifstream in(victim);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (const char* kind : {"symlink", "hardlink"}) {
    std::filesystem::remove(log);
    ASSERT_EQ(std::string(kind) == "symlink" ? symlink(victim.c_str(), log.c_str()) : link(victim.c_str(), log.c_str()),
              0);
    auto tag = launch_test::unique_tag("loglink");
    auto f = launch_test::run(ddprun({"--standalone", "--nproc-per-node", "2", "--log-dir", logs}, {"hang"}),
                              {{"DDPRUN_TEST_TAG", tag}}, 60s);
    EXPECT_EQ(f.exit_code, 2) << kind << ": " << describe(f);
    const std::string why = std::string(kind) == "symlink"
                                ? ": it is a symbolic link, which ddprun does not follow"
                                : ": it is not a regular file of this user with a single name";
    EXPECT_NE(f.output.find("rank 0: cannot write log file " + log + why), std::string::npos) << kind << ": " << f.output;
    EXPECT_EQ(read_victim(), "precious\n") << kind;
    struct stat info {};
    stat(victim.c_str(), &info);
    EXPECT_EQ(info.st_mode & 07777, 0600u) << kind;
    EXPECT_EQ(f.output.find("ready rank="), std::string::npos) << kind << ": a rank was started: " << f.output;
    EXPECT_NO_PROCESS_LEFT(tag);
  }
}

// --- bad input: exit 2, a clear message, nothing started -----------------------------------------


TEST(LaunchBadInput, UnknownOption) {
  expect_exit_two({kDdprun, "--nproc-per-nod", "2", kChild, "hang"}, "unknown option '--nproc-per-nod'");
}

TEST(LaunchBadInput, HostLists) {
  expect_exit_two(ddprun({"-H", "a:0"}, {"hang"}), "-H entry 'a:0': slots must be a number from 1 to 1024 (got '0')");
  expect_exit_two(ddprun({"-H", "a:2,a:1"}, {"hang"}), "-H: host 'a' is listed twice; list it once with all its slots");
  expect_exit_two(ddprun({"-H", "a:2", "--nnodes", "2"}, {"hang"}),
                     "--nnodes cannot be used with -H/--hostfile: the host list gives the nodes and each host's "
                     "ranks (host:slots)");
  expect_exit_two(ddprun({"-H", "localhost:1,10.213.0.9:1"}, {"hang"}),
                     "node 0 ('localhost') hosts the rendezvous, but that is a loopback address the other hosts "
                     "cannot reach");
  expect_exit_two(ddprun({"-H", "a", "-x", "DDPRUN_SURELY_UNSET"}, {"hang"}),
                     "-x DDPRUN_SURELY_UNSET: DDPRUN_SURELY_UNSET is not set here; set it, or give "
                     "-x DDPRUN_SURELY_UNSET=VALUE");
  expect_exit_two(ddprun({"-x", "A=1"}, {"hang"}), "-x and --ssh only apply with -H/--hostfile");
  expect_exit_two(ddprun({"--hostfile", "/nonexistent/hosts"}, {"hang"}), "--hostfile /nonexistent/hosts: cannot read it");
  TempDir dir;
  std::ofstream(dir.path + "/hosts") << "# two hosts\nnode1 slots=2\nnode2 slot=2\n";
  expect_exit_two(ddprun({"--hostfile", dir.path + "/hosts"}, {"hang"}),
                     "--hostfile " + dir.path + "/hosts line 3: expected 'host slots=N', got 'slot=2'");
}

TEST(LaunchBadInput, ZeroProcesses) {
  expect_exit_two(ddprun({"--nproc-per-node", "0"}, {"hang"}), "--nproc-per-node must be at least 1 (got 0)");
}

TEST(LaunchBadInput, LocalRanksFilterOutOfRange) {
  expect_exit_two(ddprun({"--nproc-per-node", "2", "--local-ranks-filter", "0,2"}, {"hang"}),
                     "--local-ranks-filter: '2' is not a local rank (valid: 0..1, comma-separated)");
}

// Durations that are not finite, or absurd, and a rank count that would exhaust the file table.
TEST(LaunchBadInput, DurationsMustBeFiniteAndSane) {
  expect_exit_two(ddprun({"--grace-period", "inf"}, {"hang"}),
                     "--grace-period inf is not a duration in seconds: use a number >= 0 and at most 86400");
  expect_exit_two(ddprun({"--grace-period", "1e308"}, {"hang"}), "--grace-period 1e+308 is not a duration");
  expect_exit_two(ddprun({"--grace-period", "nan"}, {"hang"}), "--grace-period nan is not a duration");
  expect_exit_two(ddprun({"--timeout", "nan"}, {"hang"}), "--timeout nan is not a duration in seconds: use a number > 0");
  expect_exit_two(ddprun({"--monitor-interval", "inf"}, {"hang"}), "--monitor-interval inf is not a duration");
  // Below a millisecond every wait would be 0 ms: a busy loop.
  expect_exit_two(ddprun({"--monitor-interval", "1e-300"}, {"hang"}),
                     "--monitor-interval 1e-300 is not a duration in seconds: use a number > 0 and at most 86400 "
                     "(a day); one that is not 0 at least 0.001 (a millisecond)");
  expect_exit_two(ddprun({"--grace-period", "0.0001"}, {"hang"}), "--grace-period 0.0001 is not a duration");
  expect_exit_two(ddprun({"--nproc-per-node", "100000"}, {"hang"}),
                     "--nproc-per-node 100000 is more than 1024 ranks on one node");
}

// A program that exists but cannot be executed: exit 2 like a usage error (nothing ran, so no
// restart is tried), the reason named; a missing #! interpreter is told apart from a missing file.
TEST(LaunchBadInput, AProgramThatCannotBeExecutedExitsTwo) {
  TempDir dir;
  const std::string script = dir.path + "/train.sh", binary = dir.path + "/train.bin";
  std::ofstream(script) << "#!/nonexistent/python3\n";
  std::ofstream(binary) << "not an executable format";
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  std::filesystem::permissions(binary, std::filesystem::perms::owner_all);
  for (const auto& [program, reason] :
       {std::pair<std::string, std::string>{script, "No such file or directory (the file exists: is the interpreter "
                                                    "on its #! line missing?)"},
        std::pair<std::string, std::string>{binary, "Exec format error"}}) {
    auto f = launch_test::run({kDdprun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--", program},
                              {}, 30s);
    EXPECT_EQ(f.exit_code, 2) << describe(f);
    EXPECT_NE(f.output.find("ddprun: rank 0: could not start " + program + ": " + reason), std::string::npos) << f.output;
    EXPECT_NE(f.output.find("the program could not be started"), std::string::npos) << f.output;
    EXPECT_EQ(f.output.find("restarting"), std::string::npos) << "a restart was tried: " << f.output;
  }
}

TEST(LaunchBadInput, NotANumber) {
  expect_exit_two(ddprun({"--nproc-per-node", "four"}, {"hang"}),
                     "--nproc-per-node must be a number, 'cpu' or 'gpu' (got 'four')");
}

TEST(LaunchBadInput, NodeRankNotBelowNnodes) {
  expect_exit_two(ddprun({"--nnodes", "2", "--node-rank", "2"}, {"hang"}),
                     "--node-rank 2 is out of range for --nnodes 2 (valid: 0..1)");
}

TEST(LaunchBadInput, MasterPortInUse) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const std::string port = std::to_string(ntohs(address.sin_port));
  expect_exit_two(ddprun({"--nproc-per-node", "2", "--master-port", port}, {"hang"}),
                     "--master-port " + port + " is already in use on this host");
  expect_exit_two(ddprun({"--nnodes", "2", "--node-rank", "0", "--master-port", port}, {"hang"}),
                     "--master-port " + port + " is already in use on this host");
  close(fd);
}

TEST(LaunchBadInput, ProgramNotFound) {
  expect_exit_two({kDdprun, "--nproc-per-node", "2", "--", "no_such_program_xyz"},
                     "program 'no_such_program_xyz' not found in PATH");
  expect_exit_two({kDdprun, "/nonexistent/dir/prog"}, "program '/nonexistent/dir/prog' not found");
}

TEST(LaunchBadInput, NoProgram) {
  expect_exit_two({kDdprun, "--nproc-per-node", "2"}, "no program given");
}

TEST(LaunchBadInput, StandaloneWithSeveralNodes) {
  expect_exit_two(ddprun({"--standalone", "--nnodes", "2"}, {"hang"}),
                     "--standalone is for a single node, but --nnodes is 2");
}

TEST(LaunchBadInput, NoTeeWithoutLogDir) {
  expect_exit_two(ddprun({"--no-tee"}, {"hang"}), "--no-tee without --log-dir");
}

TEST(LaunchBadInput, GpuCountWithoutGpus) {
  if (std::filesystem::exists("/dev/nvidia0") || std::system("nvidia-smi -L >/dev/null 2>&1") == 0) {
    GTEST_SKIP() << "this host has a GPU";
  }
  expect_exit_two(ddprun({"--nproc-per-node", "gpu"}, {"hang"}), "--nproc-per-node gpu: no NVIDIA GPU found");
}

TEST(Launch, CpuCountStartsOneRankPerCpu) {
  TempDir dir;
  auto f = launch_test::run(ddprun({"--nproc-per-node", "cpu", "--standalone"}, {"allreduce", dir.path}), {}, 120s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  const int cpus = std::stoi(read_result(dir.path, 0)["WORLD_SIZE"]);
  EXPECT_EQ(cpus, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
}

TEST(Launch, HelpExitsZero) {
  auto f = launch_test::run({kDdprun, "--help"}, {}, 30s);
  EXPECT_EQ(f.exit_code, 0) << describe(f);
  EXPECT_NE(f.output.find("--nproc-per-node"), std::string::npos) << f.output;
}

// --version is the project's version (one place: project(VERSION) in the top CMakeLists.txt).
TEST(Launch, VersionIsTheLibrarysVersion) {
  auto f = launch_test::run({kDdprun, "--version"}, {}, 30s);
  EXPECT_EQ(f.exit_code, 0) << describe(f);
  EXPECT_EQ(f.output, std::string("ddprun ") + TORCHDDP_VERSION + "\n");
}

// --- restarts with a program that resumes from its checkpoints -----------------------------------

// Lines "attempt=A step=S weight=W" that launch_child's resume mode appended for one rank.
std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(Launch, MaxRestartsResumesFromTheLastCheckpointWithoutRepeatingOrSkippingSteps) {
  TempDir dir;
  auto f = launch_test::run(ddprun({"--nproc-per-node", "2", "--standalone", "--max-restarts", "1"},
                                   {"resume", dir.path}), {}, 180s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  EXPECT_NE(f.output.find("rank 1 failing at step 3 (first attempt)"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("ddprun: restarting all ranks (restart 1 of 1)"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("[rank 0] rank 0 resumed from " + dir.path + "/ckpt/checkpoint-00000002.pt at step 2"),
            std::string::npos) << f.output;
  // Steps 1-2 before the failure, 3-6 after: none twice, none missing, and the weight (which
  // every step raises by 1) shows the model state resumed too.
  const std::vector<std::string> expected{
      "attempt=0 step=1 weight=1", "attempt=0 step=2 weight=2", "attempt=1 step=3 weight=3",
      "attempt=1 step=4 weight=4", "attempt=1 step=5 weight=5", "attempt=1 step=6 weight=6"};
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(read_lines(dir.path + "/steps_" + std::to_string(rank) + ".txt"), expected) << "rank " << rank;
  }
}

// --- --standalone picks its own port ---------------------------------------------------------------

TEST(Launch, StandalonePicksAFreePortEvenWhenTheDefaultIsTakenAndJobsRunSideBySide) {
  // Hold ddprun's default --master-port (29500; if someone else already holds it, it is taken anyway).
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(29500);
  const bool held = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 && listen(fd, 1) == 0;
  if (!held) std::cout << "port 29500 is already in use by another process; testing with that" << std::endl;

  TempDir a, b;
  Subprocess job_a(ddprun({"--nproc-per-node", "2", "--standalone"}, {"allreduce", a.path}), {});
  Subprocess job_b(ddprun({"--nproc-per-node", "2", "--standalone"}, {"allreduce", b.path}), {});
  auto fa = job_a.wait(120s);
  auto fb = job_b.wait(120s);
  close(fd);
  ASSERT_EQ(fa.exit_code, 0) << describe(fa);
  ASSERT_EQ(fb.exit_code, 0) << describe(fb);
  expect_world(a.path, 2, 2);
  expect_world(b.path, 2, 2);
  const std::string port_a = read_result(a.path, 0)["MASTER_PORT"], port_b = read_result(b.path, 0)["MASTER_PORT"];
  EXPECT_NE(port_a, "29500");
  EXPECT_NE(port_b, "29500");
  EXPECT_NE(port_a, port_b) << "two concurrent standalone jobs got the same port";
  for (const auto& port : {port_a, port_b}) {
    ASSERT_FALSE(port.empty());
    EXPECT_GT(std::stoi(port), 0);
    EXPECT_LE(std::stoi(port), 65535);
  }
}

// --- --monitor-interval --------------------------------------------------------------------------

// A rank's own exit is noticed at once (SIGCHLD wakes the launcher), whatever the interval: a
// 30 s interval must not keep a failed job alive for 30 s.
TEST(Launch, LocalRankFailureIsNoticedWithoutWaitingForTheMonitorInterval) {
  auto tag = launch_test::unique_tag("interval_local");
  auto f = launch_test::run(
      ddprun({"--nproc-per-node", "2", "--standalone", "--monitor-interval", "30"}, {"fail", "1", "3"}),
      {{"DDPRUN_TEST_TAG", tag}}, 90s);
  EXPECT_EQ(f.exit_code, 1) << describe(f);
  EXPECT_NE(f.output.find("exited with code 3"), std::string::npos) << f.output;
  EXPECT_LT(f.seconds, 20) << describe(f);
  EXPECT_NO_PROCESS_LEFT(tag);
}

// Another node's failure is learnt by polling the rendezvous store every --monitor-interval.
// Node 1's rank 3 fails 2 s after starting; node 0 (whose ranks just sleep) can only learn it from
// that poll. Returns how long after node 1 exited node 0 did.
double peer_failure_delay(const std::string& interval) {
  auto tag = launch_test::unique_tag("interval_peer");
  const std::string port = std::to_string(ddp::test::free_port());
  auto options = [&](const char* node) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "2", "--master-port", port,
                                    "--node-rank", node, "--timeout", "60", "--monitor-interval", interval};
  };
  Subprocess node0(ddprun(options("0"), {"fail_late", "3", "6", "2"}), job_env(tag));
  Subprocess node1(ddprun(options("1"), {"fail_late", "3", "6", "2"}), job_env(tag));
  auto f1 = node1.wait(90s);
  auto f0 = node0.wait(90s);
  EXPECT_EQ(f1.exit_code, 1) << describe(f1);
  EXPECT_EQ(f0.exit_code, 1) << describe(f0);
  EXPECT_NE(f0.output.find("another node failed: node 1: rank 3"), std::string::npos) << f0.output;
  EXPECT_NO_PROCESS_LEFT(tag);
  return f0.seconds - f1.seconds;
}

TEST(Launch, MonitorIntervalSetsHowSoonAnotherNodesFailureIsNoticed) {
  // Interval 8: node 0 polls at its start, then 8 s later, so it learns of the failure (posted ~2 s
  // in) about 6 s after node 1 has gone. Interval 0.05: at once. Bounds leave seconds of slack.
  const double slow = peer_failure_delay("8");
  const double fast = peer_failure_delay("0.05");
  std::cout << "node 0 stopped " << slow << " s after node 1 with --monitor-interval 8, " << fast
            << " s with 0.05" << std::endl;
  EXPECT_GE(slow, 3.5) << "--monitor-interval 8 was not honoured";
  EXPECT_LT(fast, 3.0) << "--monitor-interval 0.05 was not honoured";
}

// --- --nproc-per-node gpu ----------------------------------------------------------------------------

TEST(Launch, GpuCountStartsOneRankPerGpu) {
  if (!std::filesystem::exists("/dev/nvidia0") && std::system("nvidia-smi -L >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no NVIDIA GPU on this host (no /dev/nvidia0, nvidia-smi -L fails): the positive path of "
                    "--nproc-per-node gpu cannot run; GpuCountWithoutGpus covers the error path";
  }
  // As many GPUs as ddprun counts: /dev/nvidia<N> nodes, else the lines of nvidia-smi -L.
  int gpus = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev")) {
    gpus += std::regex_match(entry.path().filename().string(), std::regex("nvidia[0-9]+"));
  }
  if (gpus == 0) {
    FILE* pipe = popen("nvidia-smi -L", "r");
    char line[512];
    while (pipe != nullptr && fgets(line, sizeof(line), pipe) != nullptr) gpus += std::string(line).rfind("GPU ", 0) == 0;
    if (pipe != nullptr) pclose(pipe);
  }
  TempDir dir;
  auto f = launch_test::run(ddprun({"--nproc-per-node", "gpu", "--standalone"}, {"allreduce", dir.path}), {}, 180s);
  ASSERT_EQ(f.exit_code, 0) << describe(f);
  expect_world(dir.path, gpus, gpus);
}

}  // namespace
