// PowerSGD (ddp/powersgd.h) against PyTorch's own hook (a recording made by
// tools/record_powersgd.py with Debian's python3-torch), across a checkpoint, with DDP's options,
// and its refusals.
#include <cmath>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// --- against PyTorch's powerSGD_hook ---------------------------------------------------------------
// The recording: the buckets' parameter shapes, then per configuration its PowerSGDState
// arguments and rank 0's output for every compressed iteration and bucket.
struct Recording {
  std::vector<std::vector<std::vector<int64_t>>> buckets;
  int iterations = 0;
  struct Config {
    std::string name;
    ddp::hooks::PowerSGDOptions options;
    std::map<std::pair<int, int>, std::vector<float>> outputs;  // (iteration, bucket) -> values
  };
  std::vector<Config> configs;
};

Recording read_recording() {
  std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/powersgd_expected.txt");
  require(in.good(), "cannot open powersgd_expected.txt");
  Recording recording;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind;
    fields >> kind;
    if (kind == "buckets") {
      std::string all;
      fields >> std::ws;
      std::getline(fields, all);
      std::istringstream buckets(all);
      std::string bucket;
      while (std::getline(buckets, bucket, ';')) {
        recording.buckets.emplace_back();
        std::istringstream shapes(bucket);
        std::string shape;
        while (std::getline(shapes, shape, ',')) {
          std::istringstream sizes(shape);
          std::vector<int64_t> dims;
          for (int64_t size; sizes >> size;) dims.push_back(size);
          recording.buckets.back().push_back(dims);
        }
      }
    } else if (kind == "iterations") {
      fields >> recording.iterations;
    } else if (kind == "config") {
      Recording::Config config;
      int64_t rank, start, error_feedback, warm_start, batch, seed;
      fields >> config.name >> rank >> start >> error_feedback >> warm_start >> batch >> seed;
      config.options.matrix_approximation_rank(rank).start_powerSGD_iter(start).use_error_feedback(error_feedback)
          .warm_start(warm_start).batch_tensors_with_same_shape(batch).random_seed(seed);
      recording.configs.push_back(config);
    } else if (kind == "out") {
      std::string name;
      int iteration, bucket;
      fields >> name >> iteration >> bucket;
      auto& values = recording.configs.back().outputs[{iteration, bucket}];
      for (float value; fields >> value;) values.push_back(value);
    }
  }
  require(!recording.buckets.empty() && !recording.configs.empty(), "powersgd_expected.txt is incomplete");
  return recording;
}

// tools/record_powersgd.py's gradient formula: exact in float32.
torch::Tensor gradients(int rank, int iteration, int bucket, int64_t numel) {
  const auto k = torch::arange(numel, torch::kLong);
  const auto a = (k * 37 + rank * 101 + iteration * 53 + bucket * 13) % 199 - 99;
  const auto b = (k * k + 3 * iteration + 7 * rank) % 17;
  return a.to(torch::kFloat) / 64.0 + b.to(torch::kFloat) / 256.0;
}

DDP_WORKER(powersgd_matches_pytorch) {
  auto group = worker_init();
  const Recording recording = read_recording();
  const int rank = ddp::get_rank();
  for (const auto& config : recording.configs) {
    ddp::hooks::PowerSGDState state(config.options);
    size_t first_parameter = 0;
    std::vector<size_t> firsts;
    for (const auto& shapes : recording.buckets) {
      firsts.push_back(first_parameter);
      first_parameter += shapes.size();
    }
    double worst = 0;
    for (int iteration = 0; iteration < recording.iterations; ++iteration) {
      for (size_t b = 0; b < recording.buckets.size(); ++b) {
        std::vector<torch::Tensor> parameters;
        int64_t numel = 0;
        for (const auto& shape : recording.buckets[b]) {
          parameters.push_back(torch::zeros(shape));
          numel += parameters.back().numel();
        }
        torch::Tensor buffer = gradients(rank, iteration, static_cast<int>(b), numel);
        auto bucket = ddp::GradBucket::for_parameters(b, recording.buckets.size(), buffer, parameters, group, firsts[b]);
        auto future = state.reduce(bucket);
        future->wait();
        const torch::Tensor out = future->value().toTensor();
        const auto expected = config.outputs.find({iteration, static_cast<int>(b)});
        if (expected == config.outputs.end()) continue;  // a warm-up iteration: not recorded
        const auto want = torch::tensor(expected->second);
        require(want.numel() == out.numel(), config.name + ": output size");
        const double difference = (out - want).abs().max().item<double>();
        worst = std::max(worst, difference);
        require(difference <= 1e-5, config.name + ": iteration " + std::to_string(iteration) + " bucket " +
                                        std::to_string(b) + " differs from PyTorch's by " + std::to_string(difference));
      }
    }
    require(state.iteration() == recording.iterations, config.name + ": iteration count");
    require(state.compression_stats().compress_rate > 1, config.name + ": nothing was compressed");
    if (rank == 0) std::printf("%s: largest difference from PyTorch %.3g\n", config.name.c_str(), worst);
  }
}

