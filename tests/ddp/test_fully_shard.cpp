// ddp::fully_shard (fully sharded data parallel): training equals one process on the whole batch
// (SGD and Adam, W = 2 and 3, reshard_after_forward on and off, gradient accumulation, each
// prefetch setting), HSDP on a 2 x 2 mesh equals DDP, bf16 mixed precision stays near float32, the
// shards really are 1/W, without prefetch at most one block is unsharded at once, and every
// refusal names what was wrong.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <map>
#include <optional>
#include <type_traits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/atomic_file.h>
#include <ddp/ddp.h>

#include "sequence_number.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// A block with a residual: widths that no world size divides, so chunks are padded. Parameters
// under 65536 elements travel packed, larger ones one by one: a hidden width of 6000 gives one of
// each kind (a.weight 6000 x 11 splits evenly, b.weight 11 x 6000 is padded).
struct ShardBlockImpl : torch::nn::Module {
  explicit ShardBlockImpl(int64_t width, int64_t hidden = 7) {
    a = register_module("a", torch::nn::Linear(width, hidden));
    b = register_module("b", torch::nn::Linear(hidden, width));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(ShardBlock);

// The model as a port writes it: the blocks are called through ddp::sharded_forward (a plain call
// when nothing is sharded, as in the one-process reference).
struct ShardNetImpl : torch::nn::Module {
  explicit ShardNetImpl(int64_t middle_hidden = 6000, int64_t other_hidden = 7) {
    in = register_module("in", torch::nn::Linear(10, 11));
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), ShardBlock(11, i == 1 ? middle_hidden : other_hidden)));
    }
    out = register_module("out", torch::nn::Linear(11, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = in(x);
    for (auto& block : blocks) h = ddp::sharded_forward(block, h);
    return out(h);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::vector<ShardBlock> blocks;
};
TORCH_MODULE(ShardNet);

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<torch::Tensor> params) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

double max_difference(const torch::OrderedDict<std::string, torch::Tensor>& got, torch::nn::Module& want) {
  double worst = 0;
  const auto expected = want.named_parameters();
  require(got.size() >= expected.size(), "full_state_dict holds " + std::to_string(got.size()) + " entries");
  for (const auto& item : expected) {
    const torch::Tensor* value = got.find(item.key());
    require(value != nullptr, "full_state_dict lacks " + item.key());
    require(value->sizes() == item.value().sizes(), item.key() + ": full shape differs");
    worst = std::max(worst, (*value - item.value()).abs().max().item<double>());
  }
  return worst;
}

// Ten steps sharded against ten steps of one process on the whole batch, from the same weights.
void train_against_one_process(const std::string& optimizer_kind, bool reshard_after_forward, int micro_batches) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const std::string what = optimizer_kind + ", reshard_after_forward " + std::to_string(reshard_after_forward) +
                           ", " + std::to_string(micro_batches) + " micro-batch(es), W=" + std::to_string(world);
  // SGD on a model with a wide middle block (its large parameters travel one by one, the rest
  // packed); Adam on the narrow one: Adam's step divides by the root of the squared gradient, so on
  // a wide layer's near-zero gradients it turns the sums' different order (rank by rank here, all
  // rows at once in the reference) into differences past 1e-5 within ten steps.
  torch::manual_seed(7);
  const int64_t middle_hidden = optimizer_kind == "adam" ? 7 : 6000;
  ShardNet net(middle_hidden), reference(middle_hidden);
  copy_parameters(*net, *reference);
  const auto options = ddp::FSDPOptions().reshard_after_forward(reshard_after_forward);
  for (auto& block : net->blocks) ddp::fully_shard(block, options);
  auto model = ddp::fully_shard(net, options);
  // The shards: 1/W of every parameter's rows (rounded up), none of the full tensors.
  require(net->in->weight.size(0) == (11 + world - 1) / world - (rank == world - 1 ? (11 + world - 1) / world * world - 11 : 0),
          what + ": rank " + std::to_string(rank) + " holds " + std::to_string(net->in->weight.size(0)) + " rows of in.weight");
  auto optimizer = make_optimizer(optimizer_kind, net->parameters());
  auto reference_optimizer = make_optimizer(optimizer_kind, reference->parameters());
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = batch(step, 10, 12);
    y = y.narrow(1, 0, 5);
    const int64_t rows = 12 / world / micro_batches;
    for (int m = 0; m < micro_batches; ++m) {
      model.set_requires_gradient_sync(m == micro_batches - 1);
      auto mine_x = shard(x, rank, world).narrow(0, m * rows, rows), mine_y = shard(y, rank, world).narrow(0, m * rows, rows);
      torch::Tensor loss = torch::mse_loss(model.forward(mine_x), mine_y);
      if (m == 0) {  // between forward and backward, as many loops do: the shards' gradients are cleared
        optimizer->zero_grad();
        reference_optimizer->zero_grad();
      }
      loss.backward();
      std::vector<torch::Tensor> all_x, all_y;
      for (int r = 0; r < world; ++r) {
        all_x.push_back(shard(x, r, world).narrow(0, m * rows, rows));
        all_y.push_back(shard(y, r, world).narrow(0, m * rows, rows));
      }
      torch::mse_loss(reference->forward(torch::cat(all_x)), torch::cat(all_y)).backward();
    }
    optimizer->step();
    reference_optimizer->step();
  }
  const double worst = max_difference(model.full_state_dict(), *reference);
  require(worst <= 1e-5, what + ": parameters differ from one process by " + std::to_string(worst));
  // At most the root's parameters and gradients (in, out), one block's parameters and gradients,
  // the next block's prefetched parameters, and the previous block's reduction buffers (its
  // gradients, padded, and 1/W of them) were ever unsharded at once: not the whole model's.
  if (reshard_after_forward && micro_batches == 1) {
    const int64_t root_bytes = (reference->in->weight.numel() + reference->in->bias.numel() +
                                reference->out->weight.numel() + reference->out->bias.numel()) * 4;
    int64_t block_bytes = 0;  // the largest block's
    for (const auto& block : reference->blocks) {
      int64_t bytes = 0;
      for (const auto& param : block->parameters()) bytes += param.numel() * 4;
      block_bytes = std::max(block_bytes, bytes);
    }
    const auto stats = model.memory_stats();
    require(stats.peak_unsharded_bytes <= 2 * root_bytes + 5 * block_bytes + 4 * 64,
            what + ": " + std::to_string(stats.peak_unsharded_bytes) + " bytes were unsharded at once; root " +
                std::to_string(root_bytes) + ", a block " + std::to_string(block_bytes));
    int64_t chunk_bytes = 0;  // every parameter's ceil(rows / W) rows: this rank's padded chunks
    for (const auto& param : reference->parameters()) {
      const int64_t rows = param.size(0), row = param.numel() / rows;
      chunk_bytes += (rows + world - 1) / world * row * 4;
    }
    require(stats.parameter_bytes == chunk_bytes, what + ": this rank holds " + std::to_string(stats.parameter_bytes) +
                                                      " bytes of parameters, not its chunks' " + std::to_string(chunk_bytes));
  }
}

