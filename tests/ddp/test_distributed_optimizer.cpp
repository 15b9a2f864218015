// ddp::DistributedOptimizer (Horovod's path, no model wrapper): training equals DDP's and one
// process on the whole batch; gradient accumulation over several backward passes; the refusals;
// Horovod's broadcast_parameters and broadcast_optimizer_state.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/ddp.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

struct SmallNet : torch::nn::Module {
  SmallNet() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// The program as a Horovod user writes it: the model is a plain module, train() takes it by
// reference and calls forward.
void train_step(SmallNet& model, torch::optim::Optimizer& optimizer, const torch::Tensor& x, const torch::Tensor& y) {
  optimizer.zero_grad();
  torch::mse_loss(model.forward(x), y).backward();
  optimizer.step();
}

void require_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, const std::string& what) {
  require(got.size() == want.size(), what + ": parameter count");
  for (size_t i = 0; i < got.size(); ++i) {
    require(torch::allclose(got[i], want[i], 1e-5, 1e-6),
            what + ": parameter " + std::to_string(i) + " differs by " +
                std::to_string((got[i] - want[i]).abs().max().item<float>()));
  }
}

// Four SGD steps with momentum through DistributedOptimizer, through DDP, and in one process on
// the whole batch, from rank 0's initial weights.
DDP_WORKER(optimizer_matches) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(rank + 1);  // different weights per rank: broadcast_parameters must fix that
  SmallNet net;
  ddp::broadcast_parameters(net);
  auto ddp_net = std::make_shared<SmallNet>(), reference = std::make_shared<SmallNet>();
  copy_parameters(net, *ddp_net);
  copy_parameters(net, *reference);
  const auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
  ddp::DistributedOptimizer<torch::optim::SGD> optimizer(net.parameters(), options);
  ddp::DistributedDataParallel ddp_model(ddp_net);
  torch::optim::SGD ddp_optimizer(ddp_net->parameters(), options), reference_optimizer(reference->parameters(), options);
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({4 * world, 6}), y = torch::randn({4 * world, 3});
    auto mine_x = x.narrow(0, 4 * rank, 4), mine_y = y.narrow(0, 4 * rank, 4);
    train_step(net, optimizer, mine_x, mine_y);
    ddp_optimizer.zero_grad();
    torch::mse_loss(ddp_model(mine_x), mine_y).backward();
    ddp_optimizer.step();
    train_step(*reference, reference_optimizer, x, y);
  }
  require_close(net.parameters(), reference->parameters(), "DistributedOptimizer against one process");
  require_close(net.parameters(), ddp_net->parameters(), "DistributedOptimizer against DDP");
  const auto stats = optimizer.reduction_stats();
  require(stats.iterations_reduced == 4, "passes averaged: " + std::to_string(stats.iterations_reduced));
  require(ddp::transport() != "gloo+shm" || world == 1 || stats.collectives_launched >= 4, "no collective launched");
}
TEST(DistributedOptimizer, TrainsAsDDPAndAsOneProcessOnTheWholeBatch) {
  EXPECT_WORKERS_OK(run_workers("optimizer_matches", 2));
  EXPECT_WORKERS_OK(run_workers("optimizer_matches", 3));
  RunOptions gloo;
  gloo.env["TORCHDDP_SHM"] = "0";
  EXPECT_WORKERS_OK(run_workers("optimizer_matches", 2, gloo));
}

// A comm hook reduces the optimizer's buckets as it would DDP's: fp16 compression stays within
// fp16's rounding of one process on the whole batch.
DDP_WORKER(optimizer_hook) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(9);
  SmallNet net;
  auto reference = std::make_shared<SmallNet>();
  copy_parameters(net, *reference);
  ddp::DistributedOptimizer<torch::optim::SGD> optimizer(net.parameters(), torch::optim::SGDOptions(0.1));
  optimizer.register_comm_hook(ddp::hooks::fp16_compress());
  torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1));
  torch::manual_seed(77);
  auto x = torch::randn({4 * world, 6}), y = torch::randn({4 * world, 3});
  train_step(net, optimizer, x.narrow(0, 4 * rank, 4), y.narrow(0, 4 * rank, 4));
  train_step(*reference, reference_optimizer, x, y);
  const auto got = net.parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    require(torch::allclose(got[i], want[i], 1e-3, 1e-3), "fp16-compressed step differs at parameter " + std::to_string(i));
  }
  require(optimizer.reduction_stats().buckets.front().front().rfind("group 0 parameter ", 0) == 0,
          "buckets are not named by the optimizer's parameters");
}
TEST(DistributedOptimizer, ACommHookReducesItsBuckets) { EXPECT_WORKERS_OK(run_workers("optimizer_hook", 2)); }

// backward_passes_per_step(2): two micro-batches accumulate, the second pass is averaged; the
// reference takes both micro-batches of every rank in one process. A step after one pass refuses.
DDP_WORKER(optimizer_accumulates) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  SmallNet net;
  auto reference = std::make_shared<SmallNet>();
  copy_parameters(net, *reference);
  ddp::DistributedOptimizer<torch::optim::Adam> optimizer(ddp::DistributedOptimizerOptions().backward_passes_per_step(2),
                                                         net.parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    reference_optimizer.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      torch::manual_seed(200 + 10 * step + micro);
      auto x = torch::randn({2 * world, 6}), y = torch::randn({2 * world, 3});
      torch::mse_loss(net.forward(x.narrow(0, 2 * rank, 2)), y.narrow(0, 2 * rank, 2)).backward();
      torch::mse_loss(reference->forward(x), y).backward();
    }
    optimizer.step();
    reference_optimizer.step();
  }
  require_close(net.parameters(), reference->parameters(), "two passes per step against one process");
  require(optimizer.reduction_stats().iterations_reduced == 3, "averaged passes: " +
                                                                 std::to_string(optimizer.reduction_stats().iterations_reduced));
  // One pass, then step(): refused, naming the count.
  optimizer.zero_grad();
  torch::mse_loss(net.forward(torch::ones({2, 6})), torch::zeros({2, 3})).backward();
  try {
    optimizer.step();
    fail("step() after one of two backward passes succeeded");
  } catch (const std::runtime_error& error) {
    require_mentions(error.what(), "step() after 1 backward pass(es), but backward_passes_per_step is 2", "the refusal");
  }
}
TEST(DistributedOptimizer, BackwardPassesPerStepAccumulatesThenAverages) {
  EXPECT_WORKERS_OK(run_workers("optimizer_accumulates", 2));
}

