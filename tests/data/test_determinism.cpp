// Data parallelism changes nothing but speed: with the same global batch, world 1 x batch 64 and
// world 2 x batch 32 give the same per-step global loss for a whole epoch. This holds because the
// sampler gives rank r the positions perm[r::W] of one shared permutation, so the two ranks' batches
// of 32 together are exactly world 1's batch of 64, and DDP averages the two halves' gradients.
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_sampler.h>
#include "fashion_mnist.h"
#include <ddp/metrics.h>

#include "multiprocess.h"

namespace {

constexpr int64_t kGlobalBatch = 64;
constexpr size_t kFirstImages = 640;  // the first 640 training images: 10 steps

struct SmallNet : torch::nn::Module {
  SmallNet()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3)))),
        fc(register_module("fc", torch::nn::Linear(8 * 13 * 13, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    return fc(torch::max_pool2d(torch::relu(conv(x)), 2).flatten(1));
  }
  torch::nn::Conv2d conv;
  torch::nn::Linear fc;
};

// Trains one epoch and writes the global loss of every step, one per line, to loss_world<W>.txt.
DDP_WORKER(loss_curve) {
  torch::set_num_threads(1);
  auto pg = ddp::test::worker_init();
  const int world = ddp::get_world_size();
  const int rank = ddp::get_rank();

  examples::FashionMNIST train(examples::FashionMNIST::Split::kTrain);
  train.head(kFirstImages);
  torch::manual_seed(1);
  ddp::DistributedDataParallel model(std::make_shared<SmallNet>(), pg);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ddp::DistributedSampler sampler(kFirstImages, ddp::DistributedSamplerOptions().num_replicas(world).rank(rank).seed(7));
  auto loader = torch::data::make_data_loader(train.map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions().batch_size(kGlobalBatch / world));
  std::ostringstream curve;
  curve.precision(9);
  for (auto& batch : *loader) {
    auto loss = torch::nn::functional::cross_entropy(model.forward(batch.data), batch.target);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    ddp::Metrics step;
    step.add("loss", loss.item<double>() * batch.data.size(0), static_cast<double>(batch.data.size(0)));
    curve << step.all_reduce().mean("loss") << "\n";
  }
  if (rank == 0) ddp::test::write_shared("loss_world" + std::to_string(world) + ".txt", curve.str());
}

std::vector<double> read_curve(const std::string& path) {
  std::ifstream file(path);
  std::vector<double> curve;
  for (double loss; file >> loss;) curve.push_back(loss);
  return curve;
}

TEST(Determinism, SameGlobalBatchGivesTheSameLossCurveAtWorld1And2) {
  ddp::test::RunOptions options;
  options.shared_dir = ddp::test::make_temp_dir("determinism");
  EXPECT_WORKERS_OK(ddp::test::run_workers("loss_curve", 1, options));
  EXPECT_WORKERS_OK(ddp::test::run_workers("loss_curve", 2, options));
  const auto alone = read_curve(options.shared_dir + "/loss_world1.txt");
  const auto pair = read_curve(options.shared_dir + "/loss_world2.txt");
  ddp::test::remove_tree(options.shared_dir);

  ASSERT_EQ(alone.size(), kFirstImages / kGlobalBatch);
  ASSERT_EQ(pair.size(), alone.size());
  for (size_t step = 0; step < alone.size(); ++step) {
    EXPECT_NEAR(pair[step], alone[step], 1e-4) << "step " << step;
  }
  // It really trained: from about ln(10) down by a clear margin.
  EXPECT_NEAR(alone.front(), std::log(10.0), 0.3);
  EXPECT_LT(alone.back(), alone.front() - 0.5);
}

}  // namespace