DDP_WORKER(fsdp_matches_one_process) {
  worker_init();
  for (const std::string kind : {"sgd", "adam"}) {
    for (const bool reshard : {true, false}) {
      for (const int micro_batches : {1, 2}) train_against_one_process(kind, reshard, micro_batches);
    }
  }
}
TEST(FullyShard, TrainsAsOneProcessOnTheWholeBatch) {
  EXPECT_WORKERS_OK(run_workers("fsdp_matches_one_process", 2));
  EXPECT_WORKERS_OK(run_workers("fsdp_matches_one_process", 3));
  RunOptions gloo;
  gloo.env["TORCHDDP_SHM"] = "0";
  EXPECT_WORKERS_OK(run_workers("fsdp_matches_one_process", 2, gloo));
}

// One SGD-style step of each: the sharded model on this rank's slice of the step's batch, the
// reference on all of it. Returns the step's whole input.
template <typename Sharded, typename Reference>
torch::Tensor step_against_one_process(Sharded& model, Reference& reference, torch::optim::Optimizer& optimizer,
                                       torch::optim::Optimizer& reference_optimizer, int step, int64_t features) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  auto [x, y] = batch(step, features, 12);
  y = y.narrow(1, 0, 5);
  optimizer.zero_grad();
  reference_optimizer.zero_grad();
  torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
  torch::mse_loss(reference->forward(x), y).backward();
  optimizer.step();
  reference_optimizer.step();
  return x;
}

// Bytes of `params` padded to `world` chunks of whole rows: what one of their gathers fills.
int64_t padded_bytes(const std::vector<torch::Tensor>& params, int world) {
  int64_t bytes = 0;
  for (const auto& param : params) {
    const int64_t rows = param.size(0), row = param.numel() / rows;
    bytes += (rows + world - 1) / world * world * row * 4;
  }
  return bytes;
}

// Each prefetch setting trains as one process (SGD, ten steps) and they differ in memory only:
// with neither prefetch at most the root's and one block's full parameters and gradients were
// alive at once; FSDP2's default holds more (the next block's gather, the previous reduction).
DDP_WORKER(fsdp_prefetch_settings) {
  worker_init();
  const int world = ddp::get_world_size();
  struct Setting {
    const char* name;
    bool forward;
    ddp::BackwardPrefetch backward;
  };
  std::map<std::string, int64_t> peak;
  int64_t root_bytes = 0, block_bytes = 0;
  for (const Setting& setting : {Setting{"default", true, ddp::BackwardPrefetch::kBackwardPre},
                                 Setting{"backward post", true, ddp::BackwardPrefetch::kBackwardPost},
                                 Setting{"none", false, ddp::BackwardPrefetch::kNone}}) {
    torch::manual_seed(13);
    ShardNet net(3000, 3000), reference(3000, 3000);  // three blocks of one size
    copy_parameters(*net, *reference);
    root_bytes = padded_bytes({reference->in->weight, reference->in->bias, reference->out->weight, reference->out->bias}, world);
    block_bytes = padded_bytes(reference->blocks[0]->parameters(), world);
    const auto options = ddp::FSDPOptions().forward_prefetch(setting.forward).backward_prefetch(setting.backward);
    for (auto& block : net->blocks) ddp::fully_shard(block, options);
    auto model = ddp::fully_shard(net, options);
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 10; ++step) step_against_one_process(model, reference, optimizer, reference_optimizer, step, 10);
    const double worst = max_difference(model.full_state_dict(), *reference);
    require(worst <= 1e-5, std::string(setting.name) + " prefetch: parameters differ from one process by " +
                               std::to_string(worst));
    peak[setting.name] = model.memory_stats().peak_unsharded_bytes;
  }
  const std::string sizes = "; the root " + std::to_string(root_bytes) + ", a block " + std::to_string(block_bytes);
  require(peak["none"] <= 2 * root_bytes + 2 * block_bytes,
          "without prefetch " + std::to_string(peak["none"]) + " bytes were unsharded at once" + sizes);
  require(peak["default"] > 2 * root_bytes + 3 * block_bytes,
          "with FSDP2's prefetching only " + std::to_string(peak["default"]) + " bytes were unsharded at once" + sizes +
              ": the count misses the prefetched gather or the reduction in flight");
}
TEST(FullyShard, EveryPrefetchSettingTrainsAsOneProcessAndNoneHoldsOneBlock) {
  EXPECT_WORKERS_OK(run_workers("fsdp_prefetch_settings", 2));
  EXPECT_WORKERS_OK(run_workers("fsdp_prefetch_settings", 3));
}

// HSDP: shards inside pairs {0,1} and {2,3}, replicas across them; equals DDP over the four.
DDP_WORKER(fsdp_hybrid_matches_ddp) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  ddp::DeviceMesh mesh = ddp::init_device_mesh({2, 2}, {"replicate", "shard"});
  torch::manual_seed(11);
  ShardNet net(7), ddp_net(7);  // small: Adam's steps amplify the sums' different order past 1e-6 on a wide layer
  copy_parameters(*net, *ddp_net);
  const auto options = ddp::FSDPOptions().mesh(mesh);
  for (auto& block : net->blocks) ddp::fully_shard(block, options);
  auto model = ddp::fully_shard(net, options);
  require(net->in->weight.size(0) == (mesh.coordinate()[1] == 0 ? 6 : 5), "in.weight is cut over the shard dimension only");
  ddp::DistributedDataParallel ddp_model(ddp_net.ptr());
  torch::optim::Adam optimizer(net->parameters(), 0.01), ddp_optimizer(ddp_net->parameters(), 0.01);
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = batch(step, 10, 12);
    y = y.narrow(1, 0, 5);
    optimizer.zero_grad();
    ddp_optimizer.zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    torch::mse_loss(ddp_model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    optimizer.step();
    ddp_optimizer.step();
  }
  const double worst = max_difference(model.full_state_dict(), *ddp_net);
  require(worst <= 1e-6, "HSDP differs from DDP by " + std::to_string(worst));
}
TEST(FullyShard, HybridShardingOnATwoByTwoMeshEqualsDDP) {
  EXPECT_WORKERS_OK(run_workers("fsdp_hybrid_matches_ddp", 4));
}

