// bucket_cap_mb_auto: gradients stay right while the buckets change under them, every rank picks
// the same cap, and the pick is the fastest of the times it reports.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// Three 3 MiB layers after the first bucket (which closes at 1 MiB, after the last 3 MiB layer):
// caps of 1, 5 and 10 MiB give three different layouts ([c][b][a], [c b][a], [c b a]); every
// larger cap gives the last one again.
struct WideImpl : torch::nn::Module {
  WideImpl() {
    a = register_module("a", torch::nn::Linear(10, 768));
    b = register_module("b", torch::nn::Linear(768, 1024));
    c = register_module("c", torch::nn::Linear(1024, 768));
    d = register_module("d", torch::nn::Linear(768, 1024));
    e = register_module("e", torch::nn::Linear(1024, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(c(torch::relu(b(torch::relu(a(x))))));
    return e(torch::relu(d(x)));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, d{nullptr}, e{nullptr};
};
TORCH_MODULE(Wide);

DDP_WORKER(autotune) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(2);
  Wide net, reference;
  copy_parameters(*net, *reference);
  ddp::DistributedDataParallel model(net, ddp::DDPOptions().bucket_cap_mb_auto(true));
  torch::optim::SGD opt(model.parameters(), 0.01), ref_opt(reference->parameters(), 0.01);
  for (int step = 0; step < 40; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    ref_opt.zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x), y).backward();
    for (size_t i = 0; i < net->parameters().size(); ++i) {
      require(torch::allclose(net->parameters()[i].grad(), reference->parameters()[i].grad(), 1e-4, 1e-6),
              "step " + std::to_string(step) + ": gradient " + std::to_string(i) + " wrong while autotuning");
    }
    opt.step();
    ref_opt.step();
  }
  const auto data = model.logging_data();
  require(data.bucket_cap_mb_auto, "the option is reported");
  require(data.autotune_candidates_mb.size() >= 3, "fewer distinct layouts than expected: " +
                                                       std::to_string(data.autotune_candidates_mb.size()));
  require(data.autotune_candidates_mb.size() == data.autotune_step_times.size(), "one time per candidate");
  // Only caps with distinct layouts: 25 MiB and beyond all give one bucket here, so at most one of them.
  int single_bucket_caps = 0;
  for (double mb : data.autotune_candidates_mb) single_bucket_caps += mb >= 25 ? 1 : 0;
  require(single_bucket_caps <= 1, "caps giving the same layout were all tried");
  size_t best = 0;
  for (size_t c = 0; c < data.autotune_step_times.size(); ++c) {
    require(data.autotune_step_times[c] > 0, "a candidate without a time");
    if (data.autotune_step_times[c] < data.autotune_step_times[best]) best = c;
  }
  const auto chosen_mb = data.bucket_cap_bytes / (1024.0 * 1024.0);
  require(chosen_mb == data.autotune_candidates_mb[best], "chose " + std::to_string(chosen_mb) +
                                                              " MiB, not the fastest candidate");
  auto all = ddp::all_gather(torch::tensor({data.bucket_cap_bytes}));
  require(torch::equal(all[0], all[1]), "the ranks chose different caps");
}
// A hook keeping state per bucket cannot follow buckets that change: refused, saying what to do.
struct Counter : ddp::Stateful {
  ddp::TensorDict state_dict() const override { return {}; }
  void load_state_dict(const ddp::TensorDict&) override {}
};
DDP_WORKER(autotune_stateful_hook) {
  worker_init();
  MLP net;
  ddp::DistributedDataParallel model(net, ddp::DDPOptions().bucket_cap_mb_auto(true));
  try {
    model.register_comm_hook(ddp::CommHook(ddp::hooks::allreduce(), "counting", std::make_shared<Counter>()));
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("'counting' keeps state per bucket") != std::string::npos, message);
    require(message.find("use a fixed bucket_cap_mb with it") != std::string::npos, message);
    return;
  }
  fail("a stateful hook was accepted with bucket_cap_mb_auto");
}
TEST(Autotune, StatefulHookIsRefused) { EXPECT_WORKERS_OK(run_workers("autotune_stateful_hook", 1)); }

TEST(Autotune, EveryRankPicksTheFastestCapAndGradientsStayRight) {
  RunOptions options;
  options.timeout = std::chrono::seconds(180);
  EXPECT_WORKERS_OK(run_workers("autotune", 2, options));
}

}  // namespace
