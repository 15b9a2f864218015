#pragma once
// Multi-process tests: the test binary re-executes itself as N workers (fork + exec, so no torch
// thread pool crosses a fork), each with RANK/WORLD_SIZE and a private temp dir, under a hard
// timeout. A hang becomes a failed test, never a stuck CI.
//
//   DDP_WORKER(allreduce_sums) {            // runs in every worker process
//     auto pg = ddp::test::worker_init();   // file:// rendezvous in the shared dir
//     ...; ddp::test::require(ok, "what went wrong");
//   }
//   TEST(X, Y) { EXPECT_WORKERS_OK(ddp::test::run_workers("allreduce_sums", 2)); }
#include <sys/types.h>

#include <chrono>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <ddp/process_group.h>

#include "procutil.h"

namespace ddp::test {

struct WorkerResult {
  int rank = 0;
  int exit_code = -1;   // valid when signal == 0 and !timed_out
  int signal = 0;       // the signal that ended it, 0 if it exited
  bool timed_out = false;
  std::string output;   // stdout + stderr of the worker
};

struct RunOptions {
  std::chrono::seconds timeout{90};
  std::map<std::string, std::string> env;  // extra environment for every worker
  std::map<int, std::map<std::string, std::string>> rank_env;  // extra environment for one rank
  std::string shared_dir;                  // reuse a dir across runs (e.g. checkpoints); temp if empty
};

std::vector<WorkerResult> run_workers(const std::string& worker, int world_size, const RunOptions& options = {});

// True when every worker exited 0; otherwise explains each failure (with its output).
bool all_ok(const std::vector<WorkerResult>& results, std::string* explanation);

// --- inside a worker ---------------------------------------------------------------------------
int worker_rank();
int worker_world_size();
std::string shared_dir();      // a dir every worker of this run shares (DDP_TEST_DIR)
// init_process_group over file:// in the shared dir (or env:// when MASTER_PORT is set).
ddp::ProcessGroupPtr worker_init(std::chrono::milliseconds timeout = std::chrono::seconds(60));
[[noreturn]] void fail(const std::string& message);
inline void require(bool condition, const std::string& message) {
  if (!condition) fail(message);
}
// Fails naming `what` unless `message` contains `part`.
inline void require_mentions(const std::string& message, const std::string& part, const std::string& what) {
  require(message.find(part) != std::string::npos, what + ": expected '" + part + "' in: " + message);
}
// Fails naming `what` unless `call` throws `Error` whose message contains `part`.
template <typename Error = std::invalid_argument, typename Call>
void require_throws(Call&& call, const std::string& part, const std::string& what) {
  try {
    call();
  } catch (const Error& error) {
    require_mentions(error.what(), part, what);
    return;
  }
  fail(what + " was accepted");
}
// Writes/reads a small text file in the shared dir, to hand results between ranks and the test.
void write_shared(const std::string& name, const std::string& text);
std::string read_shared(const std::string& name);

// --- plumbing -----------------------------------------------------------------------------------
using WorkerFunction = void (*)();
struct WorkerRegistrar {
  WorkerRegistrar(const char* name, WorkerFunction function);
};
// main() of every test binary: runs a worker when DDP_TEST_WORKER is set, else GoogleTest.
int main_with_workers(int argc, char** argv);
// A free TCP port on 127.0.0.1 (for tests of env:// / tcp://); shared with ddp_bench (procutil.h).
using ddp::procutil::free_port;
// Starts one worker process now (this executable again, fork + exec at once, in its own process
// group: procutil::spawn_self) with `env` added; its output goes to `log` when given. run_workers
// uses it; a test that kills or times its workers itself calls it directly. Returns the pid.
pid_t spawn_worker(const std::string& worker, const std::map<std::string, std::string>& env,
                   const std::string& log = "");
std::string make_temp_dir(const std::string& prefix);
void remove_tree(const std::string& path);

}  // namespace ddp::test

#define DDP_WORKER(name)                                                               \
  static void name##_worker_body();                                                    \
  static ::ddp::test::WorkerRegistrar name##_registrar(#name, &name##_worker_body);    \
  static void name##_worker_body()

#define EXPECT_WORKERS_OK(results)                                                     \
  do {                                                                                 \
    std::string ddp_explanation_;                                                      \
    EXPECT_TRUE(::ddp::test::all_ok((results), &ddp_explanation_)) << ddp_explanation_; \
  } while (0)
