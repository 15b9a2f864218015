// ddp::SyncBatchNorm against an independent reference: torch::nn::BatchNorm in one process on the
// concatenated global batch. At 2 and 3 ranks with different batch sizes per rank (some empty),
// 2-D and 4-D inputs, three SGD steps under DistributedDataParallel. Then the single-process and
// eval behaviour, and the errors for ranks that disagree on channels.
#include <chrono>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/sync_batchnorm.h>

#include "error_of.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

constexpr int kSteps = 3;
constexpr int64_t kChannels = 4;

// Samples per rank in each step: different on every rank, and an empty rank in some steps.
int batch_size(int world, int rank, int step) {
  static const int two[kSteps][2] = {{3, 5}, {0, 6}, {4, 1}};
  static const int three[kSteps][3] = {{2, 0, 5}, {3, 4, 1}, {0, 6, 2}};
  return world == 2 ? two[step][rank] : three[step][rank];
}

// Linear (2-D input) or Conv2d (4-D) into a norm layer: the norm's input gradient flows on into
// a layer whose gradients DDP averages, so SyncBatchNorm's collectives interleave with DDP's.
template <typename Norm>
struct NetImpl : torch::nn::Module {
  NetImpl(bool image, Norm norm_layer) : image(image) {
    if (image) {
      conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, kChannels, 3).padding(1)));
    } else {
      linear = register_module("linear", torch::nn::Linear(6, kChannels));
    }
    norm = register_module("norm", norm_layer);
  }
  torch::Tensor forward(const torch::Tensor& x) { return norm->forward(image ? conv->forward(x) : linear->forward(x)); }
  bool image;
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear linear{nullptr};
  Norm norm{nullptr};
};

struct Case {
  const char* name;
  bool image;    // 4-D input through Conv2d, else 2-D through Linear
  bool cumulative;  // momentum unset: the cumulative average
};

// Rank r's input and loss weights in step t (the reference regenerates every rank's).
std::pair<torch::Tensor, torch::Tensor> rank_batch(const Case& c, int world, int rank, int step) {
  torch::manual_seed(1000 * world + 100 * rank + step + (c.image ? 50 : 0));
  const int64_t n = batch_size(world, rank, step);
  const auto x = c.image ? torch::randn({n, 3, 5, 5}) * 2 + 0.5 : torch::randn({n, 6}) * 2 + 0.5;
  const auto target = c.image ? torch::randn({n, kChannels, 5, 5}) : torch::randn({n, kChannels});
  return {x, target};
}

// |actual - expected| within 1e-5, relative to the expected values where they exceed 1.
void require_close(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
  require(actual.sizes() == expected.sizes(), what + ": shape " + c10::str(actual.sizes()) + ", expected " +
                                                  c10::str(expected.sizes()));
  if (expected.numel() == 0) return;
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  const double diff = (actual - expected).abs().max().item<double>();
  require(diff <= 1e-5 * scale, what + " differs from the reference by " + std::to_string(diff));
}