// bf16 compute and all-gather, float32 reduction and shards: near float32 training, not equal.
DDP_WORKER(fsdp_bf16_near_fp32) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  ShardNet net, fp32_net;
  copy_parameters(*net, *fp32_net);
  const auto bf16 = ddp::FSDPOptions().mixed_precision(
      ddp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32));
  for (auto& block : net->blocks) ddp::fully_shard(block, bf16);
  auto model = ddp::fully_shard(net, bf16);
  for (auto& block : fp32_net->blocks) ddp::fully_shard(block);
  auto fp32_model = ddp::fully_shard(fp32_net);
  torch::optim::SGD optimizer(net->parameters(), 0.05), fp32_optimizer(fp32_net->parameters(), 0.05);
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = batch(step, 10, 12);
    y = y.narrow(1, 0, 5);
    optimizer.zero_grad();
    fp32_optimizer.zero_grad();
    auto output = model.forward(shard(x, rank, world));
    require(output.scalar_type() == torch::kBFloat16, "the forward did not compute in bfloat16");
    torch::mse_loss(output.to(torch::kFloat), shard(y, rank, world)).backward();
    torch::mse_loss(fp32_model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    require(net->out->weight.grad().scalar_type() == torch::kFloat, "the shards' gradients are not float32");
    optimizer.step();
    fp32_optimizer.step();
  }
  require(net->out->weight.scalar_type() == torch::kFloat, "the shards are not float32");
  const auto fp32_state = fp32_model.full_state_dict();
  double worst_against_fp32 = 0;
  const auto mine = model.full_state_dict();
  for (const auto& item : fp32_state) {
    worst_against_fp32 = std::max(worst_against_fp32, (*mine.find(item.key()) - item.value()).abs().max().item<double>());
  }
  require(worst_against_fp32 <= 3e-2, "bf16 training strays from float32 by " + std::to_string(worst_against_fp32));
  require(worst_against_fp32 > 0, "bf16 training equals float32 bitwise: bf16 was not used");
}
TEST(FullyShard, BFloat16MixedPrecisionStaysNearFloat32) {
  EXPECT_WORKERS_OK(run_workers("fsdp_bf16_near_fp32", 2));
}

// Steps [first, last) of Adam training, each rank on its slice of the step's batch.
void train_steps(ddp::FSDPModule<ShardNetImpl>& model, torch::optim::Optimizer& optimizer, int first, int last) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  for (int step = first; step < last; ++step) {
    auto [x, y] = batch(step, 10, 12);
    optimizer.zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y.narrow(1, 0, 5), rank, world)).backward();
    optimizer.step();
  }
}

ddp::FSDPModule<ShardNetImpl> shard_net(ShardNet& net) {
  for (auto& block : net->blocks) ddp::fully_shard(block);
  return ddp::fully_shard(net);
}

// The checkpoint workers' run: the narrow ShardNet from `seed`, sharded block by block, and Adam
// over its shards.
struct ShardedAdam {
  ShardNet net;
  ddp::FSDPModule<ShardNetImpl> model;
  torch::optim::Adam optimizer;
};
ShardedAdam make_sharded_adam(uint64_t seed) {
  torch::manual_seed(seed);
  ShardNet net(7);
  // In this order (a braced list's): Adam takes the parameters fully_shard left, the shards.
  return {net, shard_net(net), torch::optim::Adam(net->parameters(), 0.01)};
}

// The largest difference between two sharded models' whole states, entry by entry.
double largest_difference(ddp::FSDPModule<ShardNetImpl>& got, ddp::FSDPModule<ShardNetImpl>& want) {
  const auto expected = want.full_state_dict();
  double worst = 0;
  for (const auto& item : got.full_state_dict()) {
    worst = std::max(worst, (item.value() - *expected.find(item.key())).abs().max().item<double>());
  }
  return worst;
}

// Five steps at W=2, then the checkpoint: the whole model and Adam's state, as one process saves.
// The narrow model: the W=2 and W=3 runs sum in different orders, which Adam amplifies on a wide
// layer (see train_against_one_process).
DDP_WORKER(fsdp_checkpoint_save) {
  worker_init();
  ShardedAdam run = make_sharded_adam(21);
  train_steps(run.model, run.optimizer, 0, 5);
  ddp::save_checkpoint(shared_dir() + "/fsdp.pt", run.model, &run.optimizer, ddp::TrainingState{0, 5});
  require(run.net->in->weight.size(0) == 6 - ddp::get_rank(), "the shards did not come back after saving");
  // The file holds the whole model: it loads into a module that was never sharded.
  ShardNet plain(7);
  ddp::load_checkpoint(shared_dir() + "/fsdp.pt", plain, nullptr);
  require(max_difference(run.model.full_state_dict(), *plain) == 0, "the saved model is not the whole model");
}

// At W=3: the W=2 checkpoint loaded into new shards, five more steps, against ten uninterrupted
// steps at W=3.
DDP_WORKER(fsdp_checkpoint_resume) {
  worker_init();
  torch::manual_seed(21);
  ShardNet resumed_net(7), straight_net(7);
  copy_parameters(*resumed_net, *straight_net);
  auto resumed = shard_net(resumed_net);
  torch::optim::Adam resumed_optimizer(resumed_net->parameters(), 0.01);
  const auto state = ddp::load_checkpoint(shared_dir() + "/fsdp.pt", resumed, &resumed_optimizer);
  require(state.global_step == 5 && state.world_size == 2, "the training state did not come back");
  require(resumed_net->in->weight.size(0) == (ddp::get_rank() < 2 ? 4 : 3), "the loaded model is not in W=3 shards");
  train_steps(resumed, resumed_optimizer, 5, 10);
  auto straight = shard_net(straight_net);
  torch::optim::Adam straight_optimizer(straight_net->parameters(), 0.01);
  train_steps(straight, straight_optimizer, 0, 10);
  const double worst = largest_difference(resumed, straight);
  require(worst <= 1e-6, "saved at W=2, resumed at W=3: differs from an uninterrupted W=3 run by " + std::to_string(worst));
}
TEST(FullyShard, ACheckpointSavedAtTwoRanksResumesAtThree) {
  RunOptions options;
  options.shared_dir = make_temp_dir("fsdp-checkpoint");
  EXPECT_WORKERS_OK(run_workers("fsdp_checkpoint_save", 2, options));
  EXPECT_WORKERS_OK(run_workers("fsdp_checkpoint_resume", 3, options));
  remove_tree(options.shared_dir);
}