TEST(PowerSGD, EqualsPyTorchsRecordedHookWithin1e5) {
  EXPECT_WORKERS_OK(run_workers("powersgd_matches_pytorch", 2));
}

// --- resume: 6 steps straight == 3 steps, checkpoint, new processes, load, 3 steps -----------------
ddp::hooks::PowerSGDOptions resume_options() {
  return ddp::hooks::PowerSGDOptions().matrix_approximation_rank(2).start_powerSGD_iter(2);
}

// Reordered's buckets change at the rebuild after the first iteration, also after resuming: the
// state must follow the parameters, not the buckets.
template <typename Net>
void train_steps(int first, int last, bool save_at_end, bool load_first, const ddp::DDPOptions& options) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(0);
  Net net;
  ddp::DistributedDataParallel model(net, options);
  model.register_comm_hook(ddp::hooks::powersgd(resume_options()));
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const std::string dir = shared_dir();
  if (load_first) {
    const auto state = ddp::load_checkpoint(ddp::checkpoint_path(dir, first), model, &optimizer);
    require(state.global_step == first, "resumed at the wrong step");
    auto* hook = dynamic_cast<ddp::hooks::PowerSGDState*>(model.comm_hook_state());
    require(hook != nullptr && hook->iteration() == first, "the hook's iteration count did not come back");
  }
  for (int step = first; step < last; ++step) {
    optimizer.zero_grad();
    auto [x, y] = batch(step);
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    optimizer.step();
  }
  if (save_at_end) {
    ddp::TrainingState state;
    state.global_step = last;
    ddp::save_checkpoint(ddp::checkpoint_path(dir, last), model, &optimizer, state);
  }
}

template <typename Net>
void resume_worker(const ddp::DDPOptions& options) {
  worker_init();
  const std::string phase = std::getenv("PHASE");
  if (phase == "straight") train_steps<Net>(0, 6, true, false, options);
  if (phase == "first") train_steps<Net>(0, 3, true, false, options);
  if (phase == "resume") train_steps<Net>(3, 6, true, true, options);
}

DDP_WORKER(powersgd_resume_mlp) { resume_worker<MLP>(ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0.001)); }
DDP_WORKER(powersgd_resume_reordered) { resume_worker<Reordered>(ddp::DDPOptions()); }

void expect_resume_is_bitwise(const std::string& worker) {
  const std::string straight_dir = make_temp_dir("psgd-straight"), resumed_dir = make_temp_dir("psgd-resumed");
  RunOptions straight, resumed;
  straight.shared_dir = straight_dir;
  straight.env = {{"PHASE", "straight"}};
  resumed.shared_dir = resumed_dir;
  EXPECT_WORKERS_OK(run_workers(worker, 2, straight));
  resumed.env = {{"PHASE", "first"}};
  EXPECT_WORKERS_OK(run_workers(worker, 2, resumed));
  resumed.env = {{"PHASE", "resume"}};
  EXPECT_WORKERS_OK(run_workers(worker, 2, resumed));
  const auto want = ddp::load_state_dict(ddp::checkpoint_path(straight_dir, 6));
  const auto got = ddp::load_state_dict(ddp::checkpoint_path(resumed_dir, 6));
  const auto at_checkpoint = ddp::load_state_dict(ddp::checkpoint_path(resumed_dir, 3));
  ASSERT_EQ(want.keys(), got.keys());
  bool moved = false;
  for (const auto& item : want) {
    EXPECT_TRUE(torch::equal(item.value(), got[item.key()])) << item.key() << " differs after resuming";
    moved |= !torch::equal(item.value(), at_checkpoint[item.key()]);
  }
  EXPECT_TRUE(moved) << "training did not move the parameters after the checkpoint";
  remove_tree(straight_dir);
  remove_tree(resumed_dir);
}

TEST(PowerSGD, SixStepsStraightEqualThreeCheckpointThreeBitwise) {
  expect_resume_is_bitwise("powersgd_resume_mlp");
  expect_resume_is_bitwise("powersgd_resume_reordered");
}

