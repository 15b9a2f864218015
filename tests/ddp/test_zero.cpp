// ddp::ZeroRedundancyOptimizer (ZeRO stage 1), mirroring PyTorch's test_zero_redundancy_optimizer.py:
// against the plain optimizer (bitwise when every rank has the whole batch's gradient; through DDP
// on shards, bitwise against the plain optimizer stepping a DDP replica, PyTorch's reference, and
// within 1e-6 or 1e-5 of one process on the whole batch), the partition's balance, the whole state
// through a checkpoint at another world size, uneven inputs under Join, and bad input named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/join.h>
#include <ddp/zero_redundancy_optimizer.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;
using torch::optim::OptimizerParamGroup;

// One group of every parameter, or two: fc1 and fc3.bias at the defaults, the rest at half the
// learning rate (so the groups' options matter).
template <typename Options>
std::vector<OptimizerParamGroup> groups_of(MLP& net, bool two_groups, const Options& defaults) {
  if (!two_groups) return {OptimizerParamGroup(net->parameters())};
  Options half = defaults;
  half.lr(defaults.lr() / 2);
  return {OptimizerParamGroup({net->fc1->weight, net->fc1->bias, net->fc3->bias}),
          OptimizerParamGroup({net->fc2->weight, net->fc2->bias, net->fc3->weight}, std::make_unique<Options>(half))};
}

// Two MLPs with the same start: the one ZeRO trains and the plain optimizer's reference.
std::pair<MLP, MLP> twin_mlps() {
  torch::manual_seed(5);
  MLP net, reference;
  copy_parameters(*net, *reference);
  return {net, reference};
}

// Steps `from` to `to` of `opt` on `net`, each on the whole batch of that step.
template <typename Opt>
void train(MLP& net, Opt& opt, int from, int to) {
  for (int step = from; step < to; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    torch::mse_loss(net->forward(x), y).backward();
    opt.step();
  }
}

struct Case {
  bool bucket_view;
  bool two_groups;
  bool through_ddp;  // DDP on shards of the batch (within 1e-6), else each rank the whole batch (bitwise)
};

std::string describe(const char* optimizer, const Case& c) {
  return std::string(optimizer) + (c.bucket_view ? " with bucket views" : "") + (c.two_groups ? ", two groups" : "") +
         (c.through_ddp ? ", through DDP" : ", whole batch") + " at rank " + std::to_string(ddp::get_rank()) + " of " +
         std::to_string(ddp::get_world_size());
}

// 10 steps of ZeRO over Optim against 10 of Optim itself in this process on the whole batch.
// Through DDP, also against Optim stepping a second DDP replica: the same averaged gradients, so
// that comparison is bitwise; the one against the whole batch measures DDP's averaging, which
// Adam's normalized update magnifies: plain Adam through DDP itself ends 3e-6 from the whole
// batch's at 3 ranks (measured), hence 1e-5 for Adam and AdamW, 1e-6 otherwise.
template <typename Optim, typename Options>
void expect_parity(const char* name, const Options& defaults, const Case& c, double tolerance = 1e-6) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  MLP net, reference, replica;
  copy_parameters(*net, *reference);
  copy_parameters(*net, *replica);
  std::unique_ptr<ddp::DistributedDataParallel<MLPImpl>> model, replica_model;
  if (c.through_ddp) {
    model = std::make_unique<ddp::DistributedDataParallel<MLPImpl>>(net);
    replica_model = std::make_unique<ddp::DistributedDataParallel<MLPImpl>>(replica);
  }
  ddp::ZeroRedundancyOptimizer<Optim> opt(groups_of(net, c.two_groups, defaults),
                                          ddp::ZeroRedundancyOptimizerOptions().parameters_as_bucket_view(c.bucket_view),
                                          defaults);
  Optim plain(groups_of(reference, c.two_groups, defaults), defaults);
  Optim replica_opt(groups_of(replica, c.two_groups, defaults), defaults);
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    if (c.through_ddp) {
      torch::mse_loss(model->forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      replica_opt.zero_grad();
      torch::mse_loss(replica_model->forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      replica_opt.step();
    } else {
      torch::mse_loss(net->forward(x), y).backward();
    }
    opt.step();
    plain.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    plain.step();
  }
  const auto params = net->parameters(), whole = reference->parameters(), replicated = replica->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string what = describe(name, c) + ": parameter " + std::to_string(i);
    const double diff = (params[i] - whole[i]).abs().max().item<double>();
    if (c.through_ddp) {
      require(torch::equal(params[i], replicated[i]), what + " is not bitwise equal to Optim's through DDP");
      require(diff <= tolerance, what + " differs from the whole batch's by " + std::to_string(diff));
    } else {
      require(torch::equal(params[i], whole[i]), what + " is not bitwise equal (differs by " + std::to_string(diff) + ")");
    }
  }
}

