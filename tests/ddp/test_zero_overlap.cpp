// ZeroRedundancyOptimizer with overlap_with_ddp (ddp/ddp_zero_hook.h), mirroring PyTorch's
// test_ddp_zero_overlap: after the warm-up, DDP + ZeRO stepping inside the comm hook equals DDP +
// the plain optimizer on a replica of the same model, and ZeRO stepping after backward, bitwise
// (the same averages; each parameter's update is elementwise); on Gloo alone and over shared memory,
// at 2 and 3 ranks, also with shard_buckets; the warm-up iterations update nothing; bucket b
// belongs to rank b % W (shard_buckets: our even split, by hand); bad input named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/ddp_zero_hook.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/zero_redundancy_optimizer.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;
using Model = ddp::DistributedDataParallel<MLPImpl>;

// One bucket per parameter: the MLP has 6, so every rank owns some at 2 and 3 ranks.
ddp::DDPOptions bucket_per_parameter() { return ddp::DDPOptions().bucket_cap_mb(0).first_bucket_cap_mb(0); }

// One synchronized iteration of `model` on this rank's shard of batch `step`.
void backward(Model& model, int step) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  auto [x, y] = batch(step);
  torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
}

struct OverlapCase {
  bool interleaved;
  bool shard_buckets;
};

// Rank loads (numel) of shard_buckets with one bucket per parameter, by hand. After the rebuild the
// buckets come in the order 5, 80, 16, 512, 32, 320 (running totals 5, 85, 101, 613, 645, 965); the
// cuts fall on the totals nearest to 965 * r / W:
//   2 ranks: 482.5 -> 613:                613 | 352
//   3 ranks: 321.7 -> 101, 643.3 -> 645:  101 | 544 | 320
std::vector<int64_t> sharded_loads(int world) {
  return world == 2 ? std::vector<int64_t>{613, 352} : std::vector<int64_t>{101, 544, 320};
}

