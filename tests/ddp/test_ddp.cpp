// DistributedDataParallel end to end: real processes, Gloo over loopback. Every test compares
// against a single process computing the same thing on the whole batch.
#include <cmath>
#include <cstdlib>
#include <sstream>

#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;


template <typename M>
void expect_same_grads(const M& reference, const std::vector<torch::Tensor>& actual, const std::string& what) {
  auto expected = reference->parameters();
  require(expected.size() == actual.size(), what + ": parameter count");
  for (size_t i = 0; i < expected.size(); ++i) {
    require(actual[i].grad().defined(), what + ": gradient " + std::to_string(i) + " undefined");
    require(torch::allclose(actual[i].grad(), expected[i].grad(), 1e-5, 1e-6),
            what + ": gradient " + std::to_string(i) + " differs by " +
                std::to_string((actual[i].grad() - expected[i].grad()).abs().max().template item<float>()));
  }
}

void expect_identical_across_ranks(const std::vector<torch::Tensor>& params, const std::string& what) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : params) flat.push_back(p.detach().flatten());
  auto gathered = ddp::all_gather(torch::cat(flat));
  for (size_t r = 1; r < gathered.size(); ++r) {
    require(torch::equal(gathered[0], gathered[r]), what + ": rank " + std::to_string(r) + " differs from rank 0");
  }
}

struct BucketConfig {
  const char* name;
  double first_mb, cap_mb;
};
const BucketConfig kBucketConfigs[] = {{"default", 1.0, 25.0}, {"per-parameter", 0.0, 0.0}, {"single", 1e3, 1e3}};

// Gradient equivalence and 5 optimizer steps, for one model type and every bucket layout.
template <typename Model>
void check_equivalence(const std::string& model_name, int64_t features) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  for (const auto& config : kBucketConfigs) {
    const std::string what = model_name + "/" + config.name;
    torch::manual_seed(rank + 7);  // different init per rank: construction must broadcast rank 0's
    Model local;
    ddp::DistributedDataParallel model(local, ddp::DDPOptions().first_bucket_cap_mb(config.first_mb).bucket_cap_mb(config.cap_mb));
    Model reference;
    copy_parameters(*model.module(), *reference);
    expect_identical_across_ranks(model.parameters(), what + " after construction");
    if (std::string(config.name) == "per-parameter") {
      require(model.reduction_stats().buckets.size() == model.parameters().size(), what + ": not one bucket per parameter");
    }
    if (std::string(config.name) == "single") {
      require(model.reduction_stats().buckets.size() == 1, what + ": not a single bucket");
    }
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = batch(step, features);
      opt.zero_grad();
      torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      ref_opt.zero_grad();
      torch::mse_loss(reference->forward(x), y).backward();
      expect_same_grads(reference, model.parameters(), what + " step " + std::to_string(step));
      opt.step();
      ref_opt.step();
    }
    for (size_t i = 0; i < reference->parameters().size(); ++i) {
      require(torch::allclose(model.parameters()[i], reference->parameters()[i], 1e-5, 1e-6), what + ": parameters drifted");
    }
    expect_identical_across_ranks(model.parameters(), what + " after 5 steps");
    require(model.reduction_stats().iterations_reduced == 5, what + ": iterations_reduced");
  }
}

DDP_WORKER(equivalence) {
  worker_init();
  check_equivalence<MLP>("mlp", 10);
  check_equivalence<ConvNet>("convnet", 64);
}

class GradientEquivalence : public ::testing::TestWithParam<int> {};
TEST_P(GradientEquivalence, MatchesSingleProcessFullBatch) {
  EXPECT_WORKERS_OK(run_workers("equivalence", GetParam()));
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, GradientEquivalence, ::testing::Values(2, 3));