DDP_WORKER(zero_parity) {
  worker_init(std::chrono::seconds(30));
  for (bool bucket_view : {false, true}) {
    for (bool two_groups : {false, true}) {
      const Case whole{bucket_view, two_groups, false};
      expect_parity<torch::optim::SGD>("SGD", torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3), whole);
      expect_parity<torch::optim::SGD>("SGD nesterov", torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true), whole);
      expect_parity<torch::optim::Adam>("Adam", torch::optim::AdamOptions(1e-2), whole);
      expect_parity<torch::optim::Adam>("Adam amsgrad", torch::optim::AdamOptions(1e-2).amsgrad(true), whole);
      expect_parity<torch::optim::AdamW>("AdamW", torch::optim::AdamWOptions(1e-2).weight_decay(0.1), whole);
      expect_parity<torch::optim::Adagrad>("Adagrad", torch::optim::AdagradOptions(0.1), whole);
      expect_parity<torch::optim::RMSprop>("RMSprop", torch::optim::RMSpropOptions(1e-2).momentum(0.5), whole);
      const Case sharded{bucket_view, two_groups, true};
      expect_parity<torch::optim::SGD>("SGD", torch::optim::SGDOptions(0.1).momentum(0.9), sharded);
      expect_parity<torch::optim::Adam>("Adam", torch::optim::AdamOptions(1e-3), sharded, 1e-5);
      expect_parity<torch::optim::AdamW>("AdamW", torch::optim::AdamWOptions(1e-3), sharded, 1e-5);
    }
  }
}
// LibTorch's optimizers have no `maximize` option (1.13 and 2.6): PyTorch's maximize cases have no
// C++ counterpart to test.
TEST(Zero, MatchesThePlainOptimizerAtTwoRanks) { EXPECT_WORKERS_OK(run_workers("zero_parity", 2)); }
TEST(Zero, MatchesThePlainOptimizerAtThreeRanks) { EXPECT_WORKERS_OK(run_workers("zero_parity", 3)); }

// The MLP's parameters (fc1.weight 320, fc1.bias 32, fc2.weight 512, fc2.bias 16, fc3.weight 80,
// fc3.bias 5), by hand: largest first, each to the least loaded rank.
//   2 ranks: 512 -> 0; 320, 80, 32, 16, 5 -> 1 (1 stays below 512):       512 | 453
//   3 ranks: 512 -> 0; 320 -> 1; 80, 32, 16, 5 -> 2:                       512 | 320 | 133
DDP_WORKER(zero_balance) {
  worker_init(std::chrono::seconds(30));
  const int world = ddp::get_world_size();
  MLP net;
  ddp::ZeroRedundancyOptimizer<torch::optim::Adam> opt(net->parameters(), {}, torch::optim::AdamOptions(1e-3));
  const std::vector<int64_t> expected = world == 2 ? std::vector<int64_t>{512, 453} : std::vector<int64_t>{512, 320, 133};
  int64_t largest = 0;
  for (const auto& p : net->parameters()) largest = std::max(largest, p.numel());
  std::vector<int64_t> loads;
  for (const auto& params : opt.params_per_rank()) {
    int64_t numel = 0;
    for (const auto& p : params) numel += p.numel();
    loads.push_back(numel);
  }
  require(loads == expected, "rank loads differ from the hand-computed partition");
  require(*std::max_element(loads.begin(), loads.end()) - *std::min_element(loads.begin(), loads.end()) <= largest,
          "the imbalance exceeds the largest parameter");
  require(opt.rank_of(net->fc2->weight) == 0 && opt.rank_of(net->fc1->weight) == 1, "fc2.weight/fc1.weight owners");
  // Only this rank's shard holds state after a step: Adam's two buffers of its parameters.
  for (const auto& p : net->parameters()) p.mutable_grad() = torch::ones_like(p);
  opt.step();
  const int64_t mine = loads[static_cast<size_t>(ddp::get_rank())];
  const int64_t bytes = ddp::optimizer_state_bytes(opt);
  require(bytes == 2 * mine * static_cast<int64_t>(sizeof(float)),
          "optimizer_state_bytes() is " + std::to_string(bytes) + ", expected Adam's 2 x " + std::to_string(mine) +
              " floats");
  // A plain Adam over the same parameters holds all of it.
  torch::optim::Adam plain(net->parameters(), torch::optim::AdamOptions(1e-3));
  plain.step();
  require(ddp::optimizer_state_bytes(plain) == 2 * 965 * static_cast<int64_t>(sizeof(float)), "plain Adam's state bytes");
}
TEST(Zero, PartitionIsBalancedAsPyTorchs) {
  EXPECT_WORKERS_OK(run_workers("zero_balance", 2));
  EXPECT_WORKERS_OK(run_workers("zero_balance", 3));
}

