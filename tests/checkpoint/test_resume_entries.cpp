// Resume in two lines: the sampler and program values (a step counter, the learning rate, a
// tensor of past losses) as checkpoint entries beside the model and optimizer. A run interrupted
// mid-epoch and resumed in new processes through load_checkpoint_if_exists ends bitwise where the
// straight run ends, each rank with its own values; rank 0 says what it resumed from.
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_sampler.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"
#include "resealed.h"

namespace {

using ckpt_test::ToyModel;
using ddp::test::require;

DDP_WORKER(resume_with_entries) {
  auto pg = ddp::test::worker_init();
  const std::string mode = std::getenv("MODE");  // straight, interrupted or resumed
  const std::string dir = ddp::test::shared_dir() + "/checkpoints";
  torch::manual_seed(0);
  ToyModel model;
  const auto data = torch::randn({40, 10}), targets = torch::randn({40, 5});
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  ddp::DistributedSampler sampler(40, ddp::DistributedSamplerOptions().seed(7));  // 20 a rank: 5 batches of 4
  int64_t iteration = 0;
  double learning_rate = 0.05;
  auto losses = torch::zeros({0}, torch::kDouble);
  const std::vector<ddp::CheckpointEntry> entries{{"model", model},     {"optimizer", optimizer},
                                                  {"sampler", sampler}, {"iteration", iteration},
                                                  {"lr", learning_rate}, {"losses", losses}};
  int64_t first_epoch = 0;
  if (mode == "resumed") {
    const auto restored = ddp::load_checkpoint_if_exists(dir, entries);
    require(restored.loaded && iteration == 7, "nothing resumed, or iteration " + std::to_string(iteration));
    first_epoch = restored.state.epoch;
  }
  for (int64_t epoch = first_epoch; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);  // keeps a restored position in its epoch
    while (auto indices = sampler.next(4)) {
      const auto index = torch::tensor(std::vector<int64_t>(indices->begin(), indices->end()));
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(data.index_select(0, index)), targets.index_select(0, index));
      loss.backward();
      for (auto& parameter : model->parameters()) {
        ddp::all_reduce(parameter.mutable_grad());
        parameter.mutable_grad().div_(ddp::get_world_size());
      }
      static_cast<torch::optim::SGDOptions&>(optimizer.param_groups()[0].options()).lr(learning_rate);
      optimizer.step();
      ++iteration;
      learning_rate *= 0.9;
      losses = torch::cat({losses, loss.detach().to(torch::kDouble).reshape({1})});
      if (mode == "interrupted" && iteration == 7) {  // mid-epoch 1
        ddp::save_checkpoint(ddp::checkpoint_path(dir, iteration), entries, ddp::TrainingState{epoch, iteration});
        return;
      }
    }
  }
  std::vector<torch::Tensor> final_state = model->parameters();
  final_state.push_back(torch::tensor({iteration}));
  final_state.push_back(torch::tensor({learning_rate}, torch::kDouble));
  final_state.push_back(losses);
  torch::save(final_state, ddp::test::shared_dir() + "/" + mode + "_" + std::to_string(ddp::get_rank()) + ".pt");
}