// A parameter the loss does not reach is named at step(); a model that differs across ranks is
// named at construction.
DDP_WORKER(optimizer_refusals) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  {
    SmallNet net;
    ddp::broadcast_parameters(net);
    ddp::DistributedOptimizer<torch::optim::SGD> optimizer(net.parameters(), torch::optim::SGDOptions(0.1));
    optimizer.zero_grad();
    net.fc1->forward(torch::ones({2, 6})).sum().backward();  // fc2 gets no gradient
    try {
      optimizer.step();
      fail("step() with parameters the loss did not reach succeeded");
    } catch (const std::runtime_error& error) {
      require_mentions(error.what(), "without gradients for 2 parameter(s): group 0 parameter 2, group 0 parameter 3",
                       "the unused parameters");
      require(std::string(error.what()).rfind("DistributedOptimizer: ", 0) == 0,
              "the message does not begin with the API the program called: " + std::string(error.what()));
      require_mentions(error.what(), "DistributedOptimizer averages every parameter it was given", "the advice");
    }
  }
  torch::nn::Linear linear(4, rank == 1 ? 3 : 2);
  try {
    ddp::DistributedOptimizer<torch::optim::SGD> optimizer(linear->parameters(), torch::optim::SGDOptions(0.1));
    fail("a model that differs across ranks was accepted");
  } catch (const std::invalid_argument& error) {
    require_mentions(error.what(), "DistributedOptimizer: the model differs across ranks", "the mismatch");
  }
  try {
    ddp::DistributedOptimizer<torch::optim::SGD> optimizer(ddp::DistributedOptimizerOptions().backward_passes_per_step(0),
                                                           linear->parameters(), torch::optim::SGDOptions(0.1));
    fail("backward_passes_per_step(0) was accepted");
  } catch (const std::invalid_argument& error) {
    require_mentions(error.what(), "backward_passes_per_step is 0", "the bad option");
  }
  require_throws(
      [&] {
        ddp::DistributedOptimizer<torch::optim::SGD> optimizer(
            ddp::DistributedOptimizerOptions().bucket_cap_mb(std::nan("")), linear->parameters(),
            torch::optim::SGDOptions(0.1));
      },
      "DistributedOptimizer: bucket_cap_mb must be a finite number in [0, 1e+12] (MiB), got nan", "a NaN bucket cap");
  torch::nn::Linear frozen(2, 2);
  for (auto& param : frozen->parameters()) param.set_requires_grad(false);
  require_throws(
      [&] { ddp::DistributedOptimizer<torch::optim::SGD> optimizer(frozen->parameters(), torch::optim::SGDOptions(0.1)); },
      "DistributedOptimizer: the optimizer has no parameter that requires a gradient", "an optimizer of frozen parameters");
}
TEST(DistributedOptimizer, UnusedParametersAndMismatchedModelsAreNamed) {
  EXPECT_WORKERS_OK(run_workers("optimizer_refusals", 2));
}

// broadcast_optimizer_state: rank 0's Adam moments, step counts and learning rate everywhere.
DDP_WORKER(optimizer_state_broadcast) {
  worker_init();
  const int rank = ddp::get_rank();
  torch::manual_seed(3);
  torch::nn::Linear linear(4, 2);
  torch::optim::Adam adam(linear->parameters(), torch::optim::AdamOptions(0.001 * (rank + 1)));
  for (int step = 0; step <= rank; ++step) {  // a different history on every rank
    adam.zero_grad();
    linear(torch::full({3, 4}, static_cast<float>(rank + step))).sum().backward();
    adam.step();
  }
  ddp::broadcast_optimizer_state(adam);
  // The state map is keyed by each process's own tensor addresses: compare what does not depend on them.
  auto moment_sum = torch::zeros({1}, torch::kDouble);
  int64_t steps = 0;
  for (const auto& entry : adam.state()) {
    const auto& state = static_cast<const torch::optim::AdamParamState&>(*entry.second);
    moment_sum += state.exp_avg().sum().to(torch::kDouble) + state.exp_avg_sq().sum().to(torch::kDouble);
    steps = std::max<int64_t>(steps, state.step());
  }
  const auto sums = ddp::all_gather(moment_sum);
  for (const auto& other : sums) require(torch::equal(other, sums[0]), "Adam's moments differ from rank 0's");
  require(adam.state().size() == 2 && steps == 1, "step count " + std::to_string(steps) + ", rank 0's is 1");
  const double lr = static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr();
  require(lr == 0.001, "learning rate " + std::to_string(lr) + ", rank 0's is 0.001");
}
TEST(DistributedOptimizer, BroadcastOptimizerStateGivesRankZerosState) {
  EXPECT_WORKERS_OK(run_workers("optimizer_state_broadcast", 2));
}

}  // namespace