// Bad input, named.
DDP_WORKER(zero_bad_input) {
  worker_init(std::chrono::seconds(30));
  using Zero = ddp::ZeroRedundancyOptimizer<torch::optim::SGD>;
  const auto sgd = torch::optim::SGDOptions(0.1);
  auto a = torch::zeros({3}, torch::requires_grad()), b = torch::zeros({2}, torch::requires_grad());
  auto d = torch::zeros({2}, torch::dtype(torch::kDouble).requires_grad(true));
  auto expect_error = [](const std::string& message, const std::string& part) {
    require_mentions(message, part, "ZeroRedundancyOptimizer bad input");
  };
  expect_error(error_of<std::invalid_argument>([&] { Zero({a, d}, {}, sgd); }),
               "ZeroRedundancyOptimizer: only supports using the same dense type for all parameters but got both "
               "torch.FloatTensor and torch.DoubleTensor (parameter 1 of group 0)");
  expect_error(error_of<std::invalid_argument>(
                   [&] { Zero(std::vector<OptimizerParamGroup>{OptimizerParamGroup({a, b}), OptimizerParamGroup({b})}, {}, sgd); }),
               "some parameters appear in more than one parameter group (parameter 0 of group 1");
  expect_error(error_of<std::invalid_argument>([&] { Zero(std::vector<torch::Tensor>{}, {}, sgd); }),
               "ZeroRedundancyOptimizer: got an empty parameter list");
  // overlap_with_ddp's own bad input: test_zero_overlap.cpp.
  Zero opt({a}, {}, sgd);
  expect_error(error_of<std::invalid_argument>([&] { opt.add_param_group(OptimizerParamGroup({a})); }),
               "some parameters appear in more than one parameter group (parameter 0 of group 1");
  expect_error(error_of<std::invalid_argument>([&] { opt.add_param_group(OptimizerParamGroup({d})); }),
               "torch.FloatTensor and torch.DoubleTensor");
  expect_error(error_of<std::invalid_argument>([&] { opt.consolidate_state_dict(7); }),
               "consolidate_state_dict(to=7): `to` must be a rank of the group, 0 to 1");
  // state_dict() before consolidation: PyTorch's message, naming this rank.
  torch::serialize::OutputArchive archive;
  const std::string me = std::to_string(ddp::get_rank());
  expect_error(error_of<std::runtime_error>([&] { opt.save(archive); }),
               "Optimizer state has not been consolidated on this rank. Please call `consolidate_state_dict(to=" + me +
                   ")` on all ranks beforehand if you meant to save the global state.");
  // A consolidation older than the last step would not fit the parameters any more.
  a.mutable_grad() = torch::ones_like(a);
  opt.consolidate_state_dict(0);
  opt.step();
  if (ddp::get_rank() == 0) {
    expect_error(error_of<std::runtime_error>([&] { opt.save(archive); }),
                 "the state was consolidated after step 0 and step() has run 1 time(s) since");
  }
}
TEST(Zero, BadInputIsNamed) { EXPECT_WORKERS_OK(run_workers("zero_bad_input", 2)); }