// --- with DDP's options: the same gradients as PowerSGD under DDP's defaults --------------------------
DDP_WORKER(powersgd_with_options) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const auto base = ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0.001);
  struct Config {
    const char* name;
    ddp::DDPOptions options;
    bool accumulate;  // two no_sync micro-batches before the synced one, against one backward of the sum
  };
  const Config configs[] = {
      {"gradient_as_bucket_view", ddp::DDPOptions(base).gradient_as_bucket_view(true), false},
      {"find_unused_parameters", ddp::DDPOptions(base).find_unused_parameters(true), false},
      {"static_graph", ddp::DDPOptions(base).static_graph(true), false},
      {"no_sync", base, true},
  };
  for (const auto& config : configs) {
    torch::manual_seed(3);
    MLP reference_net, net;
    copy_parameters(*reference_net, *net);
    ddp::DistributedDataParallel reference(reference_net, base), model(net, config.options);
    reference.register_comm_hook(ddp::hooks::powersgd(resume_options()));
    model.register_comm_hook(ddp::hooks::powersgd(resume_options()));
    for (int step = 0; step < 5; ++step) {
      for (auto* m : {&reference, &model}) {
        for (auto& p : m->parameters()) {
          if (p.grad().defined()) p.mutable_grad().zero_();
        }
      }
      auto loss_of = [&](auto& m, int micro) {
        auto [x, y] = batch(100 * step + micro);
        return torch::mse_loss(m.forward(shard(x, rank, world)), shard(y, rank, world));
      };
      if (config.accumulate) {
        {
          auto guard = model.no_sync();
          loss_of(model, 0).backward();
          loss_of(model, 1).backward();
        }
        loss_of(model, 2).backward();
        (loss_of(reference, 0) + loss_of(reference, 1) + loss_of(reference, 2)).backward();
      } else {
        loss_of(model, 0).backward();
        loss_of(reference, 0).backward();
      }
      const auto want = reference.parameters(), got = model.parameters();
      for (size_t i = 0; i < want.size(); ++i) {
        const bool same = config.accumulate ? torch::allclose(want[i].grad(), got[i].grad(), 1e-4, 1e-6)
                                            : torch::equal(want[i].grad(), got[i].grad());
        require(same, std::string(config.name) + ": step " + std::to_string(step) + " gradient " + std::to_string(i) +
                          " differs from PowerSGD with DDP's defaults");
      }
    }
    auto* state = dynamic_cast<ddp::hooks::PowerSGDState*>(model.comm_hook_state());
    require(state != nullptr && state->compression_stats().compress_rate > 2,
            std::string(config.name) + ": PowerSGD compressed less than expected");
  }
}

TEST(PowerSGD, GivesTheSameGradientsWithDDPsOptions) { EXPECT_WORKERS_OK(run_workers("powersgd_with_options", 2)); }

// --- refusals --------------------------------------------------------------------------------------
TEST(PowerSGD, RefusesWhatPyTorchRefuses) {
  using ddp::hooks::PowerSGDOptions;
  try {
    ddp::hooks::powersgd(PowerSGDOptions().start_powerSGD_iter(1));
    ADD_FAILURE() << "start_powerSGD_iter 1 with error feedback was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("start_powerSGD_iter must be > 1"), std::string::npos) << error.what();
  }
  EXPECT_THROW(ddp::hooks::powersgd(PowerSGDOptions().use_error_feedback(false).start_powerSGD_iter(1)),
               std::invalid_argument);  // warm start is still on
  EXPECT_NO_THROW(ddp::hooks::powersgd(
      PowerSGDOptions().use_error_feedback(false).warm_start(false).start_powerSGD_iter(1)));
  EXPECT_THROW(ddp::hooks::powersgd(PowerSGDOptions().matrix_approximation_rank(0)), std::invalid_argument);
  EXPECT_THROW(ddp::hooks::powersgd(PowerSGDOptions().random_seed(-1)), std::invalid_argument);
  // A state from another model is refused when it meets the parameters, naming one.
  ddp::hooks::PowerSGDState state{PowerSGDOptions()};
  auto snapshot = state.state_dict();
  snapshot.erase("rng");
  EXPECT_THROW(state.load_state_dict(snapshot), std::invalid_argument);
}

// PyTorch's hook would compute with a NaN or negative rate or epsilon (no gradient compressed, or
// a division by a norm minus something); both are refused here, naming the option and the value.
TEST(PowerSGD, RefusesNaNOrNegativeRateAndEpsilon) {
  using ddp::hooks::PowerSGDOptions;
  const auto error_for = [](PowerSGDOptions options) {
    try {
      ddp::hooks::powersgd(options);
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(error_for(PowerSGDOptions().min_compression_rate(std::nan(""))),
            "PowerSGD: min_compression_rate must be a finite number >= 0 (compress a gradient when it shrinks by "
            "more than this factor; PyTorch's default is 2), got nan");
  EXPECT_EQ(error_for(PowerSGDOptions().min_compression_rate(-1)),
            "PowerSGD: min_compression_rate must be a finite number >= 0 (compress a gradient when it shrinks by "
            "more than this factor; PyTorch's default is 2), got -1");
  EXPECT_EQ(error_for(PowerSGDOptions().orthogonalization_epsilon(std::nan(""))),
            "PowerSGD: orthogonalization_epsilon must be a finite number >= 0 (added to each norm before dividing "
            "by it; PyTorch's default is 0), got nan");
  EXPECT_EQ(error_for(PowerSGDOptions().orthogonalization_epsilon(-1e-8)),
            "PowerSGD: orthogonalization_epsilon must be a finite number >= 0 (added to each norm before dividing "
            "by it; PyTorch's default is 0), got -1e-08");
  EXPECT_EQ(error_for(PowerSGDOptions().min_compression_rate(0).orthogonalization_epsilon(1e-8)), "(accepted)");
}

}  // namespace