// In a process that shards nothing, sharded_forward is the block's own forward: the port's model
// runs unchanged in one process (and its calls skip the registry's lock, which no unit is in).
DDP_WORKER(fsdp_unsharded_forward) {
  torch::manual_seed(9);
  ShardNet net(7);
  const auto x = torch::randn({4, 10});
  torch::Tensor h = net->in(x);
  for (auto& block : net->blocks) h = block->forward(h);
  require(torch::equal(net->forward(x), net->out(h)), "sharded_forward changed an unsharded block's output");
}
TEST(FullyShard, ShardedForwardIsThePlainCallWhenNothingIsSharded) {
  EXPECT_WORKERS_OK(run_workers("fsdp_unsharded_forward", 1));
}

// --- sharded checkpoints: one file per rank, nothing gathered ----------------------------------------

// How many collectives `call` issued on the default group: Gloo advances the group's sequence
// number once per collective (the workers run with shared memory off, which does not count).
template <typename Call>
uint64_t collectives_of(const ddp::ProcessGroupPtr& group, Call&& call) {
  const uint64_t before = group->getSequenceNumberForGroup();
  call();
  return group->getSequenceNumberForGroup() - before;
}

std::string sharded_path() { return shared_dir() + "/sharded-" + std::getenv("SAVED_AT") + ".pt"; }

// Five Adam steps at this world size, then a sharded checkpoint: every rank writes its own rows,
// and saving issues a few collectives of its own, not one per parameter as the full format's
// gather does (the same model saved full, for comparison, in the same run).
DDP_WORKER(fsdp_sharded_save) {
  auto group = worker_init();
  start_sequence_number(group);
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  ShardedAdam run = make_sharded_adam(21);
  train_steps(run.model, run.optimizer, 0, 5);
  const auto sharded = ddp::CheckpointOptions().full_state_dict(false);
  const uint64_t sharded_collectives = collectives_of(group, [&] {
    ddp::save_checkpoint(sharded_path(), run.model, &run.optimizer, ddp::TrainingState{0, 5}, sharded);
  });
  const uint64_t full_collectives = collectives_of(group, [&] {
    ddp::save_checkpoint(shared_dir() + "/full.pt", run.model, &run.optimizer, ddp::TrainingState{0, 5});
  });
  const auto parameters = static_cast<uint64_t>(run.net->parameters().size());
  require(full_collectives >= parameters, "the full save issued " + std::to_string(full_collectives) +
                                              " collectives for " + std::to_string(parameters) + " parameters");
  require(sharded_collectives <= 3, "the sharded save issued " + std::to_string(sharded_collectives) +
                                        " collectives (the full one " + std::to_string(full_collectives) + ")");
  // This rank's file holds its rows alone: in.weight's 11 rows cut in ceil(11 / W).
  const std::string own = sharded_path() + ".rank-" + std::to_string(rank) + "-of-" + std::to_string(world);
  const auto rows = ddp::load_state_dict(own).find("in.weight")->size(0);
  const int64_t chunk = (11 + world - 1) / world;
  require(rows == std::min<int64_t>(chunk, 11 - rank * chunk), own + " holds " + std::to_string(rows) + " rows of in.weight");
  require(run.net->in->weight.size(0) == std::min<int64_t>(chunk, 11 - rank * chunk), "the shards changed by saving");
}

// At this world size: the sharded checkpoint loaded into new shards, five more steps, against ten
// uninterrupted steps at this world size.
DDP_WORKER(fsdp_sharded_resume) {
  worker_init();
  const int saved_at = std::atoi(std::getenv("SAVED_AT"));
  torch::manual_seed(21);
  ShardNet resumed_net(7), straight_net(7);
  copy_parameters(*resumed_net, *straight_net);
  auto resumed = shard_net(resumed_net);
  torch::optim::Adam resumed_optimizer(resumed_net->parameters(), 0.01);
  const auto state = ddp::load_checkpoint(sharded_path(), resumed, &resumed_optimizer);
  require(state.global_step == 5 && state.world_size == saved_at, "the training state did not come back");
  train_steps(resumed, resumed_optimizer, 5, 10);
  auto straight = shard_net(straight_net);
  torch::optim::Adam straight_optimizer(straight_net->parameters(), 0.01);
  train_steps(straight, straight_optimizer, 0, 10);
  const double worst = largest_difference(resumed, straight);
  require(worst <= 1e-6, "saved sharded at W=" + std::to_string(saved_at) + ", resumed at W=" +
                             std::to_string(ddp::get_world_size()) + ": differs from an uninterrupted run by " +
                             std::to_string(worst));
}
TEST(FullyShard, AShardedCheckpointResumesAtTheSameAndAtOtherWorldSizes) {
  for (const auto& [saved_at, resumed_at] : std::vector<std::pair<int, std::vector<int>>>{{2, {2, 3}}, {3, {2}}}) {
    RunOptions options;
    options.shared_dir = make_temp_dir("fsdp-sharded");
    options.env["SAVED_AT"] = std::to_string(saved_at);
    RunOptions counted = options;
    counted.env["TORCHDDP_SHM"] = "0";
    EXPECT_WORKERS_OK(run_workers("fsdp_sharded_save", saved_at, counted));
    for (const int world : resumed_at) EXPECT_WORKERS_OK(run_workers("fsdp_sharded_resume", world, options));
    remove_tree(options.shared_dir);
  }
}