void run_case(const Case& c) {
  const int world = worker_world_size(), rank = worker_rank();
  const std::string where = std::string(c.name) + ", rank " + std::to_string(rank) + " of " + std::to_string(world);
  auto sync_options = ddp::SyncBatchNormOptions(kChannels);
  auto ref_options = torch::nn::BatchNormOptions(kChannels);
  if (c.cumulative) {
    sync_options.momentum(c10::nullopt);
    ref_options.momentum(c10::nullopt);
  }
  torch::manual_seed(5);
  auto net = std::make_shared<NetImpl<ddp::SyncBatchNorm>>(c.image, ddp::SyncBatchNorm(sync_options));
  // The reference: the same layer before the norm, plain BatchNorm, one process.
  std::shared_ptr<torch::nn::Module> reference;
  std::function<torch::Tensor(const torch::Tensor&)> reference_forward;
  if (c.image) {
    auto r = std::make_shared<NetImpl<torch::nn::BatchNorm2d>>(true, torch::nn::BatchNorm2d(ref_options));
    reference = r;
    reference_forward = [r](const torch::Tensor& x) { return r->forward(x); };
  } else {
    auto r = std::make_shared<NetImpl<torch::nn::BatchNorm1d>>(false, torch::nn::BatchNorm1d(ref_options));
    reference = r;
    reference_forward = [r](const torch::Tensor& x) { return r->forward(x); };
  }
  {
    torch::NoGradGuard no_grad;
    auto from = net->named_parameters();
    for (auto& p : reference->named_parameters()) p.value().copy_(from[p.key()]);
  }
  ddp::DistributedDataParallel model(net);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));

  for (int step = 0; step < kSteps; ++step) {
    const std::string at = where + ", step " + std::to_string(step);
    // Reference: every rank's batch concatenated. The ranks' losses sum(y_r * t_r) add up to
    // sum(Y * T); DDP averages parameter gradients over the ranks, hence the reference's / world.
    std::vector<torch::Tensor> xs, ts;
    int64_t offset = 0;
    for (int r = 0; r < world; ++r) {
      auto [x, t] = rank_batch(c, world, r, step);
      if (r < rank) offset += x.size(0);
      xs.push_back(x);
      ts.push_back(t);
    }
    const torch::Tensor X = torch::cat(xs).requires_grad_();
    ref_opt.zero_grad();
    const torch::Tensor Y = reference_forward(X);
    ((Y * torch::cat(ts)).sum() / world).backward();

    auto [mine, target] = rank_batch(c, world, rank, step);
    const int64_t n = mine.size(0);
    const torch::Tensor x = mine.clone().requires_grad_();
    opt.zero_grad();
    const torch::Tensor y = model.forward(x);
    (y * target).sum().backward();

    require_close(y, Y.narrow(0, offset, n), at + ": output");
    // The input gradient is of the sum of every rank's loss (not averaged): the reference's * world.
    require_close(x.grad(), X.grad().narrow(0, offset, n) * world, at + ": input gradient");
    auto ref_params = reference->named_parameters();
    for (const auto& p : net->named_parameters()) {
      require_close(p.value().grad(), ref_params[p.key()].grad(), at + ": gradient of " + p.key());
    }
    auto ref_buffers = reference->named_buffers();
    for (const auto& b : net->named_buffers()) {
      require_close(b.value().to(torch::kDouble), ref_buffers[b.key()].to(torch::kDouble), at + ": buffer " + b.key());
    }
    // The reference tells local statistics from global ones: normalizing this rank's batch alone
    // lands far from it (so a SyncBatchNorm that did not synchronize would fail above), unless
    // this rank holds the whole global batch.
    if (n >= 2 && n < X.size(0)) {
      torch::NoGradGuard no_grad;
      const auto h = c.image ? net->conv->forward(mine) : net->linear->forward(mine);
      const auto local = torch::batch_norm(h, net->norm->weight, net->norm->bias, {}, {}, true, 0.1, 1e-5, false);
      const double gap = (local - Y.narrow(0, offset, n)).abs().max().item<double>();
      require(gap > 1e-3, at + ": local statistics give the reference's output too (gap " + std::to_string(gap) +
                              "): the test could not tell them apart");
    }
    opt.step();
    ref_opt.step();
    for (const auto& p : net->named_parameters()) {
      require_close(p.value(), ref_params[p.key()], at + ": parameter " + p.key() + " after the SGD step");
    }
  }
}

DDP_WORKER(syncbn_matches_reference) {
  worker_init(std::chrono::seconds(60));
  run_case({"2-D input (Linear, BatchNorm1d), momentum 0.1", false, false});
  run_case({"4-D input (Conv2d, BatchNorm2d), cumulative momentum", true, true});
}

TEST(SyncBatchNorm, MatchesBatchNormOnTheGlobalBatchAt2Ranks) {
  EXPECT_WORKERS_OK(run_workers("syncbn_matches_reference", 2));
}

TEST(SyncBatchNorm, MatchesBatchNormOnTheGlobalBatchAt3Ranks) {
  EXPECT_WORKERS_OK(run_workers("syncbn_matches_reference", 3));
}

