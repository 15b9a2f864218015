// Resuming mixed-precision training from a checkpoint is bitwise: 2 ranks under DDP, 8 steps
// straight versus 4 steps + save_checkpoint({model, optimizer, scaler}) + load into a fresh model,
// optimizer and default-constructed scaler + 4 steps. An inf in the first half moves the scale off
// its initial value; growth_interval 3 makes the growth count matter right after the resume.
#include <limits>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/grad_scaler.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

constexpr int kSteps = 8;

struct Run {
  MLP net;
  ddp::DistributedDataParallel<MLPImpl> model;
  torch::optim::SGD optimizer;
  ddp::GradScaler scaler;

  Run(uint64_t seed, ddp::GradScalerOptions options)
      : net((torch::manual_seed(seed), MLP())),
        model(net),
        optimizer(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
        scaler(options) {}

  void train(int from, int to) {
    const int rank = ddp::get_rank(), world = ddp::get_world_size();
    for (int t = from; t < to; ++t) {
      auto [all_x, all_y] = batch(t);
      auto x = shard(all_x, rank, world), y = shard(all_y, rank, world);
      optimizer.zero_grad();
      scaler.scale(torch::mse_loss(model.forward(x), y)).backward();
      if (t == 1 && rank == 1) net->fc2->bias.mutable_grad()[0] = std::numeric_limits<float>::infinity();
      scaler.step(optimizer);
      scaler.update();
    }
  }
};

DDP_WORKER(amp_resume_bitwise) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank();
  const auto options = ddp::GradScalerOptions().init_scale(4096).growth_interval(3);

  Run straight(1, options);
  straight.train(0, kSteps);

  const std::string path = ddp::checkpoint_path(shared_dir(), kSteps / 2);
  {
    Run first_half(1, options);
    first_half.train(0, kSteps / 2);
    require(first_half.scaler.get_scale() != 4096, "the scale must have moved off its initial value before the save");
    require(first_half.scaler.growth_tracker() != 0, "the growth count must be under way at the save");
    ddp::save_checkpoint(path, first_half.model, &first_half.optimizer, ddp::TrainingState{},
                         ddp::CheckpointOptions().state("scaler", &first_half.scaler));
  }
  Run resumed(99, ddp::GradScalerOptions());  // other weights, PyTorch's default scaler
  ddp::load_checkpoint(path, resumed.model, &resumed.optimizer, ddp::LoadOptions().state("scaler", &resumed.scaler));
  resumed.train(kSteps / 2, kSteps);

  const std::string who = "rank " + std::to_string(rank) + ": ";
  require(resumed.scaler.get_scale() == straight.scaler.get_scale(),
          who + "scale " + std::to_string(resumed.scaler.get_scale()) + " after resume, " +
              std::to_string(straight.scaler.get_scale()) + " straight");
  require(resumed.scaler.growth_tracker() == straight.scaler.growth_tracker(), who + "growth tracker differs");
  const auto resumed_params = resumed.model.parameters(), straight_params = straight.model.parameters();
  for (size_t i = 0; i < straight_params.size(); ++i) {
    require(torch::equal(resumed_params[i], straight_params[i]),
            who + "parameter " + std::to_string(i) + " after resume differs from the straight run");
  }
  // The scale the runs end with: 4096, halved by the inf at step 1, doubled after steps 2-4 and 5-7.
  require(straight.scaler.get_scale() == 8192, who + "unexpected final scale " + std::to_string(straight.scaler.get_scale()));
}
TEST(GradScalerResume, CheckpointResumeIsBitwiseScaleIncluded) {
  RunOptions options;
  options.timeout = std::chrono::seconds(120);
  EXPECT_WORKERS_OK(run_workers("amp_resume_bitwise", 2, options));
}

}  // namespace