// HSDP on a 2 x 2 mesh: the ranks of one shard coordinate hold the same rows, and each writes them;
// a load at 1-D world sizes takes each row from the first file that holds it.
DDP_WORKER(fsdp_sharded_save_hybrid) {
  worker_init();
  ddp::DeviceMesh mesh = ddp::init_device_mesh({2, 2}, {"replicate", "shard"});
  torch::manual_seed(21);
  ShardNet net(7);
  const auto options = ddp::FSDPOptions().mesh(mesh);
  for (auto& block : net->blocks) ddp::fully_shard(block, options);
  auto model = ddp::fully_shard(net, options);
  torch::optim::Adam optimizer(net->parameters(), 0.01);
  train_steps(model, optimizer, 0, 5);
  ddp::save_checkpoint(sharded_path(), model, &optimizer, ddp::TrainingState{0, 5},
                       ddp::CheckpointOptions().full_state_dict(false));
  const std::string own = sharded_path() + ".rank-" + std::to_string(ddp::get_rank()) + "-of-4";
  const int64_t rows = ddp::load_state_dict(own).find("in.weight")->size(0);
  require(rows == (mesh.coordinate()[1] == 0 ? 6 : 5), own + " holds " + std::to_string(rows) + " rows of in.weight");
}
TEST(FullyShard, AShardedCheckpointOfHybridShardingResumesOneDimensional) {
  RunOptions options;
  options.shared_dir = make_temp_dir("fsdp-sharded-hybrid");
  options.env["SAVED_AT"] = "4";
  EXPECT_WORKERS_OK(run_workers("fsdp_sharded_save_hybrid", 4, options));
  for (const int world : {2, 3}) EXPECT_WORKERS_OK(run_workers("fsdp_sharded_resume", world, options));
  remove_tree(options.shared_dir);
}

// Loading reads only the files it needs (at the saving world size: this rank's own), and each file
// it cannot use is named on every rank, though only rank 1 needs it (no rank loads what another
// could not): a missing one, another save's, a damaged one; a plain module is told which format it
// met.
DDP_WORKER(fsdp_sharded_refusals) {
  worker_init();
  const int rank = ddp::get_rank();
  const std::string path = sharded_path();
  const std::string second = path + ".rank-1-of-2";
  ShardedAdam run = make_sharded_adam(21);
  train_steps(run.model, run.optimizer, 0, 2);
  const auto sharded = ddp::CheckpointOptions().full_state_dict(false);
  ddp::save_checkpoint(path, run.model, &run.optimizer, ddp::TrainingState{0, 2}, sharded);
  ShardNet plain(7);
  require_throws<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, plain, nullptr); }, "full_state_dict(false)",
                                       "a sharded checkpoint loaded into a plain module");
  require_throws<ddp::CheckpointError>([&] { ddp::load_checkpoint(second, plain, nullptr); },
                                       "is the file of rank 1 of 2 of a sharded checkpoint",
                                       "a rank file loaded as a checkpoint");
  // Another save's file of rank 1 (what a save that stopped after rank 1 wrote leaves).
  if (rank == 1) std::filesystem::copy_file(second, path + ".earlier");
  ddp::barrier();
  ddp::save_checkpoint(path, run.model, &run.optimizer, ddp::TrainingState{0, 2}, sharded);
  if (rank == 1) std::filesystem::rename(path + ".earlier", second);
  ddp::barrier();
  require_throws<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, run.model, &run.optimizer); },
                                       "rank 1: " + second + " is not the file of rank 1", "another save's rank file");
  ddp::save_checkpoint(path, run.model, &run.optimizer, ddp::TrainingState{0, 2}, sharded);
  if (rank == 1) std::filesystem::resize_file(second, std::filesystem::file_size(second) - 10);
  ddp::barrier();
  require_throws<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, run.model, &run.optimizer); }, second,
                                       "a truncated rank file");
  ddp::save_checkpoint(path, run.model, &run.optimizer, ddp::TrainingState{0, 2}, sharded);
  ddp::barrier();
  if (rank == 1) std::filesystem::remove(second);
  ddp::barrier();
  require_throws<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, run.model, &run.optimizer); },
                                       "rank 1: " + second + " is missing: it is the file of rank 1 of the 2",
                                       "a missing rank file");
  // keep_last prunes a sharded checkpoint's rank files with its index, and a resume finds the newest.
  // Files whose names merely begin like a rank file's are not the checkpoint's: they stay.
  const std::string dir = shared_dir() + "/kept";
  const std::string older = ddp::checkpoint_path(dir, 1), newer = ddp::checkpoint_path(dir, 2);
  for (const int64_t step : {1, 2}) {
    if (step == 2 && rank == 0) {
      for (const std::string& notes : {older + ".rank-notes", newer + ".rank-notes", newer + ".rank-1-of-2.txt"}) {
        std::ofstream(notes) << "not a rank file";
      }
    }
    ddp::save_checkpoint(ddp::checkpoint_path(dir, step), run.model, &run.optimizer, ddp::TrainingState{0, step},
                         ddp::CheckpointOptions().full_state_dict(false).keep_last(1));
  }
  for (const std::string& gone : {older, older + ".rank-0-of-2", older + ".rank-1-of-2"}) {
    require(!std::filesystem::exists(gone), gone + " was kept by keep_last(1)");
  }
  for (const std::string& notes : {older + ".rank-notes", newer + ".rank-notes", newer + ".rank-1-of-2.txt"}) {
    require(std::filesystem::exists(notes), "a sharded save with keep_last(1) removed " + notes);
  }
  require(std::filesystem::exists(newer + ".rank-1-of-2"), "keep_last(1) removed the newest checkpoint's rank file");
  const auto restored = ddp::load_checkpoint_if_exists(dir, run.model, &run.optimizer);
  require(restored.loaded && restored.path == newer && restored.state.global_step == 2,
          "load_checkpoint_if_exists did not resume from the newest sharded checkpoint");
}

// At W=3, the W=2 checkpoint whose rank 1 file is gone: rank 0's rows all lie in rank 0's file, but
// it does not load what ranks 1 and 2 cannot; rank 1 needs its missing home file; rank 2 reads rank
// 0's file, then needs rank 1's. A load that fails leaves the optimizer as it was on every rank.
DDP_WORKER(fsdp_sharded_failed_load) {
  worker_init();
  const int rank = ddp::get_rank();
  ShardedAdam run = make_sharded_adam(21);
  train_steps(run.model, run.optimizer, 0, 1);
  const auto before = adam_state(run.optimizer);
  std::string message;
  try {
    ddp::load_checkpoint(sharded_path(), run.model, &run.optimizer);
  } catch (const ddp::CheckpointError& error) {
    message = error.what();
  }
  require(!message.empty(), "rank " + std::to_string(rank) + " loaded what ranks 1 and 2 could not");
  for (const int failed : {1, 2}) {
    require_mentions(message, "rank " + std::to_string(failed) + ": " + sharded_path() + ".rank-1-of-2 is missing",
                     "a missing rank file at W=3, on rank " + std::to_string(rank));
  }
  require(message.find("rank 0: ") == std::string::npos, "the error blames rank 0, which read its files");
  const auto after = adam_state(run.optimizer);
  require(after.size() == before.size(), "the failed load changed which parameters have optimizer state");
  for (const auto& [key, tensors] : before) {
    const auto found = after.find(key);
    require(found != after.end(), "the failed load dropped a parameter's optimizer state");
    for (size_t i = 0; i < tensors.size(); ++i) {
      require(found->second[i].sizes() == tensors[i].sizes() && torch::equal(found->second[i], tensors[i]),
              "the failed load left another optimizer state behind");
    }
  }
}

