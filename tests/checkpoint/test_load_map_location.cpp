// load_checkpoint consults map_location for what it places: every model tensor, with the device it
// was saved from, and the optimizer state. Checked with a rule that records its calls (no GPU here,
// so every saved device is "cpu"; the device-string logic itself is in test_map_location.cpp).
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::ToyModel;

// One SGD-with-momentum step on a fixed batch, so every parameter has a momentum buffer.
void train_step(ToyModel& model, torch::optim::SGD& optimizer, int seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({8, 10});
  optimizer.zero_grad();
  model->forward(x).pow(2).mean().backward();
  optimizer.step();
}

TEST(LoadMapLocation, RuleIsAppliedToEveryModelTensorAndTheOptimizerState) {
  const std::string dir = ddp::test::make_temp_dir("ckpt_map_");
  const std::string path = dir + "/ckpt.pt";
  torch::manual_seed(1);
  ToyModel saved;
  torch::optim::SGD saved_optimizer(saved->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train_step(saved, saved_optimizer, 2);
  ddp::save_checkpoint(path, *saved, &saved_optimizer, {});

  std::vector<std::string> calls;
  const auto recording = ddp::LoadOptions().map_location(ddp::MapLocation::function([&](const std::string& from) {
    calls.push_back(from);
    return std::string("cpu");
  }));

  // Model only: one call per state_dict entry, each told the device that entry was saved from.
  torch::manual_seed(3);
  ToyModel model_only;
  ddp::load_checkpoint(path, *model_only, nullptr, recording);
  const size_t model_tensors = saved->named_parameters().size() + saved->named_buffers().size();
  ASSERT_EQ(model_tensors, 4u);
  EXPECT_EQ(calls, std::vector<std::string>(model_tensors, "cpu"));
  EXPECT_TRUE(ckpt_test::same_state(*model_only, *saved));

  // Model and optimizer: the optimizer's momentum buffers go through the rule as well. The state is
  // read as one unit (the device of its first parameter), hence "at least one" more call; then each
  // parameter's state joins its parameter (test_optimizer_placement.cpp).
  calls.clear();
  torch::manual_seed(4);
  ToyModel loaded;
  torch::optim::SGD loaded_optimizer(loaded->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ddp::load_checkpoint(path, *loaded, &loaded_optimizer, recording);
  ASSERT_GT(calls.size(), model_tensors) << "map_location was not consulted for the optimizer state";
  EXPECT_EQ(calls, std::vector<std::string>(calls.size(), "cpu"));

  // The momentum buffers arrived, one per parameter, on the device the rule chose...
  ASSERT_EQ(loaded_optimizer.state().size(), saved->parameters().size());
  for (const auto& item : loaded_optimizer.state()) {
    const auto& state = static_cast<const torch::optim::SGDParamState&>(*item.second);
    ASSERT_TRUE(state.momentum_buffer().defined());
    EXPECT_EQ(state.momentum_buffer().device().str(), "cpu");
  }
  // ...with the saved values: the next step is the same as the uninterrupted run's.
  train_step(saved, saved_optimizer, 5);
  train_step(loaded, loaded_optimizer, 5);
  EXPECT_TRUE(ckpt_test::same_state(*loaded, *saved)) << "momentum not restored";

  // A rule that rejects the saved device stops the load and is named in the error.
  const auto bad = ddp::LoadOptions().map_location(
      ddp::MapLocation::function([](const std::string&) { return std::string("cdua:1"); }));
  try {
    ddp::load_checkpoint(path, *loaded, &loaded_optimizer, bad);
    ADD_FAILURE() << "a rule returning 'cdua:1' was not applied";
  } catch (const std::exception& error) {
    EXPECT_TRUE(ckpt_test::contains(error.what(), "mapped device 'cdua:1' is not a device")) << error.what();
  }
  ddp::test::remove_tree(dir);
}

}  // namespace