// no_sync: nothing is sent, gradients accumulate; the next synced backward reduces the sum.
DDP_WORKER(no_sync) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  for (bool as_view : {false, true}) {
    torch::manual_seed(1);
    MLP local, reference;
    ddp::DistributedDataParallel model(local, ddp::DDPOptions().gradient_as_bucket_view(as_view));
    copy_parameters(*model.module(), *reference);
    const int64_t before = model.reduction_stats().collectives_launched;
    torch::Tensor local_sum;
    {
      auto guard = model.no_sync();
      for (int step = 0; step < 2; ++step) {
        auto [x, y] = batch(step);
        torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      }
      require(model.reduction_stats().collectives_launched == before, "no_sync sent a collective");
      // Locally accumulated: the sum of this rank's two gradients, different on each rank.
      local_sum = model.parameters()[0].grad().clone();
    }
    auto gathered = ddp::all_gather(local_sum);
    require(!torch::allclose(gathered[0], gathered[1]), "ranks' local gradients should differ under no_sync");
    auto [x, y] = batch(2);
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    require(model.reduction_stats().collectives_launched > before, "the synced backward sent nothing");
    for (int step = 0; step < 3; ++step) {
      auto [rx, ry] = batch(step);
      torch::mse_loss(reference->forward(rx), ry).backward();  // accumulates like the DDP ranks
    }
    expect_same_grads(reference, model.parameters(), as_view ? "no_sync (bucket view)" : "no_sync");
  }
}
TEST(DDP, NoSyncAccumulatesLocallyThenReducesTheSum) { EXPECT_WORKERS_OK(run_workers("no_sync", 2)); }

// The rebuild: buckets start in reverse registration order and are rebuilt once in the order
// gradients really arrived (rank 0's), and gradients stay right afterwards.
DDP_WORKER(rebuild) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(3);
  Reordered local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0));
  copy_parameters(*model.module(), *reference);
  auto before = model.reduction_stats();
  require(before.buckets.front().front().rfind("first.", 0) == 0,
          "initial buckets should follow reverse registration (first.* first), got " + before.buckets.front().front());
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    model.zero_grad();
    reference->zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x), y).backward();
    expect_same_grads(reference, model.parameters(), "rebuild step " + std::to_string(step));
  }
  auto after = model.reduction_stats();
  require(after.buckets_rebuilt, "buckets were not rebuilt");
  require(after.buckets.front().front().rfind("last.", 0) == 0,
          "rebuilt buckets should start with the first-ready gradients (last.*), got " + after.buckets.front().front());
}
TEST(DDP, RebuildsBucketsOnceInObservedOrder) { EXPECT_WORKERS_OK(run_workers("rebuild", 2)); }

// find_unused_parameters: a skipped branch on every rank (globally unused: its grad stays
// undefined, like a single process), then on rank 1 only (rank 0's gradient, averaged).
DDP_WORKER(find_unused) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  Branchy local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().find_unused_parameters(true));
  copy_parameters(*model.module(), *reference);
  auto [x, y] = batch(0);
  torch::mse_loss(model.forward(shard(x, rank, world), false), shard(y, rank, world)).backward();
  require(!model->branch->weight.grad().defined(), "globally unused branch got a gradient");
  require(model->trunk->weight.grad().defined(), "trunk has no gradient");
  torch::mse_loss(reference->forward(x, false), y).backward();
  require(torch::allclose(model->trunk->weight.grad(), reference->trunk->weight.grad(), 1e-5, 1e-6), "trunk gradient");

  model.zero_grad();
  auto [x2, y2] = batch(1);
  const bool use_branch = rank == 0;  // rank 1 skips the branch
  torch::mse_loss(model.forward(shard(x2, rank, world), use_branch), shard(y2, rank, world)).backward();
  // Expected branch gradient: rank 0's local gradient divided by the world size.
  Branchy rank0;
  copy_parameters(*reference, *rank0);
  torch::mse_loss(rank0->forward(shard(x2, 0, world), true), shard(y2, 0, world)).backward();
  require(model->branch->weight.grad().defined(), "branch used on rank 0 has no gradient on rank " + std::to_string(rank));
  require(torch::allclose(model->branch->weight.grad(), rank0->branch->weight.grad() / world, 1e-5, 1e-7),
          "branch gradient is not rank 0's gradient averaged over the world");
}
TEST(DDP, FindUnusedParametersHandlesSkippedBranch) { EXPECT_WORKERS_OK(run_workers("find_unused", 2)); }