// add_param_group: a group added later is partitioned on top of the first, which keeps its owners.
DDP_WORKER(zero_add_param_group) {
  worker_init(std::chrono::seconds(30));
  auto [net, reference] = twin_mlps();
  const auto adam = torch::optim::AdamOptions(1e-2);
  auto first = [](MLP& m) { return std::vector<torch::Tensor>{m->fc1->weight, m->fc1->bias, m->fc2->weight}; };
  auto second = [](MLP& m) {
    return OptimizerParamGroup({m->fc2->bias, m->fc3->weight, m->fc3->bias},
                               std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(5e-3)));
  };
  ddp::ZeroRedundancyOptimizer<torch::optim::Adam> opt(first(net), {}, adam);
  torch::optim::Adam plain(first(reference), adam);
  const auto owners_before = opt.params_per_rank();
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {  // the other layers join after three steps (PyTorch: unfreezing layers)
      opt.add_param_group(second(net));
      plain.add_param_group(second(reference));
    }
    train(net, opt, step, step + 1);
    train(reference, plain, step, step + 1);
  }
  for (size_t r = 0; r < owners_before.size(); ++r) {
    for (const auto& p : owners_before[r]) require(opt.rank_of(p) == static_cast<int>(r), "a first-group parameter moved");
  }
  const auto params = net->parameters(), expected = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    require(torch::equal(params[i], expected[i]), "parameter " + std::to_string(i) + " differs after add_param_group");
  }
}
TEST(Zero, AddParamGroupMatchesThePlainOptimizer) { EXPECT_WORKERS_OK(run_workers("zero_add_param_group", 3)); }

// A learning-rate scheduler sets the lr of ZeRO's parameter groups; step() hands it to the local
// optimizer (PyTorch's _sync_param_groups): equal to plain Adam under the same schedule.
DDP_WORKER(zero_scheduler) {
  worker_init(std::chrono::seconds(30));
  auto [net, reference] = twin_mlps();
  const auto adam = torch::optim::AdamOptions(1e-2);
  ddp::ZeroRedundancyOptimizer<torch::optim::Adam> opt(net->parameters(), {}, adam);
  torch::optim::Adam plain(reference->parameters(), adam);
  torch::optim::StepLR schedule(opt, /*step_size=*/2, /*gamma=*/0.1), plain_schedule(plain, 2, 0.1);
  for (int step = 0; step < 6; ++step) {
    train(net, opt, step, step + 1);
    schedule.step();
    train(reference, plain, step, step + 1);
    plain_schedule.step();
  }
  require(opt.param_groups()[0].options().get_lr() == plain.param_groups()[0].options().get_lr(),
          "ZeRO's group lr is not the scheduled one");
  const auto params = net->parameters(), expected = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    require(torch::equal(params[i], expected[i]), "parameter " + std::to_string(i) + " differs under StepLR");
  }
}
TEST(Zero, LearningRateSchedulerReachesTheShards) { EXPECT_WORKERS_OK(run_workers("zero_scheduler", 2)); }

// --- the whole state through a checkpoint ------------------------------------------------------
// Every rank computes the whole batch's gradient, so ZeRO, resumed or not, at any world size, must
// equal plain Adam bitwise.
using ZeroAdam = ddp::ZeroRedundancyOptimizer<torch::optim::Adam>;
const auto kAdam = torch::optim::AdamOptions(1e-2).amsgrad(true);

std::string zero_checkpoint() { return shared_dir() + "/zero.pt"; }

// Two ranks: 5 steps, save; a fresh model and optimizer load it and run 5 more, equal to 10 straight.
DDP_WORKER(zero_checkpoint_save) {
  worker_init(std::chrono::seconds(30));
  torch::manual_seed(5);
  MLP net, straight;
  copy_parameters(*net, *straight);
  ZeroAdam straight_opt(straight->parameters(), {}, kAdam);
  train(straight, straight_opt, 0, 10);

  ZeroAdam opt(net->parameters(), ddp::ZeroRedundancyOptimizerOptions().parameters_as_bucket_view(true), kAdam);
  train(net, opt, 0, 5);
  opt.consolidate_state_dict(0);
  ddp::TrainingState state;
  state.global_step = 5;
  ddp::save_checkpoint(zero_checkpoint(), *net, &opt, state);

  torch::manual_seed(99);  // another start: everything must come from the checkpoint
  MLP resumed;
  ZeroAdam resumed_opt(resumed->parameters(), {}, kAdam);
  ddp::load_checkpoint(zero_checkpoint(), *resumed, &resumed_opt);
  require(ddp::optimizer_state_bytes(resumed_opt) == ddp::optimizer_state_bytes(opt),
          "the loaded shard's state has another size");
  train(resumed, resumed_opt, 5, 10);
  expect_bitwise(resumed, straight, "resumed at 2 ranks");
}

