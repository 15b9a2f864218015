// hosts_bench: one rank of a job whose ranks run on several hosts (over_hosts.sh starts it on
// simulated hosts, with torchrun's variables). It trains the same model (ddp_bench's MLP) under DDP
// on two groups of the same ranks, in interleaved rounds so load changes hit both alike:
//   flat          Gloo alone (a group made with NewGroupOptions().shared_memory(false))
//   hierarchical  the world group: shared memory inside each host, Gloo across them, where the
//                 hosts run the same number of ranks, two or more (otherwise Gloo as well)
// Rank 0 prints each group's transport, the median step time of each and their ratio:
//   hosts_bench: mlp_b4 (8407050 parameters), 25 MiB buckets, 4 ranks, 10 rounds x 3 steps per group
//   flat          gloo                                     median <ms> (p10 <ms>, p90 <ms>)
//   hierarchical  gloo+shm hierarchical (2 hosts x 2)      median <ms> (p10 <ms>, p90 <ms>)
//   hierarchical/flat = <ratio>
// With --phases, then the parts of a step timed apart (time_phases): the computation alone, and one
// allreduce of the gradients' size over each group. With --halves, instead of training:
// reduce_scatter_tensor and all_gather_into_tensor of 4 KB, 4 MB and 33.6 MB (float32, the whole
// tensor: the reduce-scatter's input, the all-gather's output) over each group (time_halves).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ddp/ddp.h>

#include "models.h"
#include "stats.h"

namespace bench {
namespace {

struct Settings {
  ModelConfig config;  // mlp, batch 4, width 1024, 8 layers: mlp_b4 (33.6 MB of gradients)
  double cap_mb = 25;
  int warmup = 2;  // untimed steps per group (buckets are rebuilt after the first)
  int steps = 3;   // timed steps per group per round
  int rounds = 10;
  int timeout_s = 600;
  bool phases = false;  // also time a step's parts apart: the computation alone, the allreduce alone
  bool halves = false;  // time reduce-scatter and all-gather instead of training
};

void usage() {
  std::cout << "usage: hosts_bench [--batch N] [--mlp-width N] [--mlp-layers N] [--cap MB] [--warmup N] [--steps N]\n"
               "                   [--rounds N] [--timeout SECONDS] [--phases] [--halves]\n"
               "  one rank; run it through benchmarks/over_hosts.sh, which starts every rank on its host\n";
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      usage();
      std::exit(0);
    }
    if (flag == "--phases" || flag == "--halves") {
      (flag == "--phases" ? s.phases : s.halves) = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("hosts_bench: " + flag + " needs a value (--help lists the flags)");
    const std::string value = argv[++i];
    if (flag == "--batch") s.config.batch = std::stoi(value);
    else if (flag == "--mlp-width") s.config.mlp_width = std::stoi(value);
    else if (flag == "--mlp-layers") s.config.mlp_layers = std::stoi(value);
    else if (flag == "--cap") s.cap_mb = std::stod(value);
    else if (flag == "--warmup") s.warmup = std::stoi(value);
    else if (flag == "--steps") s.steps = std::stoi(value);
    else if (flag == "--rounds") s.rounds = std::stoi(value);
    else if (flag == "--timeout") s.timeout_s = std::stoi(value);
    else throw std::invalid_argument("hosts_bench: unknown flag " + flag + " (--help lists the flags)");
  }
  return s;
}

// One group's DDP model, optimizer and batch; step() is one training step.
struct Trainer {
  std::string label;
  ddp::ProcessGroupPtr group;
  std::shared_ptr<ddp::DistributedDataParallel<BenchNet>> model;
  std::shared_ptr<torch::optim::SGD> optimizer;
  Batch batch;
  std::vector<double> step_ms;

  Trainer(std::string name, ddp::ProcessGroupPtr on, const Settings& s)
      : label(std::move(name)), group(std::move(on)), batch(make_batch(s.config, ddp::get_rank(group))) {
    model = std::make_shared<ddp::DistributedDataParallel<BenchNet>>(make_model(s.config), group,
                                                                     ddp::DDPOptions().bucket_cap_mb(s.cap_mb));
    optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-3));
  }
  void step() {
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(batch.x), batch.y).backward();
    optimizer->step();
  }
  void timed_steps(int steps) {
    for (int i = 0; i < steps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      step();
      step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
  }
};

// The parts of a step apart, every rank at once as in training: the computation (the same model and
// batch, not wrapped: forward, backward, SGD), and one allreduce of all the gradients' elements as
// one tensor over each group. Rank 0 prints the medians.
void time_phases(const Settings& s, const ddp::ProcessGroupPtr& world, const std::vector<Trainer>& trainers) {
  auto model = make_model(s.config);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-3));
  const Batch batch = make_batch(s.config, ddp::get_rank());
  at::Tensor gradients = torch::ones({parameter_count(s.config)});
  std::vector<double> compute_ms;
  std::vector<std::vector<double>> allreduce_ms(trainers.size());
  const auto time = [](auto&& body) {
    const auto start = std::chrono::steady_clock::now();
    body();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  for (int round = 0; round < s.rounds; ++round) {
    ddp::barrier(world);
    for (int i = 0; i < s.steps; ++i) {
      compute_ms.push_back(time([&] {
        optimizer.zero_grad();
        torch::nn::functional::cross_entropy(model->forward(batch.x), batch.y).backward();
        optimizer.step();
      }));
    }
    for (std::size_t g = 0; g < trainers.size(); ++g) {
      ddp::barrier(world);
      for (int i = 0; i < s.steps; ++i) {
        allreduce_ms[g].push_back(time([&] { ddp::all_reduce(gradients, c10d::ReduceOp::SUM, trainers[g].group); }));
      }
    }
  }
  if (ddp::get_rank() != 0) return;
  std::printf("phases: computation alone (every rank at once)  median %.1f ms (p10 %.1f, p90 %.1f)\n",
              median(compute_ms), quantile(compute_ms, 0.1), quantile(compute_ms, 0.9));
  for (std::size_t g = 0; g < trainers.size(); ++g) {
    std::printf("phases: allreduce of %lld floats, %-13s median %.1f ms (p10 %.1f, p90 %.1f)\n",
                static_cast<long long>(gradients.numel()), trainers[g].label.c_str(), median(allreduce_ms[g]),
                quantile(allreduce_ms[g], 0.1), quantile(allreduce_ms[g], 0.9));
  }
  std::fflush(stdout);
}

