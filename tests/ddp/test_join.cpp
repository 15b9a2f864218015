// ddp::Join: uneven inputs at 3 ranks (rank r has 10 + r batches) against a reference computed
// here, in one process, from every rank's batches; early termination; the error without Join.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/join.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

int batches_of(int rank) { return 10 + rank; }

// Rank r's t-th batch; the reference regenerates every rank's.
std::pair<torch::Tensor, torch::Tensor> rank_batch(int rank, int t) {
  torch::manual_seed(7000 + 100 * rank + t);
  return {torch::randn({4, 10}), torch::randn({4, 5})};
}

struct Variant {
  const char* name;
  bool divide_by_initial_world_size;
  bool hook;  // the allreduce() hook: shadowing runs hooks too
};

// One process replays what the ranks do together: in iteration t the ranks that still have a
// batch contribute their gradients, summed and divided by 3 (or by how many contributed).
std::vector<torch::Tensor> reference_parameters(MLP start, int world, bool divide_by_initial) {
  MLP model;
  copy_parameters(*start, *model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int t = 0; t < batches_of(world - 1); ++t) {
    std::vector<int> active;
    for (int r = 0; r < world; ++r) {
      if (t < batches_of(r)) active.push_back(r);
    }
    const double divisor = divide_by_initial ? world : static_cast<double>(active.size());
    opt.zero_grad();
    for (int r : active) {
      auto [x, y] = rank_batch(r, t);
      (torch::mse_loss(model->forward(x), y) / divisor).backward();
    }
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

DDP_WORKER(join_uneven) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const Variant variants[] = {{"divide by initial world size", true, false},
                              {"divide by active ranks", false, false},
                              {"with the allreduce() hook", true, true}};
  for (const auto& variant : variants) {
    torch::manual_seed(11);
    MLP net, start;
    copy_parameters(*net, *start);
    ddp::DistributedDataParallel model(net, ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0.001));
    if (variant.hook) model.register_comm_hook(ddp::hooks::allreduce());
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    // A per-iteration collective of the program's own, made joinable: [loss, batches] summed.
    ddp::JoinableAllReduce running(torch::zeros({2}, torch::kDouble));
    std::vector<double> counts;
    ddp::Join join({model, running}, ddp::JoinOptions().divide_by_initial_world_size(variant.divide_by_initial_world_size));
    join.run([&] {
      for (int t = 0; t < batches_of(rank); ++t) {
        auto [x, y] = rank_batch(rank, t);
        opt.zero_grad();
        auto loss = torch::mse_loss(model.forward(x), y);
        loss.backward();
        opt.step();
        counts.push_back(running.all_reduce(torch::tensor({loss.item<double>(), 1.0}, torch::kDouble))[1].item<double>());
      }
    });
    const std::string what = std::string(variant.name) + " (rank " + std::to_string(rank) + ")";
    // The program's own collective saw exactly the ranks that still had a batch.
    for (int t = 0; t < static_cast<int>(counts.size()); ++t) {
      int active = 0;
      for (int r = 0; r < world; ++r) active += t < batches_of(r) ? 1 : 0;
      require(counts[t] == active, what + ": iteration " + std::to_string(t) + " counted " +
                                       std::to_string(counts[t]) + " active ranks, expected " + std::to_string(active));
    }
    const auto expected = reference_parameters(start, world, variant.divide_by_initial_world_size);
    const auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const double diff = (params[i] - expected[i]).abs().max().item<double>();
      require(diff < 1e-5, what + ": parameter " + std::to_string(i) + " differs from the reference by " +
                               std::to_string(diff));
    }
    // Every rank holds the same final model (the last joiner's).
    std::vector<torch::Tensor> flat;
    for (const auto& p : params) flat.push_back(p.detach().flatten());
    auto gathered = ddp::all_gather(torch::cat(flat));
    for (size_t r = 1; r < gathered.size(); ++r) {
      require(torch::equal(gathered[0], gathered[r]), what + ": rank " + std::to_string(r) + "'s final model differs");
    }
  }
}
TEST(Join, UnevenInputsMatchTheReferenceOnEveryRank) {
  RunOptions options;
  options.timeout = std::chrono::seconds(120);
  EXPECT_WORKERS_OK(run_workers("join_uneven", 3, options));
}