// Three ranks load what two saved (each keeps its own, new shard) and run the last 5 steps: equal
// to plain Adam's 10 steps in one process.
DDP_WORKER(zero_checkpoint_reshard) {
  worker_init(std::chrono::seconds(30));
  torch::manual_seed(99);
  MLP net;
  ZeroAdam opt(net->parameters(), {}, kAdam);
  const auto state = ddp::load_checkpoint(zero_checkpoint(), *net, &opt);
  require(state.world_size == 2 && state.global_step == 5, "the checkpoint is not the one two ranks wrote");
  train(net, opt, 5, 10);

  torch::manual_seed(5);
  MLP reference;
  torch::optim::Adam plain(reference->parameters(), kAdam);
  train(reference, plain, 0, 10);
  expect_bitwise(net, reference, "resharded from 2 to 3 ranks");
}
TEST(Zero, CheckpointResumesBitwiseAtTheSameAndAtAnotherWorldSize) {
  RunOptions options;
  options.shared_dir = make_temp_dir("zero_checkpoint");
  EXPECT_WORKERS_OK(run_workers("zero_checkpoint_save", 2, options));
  EXPECT_WORKERS_OK(run_workers("zero_checkpoint_reshard", 3, options));
  remove_tree(options.shared_dir);
}

// A state that refuses what it reads: a load reaches it only after the optimizer loaded.
class RefusingState final : public ddp::Stateful {
 public:
  ddp::TensorDict state_dict() const override { return {{"value", torch::tensor(int64_t{1})}}; }
  void load_state_dict(const ddp::TensorDict&) override { throw std::invalid_argument("refused on purpose"); }
};

// Two ranks: a load that fails after ZeRO loaded its state (a later state refuses what it read)
// puts back the shard's state and the consolidated snapshot: saving from that snapshot needs no
// new consolidation, and training on, and resuming from what was saved, equal a straight run.
DDP_WORKER(zero_failed_load_restores) {
  worker_init(std::chrono::seconds(30));
  torch::manual_seed(5);
  MLP net, straight;
  copy_parameters(*net, *straight);
  ZeroAdam straight_opt(straight->parameters(), {}, kAdam);
  train(straight, straight_opt, 0, 8);
  ZeroAdam opt(net->parameters(), {}, kAdam);
  RefusingState refusing;
  train(net, opt, 0, 3);
  opt.consolidate_state_dict(0);
  ddp::save_checkpoint(zero_checkpoint(), *net, &opt, ddp::TrainingState{0, 3},
                       ddp::CheckpointOptions().state("refusing", &refusing));
  train(net, opt, 3, 5);  // past the checkpoint: the file's state is not this one
  opt.consolidate_state_dict(0);
  const auto before = adam_state(opt.optim());
  std::string message;
  try {
    ddp::load_checkpoint(zero_checkpoint(), *net, &opt, ddp::LoadOptions().state("refusing", &refusing));
  } catch (const ddp::CheckpointError& error) {
    message = error.what();
  }
  require(message.find("refused on purpose") != std::string::npos, "the load did not fail on the refusing state: " + message);
  const auto after = adam_state(opt.optim());
  require(after.size() == before.size() && !before.empty(), "the failed load changed which parameters have state");
  for (const auto& [key, tensors] : before) {
    const auto found = after.find(key);
    require(found != after.end(), "the failed load dropped a parameter's state");
    for (size_t i = 0; i < tensors.size(); ++i) {
      require(torch::equal(tensors[i], found->second[i]), "the failed load changed the shard's state");
    }
  }
  const std::string again = shared_dir() + "/zero_at_5.pt";
  ddp::save_checkpoint(again, *net, &opt, ddp::TrainingState{0, 5});  // the snapshot of step 5, kept
  train(net, opt, 5, 8);
  expect_bitwise(net, straight, "trained on after a failed load");
  torch::manual_seed(99);
  MLP resumed;
  ZeroAdam resumed_opt(resumed->parameters(), {}, kAdam);
  ddp::load_checkpoint(again, *resumed, &resumed_opt);
  train(resumed, resumed_opt, 5, 8);
  expect_bitwise(resumed, straight, "resumed from the snapshot the failed load kept");
}
TEST(Zero, ALoadFailingAfterTheOptimizerPutsItsShardAndSnapshotBack) {
  RunOptions options;
  options.shared_dir = make_temp_dir("zero_failed_load");
  EXPECT_WORKERS_OK(run_workers("zero_failed_load_restores", 2, options));
  remove_tree(options.shared_dir);
}