TEST(ResumeEntries, SamplerAndProgramValuesResumeBitwiseInTwoLines) {
  ddp::test::RunOptions options;
  options.shared_dir = ddp::test::make_temp_dir("resume_entries_");
  for (const std::string mode : {"straight", "interrupted", "resumed"}) {
    options.env["MODE"] = mode;
    const auto results = ddp::test::run_workers("resume_with_entries", 2, options);
    EXPECT_WORKERS_OK(results);
    if (mode == "resumed") {
      EXPECT_NE(results[0].output.find("ddp: resumed from " + options.shared_dir +
                                       "/checkpoints/checkpoint-00000007.pt: epoch 1, global step 7"),
                std::string::npos)
          << results[0].output;
    }
  }
  for (int rank : {0, 1}) {
    std::vector<torch::Tensor> straight, resumed;
    torch::load(straight, options.shared_dir + "/straight_" + std::to_string(rank) + ".pt");
    torch::load(resumed, options.shared_dir + "/resumed_" + std::to_string(rank) + ".pt");
    ASSERT_EQ(straight.size(), resumed.size());
    for (size_t i = 0; i < straight.size(); ++i) {
      EXPECT_TRUE(torch::equal(straight[i], resumed[i])) << "rank " << rank << ", tensor " << i << ": "
                                                         << straight[i] << " vs " << resumed[i];
    }
    EXPECT_EQ(straight.back().numel(), 10) << "rank " << rank << ": every step's loss, the first seven restored";
  }
  ddp::test::remove_tree(options.shared_dir);
}

// What a damaged entry stands in for: a sound file whose entry holds `state` (a field missing, or
// one with no elements) where the sampler's or a value's state belongs.
class DamagedEntry final : public ddp::Stateful {
 public:
  explicit DamagedEntry(ddp::TensorDict state) : state_(std::move(state)) {}
  ddp::TensorDict state_dict() const override { return state_; }
  void load_state_dict(const ddp::TensorDict&) override {}

 private:
  ddp::TensorDict state_;
};