// Three replicas of one MLP: ZeRO overlapped with DDP (the hook steps), ZeRO stepping after
// backward, and the plain optimizer. The warm-up iterations on each (one; two with shard_buckets;
// the same bucket rebuild everywhere, so the averages are bitwise the same), then 10 steps; all
// three must end equal.
template <typename Optim, typename Options>
void expect_overlap_parity(const char* name, const Options& defaults, const OverlapCase& c) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const std::string what = std::string(name) + (c.interleaved ? ", interleaved" : "") +
                           (c.shard_buckets ? ", shard_buckets" : "") +
                           " at rank " + std::to_string(rank) + " of " + std::to_string(world);
  torch::manual_seed(5);
  MLP net, stepped, plain_net, start;
  copy_parameters(*net, *stepped);
  copy_parameters(*net, *plain_net);
  copy_parameters(*net, *start);
  Model model(net, bucket_per_parameter()), stepped_model(stepped, bucket_per_parameter()), plain_model(plain_net, bucket_per_parameter());
  ddp::ZeroRedundancyOptimizer<Optim> zero(model.parameters(),
                                           ddp::ZeroRedundancyOptimizerOptions().overlap_with_ddp(true), defaults);
  model.register_comm_hook(
      c.interleaved
          ? ddp::hooks::hook_with_zero_step_interleaved(ddp::hooks::allreduce(), model, zero, c.shard_buckets)
          : ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), model, zero, c.shard_buckets));
  ddp::ZeroRedundancyOptimizer<Optim> stepped_zero(stepped_model.parameters(), {}, defaults);
  Optim plain(plain_model.parameters(), defaults);

  // Warm-up: before DDP rebuilt its buckets (and, with shard_buckets, while the hook records them)
  // nothing is updated and step() does nothing.
  const int warmup = c.shard_buckets ? 2 : 1;
  for (int step = 0; step < warmup; ++step) {
    backward(model, step);
    require(!zero.step().defined(), what + ": step() returned a loss in overlap mode");
    expect_bitwise(net, start, what + ", after warm-up iteration " + std::to_string(step + 1) + " (must be unchanged)");
    backward(stepped_model, step);
    backward(plain_model, step);
  }
  require(zero.overlap_initialized() == c.shard_buckets, what + ": initialized too early or too late");

  for (int step = warmup; step < warmup + 10; ++step) {
    zero.zero_grad();
    backward(model, step);
    zero.step();  // a no-op: the hook stepped
    stepped_zero.zero_grad();
    backward(stepped_model, step);
    stepped_zero.step();
    plain.zero_grad();
    backward(plain_model, step);
    plain.step();
    require(zero.overlap_initialized(), what + ": not initialized after the first updating pass");
  }
  expect_bitwise(net, plain_net, what + ": overlap against the plain optimizer through DDP");
  expect_bitwise(net, stepped, what + ": overlap against ZeRO's step() through DDP");
  require(!torch::equal(net->fc1->weight, start->fc1->weight), what + ": fc1.weight never moved");

  // The assignment: PyTorch's bucket b -> rank b % W, or shard_buckets' (by hand, above). Each
  // rank holds state for its own parameters only.
  const auto buckets = model.reduction_stats().buckets;
  const auto named = net->named_parameters();
  std::vector<int64_t> loads(static_cast<size_t>(world), 0);
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (const auto& param_name : buckets[b]) {
      const int owner = zero.rank_of(named[param_name]);
      loads[static_cast<size_t>(owner)] += named[param_name].numel();
      if (c.shard_buckets) continue;
      require(owner == static_cast<int>(b % static_cast<size_t>(world)),
              what + ": " + param_name + " of bucket " + std::to_string(b) + " belongs to rank " + std::to_string(owner));
    }
  }
  if (c.shard_buckets) {
    std::string got, order;
    for (int64_t load : loads) got += " " + std::to_string(load);
    for (const auto& bucket : buckets) order += " " + std::to_string(named[bucket.at(0)].numel());
    require(loads == sharded_loads(world),
            what + ": loads" + got + " differ from the hand-computed ones (buckets' sizes in order:" + order + ")");
  }
  if (std::is_same_v<Optim, torch::optim::Adam>) {
    const int64_t owned = loads[static_cast<size_t>(rank)];
    require(ddp::optimizer_state_bytes(zero) == 2 * owned * static_cast<int64_t>(sizeof(float)),
            what + ": optimizer_state_bytes() is " + std::to_string(ddp::optimizer_state_bytes(zero)) +
                ", expected Adam's 2 x " + std::to_string(owned) + " floats");
  }
}

DDP_WORKER(zero_overlap_parity) {
  worker_init(std::chrono::seconds(30));
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3);
  const auto adam = torch::optim::AdamOptions(1e-2);
  for (const OverlapCase& c : {OverlapCase{false, false}, OverlapCase{true, false}, OverlapCase{false, true}, OverlapCase{true, true}}) {
    expect_overlap_parity<torch::optim::SGD>("SGD", sgd, c);
    expect_overlap_parity<torch::optim::Adam>("Adam", adam, c);
  }
}
TEST(ZeroOverlap, EqualsThePlainOptimizerAfterTheWarmUpOnSharedMemory) {
  EXPECT_WORKERS_OK(run_workers("zero_overlap_parity", 2));
  EXPECT_WORKERS_OK(run_workers("zero_overlap_parity", 3));
}
TEST(ZeroOverlap, EqualsThePlainOptimizerAfterTheWarmUpOnGloo) {
  RunOptions gloo;
  gloo.env["TORCHDDP_SHM"] = "0";
  EXPECT_WORKERS_OK(run_workers("zero_overlap_parity", 2, gloo));
  EXPECT_WORKERS_OK(run_workers("zero_overlap_parity", 3, gloo));
}

// shard_buckets cutting DDP's one bucket: n parameters of 64 elements, x * p0 + x^2 * p1 + ...
struct PowersImpl : torch::nn::Module {
  explicit PowersImpl(int n) {
    for (int k = 0; k < n; ++k) p.push_back(register_parameter("p" + std::to_string(k), torch::randn({64})));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = torch::zeros_like(x), power = torch::ones_like(x);
    for (const auto& param : p) y = y + (power = power * x) * param;
    return y;
  }
  std::vector<torch::Tensor> p;
};
TORCH_MODULE(Powers);