// PyTorch's test_state_dict: the saved state carries the groups' options, and loading restores
// them ("we should be using LR1 and not LR2 after reloading"), so the momentum buffer goes on:
// x = 1 - 0.1 * 1 = 0.9, then buffer 0.9 * 1 + 1 = 1.9 and x = 0.9 - 0.1 * 1.9 = 0.71.
DDP_WORKER(zero_state_dict_options) {
  worker_init(std::chrono::seconds(30));
  using ZeroSgd = ddp::ZeroRedundancyOptimizer<torch::optim::SGD>;
  const std::string file = shared_dir() + "/zero_sgd.pt";
  auto x = torch::tensor({1.0f}).requires_grad_(true);
  ZeroSgd o({x}, {}, torch::optim::SGDOptions(0.1).momentum(0.9));
  x.backward();
  o.step();
  require(x.item<float>() == 0.9f, "x after the first step: " + std::to_string(x.item<float>()));
  o.zero_grad();
  o.consolidate_state_dict(0);
  if (ddp::get_rank() == 0) {
    torch::serialize::OutputArchive archive;
    o.save(archive);
    archive.save_to(file);
  }
  ddp::barrier();

  ZeroSgd reloaded({x}, {}, torch::optim::SGDOptions(0.01));
  torch::serialize::InputArchive archive;
  archive.load_from(file);
  reloaded.load(archive);
  for (const torch::optim::Optimizer* opt : {static_cast<const torch::optim::Optimizer*>(&reloaded),
                                              static_cast<const torch::optim::Optimizer*>(&reloaded.optim())}) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(opt->param_groups()[0].options());
    require(options.lr() == 0.1 && options.momentum() == 0.9,
            "after load: lr " + std::to_string(options.lr()) + ", momentum " + std::to_string(options.momentum()) +
                (opt == &reloaded ? " on the wrapper" : " on the local optimizer"));
  }
  x.backward();
  reloaded.step();
  require(std::abs(x.item<float>() - 0.71f) < 1e-6f, "x after the step from the loaded state: " +
                                                         std::to_string(x.item<float>()) + ", PyTorch's is 0.71");
}
TEST(Zero, LoadRestoresTheSavedOptionsAsPyTorchsTestStateDict) {
  RunOptions options;
  options.shared_dir = make_temp_dir("zero_state_dict");
  EXPECT_WORKERS_OK(run_workers("zero_state_dict_options", 2, options));
  remove_tree(options.shared_dir);
}

// A ZeRO checkpoint loads into the plain optimizer, and the plain optimizer's into ZeRO: both hold
// Optim's own format (ZeRO's state consolidated), so each goes on bitwise as 10 steps straight.
std::string zero_file() { return shared_dir() + "/from_zero.pt"; }
std::string plain_file() { return shared_dir() + "/from_plain.pt"; }
MLP plain_adam_reference(int steps) {
  torch::manual_seed(5);
  MLP reference;
  torch::optim::Adam plain(reference->parameters(), kAdam);
  train(reference, plain, 0, steps);
  return reference;
}

DDP_WORKER(zero_saves_for_plain) {
  worker_init(std::chrono::seconds(30));
  torch::manual_seed(5);
  MLP net;
  ZeroAdam opt(net->parameters(), {}, kAdam);
  train(net, opt, 0, 5);
  opt.consolidate_state_dict(0);
  ddp::save_checkpoint(zero_file(), *net, &opt, ddp::TrainingState());
}

DDP_WORKER(plain_loads_zero_and_saves) {
  worker_init(std::chrono::seconds(30));
  torch::manual_seed(99);
  MLP net;
  torch::optim::Adam plain(net->parameters(), kAdam);
  ddp::load_checkpoint(zero_file(), *net, &plain);
  train(net, plain, 5, 10);
  MLP reference = plain_adam_reference(10);
  expect_bitwise(net, reference, "plain Adam from ZeRO's checkpoint");

  torch::manual_seed(5);
  MLP first;
  torch::optim::Adam first_opt(first->parameters(), kAdam);
  train(first, first_opt, 0, 5);
  ddp::save_checkpoint(plain_file(), *first, &first_opt, ddp::TrainingState());
}