TEST(FullyShard, AShardedCheckpointNamesTheFileItCannotUse) {
  RunOptions options;
  options.shared_dir = make_temp_dir("fsdp-sharded-refusals");
  options.env["SAVED_AT"] = "2";
  EXPECT_WORKERS_OK(run_workers("fsdp_sharded_refusals", 2, options));
  EXPECT_WORKERS_OK(run_workers("fsdp_sharded_failed_load", 3, options));
  remove_tree(options.shared_dir);
}

// This rank's shards and Adam's state of them, copied: what a failed load must leave as it was.
struct LocalState {
  std::vector<torch::Tensor> shards;
  std::map<std::decay_t<decltype(std::declval<torch::optim::Adam&>().state().begin()->first)>, std::vector<torch::Tensor>>
      optimizer;
};
LocalState local_state(ShardNet& net, torch::optim::Adam& optimizer) {
  LocalState state{{}, adam_state(optimizer)};
  for (const auto& param : net->parameters()) state.shards.push_back(param.detach().clone());
  return state;
}
void require_unchanged(const LocalState& before, const LocalState& after, const std::string& what) {
  require(after.shards.size() == before.shards.size(), what + " changed the number of parameters");
  for (size_t i = 0; i < before.shards.size(); ++i) {
    require(after.shards[i].sizes() == before.shards[i].sizes() && torch::equal(after.shards[i], before.shards[i]),
            what + " changed parameter " + std::to_string(i) + " of this rank's shards");
  }
  require(after.optimizer.size() == before.optimizer.size(), what + " changed which parameters have optimizer state");
  for (const auto& [key, tensors] : before.optimizer) {
    const auto found = after.optimizer.find(key);
    require(found != after.optimizer.end(), what + " dropped a parameter's optimizer state");
    for (size_t i = 0; i < tensors.size(); ++i) {
      require(found->second[i].sizes() == tensors[i].sizes() && torch::equal(found->second[i], tensors[i]),
              what + " changed the optimizer's state");
    }
  }
}

// A full checkpoint that the last rank cannot read (its path names a missing file, then a damaged
// copy: what a rank sees whose disk lacks the file or holds a torn one), the others can: every rank
// throws within seconds, naming that rank and its error, where the others used to wait in the
// load's gather for it; no rank's shards or optimizer state changed; the group stays usable, and a
// load every rank can read then gives every rank the file's model. HYBRID=1: a 2 x 2 mesh, where
// the ranks of the other shard group hear of the failure across the replicate group.
DDP_WORKER(fsdp_unreadable_full_load) {
  worker_init();
  const int rank = ddp::get_rank(), last = ddp::get_world_size() - 1;
  const bool hybrid = std::getenv("HYBRID") != nullptr;
  torch::manual_seed(21);
  ShardNet net(7);
  std::optional<ddp::FSDPModule<ShardNetImpl>> sharded;
  if (hybrid) {
    const auto options = ddp::FSDPOptions().mesh(ddp::init_device_mesh({2, 2}, {"replicate", "shard"}));
    for (auto& block : net->blocks) ddp::fully_shard(block, options);
    sharded.emplace(ddp::fully_shard(net, options));
  } else {
    sharded.emplace(shard_net(net));
  }
  auto& model = *sharded;
  torch::optim::Adam optimizer(net->parameters(), 0.01);
  const std::string good = shared_dir() + "/readable.pt", damaged = shared_dir() + "/damaged.pt";
  train_steps(model, optimizer, 0, 3);
  ddp::save_checkpoint(good, model, &optimizer, ddp::TrainingState{0, 3});
  if (rank == 0) {
    std::filesystem::copy_file(good, damaged);
    std::filesystem::resize_file(damaged, std::filesystem::file_size(damaged) - 10);
  }
  train_steps(model, optimizer, 3, 5);  // the model now differs from the file: a load would change it
  ddp::barrier();
  const LocalState before = local_state(net, optimizer);
  for (const std::string& unreadable : {shared_dir() + "/absent.pt", damaged}) {
    const std::string mine = rank == last ? unreadable : good;
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      ddp::load_checkpoint(mine, model, &optimizer);
    } catch (const ddp::CheckpointError& error) {
      message = error.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    require(!message.empty(), "rank " + std::to_string(rank) + " loaded " + mine + " though rank " +
                                  std::to_string(last) + " could not read " + unreadable);
    require(seconds < 10, "the failed load took " + std::to_string(seconds) + " s");
    require_mentions(message, "rank " + std::to_string(last) + ": ", "the error of a load rank " + std::to_string(last) +
                                                                         " could not read");
    require_mentions(message, unreadable, "the error of a load rank " + std::to_string(last) + " could not read");
    require_mentions(message, "No rank's model or optimizer was changed", "the error of a failed load");
    require(message.find("rank 0: ") == std::string::npos || last == 0, "the error blames rank 0, which read the file");
    require_unchanged(before, local_state(net, optimizer), "a load rank " + std::to_string(last) + " could not read");
  }
  ddp::load_checkpoint(good, model, &optimizer);
  ShardNet plain(7);
  ddp::load_checkpoint(good, plain, nullptr);
  require(max_difference(model.full_state_dict(), *plain) == 0, "after the failed loads, a sound load differs from the file");
}
TEST(FullyShard, AFullCheckpointOneRankCannotReadFailsOnEveryRankAndChangesNothing) {
  for (const bool hybrid : {false, true}) {
    RunOptions options;
    options.shared_dir = make_temp_dir("fsdp-unreadable");
    if (hybrid) options.env["HYBRID"] = "1";
    EXPECT_WORKERS_OK(run_workers("fsdp_unreadable_full_load", hybrid ? 4 : 2, options));
    remove_tree(options.shared_dir);
  }
}

