// examples/checkpoint runs as the tutorial does: 2 processes, gloo, env:// rendezvous.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include <gtest/gtest.h>

#include "multiprocess.h"

namespace {

// The worker becomes the example program (same RANK/WORLD_SIZE/LOCAL_RANK, MASTER_* from the test).
DDP_WORKER(exec_checkpoint_example) {
  const std::string checkpoint = ddp::test::shared_dir() + "/model.checkpoint";
  execl(CKPT_EXAMPLE_PATH, CKPT_EXAMPLE_PATH, checkpoint.c_str(), static_cast<char*>(nullptr));
  ddp::test::fail(std::string("cannot run ") + CKPT_EXAMPLE_PATH);
}

// The example without a path: it picks its own.
DDP_WORKER(exec_checkpoint_example_default_path) {
  execl(CKPT_EXAMPLE_PATH, CKPT_EXAMPLE_PATH, static_cast<char*>(nullptr));
  ddp::test::fail(std::string("cannot run ") + CKPT_EXAMPLE_PATH);
}

// Runs the example on two ranks with its checkpoint at `dir`/model.checkpoint.
std::vector<ddp::test::WorkerResult> run_example(const std::string& dir = "") {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())}};
  options.shared_dir = dir;
  return ddp::test::run_workers("exec_checkpoint_example", 2, options);
}

mode_t type_of(const std::string& path) {
  struct stat status {};
  return ::lstat(path.c_str(), &status) == 0 ? (status.st_mode & S_IFMT) : 0;
}

TEST(CheckpointExample, TwoProcessesOnCpuWithEnvInit) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-example");
  const auto results = run_example(dir);
  EXPECT_WORKERS_OK(results);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_NE(results[0].output.find("replicas identical"), std::string::npos) << results[0].output;
  EXPECT_NE(results[1].output.find("rank 1 loaded"), std::string::npos) << results[1].output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.checkpoint")) << "the file it created is left behind";
  ddp::test::remove_tree(dir);
}

// The example deletes its checkpoint at the end only when it created it (issue 28: it deleted
// whatever PATH named): a file that was there stays, holding the checkpoint now.
TEST(CheckpointExample, AFileThatWasThereIsKept) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-example");
  std::ofstream(dir + "/model.checkpoint") << "the user's";
  const auto results = run_example(dir);
  EXPECT_WORKERS_OK(results);
  EXPECT_EQ(type_of(dir + "/model.checkpoint"), static_cast<mode_t>(S_IFREG));
  ddp::test::remove_tree(dir);
}

// A FIFO or a device node at PATH: the save is refused on rank 0, every rank ends with an error,
// and the node is still there. The device node is this test's own (1:3, as /dev/null), never a
// real one.
TEST(CheckpointExample, ANodeThatIsNoRegularFileIsRefusedAndKept) {
  for (const mode_t type : {S_IFIFO, S_IFCHR}) {
    if (type == S_IFCHR && ::geteuid() != 0) {
      std::cout << "device node case skipped: making one (mknod) needs root\n";
      continue;
    }
    SCOPED_TRACE(type == S_IFIFO ? "FIFO" : "character device");
    const std::string dir = ddp::test::make_temp_dir("ckpt-example");
    const std::string path = dir + "/model.checkpoint";
    ASSERT_EQ(::mknod(path.c_str(), type | 0600, type == S_IFCHR ? makedev(1, 3) : 0), 0);
    const auto results = run_example(dir);
    ASSERT_EQ(results.size(), 2u);
    EXPECT_EQ(results[0].exit_code, 1) << results[0].output;
    EXPECT_NE(results[0].output.find("checkpoint_ddp: error: cannot save checkpoint " + path + ": cannot write " + path +
                                     ": it is a "),
              std::string::npos)
        << results[0].output;
    EXPECT_EQ(results[1].exit_code, 1) << results[1].output;
    EXPECT_NE(results[1].output.find("rank 0 failed to save checkpoint " + path), std::string::npos) << results[1].output;
    EXPECT_EQ(type_of(path), type);
    ddp::test::remove_tree(dir);
  }
}

// Without a path, the checkpoint goes into a new directory only this user may enter, removed at
// the end (before: $TMPDIR/torchddp_model.checkpoint in world-writable /tmp, where another user's
// link made a root run overwrite root's file).
TEST(CheckpointExample, TheDefaultPathIsInAPrivateDirectoryOfItsOwn) {
  const std::string temp = std::filesystem::temp_directory_path().string();
  const std::string old_default = temp + "/torchddp_model.checkpoint";
  const bool old_default_was_there = std::filesystem::exists(std::filesystem::symlink_status(old_default));
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())}};
  const auto results = ddp::test::run_workers("exec_checkpoint_example_default_path", 2, options);
  EXPECT_WORKERS_OK(results);
  ASSERT_EQ(results.size(), 2u);
  const std::string head = "rank 1 loaded " + temp + "/torchddp-checkpoint-";
  const std::size_t at = results[1].output.find(head);
  ASSERT_NE(at, std::string::npos) << results[1].output;
  const std::string path = results[1].output.substr(at + 14, results[1].output.find(' ', at + head.size()) - at - 14);
  EXPECT_EQ(std::filesystem::path(path).filename(), "model.checkpoint") << path;
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(path).parent_path())) << "its directory is left behind";
  if (!old_default_was_there) EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(old_default)));
}

}  // namespace
