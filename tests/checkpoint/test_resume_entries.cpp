// Resume in two lines: the sampler and program values (a step counter, the learning rate, a
// tensor of past losses) as checkpoint entries beside the model and optimizer. A run interrupted
// mid-epoch and resumed in new processes through load_checkpoint_if_exists ends bitwise where the
// straight run ends, each rank with its own values; rank 0 says what it resumed from.
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_sampler.h>

#include "models.h"
#include "multiprocess.h"

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

}  // namespace