// A state a load requires (as a GradScaler would be), which the checkpoint below was saved without.
class RequiredCounter final : public ddp::Stateful {
 public:
  ddp::TensorDict state_dict() const override { return {{"count", torch::tensor(count)}}; }
  void load_state_dict(const ddp::TensorDict& state) override { count = state.at("count").item<int64_t>(); }
  int64_t count = 0;
};

// At W=2, a checkpoint (FORMAT=full: one file; sharded: full_state_dict(false)) loaded with
// LoadOptions().state() naming a state it lacks: every rank throws naming it, into a fresh model
// with a fresh Adam (no state) and into a model that trained on past the checkpoint; the shards and
// the optimizer state are bitwise as they were ("no state" included). Then the load without it
// resumes, and three more steps equal a straight run of six.
DDP_WORKER(fsdp_required_state_missing) {
  worker_init();
  const int rank = ddp::get_rank();
  const bool full = std::string(std::getenv("FORMAT")) == "full";
  const std::string path = shared_dir() + "/lacking.pt";
  torch::manual_seed(21);
  ShardNet saved_net(7), straight_net(7);
  copy_parameters(*saved_net, *straight_net);
  auto saved = shard_net(saved_net);
  torch::optim::Adam saved_optimizer(saved_net->parameters(), 0.01);
  train_steps(saved, saved_optimizer, 0, 3);
  ddp::save_checkpoint(path, saved, &saved_optimizer, ddp::TrainingState{0, 3},
                       ddp::CheckpointOptions().full_state_dict(full));
  torch::manual_seed(5);  // other values than the file's: a load would change them
  ShardNet fresh_net(7);
  auto fresh = shard_net(fresh_net);
  torch::optim::Adam fresh_optimizer(fresh_net->parameters(), 0.01);
  RequiredCounter counter;
  counter.count = 41;
  auto refused = [&](ShardNet& net, ddp::FSDPModule<ShardNetImpl>& model, torch::optim::Adam& optimizer,
                     const std::string& what) {
    const LocalState before = local_state(net, optimizer);
    std::string message;
    try {
      ddp::load_checkpoint(path, model, &optimizer, ddp::LoadOptions().state("scaler", &counter));
    } catch (const ddp::CheckpointError& error) {
      message = error.what();
    }
    require(!message.empty(), "rank " + std::to_string(rank) + ": " + what + " loaded without the state it requires");
    require_unchanged(before, local_state(net, optimizer), what);
    require(counter.count == 41, what + " changed the state it could not restore");
    require_mentions(message, "holds no state named \"scaler\"", what);
    for (const int r : {0, 1}) {
      require_mentions(message, "rank " + std::to_string(r) + ": ", what + ", on rank " + std::to_string(rank));
    }
  };
  refused(fresh_net, fresh, fresh_optimizer, "a load into a fresh model and optimizer");
  require(fresh_optimizer.state().empty(), "the failed load left optimizer state in a fresh Adam");
  train_steps(saved, saved_optimizer, 3, 4);
  refused(saved_net, saved, saved_optimizer, "a load into a model trained past the checkpoint");
  require(ddp::load_checkpoint(path, fresh, &fresh_optimizer).global_step == 3, "the good load did not resume");
  train_steps(fresh, fresh_optimizer, 3, 6);
  auto straight = shard_net(straight_net);
  torch::optim::Adam straight_optimizer(straight_net->parameters(), 0.01);
  train_steps(straight, straight_optimizer, 0, 6);
  const double worst = largest_difference(fresh, straight);
  require(worst == 0, "resumed after the failed loads: differs from a straight run by " + std::to_string(worst));
}
TEST(FullyShard, ALoadLackingARequiredStateFailsOnEveryRankAndChangesNothing) {
  for (const std::string format : {"full", "sharded"}) {
    RunOptions options;
    options.shared_dir = make_temp_dir("fsdp-required-state");
    options.env["FORMAT"] = format;
    EXPECT_WORKERS_OK(run_workers("fsdp_required_state_missing", 2, options));
    remove_tree(options.shared_dir);
  }
}

// A full save into the path of a sharded checkpoint (W=2) removes that checkpoint's two rank files,
// and only once the full file is in place: a save that fails leaves the sharded checkpoint whole.
// Files it does not own stay: another world size's rank file, a rank past the index's world, a
// name that merely begins the same, another checkpoint's rank file.
DDP_WORKER(fsdp_full_save_over_sharded) {
  worker_init();
  const int rank = ddp::get_rank();
  ShardedAdam run = make_sharded_adam(21);
  train_steps(run.model, run.optimizer, 0, 2);
  const std::string path = shared_dir() + "/over.pt", other = shared_dir() + "/other.pt";
  const std::vector<std::string> owned = {path + ".rank-0-of-2", path + ".rank-1-of-2"};
  for (const std::string& sharded_at : {other, path}) {
    ddp::save_checkpoint(sharded_at, run.model, &run.optimizer, ddp::TrainingState{0, 2},
                         ddp::CheckpointOptions().full_state_dict(false));
  }
  const std::vector<std::string> bystanders = {path + ".rank-0-of-3", path + ".rank-2-of-2", path + ".rank-notes",
                                               other + ".rank-0-of-2"};
  // Rank 0's temporary file cannot be made (a directory holds its name): its write fails.
  const std::string blocked = ddp::temporary_path_for(path);
  if (rank == 0) {
    for (const std::string& file : {path + ".rank-0-of-3", path + ".rank-2-of-2", path + ".rank-notes"}) {
      std::ofstream(file) << "not the index's";
    }
    std::filesystem::create_directories(blocked + "/inside");
  }
  ddp::barrier();
  require_throws<ddp::CheckpointError>(
      [&] { ddp::save_checkpoint(path, run.model, &run.optimizer, ddp::TrainingState{0, 3}); },
      "save checkpoint " + path, "a full save whose write failed");
  for (const std::string& file : owned) require(std::filesystem::exists(file), "a failed full save removed " + file);
  require(ddp::load_checkpoint(path, run.model, &run.optimizer).global_step == 2,
          "the sharded checkpoint did not survive a failed full save into its path");
  if (rank == 0) remove_tree(blocked);
  ddp::barrier();
  train_steps(run.model, run.optimizer, 2, 3);
  ddp::save_checkpoint(path, run.model, &run.optimizer, ddp::TrainingState{0, 3});
  for (const std::string& file : owned) require(!std::filesystem::exists(file), "the full save left " + file);
  for (const std::string& file : bystanders) require(std::filesystem::exists(file), "the full save removed " + file);
  ShardNet plain(7);
  require(ddp::load_checkpoint(path, plain, nullptr).global_step == 3, "the full checkpoint does not load");
  require(max_difference(run.model.full_state_dict(), *plain) == 0, "the full checkpoint is not the model");
}
TEST(FullyShard, AFullSaveOverAShardedCheckpointRemovesItsRankFilesAlone) {
  RunOptions options;
  options.shared_dir = make_temp_dir("fsdp-full-over-sharded");
  EXPECT_WORKERS_OK(run_workers("fsdp_full_save_over_sharded", 2, options));
  remove_tree(options.shared_dir);
}