// Trains Powers(n) with shard_buckets' overlap and, from the same values, a replica with plain
// Adam through DDP on the same data; they must end equal. Returns the elements each rank owns.
std::vector<int64_t> train_with_shard_buckets(int n) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(3);
  Powers net(n), reference(n);
  {
    torch::NoGradGuard no_grad;
    for (int k = 0; k < n; ++k) reference->p[static_cast<size_t>(k)].copy_(net->p[static_cast<size_t>(k)]);
  }
  ddp::DistributedDataParallel<PowersImpl> model(net), plain_model(reference);
  const auto adam = torch::optim::AdamOptions(1e-2);
  ddp::ZeroRedundancyOptimizer<torch::optim::Adam> zero(model.parameters(),
                                                        ddp::ZeroRedundancyOptimizerOptions().overlap_with_ddp(true), adam);
  model.register_comm_hook(ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), model, zero, /*shard_buckets=*/true));
  torch::optim::Adam plain(plain_model.parameters(), adam);
  for (int step = 0; step < 8; ++step) {
    torch::manual_seed(200 + step);
    const auto x = torch::randn({6, 64}).div(2), y = torch::randn({6, 64});
    auto run = [&](auto& m) { torch::mse_loss(m.forward(shard(x, rank, world)), shard(y, rank, world)).backward(); };
    zero.zero_grad();
    run(model);
    if (step >= 2) {  // the two warm-up iterations update nothing: the reference steps after them only
      plain.zero_grad();
      run(plain_model);
      plain.step();
    } else {
      run(plain_model);
    }
  }
  for (int k = 0; k < n; ++k) {
    require(torch::equal(net->p[static_cast<size_t>(k)], reference->p[static_cast<size_t>(k)]),
            "rank " + std::to_string(rank) + ": shard_buckets' pieces differ from plain Adam through DDP (p" +
                std::to_string(k) + " of " + std::to_string(n) + ")");
  }
  require(model.reduction_stats().buckets.size() == 1, "expected one bucket");
  std::vector<int64_t> loads(static_cast<size_t>(world), 0);
  for (const auto& param : net->p) loads[static_cast<size_t>(zero.rank_of(param))] += param.numel();
  require(ddp::optimizer_state_bytes(zero) == 2 * loads[static_cast<size_t>(rank)] * static_cast<int64_t>(sizeof(float)),
          "rank " + std::to_string(rank) + " holds " + std::to_string(ddp::optimizer_state_bytes(zero)) + " bytes of state");
  return loads;
}

std::string loads_text(const std::vector<int64_t>& loads) {
  std::string text;
  for (int64_t load : loads) text += (text.empty() ? "" : " ") + std::to_string(load);
  return text;
}

// The bucket's parameters are cut where the running total (64, 128, ...) comes nearest to
// total * r / W. Two parameters: at 2 ranks the cut is at 64, one each; at 3 both marks (42.7,
// 85.3) are nearest to 64, so ranks 0 and 2 own one each and rank 1 none. Four: at 2 ranks the cut
// is at 128; at 3 the marks 85.3 and 170.7 are nearest to 64 and 192: 64 / 128 / 64.
DDP_WORKER(zero_overlap_split) {
  worker_init(std::chrono::seconds(30));
  const bool two = ddp::get_world_size() == 2;
  const std::vector<std::pair<int, std::vector<int64_t>>> cases{
      {2, two ? std::vector<int64_t>{64, 64} : std::vector<int64_t>{64, 0, 64}},
      {4, two ? std::vector<int64_t>{128, 128} : std::vector<int64_t>{64, 128, 64}}};
  for (const auto& [n, expected] : cases) {
    const auto loads = train_with_shard_buckets(n);
    require(loads == expected, std::to_string(n) + " parameters: elements owned per rank " + loads_text(loads) +
                                   ", expected " + loads_text(expected));
  }
}
TEST(ZeroOverlap, ShardBucketsCutsTheBucketsNearestToAnEvenSplit) {
  EXPECT_WORKERS_OK(run_workers("zero_overlap_split", 2));
  EXPECT_WORKERS_OK(run_workers("zero_overlap_split", 3));
}