// Without find_unused_parameters, the same skipped branch is an error at the next forward that
// names the parameters, not a hang.
DDP_WORKER(unused_error) {
  worker_init(std::chrono::seconds(20));
  torch::manual_seed(5);
  Branchy local;
  ddp::DistributedDataParallel model(local);
  auto [x, y] = batch(0);
  torch::mse_loss(model.forward(x, false), y).backward();
  try {
    model.forward(x, false);
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("without gradients for 2 parameter(s): branch.weight, branch.bias") != std::string::npos ||
                message.find("without gradients for 2 parameter(s): branch.bias, branch.weight") != std::string::npos,
            "message does not name the branch: " + message);
    require(message.find("find_unused_parameters(true)") != std::string::npos, "no hint: " + message);
    return;
  }
  fail("the next forward did not report the unused parameters");
}
TEST(DDP, UnusedParameterWithoutFindUnusedIsAClearError) { EXPECT_WORKERS_OK(run_workers("unused_error", 2)); }

// static_graph: the unused branch is learnt in the first iteration, then skipped without a search.
DDP_WORKER(static_graph) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  Branchy local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().static_graph(true));
  copy_parameters(*model.module(), *reference);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    model.zero_grad();
    reference->zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world), false), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x, false), y).backward();
    require(torch::allclose(model->head->weight.grad(), reference->head->weight.grad(), 1e-5, 1e-6), "head gradient");
    require(torch::allclose(model->trunk->weight.grad(), reference->trunk->weight.grad(), 1e-5, 1e-6), "trunk gradient");
  }
  require(model.reduction_stats().iterations_reduced == 3, "static graph iterations");
}
TEST(DDP, StaticGraphLearnsUnusedParameters) { EXPECT_WORKERS_OK(run_workers("static_graph", 2)); }

// gradient_as_bucket_view: grads live in the buckets (one storage per bucket), values right.
DDP_WORKER(bucket_view) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(2);
  MLP local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().gradient_as_bucket_view(true).first_bucket_cap_mb(100));
  copy_parameters(*model.module(), *reference);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    ref_opt.zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x), y).backward();
    expect_same_grads(reference, model.parameters(), "bucket view step " + std::to_string(step));
    auto params = model.parameters();
    require(model.reduction_stats().buckets.size() == 1, "expected a single bucket");
    for (const auto& p : params) {
      require(p.grad().is_alias_of(params[0].grad()), "a gradient is not a view of the shared bucket");
    }
    opt.step();
    ref_opt.step();
  }
}
TEST(DDP, GradientAsBucketViewSharesBucketStorage) { EXPECT_WORKERS_OK(run_workers("bucket_view", 2)); }