// A checkpoint whose sampler or program value entry is incomplete (a field missing or truncated to
// no elements, saved in its place; or the entry gone from the file's list of states, edited and
// re-sealed) is refused naming the entry, and changes nothing: not the sampler, not the values
// (those listed before the damaged entry included), not the model or the optimizer. A sound
// checkpoint then restores them all.
TEST(ResumeEntries, AnIncompleteSamplerOrValueEntryIsRefusedAndChangesNothing) {
  const std::string dir = ddp::test::make_temp_dir("incomplete_entries_");
  // The saving run's values, each other than the loading run's.
  torch::manual_seed(1);
  ToyModel saved_model;
  torch::optim::SGD saved_optimizer(saved_model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  saved_model->forward(torch::randn({4, 10})).sum().backward();
  saved_optimizer.step();
  ddp::DistributedSampler saved_sampler(40, ddp::DistributedSamplerOptions().seed(7).num_replicas(2).rank(0));
  saved_sampler.set_epoch(1);
  (void)saved_sampler.next(4);
  int64_t saved_iteration = 7;
  double saved_lr = 0.01;
  auto saved_losses = torch::tensor({1.5, 2.5}, torch::kDouble);
  DamagedEntry sampler_without_consumed({{"epoch", torch::scalar_tensor(1, torch::kLong)}});
  DamagedEntry sampler_truncated({{"epoch", torch::scalar_tensor(1, torch::kLong)}, {"consumed", torch::zeros({0}, torch::kLong)}});
  DamagedEntry value_without_value({{"count", torch::scalar_tensor(7, torch::kLong)}});
  DamagedEntry value_truncated({{"value", torch::zeros({0}, torch::kDouble)}});
  // The sound file, and one per damaged entry.
  auto save = [&](const std::string& file, ddp::CheckpointEntry sampler, ddp::CheckpointEntry iteration,
                  ddp::CheckpointEntry lr) {
    ddp::save_checkpoint(dir + "/" + file, {{"model", saved_model}, {"optimizer", saved_optimizer}, std::move(sampler),
                                            std::move(iteration), std::move(lr), {"losses", saved_losses}},
                         ddp::TrainingState{1, 7});
    return dir + "/" + file;
  };
  const std::string sound = save("sound.pt", {"sampler", saved_sampler}, {"iteration", saved_iteration}, {"lr", saved_lr});
  struct Case {
    std::string file, entry;
  };
  std::vector<Case> cases = {
      {save("no-consumed.pt", {"sampler", sampler_without_consumed}, {"iteration", saved_iteration}, {"lr", saved_lr}),
       "the state \"sampler\""},
      {save("short-consumed.pt", {"sampler", sampler_truncated}, {"iteration", saved_iteration}, {"lr", saved_lr}),
       "the state \"sampler\""},
      {save("no-value.pt", {"sampler", saved_sampler}, {"iteration", value_without_value}, {"lr", saved_lr}),
       "the state \"iteration\""},
      {save("short-value.pt", {"sampler", saved_sampler}, {"iteration", saved_iteration}, {"lr", value_truncated}),
       "the state \"lr\""}};
  // The sampler's name in the list of states, renamed (same length): the file has no sampler entry.
  std::vector<char> renamed = ckpt_test::resealed::rewrite(
      ddp::read_checkpoint_file(sound), "ddp_training_state/data.pkl", [](std::string& pickle) {
        const std::string name("\x07\x00\x00\x00sampler", 11);  // BINUNICODE's length, then the name
        const auto at = pickle.find(name);
        ASSERT_NE(at, std::string::npos) << "no state named sampler in the training record";
        pickle.replace(at, name.size(), std::string("\x07\x00\x00\x00samplez", 11));
      });
  ddp::seal_archive(renamed);
  std::ofstream(dir + "/no-sampler.pt", std::ios::binary)
      .write(renamed.data(), static_cast<std::streamsize>(renamed.size()));
  cases.push_back({dir + "/no-sampler.pt", "no state named \"sampler\""});

  torch::manual_seed(2);
  ToyModel model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  ddp::DistributedSampler sampler(40, ddp::DistributedSamplerOptions().seed(7).num_replicas(2).rank(0));
  int64_t iteration = 3;
  double lr = 0.5;
  auto losses = torch::tensor({9.0}, torch::kDouble);
  // The values before the sampler, the sampler before the other values: whichever entry is
  // damaged, another is restored before it in the order given.
  const std::vector<ddp::CheckpointEntry> entries{{"model", model},         {"optimizer", optimizer},
                                                  {"losses", losses},       {"sampler", sampler},
                                                  {"iteration", iteration}, {"lr", lr}};
  std::vector<torch::Tensor> parameters_before;
  for (const auto& parameter : model->parameters()) parameters_before.push_back(parameter.detach().clone());
  const auto losses_before = losses.clone();
  const ddp::SamplerState sampler_before = sampler.state();
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    const std::string error =
        ddp::test::error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(c.file, entries); });
    EXPECT_TRUE(ckpt_test::contains(error, c.entry)) << error;
    EXPECT_TRUE(ckpt_test::contains(error, c.file)) << error;
    EXPECT_TRUE(sampler.state() == sampler_before) << "epoch " << sampler.state().epoch << ", consumed "
                                                    << sampler.state().consumed;
    EXPECT_EQ(iteration, 3);
    EXPECT_EQ(lr, 0.5);
    EXPECT_TRUE(torch::equal(losses, losses_before)) << losses;
    const auto parameters = model->parameters();
    for (size_t i = 0; i < parameters.size(); ++i) {
      EXPECT_TRUE(torch::equal(parameters[i], parameters_before[i])) << "parameter " << i;
    }
    EXPECT_TRUE(optimizer.state().empty()) << "the failed load left optimizer state";
  }
  const auto state = ddp::load_checkpoint(sound, entries);
  EXPECT_EQ(state.global_step, 7);
  EXPECT_TRUE(sampler.state() == saved_sampler.state());
  EXPECT_EQ(iteration, 7);
  EXPECT_EQ(lr, 0.01);
  EXPECT_TRUE(torch::equal(losses, saved_losses));
  const auto parameters = model->parameters(), saved_parameters = saved_model->parameters();
  for (size_t i = 0; i < parameters.size(); ++i) EXPECT_TRUE(torch::equal(parameters[i], saved_parameters[i]));
  ddp::test::remove_tree(dir);
}

}  // namespace