// A block with a frozen layer (requires_grad false) and a layer its forward never uses.
struct MixedBlockImpl : torch::nn::Module {
  MixedBlockImpl() {
    frozen = register_module("frozen", torch::nn::Linear(6, 6));
    trained = register_module("trained", torch::nn::Linear(6, 6));
    unused = register_module("unused", torch::nn::Linear(6, 6));
    for (auto& param : frozen->parameters()) param.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return trained(torch::tanh(frozen(x))); }
  torch::nn::Linear frozen{nullptr}, trained{nullptr}, unused{nullptr};
};
TORCH_MODULE(MixedBlock);

struct MixedNetImpl : torch::nn::Module {
  MixedNetImpl() {
    first = register_module("first", MixedBlock());
    second = register_module("second", MixedBlock());
    head = register_module("head", torch::nn::Linear(6, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(ddp::sharded_forward(second, ddp::sharded_forward(first, x)));
  }
  MixedBlock first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MixedNet);

// Frozen parameters stay as they were, parameters no forward uses get no update (their gradient
// is zero, as a rank without one contributes nothing), and an evaluation forward under no_grad
// between steps changes nothing: all as one process on the whole batch.
DDP_WORKER(fsdp_frozen_unused_and_eval) {
  worker_init();
  torch::manual_seed(3);
  MixedNet net, reference;
  copy_parameters(*net, *reference);
  auto model = ddp::fully_shard(net, {}, net->first, net->second);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 6; ++step) {
    const auto x = step_against_one_process(model, reference, optimizer, reference_optimizer, step, 6);
    torch::NoGradGuard no_grad;  // an evaluation between steps
    model.eval();
    const auto evaluated = model.forward(x);
    model.train();
    require(torch::allclose(evaluated, reference->forward(x), 1e-5, 1e-6), "the evaluation forward differs");
  }
  const double worst = max_difference(model.full_state_dict(), *reference);
  require(worst <= 1e-5, "frozen and unused parameters: differs from one process by " + std::to_string(worst));
}
TEST(FullyShard, FrozenAndUnusedParametersAndEvaluationForwardsTrainAsOneProcess) {
  EXPECT_WORKERS_OK(run_workers("fsdp_frozen_unused_and_eval", 2));
  EXPECT_WORKERS_OK(run_workers("fsdp_frozen_unused_and_eval", 3));
}

struct IntParamImpl : torch::nn::Module {
  IntParamImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 3));
    steps = register_parameter("steps", torch::zeros({2}, torch::kLong), /*requires_grad=*/false);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor steps;
};

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    shared = torch::nn::Linear(4, 4);
    first = register_module("first", ShardBlock(4));
    second = register_module("second", ShardBlock(4));
    first->register_module("tied", shared);
    second->register_module("tied", shared);
  }
  torch::nn::Linear shared{nullptr};
  ShardBlock first{nullptr}, second{nullptr};
};

DDP_WORKER(fsdp_refusals) {
  worker_init();
  const int rank = ddp::get_rank();
  {
    ShardNet net;
    ddp::fully_shard(net->blocks[0]);
    require_throws([&] { ddp::fully_shard(net->blocks[0]); }, "already sharded", "a block sharded twice");
    ddp::fully_shard(net);
    require_throws([&] { ddp::fully_shard(net->blocks[1]); }, "bottom-up", "a block sharded after its parent");
    require_throws([&] { ddp::DistributedDataParallel refused(net.ptr()); }, "sharded by ddp::fully_shard",
                   "DDP over a sharded module");
  }
  {
    auto tied = std::make_shared<TiedImpl>();
    ddp::fully_shard(tied->first);
    require_throws([&] { ddp::fully_shard(tied->second); }, "shared between blocks", "a parameter shared by two blocks");
  }
  {
    auto with_int = std::make_shared<IntParamImpl>();
    require_throws([&] { ddp::fully_shard(with_int); }, "'steps' has dtype Long", "an integer parameter");
  }
  {
    auto mixed = std::make_shared<ShardBlockImpl>(4);
    mixed->b->to(torch::kDouble);
    require_throws([&] { ddp::fully_shard(mixed); }, "one fully_shard call shards parameters of one dtype",
                   "parameters of two dtypes in one call");
  }
  {
    ShardNet net;
    ddp::DistributedDataParallel wrapped(net.ptr());
    require_throws([&] { ddp::fully_shard(net); }, "driven by DistributedDataParallel", "fully_shard after DDP");
  }
  {
    ShardBlockImpl on_stack(4);
    require_throws([&] { ddp::fully_shard(on_stack); }, "std::shared_ptr", "a module not held by a shared_ptr");
  }
  {
    auto different = std::make_shared<ShardBlockImpl>(rank == 1 ? 5 : 4);
    require_throws([&] { ddp::fully_shard(different); }, "ddp::fully_shard: the model differs across ranks",
                   "different models on the ranks");
  }
  {
    ShardNet net;
    ddp::DeviceMesh mesh = ddp::init_device_mesh({2, 1, 1});
    require_throws([&] { ddp::fully_shard(net, ddp::FSDPOptions().mesh(mesh)); }, "3 dimensions", "a 3-D mesh");
  }
  // The world is still usable after every refusal.
  torch::Tensor one = torch::ones({1});
  ddp::all_reduce(one);
  require(one.item<float>() == 2, "the group is unusable after the refusals");
}
TEST(FullyShard, RefusalsNameWhatWasWrong) {
  EXPECT_WORKERS_OK(run_workers("fsdp_refusals", 2));
}

}  // namespace