// Buffers: rank 0's values reach every rank before each forward (and not when disabled).
struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(10, 5));
    scale = register_buffer("scale", torch::ones({1}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(WithBuffer);

DDP_WORKER(buffers) {
  worker_init();
  const int rank = ddp::get_rank();
  for (bool broadcast : {true, false}) {
    WithBuffer local;
    ddp::DistributedDataParallel model(local, ddp::DDPOptions().broadcast_buffers(broadcast));
    {
      torch::NoGradGuard no_grad;
      model->scale.fill_(rank == 0 ? 2.0 : 5.0);  // diverge after construction
    }
    auto [x, y] = batch(0);
    torch::mse_loss(model.forward(x), y).backward();
    const float expected = broadcast ? 2.0f : (rank == 0 ? 2.0f : 5.0f);
    require(model->scale.item<float>() == expected, std::string("buffer after forward with broadcast_buffers=") +
                                                        (broadcast ? "true" : "false") + ": " +
                                                        std::to_string(model->scale.item<float>()));
  }
}
TEST(DDP, BroadcastBuffersGivesRankZerosValues) { EXPECT_WORKERS_OK(run_workers("buffers", 2)); }

// Frozen parameters are not bucketed; any forward signature and ModuleHolders work.
struct TwoInputImpl : torch::nn::Module {
  TwoInputImpl() {
    frozen = register_module("frozen", torch::nn::Linear(10, 10));
    fc = register_module("fc", torch::nn::Linear(10, 5));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& a, const torch::Tensor& b, double gain) {
    auto out = fc(frozen(a) + b) * gain;
    return {out, out.sum()};
  }
  torch::nn::Linear frozen{nullptr}, fc{nullptr};
};
TORCH_MODULE(TwoInput);

DDP_WORKER(signatures) {
  worker_init();
  TwoInput two;
  ddp::DistributedDataParallel model(two, ddp::DDPOptions().find_unused_parameters(true));
  for (const auto& bucket : model.reduction_stats().buckets) {
    for (const auto& name : bucket) require(name.rfind("frozen.", 0) != 0, "frozen parameter was bucketed: " + name);
  }
  auto [out, total] = model.forward(torch::ones({2, 10}), torch::ones({2, 10}), 0.5);
  require(out.sizes() == torch::IntArrayRef({2, 5}), "tuple output shape");
  total.backward();
  require(model->fc->weight.grad().defined(), "fc has no gradient");
  require(!model->frozen->weight.grad().defined(), "frozen layer got a gradient");

  torch::nn::Sequential seq(torch::nn::Linear(10, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
  ddp::DistributedDataParallel wrapped(seq);  // a ModuleHolder: deduces SequentialImpl
  wrapped.forward(torch::ones({3, 10})).sum().backward();
  auto grads = ddp::all_gather(wrapped.parameters()[0].grad());
  require(torch::equal(grads[0], grads[1]), "Sequential gradients differ across ranks");
  wrapped.eval();
  require(!wrapped.is_training() && !seq->is_training(), "eval() did not reach the module");
}
TEST(DDP, AnyForwardSignatureTupleOutputsAndFrozenParameters) { EXPECT_WORKERS_OK(run_workers("signatures", 2)); }

// A plain module on the stack, held by reference (no shared_ptr, no TORCH_MODULE holder), as most
// of pytorch/examples keep it: training through the wrapper matches one process on the whole
// batch, and the wrapper trains that very module.
struct PlainNet : torch::nn::Module {
  PlainNet() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

DDP_WORKER(by_reference) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(rank + 3);  // rank 0's parameters must reach every rank
  PlainNet net;
  ddp::DistributedDataParallel model(net);
  static_assert(std::is_same_v<decltype(model), ddp::DistributedDataParallel<PlainNet>>);
  require(model.module().get() == &net, "the wrapper does not hold the module it was given");
  auto reference = std::make_shared<PlainNet>();
  copy_parameters(net, *reference);
  torch::optim::SGD optimizer(net.parameters(), 0.1), reference_optimizer(reference->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(50 + step);
    auto x = torch::randn({4 * world, 6}), y = torch::randn({4 * world, 3});
    optimizer.zero_grad();
    reference_optimizer.zero_grad();
    torch::mse_loss(model(x.narrow(0, 4 * rank, 4)), y.narrow(0, 4 * rank, 4)).backward();
    torch::mse_loss(reference->forward(x), y).backward();
    expect_same_grads(reference, net.parameters(), "by reference, step " + std::to_string(step));
    optimizer.step();
    reference_optimizer.step();
  }
  ddp::test::require(torch::allclose(net.fc2->weight, reference->fc2->weight, 1e-5, 1e-6), "weights after 3 steps");
}
TEST(DDP, AModuleHeldByReferenceTrainsAsOneProcessOnTheWholeBatch) {
  EXPECT_WORKERS_OK(run_workers("by_reference", 2));
  EXPECT_WORKERS_OK(run_workers("by_reference", 3));
}

// --- errors ---------------------------------------------------------------------------------------

DDP_WORKER(mismatched_models) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  torch::nn::Sequential seq(torch::nn::Linear(10, 4), torch::nn::Linear(4, rank == 1 ? 3 : 2));
  try {
    ddp::DistributedDataParallel model(seq);
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("the model differs across ranks") != std::string::npos, message);
    require(message.find("parameter #2 ('1.weight' here) is [3, 4] Float on rank 1 but [2, 4] Float on rank 0") !=
                    std::string::npos || rank == 0, message);
    require(message.find("parameter #2") != std::string::npos, message);
    return;
  }
  fail("mismatched models were accepted");
}
TEST(DDPErrors, MismatchedModelsNameTheFirstDifference) { EXPECT_WORKERS_OK(run_workers("mismatched_models", 2)); }

DDP_WORKER(backward_twice) {
  worker_init(std::chrono::seconds(20));
  MLP local;
  ddp::DistributedDataParallel model(local);
  auto [x, y] = batch(0);
  auto loss = torch::mse_loss(model.forward(x), y);
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("backward() was called twice after one forward()") != std::string::npos, message);
    return;
  }
  fail("a second backward without forward was accepted");
}
TEST(DDPErrors, BackwardTwiceWithoutForward) { EXPECT_WORKERS_OK(run_workers("backward_twice", 2)); }

