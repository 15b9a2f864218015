// Two jobs given one checkpoint directory (before: they overwrote and pruned each other's
// checkpoint-<step>.pt while both ran): the second job's save is refused, naming the first; a
// lock whose process has ended is taken over; processes of one run share it.
#ifndef _WIN32
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::contains;
using ckpt_test::ToyModel;

// A job that saved into the shared directory and runs on (until killed).
DDP_WORKER(hold_checkpoint_directory) {
  ToyModel model;
  ddp::save_checkpoint(ddp::checkpoint_path(ddp::test::shared_dir(), 1), *model, nullptr, {});
  ddp::test::write_shared("saved", "1");
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

std::string text_of(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

std::string save_error(const std::string& path) {
  ToyModel model;
  return ddp::test::error_of<ddp::CheckpointError>([&] { ddp::save_checkpoint(path, *model, nullptr, {}); });
}

TEST(DirectoryLock, ASecondJobIsRefusedWhileTheFirstLives) {
  ASSERT_EQ(std::getenv("TORCHDDP_RUN_ID"), nullptr) << "the test expects to run outside a launcher";
  const std::string dir = ddp::test::make_temp_dir("ckpt-lock");
  const pid_t first = ddp::test::spawn_worker(
      "hold_checkpoint_directory", {{"DDP_TEST_DIR", dir}, {"TORCHDDP_RUN_ID", "job-a"}, {"OMP_NUM_THREADS", "1"}});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(dir + "/saved") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/saved")) << "the first job never saved";

  const std::string path = ddp::checkpoint_path(dir, 2);
  EXPECT_EQ(save_error(path),
            "cannot save checkpoint " + path + ": the checkpoint directory " + dir + " is in use by another job: " + dir +
                "/.torchddp-checkpoint.lock names run 'job-a', pid " + std::to_string(first) + " on host " +
                host_name() + ", which still holds it (this is a run without an id). Two jobs saving into one "
                "directory overwrite and prune each other's checkpoints: give this job its own directory, or end the "
                "other (a lock whose process has ended is taken over)");
  EXPECT_FALSE(std::filesystem::exists(path));

  // Another process of the same run (a launcher's restart, a second group) shares the directory.
  ::setenv("TORCHDDP_RUN_ID", "job-a", 1);
  EXPECT_EQ(save_error(path), "");
  ::unsetenv("TORCHDDP_RUN_ID");

  // Once the first job has ended, its lock is taken over, and names this process.
  ::kill(first, SIGKILL);
  ::waitpid(first, nullptr, 0);
  EXPECT_EQ(save_error(ddp::checkpoint_path(dir, 3)), "");
  EXPECT_EQ(text_of(dir + "/.torchddp-checkpoint.lock"),
            "run_id= pid=" + std::to_string(::getpid()) + " host=" + host_name() + "\n");
  ddp::test::remove_tree(dir);
}

// A lock file left by a process that has ended (killed, its machine rebooted): taken over.
TEST(DirectoryLock, ALockOfAProcessThatEndedIsTakenOver) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-lock");
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  std::ofstream(dir + "/.torchddp-checkpoint.lock") << "run_id=job-gone pid=" << gone << " host=" << host_name() << "\n";
  EXPECT_EQ(save_error(ddp::checkpoint_path(dir, 1)), "");
  EXPECT_TRUE(contains(text_of(dir + "/.torchddp-checkpoint.lock"), " pid=" + std::to_string(::getpid()) + " "));
  ddp::test::remove_tree(dir);
}

}  // namespace
#endif  // _WIN32
