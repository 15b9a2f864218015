// The DDP contract points that need a closer look than "gradients match": allreduces overlap
// backward, the one rebuild follows rank 0's order, the process_group option is the group used,
// and the default bucket caps follow the rule of bucket_assignment.cpp.
#include <algorithm>
#include <cstdlib>
#include <map>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

void expect_same_grads(torch::nn::Module& expected, torch::nn::Module& actual, const std::string& what) {
  auto want = expected.named_parameters(), got = actual.named_parameters();
  for (const auto& item : want) {
    const auto& grad = got[item.key()].grad();
    require(grad.defined(), what + ": " + item.key() + " has no gradient");
    require(torch::allclose(grad, item.value().grad(), 1e-5, 1e-6), what + ": gradient of " + item.key() + " differs");
  }
}
std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}
std::vector<std::string> flatten(const std::vector<std::vector<std::string>>& buckets) {
  std::vector<std::string> out;
  for (const auto& bucket : buckets) out.insert(out.end(), bucket.begin(), bucket.end());
  return out;
}

// --- 1. overlap ------------------------------------------------------------------------------------

// The first layer has no bias, so its weight's gradient is the very last one of backward (the
// input needs no gradient): nothing else can arrive after it.
struct DeepImpl : torch::nn::Module {
  DeepImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(10, 16).bias(false)));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 16));
    fc4 = register_module("fc4", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc4(torch::relu(fc3(torch::relu(fc2(torch::relu(fc1(x)))))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, fc4{nullptr};
};
TORCH_MODULE(Deep);

// A tensor hook runs just before its gradient is accumulated, i.e. before DDP's post-hook marks it
// ready: it sees how many bucket allreduces were already launched when that gradient arrived.
DDP_WORKER(overlap) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(21);
  Deep local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0));
  copy_parameters(*model.module(), *reference);
  const int64_t buckets = static_cast<int64_t>(model.reduction_stats().buckets.size());
  require(buckets == 7, "expected one bucket per parameter, got " + std::to_string(buckets));

  std::vector<std::pair<std::string, int64_t>> arrivals;  // (parameter, launched in this backward)
  int64_t launched_before = 0;
  for (const auto& item : model.named_parameters()) {
    const std::string name = item.key();
    item.value().register_hook([&arrivals, &model, &launched_before, name](const torch::Tensor&) {
      arrivals.emplace_back(name, model.reduction_stats().collectives_launched - launched_before);
    });
  }

  for (int step = 0; step < 3; ++step) {
    const std::string what = "step " + std::to_string(step);
    arrivals.clear();
    launched_before = model.reduction_stats().collectives_launched;
    model.zero_grad();
    reference->zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x), y).backward();

    require(arrivals.size() == 7 && arrivals.back().first == "fc1.weight",
            what + ": fc1.weight should be the last gradient to arrive");
    // Every bucket but fc1.weight's was already on the wire while backward still had work to do.
    require(arrivals.back().second == buckets - 1,
            what + ": when the last gradient arrived, " + std::to_string(arrivals.back().second) + " of " +
                std::to_string(buckets) + " allreduces had been launched (expected " + std::to_string(buckets - 1) + ")");
    const auto stats = model.reduction_stats();
    require(stats.collectives_launched - launched_before == buckets, what + ": not one allreduce per bucket");
    if (step > 0) {
      // After the rebuild, bucket k holds the k-th gradient to arrive, and it is launched the
      // moment that gradient is ready: the k-th arrival finds exactly k allreduces launched.
      require(stats.buckets_rebuilt, what + ": buckets not rebuilt");
      for (size_t k = 0; k < arrivals.size(); ++k) {
        require(arrivals[k].first == stats.buckets[k].front(),
                what + ": bucket " + std::to_string(k) + " is " + stats.buckets[k].front() + " but gradient #" +
                    std::to_string(k) + " to arrive was " + arrivals[k].first);
        require(arrivals[k].second == static_cast<int64_t>(k),
                what + ": gradient #" + std::to_string(k) + " (" + arrivals[k].first + ") found " +
                    std::to_string(arrivals[k].second) + " allreduces launched, expected " + std::to_string(k));
      }
    }
    expect_same_grads(*reference, *model.module(), what);
  }
}
TEST(DDPContract, AllreducesLaunchInBucketOrderWhileBackwardRuns) { EXPECT_WORKERS_OK(run_workers("overlap", 2)); }

// --- 2. the rebuild follows rank 0's order ---------------------------------------------------------