DDP_WORKER(sparse_gradient) {
  worker_init(std::chrono::seconds(20));
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true));
  ddp::DistributedDataParallel model(embedding);
  try {
    model.forward(torch::tensor({1, 2}, torch::kLong)).sum().backward();
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("parameter 'weight' produced a sparse gradient") != std::string::npos, message);
    return;
  }
  fail("a sparse gradient was accepted");
}
TEST(DDPErrors, SparseGradientsAreRejected) { EXPECT_WORKERS_OK(run_workers("sparse_gradient", 2)); }

DDP_WORKER(nothing_to_sync) {
  worker_init(std::chrono::seconds(20));
  torch::nn::Linear frozen(3, 3);
  for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  try {
    ddp::DistributedDataParallel model(frozen);
  } catch (const std::invalid_argument& error) {
    require(std::string(error.what()).find("no parameter that requires a gradient") != std::string::npos, error.what());
    // Neither rank leaves before both are connected: a rank that exits while the other is still
    // setting up Gloo's connections makes that one fail with "Connection closed by peer".
    ddp::barrier();
    return;
  }
  fail("a module without trainable parameters was accepted");
}
TEST(DDPErrors, ModuleWithoutTrainableParameters) { EXPECT_WORKERS_OK(run_workers("nothing_to_sync", 2)); }