DDP_WORKER(zero_loads_plain) {
  worker_init(std::chrono::seconds(30));
  torch::manual_seed(99);
  MLP net;
  ZeroAdam opt(net->parameters(), {}, kAdam);
  ddp::load_checkpoint(plain_file(), *net, &opt);
  train(net, opt, 5, 10);
  MLP reference = plain_adam_reference(10);
  expect_bitwise(net, reference, "ZeRO from plain Adam's checkpoint");
}
TEST(Zero, ItsCheckpointLoadsIntoThePlainOptimizerAndBack) {
  RunOptions options;
  options.shared_dir = make_temp_dir("zero_plain");
  EXPECT_WORKERS_OK(run_workers("zero_saves_for_plain", 2, options));
  EXPECT_WORKERS_OK(run_workers("plain_loads_zero_and_saves", 1, options));
  EXPECT_WORKERS_OK(run_workers("zero_loads_plain", 2, options));
  remove_tree(options.shared_dir);
}

// --- uneven inputs -----------------------------------------------------------------------------
// Rank r has 4 + r batches. A rank that ran out still steps its shard with the averaged gradients
// DDP's shadow pass gives it, and broadcasts it: every rank ends equal to one process that, in
// iteration t, sums the gradients of the ranks that still had a batch and divides by 3.
int zero_batches_of(int rank) { return 4 + rank; }

std::pair<torch::Tensor, torch::Tensor> zero_rank_batch(int rank, int t) {
  torch::manual_seed(8000 + 100 * rank + t);
  return {torch::randn({4, 10}), torch::randn({4, 5})};
}

DDP_WORKER(zero_join_uneven) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::manual_seed(11);
  MLP net, reference;
  copy_parameters(*net, *reference);
  ddp::DistributedDataParallel model(net);
  ddp::ZeroRedundancyOptimizer<torch::optim::SGD> opt(model.parameters(), {}, sgd);
  ddp::Join({model, opt}).run([&] {
    for (int t = 0; t < zero_batches_of(rank); ++t) {
      auto [x, y] = zero_rank_batch(rank, t);
      opt.zero_grad();
      torch::mse_loss(model.forward(x), y).backward();
      opt.step();
    }
  });

  torch::optim::SGD plain(reference->parameters(), sgd);
  for (int t = 0; t < zero_batches_of(world - 1); ++t) {
    plain.zero_grad();
    for (int r = 0; r < world; ++r) {
      if (t >= zero_batches_of(r)) continue;
      auto [x, y] = zero_rank_batch(r, t);
      (torch::mse_loss(reference->forward(x), y) / world).backward();
    }
    plain.step();
  }
  const auto params = net->parameters(), expected = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const double diff = (params[i] - expected[i]).abs().max().item<double>();
    require(diff <= 1e-6, "rank " + std::to_string(rank) + ": parameter " + std::to_string(i) + " differs by " +
                              std::to_string(diff));
  }
}
TEST(Zero, UnevenInputsUnderJoinMatchTheReference) { EXPECT_WORKERS_OK(run_workers("zero_join_uneven", 3)); }

// The optimizer listed before the model would shadow its collectives in the wrong order: refused.
DDP_WORKER(zero_join_order) {
  worker_init(std::chrono::seconds(30));
  MLP net;
  ddp::DistributedDataParallel model(net);
  ddp::ZeroRedundancyOptimizer<torch::optim::SGD> opt(model.parameters(), {}, torch::optim::SGDOptions(0.1));
  const std::string message = error_of<std::invalid_argument>([&] {
    ddp::Join({opt, model}).run([&] {
      auto [x, y] = batch(0);
      torch::mse_loss(model.forward(x), y).backward();
      opt.step();
    });
  });
  require(message.find("list the DistributedDataParallel model before the optimizer") != std::string::npos,
          "got '" + message + "'");
}
TEST(Zero, JoinRefusesTheOptimizerBeforeTheModel) { EXPECT_WORKERS_OK(run_workers("zero_join_order", 2)); }

}  // namespace