// No process group (and a world of one): plain BatchNorm, bitwise, in training and eval.
TEST(SyncBatchNorm, WithoutAProcessGroupIsPlainBatchNorm) {
  ASSERT_FALSE(ddp::is_initialized());
  ddp::SyncBatchNorm sync(ddp::SyncBatchNormOptions(3).momentum(0.3));
  torch::nn::BatchNorm2d plain(torch::nn::BatchNorm2dOptions(3).momentum(0.3));
  torch::manual_seed(3);
  for (int step = 0; step < 2; ++step) {
    const auto input = torch::randn({4, 3, 5, 5});
    const auto a = input.clone().requires_grad_(), b = input.clone().requires_grad_();
    const auto ya = sync->forward(a), yb = plain->forward(b);
    EXPECT_TRUE(torch::equal(ya, yb));
    ya.pow(2).sum().backward();
    yb.pow(2).sum().backward();
    EXPECT_TRUE(torch::equal(a.grad(), b.grad()));
    EXPECT_TRUE(torch::equal(sync->weight.grad(), plain->weight.grad()));
    EXPECT_TRUE(torch::equal(sync->running_var, plain->running_var));
    EXPECT_EQ(sync->num_batches_tracked.item<int64_t>(), plain->num_batches_tracked.item<int64_t>());
  }
  sync->eval();
  plain->eval();
  const auto input = torch::randn({2, 3, 4, 4});
  EXPECT_TRUE(torch::equal(sync->forward(input), plain->forward(input)));
  // BatchNorm's parameter and buffer names, in its order.
  EXPECT_EQ(sync->named_parameters().keys(), plain->named_parameters().keys());
  EXPECT_EQ(sync->named_buffers().keys(), plain->named_buffers().keys());
  const auto message = error_of<std::invalid_argument>([&] { sync->forward(torch::randn({3})); });
  EXPECT_NE(message.find("expected a 2-D to 5-D input (N, C, ...), got 1-D"), std::string::npos) << message;
}

// Ranks that disagree on channels: an error naming every rank's count, on every rank, at once
// (well inside the group's 60 s timeout). Eval forwards communicate nothing.
DDP_WORKER(syncbn_mismatch) {
  worker_init(std::chrono::seconds(60));
  const int rank = worker_rank();
  auto expect_error = [&](const std::function<void()>& run, const std::string& expected, const std::string& what) {
    const auto start = std::chrono::steady_clock::now();
    const std::string message = error_of<std::invalid_argument>(run);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    require(message.find(expected) != std::string::npos,
            what + ": expected an error containing '" + expected + "', got '" + message + "'");
    require(seconds < 20, what + ": the error took " + std::to_string(seconds) + " s");
  };
  // Layers built with different num_features.
  ddp::SyncBatchNorm differs(rank == 1 ? 5 : 4);
  expect_error([&] { differs->forward(torch::randn({4, rank == 1 ? 5 : 4})); },
               "the ranks' layers disagree on num_features (the channel count): rank 0 has 4, rank 1 has 5",
               "different num_features");
  // The same layer, but rank 1 feeds it 3 channels.
  ddp::SyncBatchNorm same(4);
  expect_error([&] { same->forward(torch::randn({2, rank == 1 ? 3 : 4, 3, 3})); },
               "every rank's input must be (N, 4, ...) with 2 to 5 dimensions, but rank 0 has a 4-D input of 4 "
               "channels, rank 1 has a 4-D input of 3 channels",
               "an input of other channels");
  // The group is still in step after both errors: a correct forward works.
  same->forward(torch::randn({2, 4, 3, 3}));
  // Eval: no collective, so ranks may run different numbers of forwards; a barrier (which checks
  // that every rank runs the same collective) then pairs up.
  same->eval();
  for (int i = 0; i < 3 * rank; ++i) same->forward(torch::randn({2, 4}));
  ddp::barrier();
}

TEST(SyncBatchNorm, RanksWithOtherChannelCountsFailTogetherWithoutHanging) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("syncbn_mismatch", 2, options));
}

}  // namespace
