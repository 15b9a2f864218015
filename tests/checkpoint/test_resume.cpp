// Resume equivalence: 6 steps straight == 3 steps, checkpoint, new processes, load, 3 steps —
// bitwise on CPU, for SGD with momentum and for Adam. Batches come from each rank's own RNG
// stream, so this also checks that every rank gets its own RNG state back.
#include <cstdlib>
#include <memory>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::ToyModel;
using ddp::test::require;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(ToyModel& model) {
  const std::string kind = std::getenv("OPTIMIZER");
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(model->parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
  }
  return std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.01));
}

// One data-parallel step: own batch, averaged gradients (what DDP computes), optimizer step.
void train_step(ToyModel& model, torch::optim::Optimizer& optimizer) {
  const auto x = torch::randn({8, 10});
  const auto y = torch::randn({8, 5});
  optimizer.zero_grad();
  torch::mse_loss(model->forward(x), y).backward();
  for (auto& parameter : model->parameters()) {
    ddp::all_reduce(parameter.mutable_grad());
    parameter.mutable_grad().div_(ddp::get_world_size());
  }
  optimizer.step();
}

void start(ToyModel& model) {
  torch::manual_seed(0);  // same initial model on every rank
  model = ToyModel();
  torch::manual_seed(1000 + ddp::get_rank());  // a different data stream per rank
}

DDP_WORKER(train_six_straight) {
  auto pg = ddp::test::worker_init();
  ToyModel model(nullptr);
  start(model);
  auto optimizer = make_optimizer(model);
  for (int step = 0; step < 6; ++step) train_step(model, *optimizer);
  if (ddp::get_rank() == 0) ddp::save_state_dict(ddp::test::shared_dir() + "/straight.pt", *model);
}

DDP_WORKER(train_three_and_checkpoint) {
  auto pg = ddp::test::worker_init();
  ToyModel model(nullptr);
  start(model);
  auto optimizer = make_optimizer(model);
  for (int step = 0; step < 3; ++step) train_step(model, *optimizer);
  ddp::TrainingState state;
  state.global_step = 3;
  ddp::save_checkpoint(ddp::checkpoint_path(ddp::test::shared_dir(), 3), *model, optimizer.get(), state);
}

DDP_WORKER(resume_and_train_three) {
  auto pg = ddp::test::worker_init();
  torch::manual_seed(4242);  // nothing from a fresh start may leak into the result
  ToyModel model;
  auto optimizer = make_optimizer(model);
  const auto latest = ddp::latest_checkpoint(ddp::test::shared_dir());
  require(latest.has_value(), "no checkpoint found to resume from");
  const auto state = ddp::load_checkpoint(*latest, *model, optimizer.get());
  require(state.global_step == 3, "resumed at step " + std::to_string(state.global_step));
  for (int step = 0; step < 3; ++step) train_step(model, *optimizer);
  if (ddp::get_rank() == 0) ddp::save_state_dict(ddp::test::shared_dir() + "/resumed.pt", *model);
}

class Resume : public ::testing::TestWithParam<std::string> {};

TEST_P(Resume, SixStepsStraightEqualThreeCheckpointThree) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-resume");
  ddp::test::RunOptions options;
  options.shared_dir = dir;
  options.env = {{"OPTIMIZER", GetParam()}};
  EXPECT_WORKERS_OK(ddp::test::run_workers("train_six_straight", 2, options));
  EXPECT_WORKERS_OK(ddp::test::run_workers("train_three_and_checkpoint", 2, options));
  EXPECT_WORKERS_OK(ddp::test::run_workers("resume_and_train_three", 2, options));
  const auto straight = ddp::load_state_dict(dir + "/straight.pt");
  const auto resumed = ddp::load_state_dict(dir + "/resumed.pt");
  ASSERT_EQ(straight.keys(), resumed.keys());
  for (const auto& item : straight) {
    EXPECT_TRUE(torch::equal(item.value(), resumed[item.key()])) << item.key() << " differs after resuming";
  }
  // Resuming must not be trivially equal to where training stood at the checkpoint.
  const auto at_checkpoint = ddp::load_state_dict(ddp::checkpoint_path(dir, 3));
  EXPECT_FALSE(torch::equal(at_checkpoint["net1.weight"], straight["net1.weight"]));
  ddp::test::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Resume, ::testing::Values("sgd", "adam"));

}  // namespace