// Two independent branches. Autograd runs the ready node with the higher sequence number first, so
// the branch called LAST in forward delivers its gradients FIRST: the call order picks which
// parameters are ready first, and it differs between ranks.
struct TwoBranchImpl : torch::nn::Module {
  TwoBranchImpl() {
    a = register_module("a", torch::nn::Linear(10, 5));
    b = register_module("b", torch::nn::Linear(10, 5));
  }
  torch::Tensor forward(torch::Tensor x, bool a_first_ready) {
    if (a_first_ready) {
      auto yb = b(x);
      return a(x) + yb;
    }
    auto ya = a(x);
    return ya + b(x);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoBranch);

// Parameter indices (in named_parameters order) of `names`, as a tensor to all_gather.
torch::Tensor encode(const std::vector<std::string>& names, const std::vector<std::string>& all) {
  std::vector<int64_t> indices;
  for (const auto& name : names) {
    indices.push_back(std::find(all.begin(), all.end(), name) - all.begin());
  }
  return torch::tensor(indices, torch::kLong);
}

DDP_WORKER(rebuild_rank0_order) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(31);
  TwoBranch local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0));
  copy_parameters(*model.module(), *reference);
  const std::vector<std::string> names = model.named_parameters().keys();
  const auto initial = flatten(model.reduction_stats().buckets);
  require(initial == std::vector<std::string>({"b.bias", "b.weight", "a.bias", "a.weight"}),
          "initial buckets should be in reverse registration order, got " + join(initial));

  std::vector<std::string> arrived;
  for (const auto& item : model.named_parameters()) {
    const std::string name = item.key();
    item.value().register_hook([&arrived, name](const torch::Tensor&) { arrived.push_back(name); });
  }

  const bool a_first = rank == 0;  // rank 0: a's gradients first; the others: b's first
  std::vector<std::string> layout_after_rebuild;
  for (int step = 0; step < 5; ++step) {
    const std::string what = "step " + std::to_string(step);
    arrived.clear();
    model.zero_grad();
    reference->zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(model.forward(shard(x, rank, world), a_first), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x, true), y).backward();
    expect_same_grads(*reference, *model.module(), what);

    const auto stats = model.reduction_stats();
    const auto layout = flatten(stats.buckets);
    if (step == 0) {
      // The premise: the ranks really observed different orders, rank 0 starting with a.
      const bool a_came_first = arrived.front().rfind("a.", 0) == 0;
      require(arrived.size() == names.size() && a_came_first == a_first,
              "rank " + std::to_string(rank) + " observed " + join(arrived) +
                  ": the forward call order did not decide which branch is ready first");
      auto observed = ddp::all_gather(encode(arrived, names));
      require(!torch::equal(observed[0], observed[1]), "ranks observed the same order: nothing to test");
      // Rank 0's observed order: the layout every rank must adopt.
      const int64_t* rank0_order = observed[0].data_ptr<int64_t>();
      for (size_t i = 0; i < names.size(); ++i) layout_after_rebuild.push_back(names[rank0_order[i]]);
      require(!stats.buckets_rebuilt && layout == initial, "buckets changed before the first rebuild point");
      continue;
    }
    // The rebuild happened once, before step 1's forward, in rank 0's order on every rank.
    require(stats.buckets_rebuilt, what + ": buckets not rebuilt");
    require(stats.buckets.size() == names.size(), what + ": not one bucket per parameter any more");
    require(layout == layout_after_rebuild,
            what + ": rank " + std::to_string(rank) + " has buckets " + join(layout) + ", expected rank 0's observed order " +
                join(layout_after_rebuild));
    auto gathered = ddp::all_gather(encode(layout, names));
    for (size_t r = 1; r < gathered.size(); ++r) {
      require(torch::equal(gathered[0], gathered[r]), what + ": bucket layout differs between rank 0 and rank " + std::to_string(r));
    }
  }
}
TEST(DDPContract, RebuildUsesRankZerosObservedOrderOnce) { EXPECT_WORKERS_OK(run_workers("rebuild_rank0_order", 2)); }

// --- 3. the process_group option ------------------------------------------------------------------