// throw_on_early_termination: as soon as rank 0 (10 batches) runs out, every rank stops with an
// error naming it.
DDP_WORKER(join_throw) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank();
  MLP net;
  ddp::DistributedDataParallel model(net);
  int trained = 0;
  std::string message;
  try {
    ddp::Join({model}, ddp::JoinOptions().throw_on_early_termination(true)).run([&] {
      for (int t = 0; t < batches_of(rank); ++t) {
        auto [x, y] = rank_batch(rank, t);
        torch::mse_loss(model.forward(x), y).backward();
        ++trained;
      }
    });
  } catch (const ddp::EarlyTerminationError& error) {
    message = error.what();
  }
  require(!message.empty(), "rank " + std::to_string(rank) + " finished without the early-termination error");
  require(message.find("rank 0 ran out of inputs first") != std::string::npos, message);
  require(message.find("ranks 1, 2 still had some") != std::string::npos, message);
  require(trained == 10, "rank " + std::to_string(rank) + " trained " + std::to_string(trained) + " iterations, not 10");
}
TEST(Join, ThrowOnEarlyTerminationStopsEveryRankNamingTheFirst) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("join_throw", 3, options));
}

// A model with buffers (BatchNorm's running statistics), where the highest rank (the source of
// buffers while every rank is active) runs out first: rank r has 12 - r batches. Every iteration
// starts from the buffers of one rank that ran the previous iteration's forward: by default the
// highest rank active in that previous iteration (the join check is read one iteration late), and
// when active ranks wait for the check (divide_by_initial_world_size(false)) the highest rank
// active in this one. The reference below replays that in one process; parameters and buffers
// must match it on every rank.
int buffer_batches_of(int rank) { return 12 - rank; }

struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    a = register_module("a", torch::nn::Linear(10, 8));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));
    b = register_module("b", torch::nn::Linear(8, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::relu(norm(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Normed);

std::vector<torch::Tensor> state_of(torch::nn::Module& module) {
  std::vector<torch::Tensor> state;
  for (const auto& p : module.parameters()) state.push_back(p.detach().clone());
  for (const auto& b : module.buffers()) state.push_back(b.detach().clone());
  return state;
}

void set_buffers(torch::nn::Module& module, const std::vector<torch::Tensor>& buffers) {
  torch::NoGradGuard no_grad;
  auto mine = module.buffers();
  for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(buffers[i]);
}

std::vector<torch::Tensor> reference_with_buffers(int world, bool waits_for_check) {
  torch::manual_seed(5);
  Normed model;
  torch::optim::SGD opt(model->parameters(), 0.05);
  auto active_in = [&](int t) {
    std::vector<int> active;
    for (int r = 0; r < world; ++r) {
      if (t < buffer_batches_of(r)) active.push_back(r);
    }
    return active;
  };
  const int iterations = buffer_batches_of(0);
  std::vector<torch::Tensor> start = state_of(*model);
  start.erase(start.begin(), start.begin() + model->parameters().size());  // the buffers
  for (int t = 0; t < iterations; ++t) {
    const auto active = active_in(t);
    // Whose buffers, after this iteration's forward, the next iteration starts from (after the
    // last one: the last joiner's, which Join hands to every rank).
    const int next_source = t + 1 == iterations ? active.back()
                            : waits_for_check   ? active_in(t + 1).back()
                                                : active.back();
    const double divisor = waits_for_check ? static_cast<double>(active.size()) : world;
    std::vector<torch::Tensor> next;
    opt.zero_grad();
    for (int r : active) {
      set_buffers(*model, start);
      auto [x, y] = rank_batch(r, t);
      (torch::mse_loss(model->forward(x), y) / divisor).backward();
      if (r == next_source) {
        for (const auto& b : model->buffers()) next.push_back(b.detach().clone());
      }
    }
    opt.step();
    start = next;
  }
  set_buffers(*model, start);
  return state_of(*model);
}

DDP_WORKER(join_buffers) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  for (bool waits : {false, true}) {
    torch::manual_seed(5);
    Normed net;
    ddp::DistributedDataParallel model(net);
    torch::optim::SGD opt(model.parameters(), 0.05);
    ddp::Join({model}, ddp::JoinOptions().divide_by_initial_world_size(!waits)).run([&] {
      for (int t = 0; t < buffer_batches_of(rank); ++t) {
        auto [x, y] = rank_batch(rank, t);
        opt.zero_grad();
        torch::mse_loss(model.forward(x), y).backward();
        opt.step();
      }
    });
    const std::string what = std::string(waits ? "waiting for the check" : "the check read late") + ", rank " +
                             std::to_string(rank);
    const auto expected = reference_with_buffers(world, waits);
    const auto state = state_of(*net);
    for (size_t i = 0; i < state.size(); ++i) {
      const double diff = (state[i].to(torch::kDouble) - expected[i].to(torch::kDouble)).abs().max().item<double>();
      require(diff < 1e-5, what + ": parameter or buffer " + std::to_string(i) + " differs from the reference by " +
                               std::to_string(diff));
    }
    require(net->norm->num_batches_tracked.item<int64_t>() == buffer_batches_of(0),
            what + ": num_batches_tracked is " + std::to_string(net->norm->num_batches_tracked.item<int64_t>()));
  }
}
TEST(Join, ModelWithBuffersMatchesTheReferenceOnEveryRank) {
  RunOptions options;
  options.timeout = std::chrono::seconds(90);
  EXPECT_WORKERS_OK(run_workers("join_buffers", 3, options));
}

// Misuse that needs no second rank: each message says what was wrong and what to do.
TEST(Join, MisuseIsNamed) {
  try {
    ddp::Join join(std::vector<std::reference_wrapper<ddp::Joinable>>{});
    ADD_FAILURE() << "a Join without joinables was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("give it at least one joinable"), std::string::npos) << error.what();
  }
  ddp::JoinableAllReduce running(torch::zeros({2}, torch::kDouble));
  try {
    running.all_reduce(torch::zeros({3}, torch::kDouble));
    ADD_FAILURE() << "a tensor of another shape was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("got [3] Double, but it was made for [2] Double"), std::string::npos)
        << error.what();
  }
}

// Ranks whose buckets differ (here: different bucket_cap_mb) are an error on every rank listing
// each rank's buckets, at construction, instead of reductions pairing mismatched data.
DDP_WORKER(different_buckets) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank();
  MLP net;
  try {
    ddp::DistributedDataParallel model(
        net, ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(rank == 0 ? 25 : 0));
  } catch (const ddp::CollectiveError& error) {
    const std::string message = error.what();
    require(message.find("the ranks built different gradient buckets") != std::string::npos, message);
    require(message.find("do all ranks pass the same DDPOptions, e.g. bucket_cap_mb?") != std::string::npos, message);
    require(message.find("rank 0: 2 bucket(s)") != std::string::npos, message);  // first: the last bias alone
    require(message.find("rank 1: 6 bucket(s)") != std::string::npos, message);  // one per parameter
    return;
  }
  fail("rank " + std::to_string(rank) + " built its model although the ranks' buckets differ");
}
TEST(Desync, DifferentBucketsAreNamedAtConstruction) { EXPECT_WORKERS_OK(run_workers("different_buckets", 2)); }

// Without Join, uneven inputs keep their clear error at the timeout: the rank with a batch left
// fails in its gradient allreduce, and the message points at Join.
DDP_WORKER(uneven_without_join) {
  worker_init(std::chrono::seconds(3));
  const int rank = ddp::get_rank();
  MLP net;
  ddp::DistributedDataParallel model(net);
  std::string message;
  try {
    for (int t = 0; t < (rank == 0 ? 3 : 2); ++t) {  // past the bucket rebuild (iteration 2)
      auto [x, y] = rank_batch(rank, t);
      torch::mse_loss(model.forward(x), y).backward();
    }
  } catch (const std::exception& error) {
    message = error.what();
  }
  if (rank == 0) {
    require(message.find("allreduce of gradient bucket") != std::string::npos, "rank 0: " + message);
    require(message.find("ddp::Join") != std::string::npos, "rank 0: " + message);
  } else {
    require(message.empty(), "rank 1 failed: " + message);
    std::this_thread::sleep_for(std::chrono::seconds(5));  // stay alive past rank 0's timeout
  }
}
TEST(Join, UnevenInputsWithoutJoinFailAtTheTimeoutPointingToJoin) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("uneven_without_join", 2, options));
}

}  // namespace