// Bad input, named.
DDP_WORKER(zero_overlap_bad_input) {
  worker_init(std::chrono::seconds(30));
  using Zero = ddp::ZeroRedundancyOptimizer<torch::optim::SGD>;
  const auto sgd = torch::optim::SGDOptions(0.1);
  const auto overlap = ddp::ZeroRedundancyOptimizerOptions().overlap_with_ddp(true);
  auto expect_error = [](const std::string& message, const std::string& part) {
    require_mentions(message, part, "overlap_with_ddp bad input");
  };
  MLP net;
  Model model(net, bucket_per_parameter());

  // The hook with an optimizer that steps in step().
  Zero plain_zero(model.parameters(), {}, sgd);
  expect_error(error_of<std::invalid_argument>(
                   [&] { ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), model, plain_zero); }),
               "hook_with_zero_step: ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True`");
  // overlap_with_ddp: one parameter group, add_param_group refused (PyTorch's rule).
  expect_error(error_of<std::invalid_argument>([&] {
                 Zero(std::vector<torch::optim::OptimizerParamGroup>{
                          torch::optim::OptimizerParamGroup({net->fc1->weight}),
                          torch::optim::OptimizerParamGroup({net->fc1->bias})},
                      overlap, sgd);
               }),
               "with `overlap_with_ddp=True` only supports a single parameter group (got 2)");
  Zero zero(model.parameters(), overlap, sgd);
  expect_error(error_of<std::invalid_argument>(
                   [&] { zero.add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({2}, torch::requires_grad())})); }),
               "with `overlap_with_ddp=True` only supports a single parameter group: add_param_group is refused");
  // overlap_with_ddp but no hook: step() would never update anything.
  expect_error(error_of<std::logic_error>([&] { zero.step(); }), "no hook was made for this optimizer");
  // Before the hook assigned the buckets there is no shard to consolidate (PyTorch's check).
  expect_error(error_of<std::runtime_error>([&] { zero.consolidate_state_dict(0); }),
               "consolidate_state_dict: This method should not be called until this ZeroRedundancyOptimizer instance "
               "has been fully initialized");
  // bucket_cap_mb_auto changes the buckets after the rebuild.
  MLP auto_net;
  Model auto_model(auto_net, ddp::DDPOptions().bucket_cap_mb_auto(true));
  expect_error(error_of<std::invalid_argument>(
                   [&] { ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), auto_model, zero); }),
               "bucket_cap_mb_auto changes DDP's buckets");
  // One hook per optimizer.
  model.register_comm_hook(ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), model, zero));
  expect_error(error_of<std::invalid_argument>(
                   [&] { ddp::hooks::hook_with_zero_step_interleaved(ddp::hooks::allreduce(), model, zero); }),
               "a hook_with_zero_step(allreduce) hook was already made for this optimizer");
  require(!zero.step().defined(), "step() with the hook made must do nothing");

  // A model parameter the optimizer does not hold: the first backward after the rebuild fails,
  // naming it, on every rank alike (no hang).
  MLP partial_net;
  Model partial(partial_net, bucket_per_parameter());
  std::vector<torch::Tensor> some;
  for (const auto& item : partial_net->named_parameters()) {
    if (item.key() != "fc1.bias") some.push_back(item.value());
  }
  Zero partial_zero(some, overlap, sgd);
  partial.register_comm_hook(ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), partial, partial_zero));
  backward(partial, 0);  // warm-up
  expect_error(error_of([&] { backward(partial, 1); }),
               "is not one of the optimizer's parameters; construct it over model.parameters()");
}
TEST(ZeroOverlap, BadInputIsNamed) { EXPECT_WORKERS_OK(run_workers("zero_overlap_bad_input", 2)); }

}  // namespace