// The default group is each rank alone (a world of one); the explicit group spans both ranks. Had
// DDP used the default group, parameters would not be broadcast and gradients not averaged.
DDP_WORKER(explicit_group) {
  const int rank = worker_rank(), world = worker_world_size();
  ddp::InitOptions solo{"gloo", "file://" + shared_dir() + "/solo_" + std::to_string(rank)};
  solo.rank = 0;
  solo.world_size = 1;
  ddp::init_process_group(solo);
  require(ddp::get_world_size() == 1, "the default group should be a world of one");
  ddp::InitOptions both{"gloo", "file://" + std::string(std::getenv("DDP_TEST_STORE"))};
  both.rank = rank;
  both.world_size = world;
  both.timeout = std::chrono::seconds(60);
  auto group = ddp::new_process_group(both);
  require(ddp::default_group() != group, "new_process_group replaced the default group");

  torch::manual_seed(40 + rank);  // a different start on each rank: only a broadcast over `group` aligns them
  MLP local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().process_group(group));
  require(model.process_group() == group, "options().process_group is not the group passed in");
  copy_parameters(*model.module(), *reference);
  std::vector<torch::Tensor> flat;
  for (const auto& p : model.parameters()) flat.push_back(p.detach().flatten());
  auto gathered = ddp::all_gather(torch::cat(flat), group);
  require(torch::equal(gathered[0], gathered[1]), "parameters were not broadcast over the explicit group");

  for (int step = 0; step < 2; ++step) {
    model.zero_grad();
    reference->zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x), y).backward();  // full batch = the average over both ranks
    expect_same_grads(*reference, *model.module(), "explicit group step " + std::to_string(step));
  }
}
TEST(DDPContract, ProcessGroupOptionIsTheGroupReducedOver) { EXPECT_WORKERS_OK(run_workers("explicit_group", 2)); }

// --- 7. default bucket caps -----------------------------------------------------------------------

// ~33 MiB of fp32 parameters with default options. bucket_assignment.cpp walks parameters in
// reverse registration order and closes a bucket once it holds at least its cap (1 MiB for the
// first, 25 MiB after), so every closed bucket reaches its cap and was below it before its last
// member; only the leftover last bucket may stay below.
DDP_WORKER(default_caps) {
  worker_init();
  auto make = [] {
    return torch::nn::Sequential(torch::nn::Linear(512, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                                 torch::nn::ReLU(), torch::nn::Linear(2048, 1024), torch::nn::ReLU(),
                                 torch::nn::Linear(1024, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 256),
                                 torch::nn::ReLU(), torch::nn::Linear(256, 10));
  };
  torch::manual_seed(7);
  auto local = make(), reference = make();
  ddp::DistributedDataParallel model(local);
  copy_parameters(*model.module(), *reference);
  std::map<std::string, int64_t> bytes;
  int64_t total = 0;
  for (const auto& item : model.named_parameters()) {
    bytes[item.key()] = item.value().numel() * 4;
    total += bytes[item.key()];
  }
  const int64_t MiB = 1 << 20;
  require(total > 30 * MiB && total < 60 * MiB, "model size " + std::to_string(total) + " bytes");

  const auto buckets = model.reduction_stats().buckets;
  auto registration = model.named_parameters().keys();
  require(flatten(buckets) == std::vector<std::string>(registration.rbegin(), registration.rend()),
          "buckets are not filled in reverse registration order");
  for (size_t b = 0; b < buckets.size(); ++b) {
    int64_t size = 0;
    for (const auto& name : buckets[b]) size += bytes[name];
    const int64_t cap = b == 0 ? 1 * MiB : 25 * MiB;
    const int64_t before_last = size - bytes[buckets[b].back()];
    const std::string what = "bucket " + std::to_string(b) + " (" + join(buckets[b]) + ", " + std::to_string(size) +
                             " bytes, cap " + std::to_string(cap) + ")";
    require(before_last < cap, what + ": should have closed before its last parameter");
    if (b + 1 < buckets.size()) require(size >= cap, what + ": closed before reaching its cap");
  }
  // The same rule, spelled out for this model: 1 MiB is first reached with 8.weight (1 MiB), 25 MiB
  // with 2.weight (16 MiB on top of 12 MiB); 0.* is what is left.
  const std::vector<std::vector<std::string>> expected = {
      {"10.bias", "10.weight", "8.bias", "8.weight"},
      {"6.bias", "6.weight", "4.bias", "4.weight", "2.bias", "2.weight"},
      {"0.bias", "0.weight"}};
  require(buckets == expected, "unexpected default bucket layout");

  auto x = torch::randn({4, 512});
  model.forward(x).pow(2).sum().backward();
  reference->forward(x).pow(2).sum().backward();
  require(model.reduction_stats().collectives_launched == 3, "one step should launch 3 allreduces");
  expect_same_grads(*reference, *model.module(), "default caps");
}
TEST(DDPContract, DefaultBucketCapsOneMiBThenTwentyFiveMiB) { EXPECT_WORKERS_OK(run_workers("default_caps", 1)); }

}  // namespace
