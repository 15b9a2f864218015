#include "multiprocess.h"

#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>
#include <torch/version.h>

namespace ddp::test {
namespace {

std::map<std::string, WorkerFunction>& registry() {
  static std::map<std::string, WorkerFunction> workers;
  return workers;
}

std::string self_executable() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int env_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) fail(std::string("worker environment lacks ") + name);
  return std::atoi(value);
}

}  // namespace

WorkerRegistrar::WorkerRegistrar(const char* name, WorkerFunction function) {
  registry()[name] = function;
}

std::string make_temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
  return pattern;
}

// nftw rather than std::filesystem::remove_all: PyPI's torch 2.11 exports its own copy of
// remove_all from libtorch.so, which the dynamic linker binds first and which jumps to a null
// address (seen on the lent GPU machine: every test that cleaned up a temp folder crashed there).
void remove_tree(const std::string& path) {
  auto remove_one = [](const char* entry, const struct stat*, int, struct FTW*) {
    ::remove(entry);  // errors ignored: a temp folder another process already removed is fine
    return 0;
  };
  ::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);  // children first, links not followed
}

pid_t spawn_worker(const std::string& worker, const std::map<std::string, std::string>& env, const std::string& log) {
  if (registry().count(worker) == 0) throw std::invalid_argument("no DDP_WORKER named " + worker);
  procutil::SpawnOptions options;
  options.env = {{"DDP_TEST_WORKER", worker}};
  for (const auto& [key, value] : env) options.env[key] = value;
  options.log = log;
  options.own_process_group = true;  // a kill of the group takes any grandchildren too
  return procutil::spawn_self({self_executable()}, options);
}

std::vector<WorkerResult> run_workers(const std::string& worker, int world_size, const RunOptions& options) {
  if (registry().count(worker) == 0) throw std::invalid_argument("no DDP_WORKER named " + worker);
  const bool own_dir = options.shared_dir.empty();
  const std::string dir = own_dir ? make_temp_dir("ddp_test_") : options.shared_dir;
  // A fresh rendezvous file per run: FileStore keys must not leak between runs.
  const std::string store_file = make_temp_dir("ddp_store_") + "/store";

  std::vector<pid_t> pids(world_size, -1);
  std::vector<WorkerResult> results(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    std::map<std::string, std::string> env = {
        {"RANK", std::to_string(rank)}, {"LOCAL_RANK", std::to_string(rank)},
        {"WORLD_SIZE", std::to_string(world_size)}, {"DDP_TEST_DIR", dir},
        {"DDP_TEST_STORE", store_file}, {"OMP_NUM_THREADS", "1"}};
    for (const auto& [key, value] : options.env) env[key] = value;
    if (auto it = options.rank_env.find(rank); it != options.rank_env.end()) {
      for (const auto& [key, value] : it->second) env[key] = value;
    }
    pids[rank] = spawn_worker(worker, env, dir + "/worker_" + std::to_string(rank) + ".log");
    results[rank].rank = rank;
  }

  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  int running = world_size;
  while (running > 0) {
    for (int rank = 0; rank < world_size; ++rank) {
      if (pids[rank] < 0) continue;
      int status = 0;
      if (waitpid(pids[rank], &status, WNOHANG) == pids[rank]) {
        if (WIFEXITED(status)) results[rank].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) results[rank].signal = WTERMSIG(status);
        pids[rank] = -1;
        --running;
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int rank = 0; rank < world_size; ++rank) {
        if (pids[rank] < 0) continue;
        kill(-pids[rank], SIGKILL);
        waitpid(pids[rank], nullptr, 0);
        results[rank].timed_out = true;
        pids[rank] = -1;
      }
      running = 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int rank = 0; rank < world_size; ++rank) {
    results[rank].output = read_file(dir + "/worker_" + std::to_string(rank) + ".log");
  }
  remove_tree(std::filesystem::path(store_file).parent_path().string());
  if (own_dir) remove_tree(dir);
  return results;
}

bool all_ok(const std::vector<WorkerResult>& results, std::string* explanation) {
  std::ostringstream out;
  bool ok = true;
  for (const auto& result : results) {
    if (result.exit_code == 0 && result.signal == 0 && !result.timed_out) continue;
    ok = false;
    out << "rank " << result.rank << ": ";
    if (result.timed_out) out << "TIMED OUT (killed)";
    else if (result.signal) out << "killed by signal " << result.signal;
    else out << "exit code " << result.exit_code;
    out << "\n--- output ---\n" << result.output << "\n";
  }
  if (explanation) *explanation = out.str();
  return ok;
}

int worker_rank() { return env_int("RANK"); }
int worker_world_size() { return env_int("WORLD_SIZE"); }

std::string shared_dir() {
  const char* dir = std::getenv("DDP_TEST_DIR");
  if (dir == nullptr) fail("not running as a test worker (DDP_TEST_DIR unset)");
  return dir;
}

ddp::ProcessGroupPtr worker_init(std::chrono::milliseconds timeout) {
  ddp::InitOptions options;
  options.backend = "gloo";
  options.timeout = timeout;
  const char* port = std::getenv("MASTER_PORT");
  options.init_method = port ? "env://" : std::string("file://") + std::getenv("DDP_TEST_STORE");
  return ddp::init_process_group(options);
}

void fail(const std::string& message) { throw std::runtime_error(message); }

void write_shared(const std::string& name, const std::string& text) {
  const std::string path = shared_dir() + "/" + name;
  std::ofstream(path + ".tmp", std::ios::binary) << text;
  std::filesystem::rename(path + ".tmp", path);
}

std::string read_shared(const std::string& name) { return read_file(shared_dir() + "/" + name); }

int main_with_workers(int argc, char** argv) {
  if (const char* worker = std::getenv("DDP_TEST_WORKER")) {
    auto it = registry().find(worker);
    if (it == registry().end()) {
      std::cerr << "unknown worker " << worker << "\n";
      return 127;
    }
    try {
      it->second();
    } catch (const std::exception& error) {
      std::cerr << "worker " << worker << " rank " << std::getenv("RANK") << " failed: " << error.what() << std::endl;
      return 1;
    }
    std::cout.flush();
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  // Each test's log names the LibTorch it was built against (CI runs the suite on 1.13 and 2.x).
  // Not while listing: gtest_discover_tests parses that output.
  if (!GTEST_FLAG_GET(list_tests)) std::cout << "[torchddp] built against LibTorch " << TORCH_VERSION << "\n";
  return RUN_ALL_TESTS();
}

}  // namespace ddp::test
