// ddp::GradScaler at 2 ranks under DistributedDataParallel: an inf on one rank only - written into
// its gradient after a synchronized backward, or coming from its own batch inside no_sync() - makes
// both ranks skip the step and back off identically; ranks that disagree on the collective get an
// error naming the scaler instead of a hang.
#include <cmath>
#include <limits>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/grad_scaler.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// Every rank holds the same values (compared bitwise across ranks).
void require_same_on_every_rank(const torch::Tensor& local, const std::string& what) {
  const auto gathered = ddp::all_gather(local.detach().flatten());
  for (size_t r = 1; r < gathered.size(); ++r) {
    require(torch::equal(gathered[0], gathered[r]), what + ": rank " + std::to_string(r) + " differs from rank 0");
  }
}

torch::Tensor flat(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : params) parts.push_back(p.detach().flatten());
  return torch::cat(parts).clone();
}

DDP_WORKER(amp_inf_on_one_rank) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  MLP net;
  ddp::DistributedDataParallel model(net);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.1));
  ddp::GradScaler scaler(ddp::GradScalerOptions().init_scale(1024).growth_interval(100));
  const float inf = std::numeric_limits<float>::infinity();

  enum class Poison { kNone, kGradAfterBackward, kBatchInsideNoSync };
  // One iteration; returns whether the scaler stepped. Checks that a skipped step left the
  // parameters exactly as they were, on this rank.
  auto iterate = [&](int t, Poison poison) {
    auto [all_x, all_y] = batch(t);
    auto x = shard(all_x, rank, world), y = shard(all_y, rank, world);
    optimizer.zero_grad();
    if (poison == Poison::kBatchInsideNoSync) {
      // Gradients stay local: rank 1's are inf/NaN, rank 0's are finite.
      if (rank == 1) x[0][0] = inf;
      auto guard = model.no_sync();
      scaler.scale(torch::mse_loss(model.forward(x), y)).backward();
    } else {
      scaler.scale(torch::mse_loss(model.forward(x), y)).backward();
      if (poison == Poison::kGradAfterBackward && rank == 1) net->fc1->weight.mutable_grad()[0][0] = inf;
    }
    if (poison != Poison::kNone && rank == 0) {
      for (const auto& p : model.parameters()) {
        require(torch::isfinite(p.grad()).all().item<bool>(), "the test needs rank 0's gradients finite");
      }
    }
    const auto before = flat(model.parameters());
    const bool stepped = scaler.step(optimizer);
    scaler.update();
    if (!stepped) require(torch::equal(flat(model.parameters()), before), "a skipped step changed the parameters");
    return stepped;
  };

  struct Expected {
    Poison poison;
    bool stepped;
    double scale;
  };
  const Expected script[] = {{Poison::kNone, true, 1024},
                             {Poison::kGradAfterBackward, false, 512},
                             {Poison::kNone, true, 512},
                             {Poison::kBatchInsideNoSync, false, 256},
                             {Poison::kNone, true, 256}};
  for (int t = 0; t < 5; ++t) {
    const std::string where = "rank " + std::to_string(rank) + ", iteration " + std::to_string(t);
    const bool stepped = iterate(t, script[t].poison);
    require(stepped == script[t].stepped, where + ": stepped=" + std::to_string(stepped));
    require(scaler.get_scale() == script[t].scale, where + ": scale " + std::to_string(scaler.get_scale()) +
                                                       ", expected " + std::to_string(script[t].scale));
    require_same_on_every_rank(torch::tensor({scaler.get_scale()}, torch::kDouble), where + ": the scale");
    require_same_on_every_rank(flat(model.parameters()), where + ": the parameters");
  }
}
TEST(GradScalerDistributed, InfOnOneRankSkipsTheStepOnEveryRankAndBacksOffIdentically) {
  EXPECT_WORKERS_OK(run_workers("amp_inf_on_one_rank", 2));
}

// Rank 0 steps the scaler while rank 1 runs another collective: both fail with an error (rank 0's
// naming the scaler and what to do) within the group's timeout, instead of pairing the buffers.
DDP_WORKER(amp_collective_mismatch) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto weight = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD optimizer({weight}, torch::optim::SGDOptions(0.1));
  ddp::GradScaler scaler;
  std::string message = "(nothing thrown)";
  try {
    if (rank == 0) {
      scaler.scale(torch::zeros({}));
      weight.mutable_grad() = torch::ones({4});
      scaler.step(optimizer);
    } else {
      auto other = torch::zeros({3});
      ddp::all_reduce(other);
    }
  } catch (const ddp::CollectiveError& error) {
    message = error.what();
  }
  require(message.find("not running the same collective") != std::string::npos, "rank " + std::to_string(rank) + ": " + message);
  if (rank == 0) {
    require(message.find("GradScaler: agreeing on inf/NaN gradients across ranks failed") != std::string::npos &&
                message.find("same optimizers in the same order") != std::string::npos,
            "rank 0: " + message);
  }
}
TEST(GradScalerDistributed, RanksThatDisagreeGetAnErrorNamingTheScaler) {
  EXPECT_WORKERS_OK(run_workers("amp_collective_mismatch", 2));
}

}  // namespace