// bucket_cap_mb and first_bucket_cap_mb: NaN passes a "< 0" check and 1e308 MiB overflows the byte
// count, so both are refused by name, with the value as given, before any collective.
DDP_WORKER(bad_bucket_caps) {
  worker_init(std::chrono::seconds(20));
  MLP net;
  const auto error_for = [&](ddp::DDPOptions options) {
    try {
      ddp::DistributedDataParallel model(net, options);
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("(accepted)");
  };
  const std::string rule = " must be a finite number in [0, 1e+12] (MiB; a cap above the model's size already puts "
                           "every gradient in one bucket), got ";
  for (double bad : {std::nan(""), 1e308, -1.0, HUGE_VAL}) {
    std::ostringstream text;
    text << bad;
    const std::string got = error_for(ddp::DDPOptions().bucket_cap_mb(bad));
    require(got == "DistributedDataParallel: bucket_cap_mb" + rule + text.str(), "bucket_cap_mb " + text.str() + ": " + got);
    const std::string first = error_for(ddp::DDPOptions().first_bucket_cap_mb(bad));
    require(first == "DistributedDataParallel: first_bucket_cap_mb" + rule + text.str(),
            "first_bucket_cap_mb " + text.str() + ": " + first);
  }
  ddp::barrier();  // neither rank leaves while the other may still use the connections
}
TEST(DDPErrors, BucketCapsMustBeFiniteAndInRange) { EXPECT_WORKERS_OK(run_workers("bad_bucket_caps", 2)); }

// A rank that dies: the survivor's backward fails with a clear error within the timeout.
DDP_WORKER(dead_rank) {
  worker_init(std::chrono::seconds(5));
  MLP local;
  ddp::DistributedDataParallel model(local);
  auto [x, y] = batch(0);
  for (int i = 0; i < 2; ++i) {  // past the run's one-off collectives (the hook check, the bucket rebuild)
    torch::mse_loss(model.forward(x), y).backward();
  }
  ddp::barrier();
  if (ddp::get_rank() == 1) {
    // Dies without a word, once rank 0 is surely past the barrier (Gloo may otherwise report the
    // closed connection inside rank 0's barrier, before the backward this test is about).
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::_Exit(0);
  }
  try {
    torch::mse_loss(model.forward(x), y).backward();
  } catch (const std::exception& error) {
    const std::string message = error.what();
    require(message.find("allreduce of gradient bucket") != std::string::npos, message);
    require(message.find("a peer rank may have died") != std::string::npos, message);
    return;
  }
  fail("backward succeeded although rank 1 is dead");
}
TEST(DDPErrors, DeadRankBecomesAnErrorNotAHang) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("dead_rank", 2, options));
}

}  // namespace

namespace {

// How many post-hooks each parameter's gradient accumulator carries.
std::vector<size_t> hook_counts(const std::vector<torch::Tensor>& params) {
  std::vector<size_t> counts;
  for (const auto& p : params) counts.push_back(torch::autograd::impl::grad_accumulator(p)->post_hooks().size());
  return counts;
}

// Wrapping a module again, while the old wrapper is still alive (`model = DDP(...)` builds the new
// one first) and after it is gone, leaves exactly one hook per parameter, and gradients are
// averaged exactly once.
DDP_WORKER(rewrap) {
  auto pg = worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  MLP net;
  const auto params = net->parameters();
  // Hold the accumulators, as a live wrapper does, so that hooks left behind would stay visible.
  // (grad_accumulator returns a std::shared_ptr<Node> in 1.13 and 2.6, a c10::intrusive_ptr in 2.15.)
  std::vector<decltype(torch::autograd::impl::grad_accumulator(params[0]))> keep;
  for (const auto& p : params) keep.push_back(torch::autograd::impl::grad_accumulator(p));
  const auto none = hook_counts(params);
  auto with = [&](size_t extra) {
    auto counts = none;
    for (auto& c : counts) c += extra;
    return counts;
  };
  {
    auto first = std::make_unique<ddp::DistributedDataParallel<MLPImpl>>(net.ptr(), pg);
    require(hook_counts(params) == with(1), "one wrapper: one hook per parameter");
    auto second = std::make_unique<ddp::DistributedDataParallel<MLPImpl>>(net.ptr(), pg);
    first.reset();
    require(hook_counts(params) == with(1), "after replacing the wrapper: still one hook per parameter");
  }
  require(hook_counts(params) == none, "after the last wrapper is gone: no hook left");
  for (int round = 0; round < 3; ++round) {
    ddp::DistributedDataParallel model(net, pg);
    require(hook_counts(params) == with(1), "wrapped again: one hook per parameter");
  }
  // One more wrapper trains: the average of the ranks' gradients, once.
  MLP reference;
  copy_parameters(*net, *reference);
  ddp::DistributedDataParallel model(net, pg);
  auto [x, y] = batch(0);
  net->zero_grad();
  torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
  torch::mse_loss(reference->forward(x), y).backward();
  expect_same_grads(reference, net->parameters(), "after re-wrapping");
}
TEST(DDP, RewrappingLeavesExactlyOneSetOfHooks) { EXPECT_WORKERS_OK(run_workers("rewrap", 2)); }

}  // namespace
