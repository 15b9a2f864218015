// examples/checkpoint runs as the tutorial does: 2 processes, gloo, env:// rendezvous.
#include <unistd.h>

#include <gtest/gtest.h>

#include "multiprocess.h"

namespace {

// The worker becomes the example program (same RANK/WORLD_SIZE/LOCAL_RANK, MASTER_* from the test).
DDP_WORKER(exec_checkpoint_example) {
  const std::string checkpoint = ddp::test::shared_dir() + "/model.checkpoint";
  execl(CKPT_EXAMPLE_PATH, CKPT_EXAMPLE_PATH, checkpoint.c_str(), static_cast<char*>(nullptr));
  ddp::test::fail(std::string("cannot run ") + CKPT_EXAMPLE_PATH);
}

TEST(CheckpointExample, TwoProcessesOnCpuWithEnvInit) {
  ddp::test::RunOptions options;
  options.env = {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::test::free_port())}};
  const auto results = ddp::test::run_workers("exec_checkpoint_example", 2, options);
  EXPECT_WORKERS_OK(results);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_NE(results[0].output.find("replicas identical"), std::string::npos) << results[0].output;
  EXPECT_NE(results[1].output.find("rank 1 loaded"), std::string::npos) << results[1].output;
}

}  // namespace