// reduce_scatter_tensor and all_gather_into_tensor over each group, in interleaved rounds of
// `steps` each, every rank at once; rank 0 prints the medians and hierarchical/flat.
void time_halves(const Settings& s, const ddp::ProcessGroupPtr& world, const ddp::ProcessGroupPtr& flat) {
  const std::vector<std::pair<std::string, ddp::ProcessGroupPtr>> groups{{"flat", flat}, {"hierarchical", world}};
  const int size = ddp::get_world_size();
  for (const int64_t bytes : {int64_t{4096}, int64_t{4000000}, int64_t{33600000}}) {
    const int64_t per_rank = bytes / 4 / size;
    auto whole = torch::ones({per_rank * size}), piece = torch::ones({per_rank});
    std::vector<std::vector<double>> rs_ms(2), ag_ms(2);
    const auto time = [](auto&& body) {
      const auto start = std::chrono::steady_clock::now();
      body();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    for (int round = -1; round < s.rounds; ++round) {  // round -1: warm-up, untimed
      for (std::size_t g = 0; g < groups.size(); ++g) {
        ddp::barrier(world);
        for (int i = 0; i < s.steps; ++i) {
          const double rs = time([&] { ddp::reduce_scatter_tensor(piece, whole, c10d::ReduceOp::SUM, groups[g].second); });
          const double ag = time([&] { ddp::all_gather_into_tensor(whole, piece, groups[g].second); });
          if (round >= 0) rs_ms[g].push_back(rs), ag_ms[g].push_back(ag);
        }
      }
    }
    if (ddp::get_rank() != 0) continue;
    for (const auto& [name, ms] : {std::make_pair("reduce_scatter_tensor", rs_ms), std::make_pair("all_gather_into_tensor", ag_ms)}) {
      std::printf("halves: %-22s %6.3f MB  flat median %.2f ms (p10 %.2f, p90 %.2f)  hierarchical median %.2f ms "
                  "(p10 %.2f, p90 %.2f)  hierarchical/flat = %.3f\n", name, bytes / 1e6, median(ms[0]),
                  quantile(ms[0], 0.1), quantile(ms[0], 0.9), median(ms[1]), quantile(ms[1], 0.1), quantile(ms[1], 0.9),
                  median(ms[1]) / median(ms[0]));
    }
    std::fflush(stdout);
  }
}

int run(const Settings& s) {
  ddp::InitOptions init{"gloo", "env://"};
  init.timeout = std::chrono::seconds(s.timeout_s);
  auto world = ddp::init_process_group(init);
  auto flat_group = ddp::new_group(ddp::NewGroupOptions().shared_memory(false));
  if (s.halves) {
    if (ddp::get_rank() == 0) {
      std::printf("hosts_bench: halves, %d ranks, %s against %s, %d rounds x %d per group\n", ddp::get_world_size(),
                  ddp::transport(world).c_str(), ddp::transport(flat_group).c_str(), s.rounds, s.steps);
    }
    time_halves(s, world, flat_group);
    ddp::barrier(world);
    ddp::destroy_process_group();
    return 0;
  }
  std::vector<Trainer> trainers;
  trainers.emplace_back("flat", flat_group, s);
  trainers.emplace_back("hierarchical", world, s);

  for (Trainer& trainer : trainers) {
    for (int i = 0; i < s.warmup; ++i) trainer.step();
  }
  // Interleaved: every round runs each group's steps once, all ranks starting together.
  for (int round = 0; round < s.rounds; ++round) {
    for (Trainer& trainer : trainers) {
      ddp::barrier(world);
      trainer.timed_steps(s.steps);
    }
  }

  if (ddp::get_rank() == 0) {
    std::printf("hosts_bench: %s (%lld parameters), %g MiB buckets, %d ranks, %d rounds x %d steps per group\n",
                s.config.label().c_str(), static_cast<long long>(parameter_count(s.config)), s.cap_mb,
                ddp::get_world_size(), s.rounds, s.steps);
    for (const Trainer& trainer : trainers) {
      std::printf("%-13s %-40s median %.1f ms (p10 %.1f, p90 %.1f)\n", trainer.label.c_str(),
                  ddp::transport(trainer.group).c_str(), median(trainer.step_ms), quantile(trainer.step_ms, 0.1),
                  quantile(trainer.step_ms, 0.9));
    }
    std::printf("hierarchical/flat = %.3f\n", median(trainers[1].step_ms) / median(trainers[0].step_ms));
    std::fflush(stdout);
  }
  if (s.phases) time_phases(s, world, trainers);
  ddp::barrier(world);  // nobody tears down the store while a peer still needs it
  trainers.clear();
  ddp::destroy_process_group();
  return 0;
}

}  // namespace
}  // namespace bench

int main(int argc, char** argv) {
  try {
    return bench::run(bench::parse(argc, argv));
  } catch (const std::exception& error) {
    std::cerr << "hosts_bench: error: " << error.what() << std::endl;
    return 1;
  }
}
