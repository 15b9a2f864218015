// kill -9 while a large checkpoint is being written, many times at random moments: the
// checkpoint on disk always loads, whole, as either the previous or the new version.
#ifndef _WIN32
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/atomic_file.h>
#include <ddp/checkpoint.h>

#include "multiprocess.h"

namespace {

// ~16 MiB of parameters, so a write takes long enough to be interrupted.
struct Large : torch::nn::Module {
  Large() { weight = register_parameter("weight", torch::zeros({2048, 2048})); }
  torch::Tensor weight;
};

// Version k: every weight equals k and the metadata says k, so a mixed file would be caught.
void save_version(const std::string& path, Large& model, int64_t k) {
  {
    torch::NoGradGuard no_grad;
    model.weight.fill_(static_cast<float>(k));
  }
  ddp::TrainingState state;
  state.global_step = k;
  state.metadata = {{"version", std::to_string(k)}};
  ddp::save_checkpoint(path, model, nullptr, state);
}

// The temporary file a writer with `pid` uses for `path` (ddp::temporary_path_for's, for that pid).
std::string temporary_of(const std::string& path, pid_t pid) {
  const std::filesystem::path file(path);
  return (file.parent_path() / (".torchddp-tmp." + std::to_string(pid) + "." + file.filename().string())).string();
}

// The temporary files (".torchddp-tmp.<pid>.<name>") in `dir`.
std::vector<std::string> temporaries_in(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".torchddp-tmp.", 0) == 0) found.push_back(name);
  }
  return found;
}

// Worker: rewrites the same checkpoint forever with increasing versions until killed.
DDP_WORKER(rewrite_checkpoint_forever) {
  const std::string path = ddp::test::shared_dir() + "/ckpt.pt";
  Large model;
  int64_t k = std::stoll(std::getenv("FIRST_VERSION"));
  std::ofstream(ddp::test::shared_dir() + "/started." + std::getenv("FIRST_VERSION")) << "1";
  for (;; ++k) save_version(path, model, k);
}

pid_t spawn_writer(const std::string& dir, int64_t first_version) {
  return ddp::test::spawn_worker("rewrite_checkpoint_forever",
                                 {{"DDP_TEST_DIR", dir}, {"RANK", "0"}, {"WORLD_SIZE", "1"}, {"OMP_NUM_THREADS", "1"},
                                  {"FIRST_VERSION", std::to_string(first_version)}});
}

TEST(CrashSafety, KillNineDuringWritesAlwaysLeavesALoadableCheckpoint) {
  // One job restarted again and again: this process and its writers share a run id (and so the
  // directory's lock).
  ::setenv("TORCHDDP_RUN_ID", "crash-safety", 1);
  const std::string dir = ddp::test::make_temp_dir("ckpt-crash");
  const std::string path = dir + "/ckpt.pt";
  Large model;
  save_version(path, model, 1);
  int64_t last_version = 1;
  int killed_mid_write = 0;
  std::mt19937 random(12345);
  // At least 20 kills, and go on until 5 of them hit a write in progress (a kill can also land
  // while the next version is being serialized in memory, before its file is opened).
  // The loop as a whole is bounded too (each writer start by 60 s, all of it by 4 minutes), so a
  // slow machine fails the mid-write count below rather than running on.
  constexpr int kMinKills = 20, kMinMidWrite = 5, kMaxKills = 100;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(4);
  int kill_number = 0;
  for (; (kill_number < kMinKills || (killed_mid_write < kMinMidWrite && kill_number < kMaxKills)) &&
         std::chrono::steady_clock::now() < give_up;
       ++kill_number) {
    const pid_t pid = spawn_writer(dir, last_version + 1);
    ASSERT_GT(pid, 0);
    const std::string started = dir + "/started." + std::to_string(last_version + 1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(started) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(std::filesystem::exists(started)) << "writer never started";
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 600)(random)));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "writer ended on its own: " << status;
    // A leftover temporary file means the kill landed inside a write.
    const std::string temporary = temporary_of(path, pid);
    // It stays: the next writer's save removes it (checked after the loop).
    if (std::filesystem::exists(temporary)) ++killed_mid_write;

    Large loaded;
    ddp::TrainingState state;
    ASSERT_NO_THROW(state = ddp::load_checkpoint(path, loaded, nullptr)) << "after kill " << kill_number;
    const int64_t version = state.global_step;
    EXPECT_GE(version, last_version) << "an older checkpoint came back";
    EXPECT_EQ(state.metadata["version"], std::to_string(version));
    EXPECT_TRUE(torch::equal(loaded.weight, torch::full({2048, 2048}, static_cast<float>(version))))
        << "weights of a different version than the metadata: a torn file";
    last_version = version;
    std::filesystem::remove(started);
  }
  // The test means something only if kills really hit writes in progress.
  EXPECT_GE(killed_mid_write, kMinMidWrite) << "too few kills landed during a write";
  std::cout << "[ crash    ] " << killed_mid_write << " of " << kill_number << " kills landed mid-write; "
            << "last complete version " << last_version << std::endl;
  // Each killed writer's temporary file was removed by the next save: after one more, none is left.
  save_version(path, model, last_version + 1);
  EXPECT_EQ(temporaries_in(dir), std::vector<std::string>{}) << "temporary files of killed writers left behind";
  ddp::test::remove_tree(dir);
  ::unsetenv("TORCHDDP_RUN_ID");
}

// What a save sweeps: its own temporary files (".torchddp-tmp.<pid>.<name>") of processes that no
// longer exist, and nothing else: a file merely named "<anything>.tmp.<digits>" is not ours
// (before: notes.tmp.999999 beside a checkpoint was deleted), nor one of another user.
TEST(CrashSafety, ASaveRemovesTheTemporaryFilesOfDeadWritersOnly) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-orphans");
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);  // reaped: no process has this pid now
  const std::string orphan = temporary_of(dir + "/checkpoint-00000003.pt", gone);
  const std::string live = temporary_of(dir + "/checkpoint-00000003.pt", getppid());
  const std::string notes = dir + "/notes.tmp." + std::to_string(gone);
  const std::string old_style = dir + "/checkpoint-00000003.pt.tmp." + std::to_string(gone);
  const std::string other = dir + "/notes.tmp.txt";
  for (const auto& file : {orphan, live, notes, old_style, other}) std::ofstream(file) << "partial";
  // Named as ours, but another user's: not ours to remove.
  const std::string foreign = temporary_of(dir + "/checkpoint-00000002.pt", gone);
  std::ofstream(foreign) << "someone else's";
  const bool root = geteuid() == 0;
  if (root) ASSERT_EQ(chown(foreign.c_str(), 65534, 65534), 0);
  Large model;
  save_version(dir + "/checkpoint-00000004.pt", model, 4);
  EXPECT_FALSE(std::filesystem::exists(orphan)) << "the dead writer's temporary file is still there";
  EXPECT_TRUE(std::filesystem::exists(live)) << "a live process's temporary file was removed";
  for (const auto& file : {notes, old_style, other}) EXPECT_TRUE(std::filesystem::exists(file)) << file << " was removed";
  if (root) EXPECT_TRUE(std::filesystem::exists(foreign)) << "another user's file was removed";
  ddp::test::remove_tree(dir);
}

}  // namespace
#endif  // _WIN32
