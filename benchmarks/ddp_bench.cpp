// ddp_bench: what does gradient synchronization cost in a C++ training step, and how does
// ddp::DistributedDataParallel ("ours") compare with no communication ("local"), a hand-rolled
// allreduce after backward ("naive") and PyTorch's own c10d::Reducer ("reducer") at the same
// bucket sizes? README.md explains the variants, the output and the measured numbers.
//
//   ddp_bench                 # full run: mlp batch 4, mlp batch 64, resnet batch 32 at 2 ranks
//   ddp_bench --quick         # seconds; what CTest runs
//
// The parent fork+execs itself once per rank for each job (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, and DDP_BENCH_JOB saying what to run); ranks meet through env:// over Gloo.
// Timing job: every variant of one model is built in one process and run in interleaved rounds,
// so machine noise hits all variants alike. Memory job: one variant alone in fresh processes,
// so its peak RSS is its own. Rank 0 writes JSON; the parent merges it (report.cpp).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <ddp/ddp.h>

#include "models.h"
#include "options.h"
#include "procutil.h"
#include "report.h"
#include "stats.h"
#include "variants.h"

namespace bench {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

void usage() {
  std::cout <<
      "usage: ddp_bench [--quick] [--model mlp|resnet] [--batch N] [--configs mlp:4,mlp:64:3,resnet:32]\n"
      "                 [--world 2] [--caps 0,1,5,25,100] [--view-caps 25] [--warmup N] [--steps N]\n"
      "                 [--rounds N] [--memory-steps N] [--no-memory] [--no-features] [--no-hooks] [--mlp-width N]\n"
      "                 [--mlp-layers N]\n"
      "                 [--timeout SECONDS] [--out DIR] [--only fsdp_adam,ours+adam,...]\n"
      "  --quick      a small MLP, few steps, worlds 1 and 2 (what CTest runs; under a minute)\n"
      "  --model      one model at its default batch (mlp 4, resnet 32) instead of the three configs\n"
      "  --configs    model:batch[:rounds] list (rounds overrides --rounds for that config)\n"
      "  --caps       bucket_cap_mb values for reducer and ours; 0 = one bucket per parameter\n"
      "  --view-caps  bucket sizes for ours_view (gradient_as_bucket_view) and the memory pass\n"
      "  --rounds     interleaved rounds; each runs --steps timed steps of every variant\n"
      "  --no-features  without ours_join, ours_detail, ours_auto, ours_optimizer, ours_syncbn (what Join, DETAIL, autotuning,\n"
      "               SyncBatchNorm cost)\n"
      "  --only       these variants alone (kind names, as the report prints them), no allreduce section\n"
      "  --no-hooks   without the communication hook variants (ours+fp16, ours+bf16, ours+powersgd1/4, reducer+fp16)\n";
}

template <typename T>
std::vector<T> parse_list(const std::string& text) {
  std::vector<T> values;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) values.push_back(static_cast<T>(std::stod(item)));
  return values;
}

ModelConfig model_config(const std::string& model, int batch, int rounds = 0) {
  ModelConfig config;
  config.model = model;
  config.batch = batch > 0 ? batch : (model == "resnet" ? 32 : 4);
  config.rounds = rounds;
  return config;
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& arg : args) {
    if (arg == "--quick") {  // first, so that later flags can still override it
      o.quick = true;
      o.worlds = {1, 2};
      o.configs = {model_config("mlp", 4)};
      o.configs[0].mlp_width = 256;
      o.configs[0].mlp_layers = 4;
      o.warmup = 2;
      o.steps = 2;
      o.rounds = 2;
      o.memory_steps = 2;
      o.timeout_s = 60;
      o.out = "ddp_bench_quick";
    }
  }
  std::string model;
  int batch = 0, width = 0, layers = 0;
  bool out_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument(arg + " needs a value");
      return args[++i];
    };
    if (arg == "--quick") continue;
    else if (arg == "--model") model = value();
    else if (arg == "--batch") batch = std::stoi(value());
    else if (arg == "--configs") {
      o.configs.clear();
      std::stringstream in(value());
      for (std::string item; std::getline(in, item, ',');) {  // model[:batch[:rounds]]
        std::vector<std::string> parts;
        std::stringstream fields(item);
        for (std::string part; std::getline(fields, part, ':');) parts.push_back(part);
        o.configs.push_back(model_config(parts.at(0), parts.size() > 1 ? std::stoi(parts[1]) : 0,
                                         parts.size() > 2 ? std::stoi(parts[2]) : 0));
      }
    }
    else if (arg == "--world") o.worlds = parse_list<int>(value());
    else if (arg == "--caps") o.caps = parse_list<double>(value());
    else if (arg == "--view-caps") o.view_caps = parse_list<double>(value());
    else if (arg == "--warmup") o.warmup = std::stoi(value());
    else if (arg == "--steps") o.steps = std::stoi(value());
    else if (arg == "--rounds") o.rounds = std::stoi(value());
    else if (arg == "--memory-steps") o.memory_steps = std::stoi(value());
    else if (arg == "--no-memory") o.memory = false;
    else if (arg == "--only") {
      std::stringstream names(value());
      for (std::string name; std::getline(names, name, ',');) o.only.push_back(name);
    }
    else if (arg == "--no-features") o.features = false;
    else if (arg == "--no-hooks") o.hooks = false;
    else if (arg == "--mlp-width") width = std::stoi(value());
    else if (arg == "--mlp-layers") layers = std::stoi(value());
    else if (arg == "--timeout") o.timeout_s = std::stoi(value());
    else if (arg == "--out") {
      o.out = value();
      out_given = true;
    }
    else if (arg == "--help" || arg == "-h") { usage(); std::exit(0); }
    else throw std::invalid_argument("unknown argument " + arg + " (see --help)");
  }
  if (!model.empty()) o.configs = {model_config(model, batch)};
  else if (batch > 0) for (auto& config : o.configs) config.batch = batch;
  for (auto& config : o.configs) {
    if (width > 0) config.mlp_width = width;
    if (layers > 0) config.mlp_layers = layers;
  }
  // Without --out, the files go beside the executable (in the build tree), not into whatever
  // folder it was started from (often the source tree).
  if (!out_given) o.out = (fs::read_symlink("/proc/self/exe").parent_path() / o.out).string();
  return o;
}

// ------------------------------------------------------------------------------------------------
// Rank jobs
// ------------------------------------------------------------------------------------------------

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// All variants of one model, interleaved: per round every variant runs `steps` timed steps, in an
// order rotated each round, with a barrier before each so the ranks start it together.
void timing_job(const Options& o, const ModelConfig& config, const Groups& groups) {
  const ddp::ProcessGroupPtr& group = groups.ours;
  const int rank = group->getRank();
  const int world = group->getSize();
  const Batch batch = make_batch(config, rank);
  std::vector<Variant> variants;
  for (const auto& spec : all_variants(o.caps, o.view_caps, o.features, o.hooks, config.model == "resnet")) {
    if (!selected(o, spec.kind_name())) continue;
    variants.push_back(make_variant(spec, make_model(config, uses_sync_batchnorm(spec)), batch, groups));
  }
  for (auto& variant : variants) {
    variant.run_block([&] {
      for (int i = 0; i < o.warmup; ++i) variant.step();  // ours and reducer rebuild buckets here
      // ours_auto: until the autotuner has chosen (about 5 steps per distinct layout). The same
      // count on every rank: they agree on the choice in the same step.
      for (int i = 0; i < 200 && !variant.settled(); ++i) variant.step();
    });
  }
  std::vector<std::vector<double>> times(variants.size()), round_medians(variants.size());
  const int rounds = config.rounds > 0 ? config.rounds : o.rounds;
  const auto started = std::chrono::steady_clock::now();
  for (int round = 0; round < rounds; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + static_cast<size_t>(round)) % variants.size();
      ddp::barrier(group);
      std::vector<double> steps;
      variants[v].run_block([&] {
        for (int s = 0; s < o.steps; ++s) {
          const auto start = std::chrono::steady_clock::now();
          variants[v].step();
          steps.push_back(ms_since(start));
        }
      });
      times[v].insert(times[v].end(), steps.begin(), steps.end());
      round_medians[v].push_back(median(steps));
    }
    if (rank == 0) {
      std::cerr << config.label() << " world " << world << ": round " << round + 1 << "/" << rounds << ", "
                << static_cast<int>(ms_since(started) / 1000) << " s\n";
    }
  }
  ddp::barrier(group);
  if (rank != 0) return;
  json out = {{"model", config.model}, {"batch", config.batch}, {"label", config.label()}, {"world", world},
              {"parameters", parameter_count(config)}, {"warmup", o.warmup}, {"steps", o.steps},
              {"rounds", rounds}, {"variants", json::array()}};
  for (size_t v = 0; v < variants.size(); ++v) {
    const VariantSpec& spec = variants[v].spec;
    out["variants"].push_back({{"id", spec.id()}, {"kind", spec.kind_name()},
                               {"bucket_cap_mb", spec.has_buckets() ? json(spec.bucket_cap_mb) : json()},
                               {"collectives", variants[v].collectives()}, {"note", variants[v].note()},
                               {"times_ms", times[v]},
                               {"round_median_ms", round_medians[v]}});
  }
  std::ofstream(fs::path(o.out) / timing_file(config, world)) << out.dump(1) << "\n";
}

// A line of /proc/self/status in MiB, e.g. VmHWM (peak resident set) or VmRSS.
double proc_status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;  // kB
  }
  return std::nan("");
}

// This process's proportional set size in MiB (/proc/self/smaps_rollup): each page counted once
// per process that maps it, divided among them. Shared memory (DDP's buckets) is mapped
// by every rank and touched across ranks, so RSS counts the pages a rank reads and writes in its
// peers' memory as its own too; PSS sums over the ranks to what the machine really holds.
double proportional_set_mib() {
  std::ifstream in("/proc/self/smaps_rollup");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Pss:", 0) == 0) return std::stod(line.substr(4)) / 1024.0;  // kB
  }
  return std::nan("");
}

// The memory pass's measured steps, in a function of their own so that a profiler can count just
// them: valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*run_steps*' (README).
__attribute__((noinline)) void run_steps(Variant& variant, int steps) {
  for (int i = 0; i < steps; ++i) variant.step();
}

// Makes VmHWM (the peak resident set) equal to the current RSS again (Linux: clear_refs 5).
bool reset_peak_rss() { return static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5"); }

// One variant alone, in fresh ranks. Baseline: the RSS once model and data exist. Then the
// variant is built and warmed up (construction and the one bucket rebuild happen here); the peak
// so far is "setup". Then the peak is reset and a few more steps run: that peak is "steady", what
// the variant holds while it trains. Both are reported above the baseline. The parent starts
// these ranks with a fixed malloc mmap threshold, so freed tensors go back to the kernel and RSS
// follows what is really alive.
void memory_job(const Options& o, const ModelConfig& config, const VariantSpec& spec, const Groups& groups) {
  const ddp::ProcessGroupPtr& group = groups.ours;
  auto model = make_model(config, uses_sync_batchnorm(spec));
  const Batch batch = make_batch(config, group->getRank());
  ddp::barrier(group);
  if (!reset_peak_rss()) throw std::runtime_error("cannot reset the peak RSS (/proc/self/clear_refs)");
  int64_t largest_block_bytes = 0;  // fully_shard's promise: 16/W per parameter plus one block (unsharded)
  for (const auto& block : model->shard_blocks()) {
    int64_t bytes = 0;
    for (const auto& param : block->parameters()) bytes += param.numel() * 4;
    largest_block_bytes = std::max(largest_block_bytes, bytes);
  }
  // fully_shard's chunks are whole rows, ceil(rows / W) each: the parameters as sharded.
  int64_t padded_parameters = 0;
  const int64_t world = group->getSize();
  for (const auto& param : model->parameters()) {
    const int64_t rows = param.dim() == 0 ? 1 : param.size(0);
    padded_parameters += (rows + world - 1) / world * world * (param.numel() / std::max<int64_t>(rows, 1));
  }
  const double baseline = proc_status_mib("VmRSS");
  const double baseline_pss = proportional_set_mib();
  Variant variant = make_variant(spec, model, batch, groups);
  for (int i = 0; i < o.warmup; ++i) variant.step();
  const double setup_peak = proc_status_mib("VmHWM");
  reset_peak_rss();
  run_steps(variant, o.memory_steps);
  const double steady_peak = proc_status_mib("VmHWM");
  ddp::barrier(group);  // every rank has touched what it touches in a step: PSS is divided alike
  const double steady_pss = proportional_set_mib();
  // Each rank's optimizer state (ZeRO: its shard's), gathered for rank 0's report.
  const auto state_bytes = ddp::all_gather(torch::tensor({variant.optimizer_state_bytes()}, torch::kLong), group);
  const auto library_bytes = variant.library_bytes();
  ddp::barrier(group);
  if (group->getRank() != 0) return;
  std::vector<int64_t> state_per_rank;
  for (const auto& bytes : state_bytes) state_per_rank.push_back(bytes.item<int64_t>());
  int64_t largest_parameter_bytes = 0;  // ZeRO's promise: a shard within 1/W plus one parameter's state
  for (const auto& param : model->parameters()) {
    largest_parameter_bytes = std::max<int64_t>(largest_parameter_bytes, static_cast<int64_t>(param.nbytes()));
  }
  json out = {{"id", spec.id()}, {"baseline_rss_mib", baseline},
              {"steady_peak_delta_mib", steady_peak - baseline},
              {"setup_peak_delta_mib", std::max(setup_peak, steady_peak) - baseline},
              {"steady_pss_delta_mib", steady_pss - baseline_pss},
              {"optimizer_state_bytes_per_rank", state_per_rank},
              {"largest_parameter_bytes", largest_parameter_bytes}};
  for (const auto& [name, bytes] : library_bytes) out["library_bytes"][name] = bytes;
  out["largest_block_bytes"] = largest_block_bytes;
  out["parameters"] = parameter_count(config);
  out["padded_parameters"] = padded_parameters;
  std::ofstream(fs::path(o.out) / memory_file(config, group->getSize(), spec)) << out.dump(1) << "\n";
}

// The shared-memory core's own allreduce (ddp_shm_bench, built beside the tests: no c10d, no
// thread, no tensor) at `sizes` world's ranks, run by rank 0 while the others wait: the floor under
// the public path, printed beside it. ddp_shm_bench's sizes are this section's, in the same order
// (its largest is 33.6 MB, 8.4 M floats, against 32 MiB here). Empty when it is not built.
std::vector<double> core_allreduce_ms(int world, size_t sizes, bool quick) {
  const fs::path binary = fs::read_symlink("/proc/self/exe").parent_path() / ".." / "tests" / "shm" / "ddp_shm_bench";
  if (!fs::exists(binary)) return {};
  const std::string command = binary.string() + " --ranks " + std::to_string(world) +
                              (quick ? " --runs-scale 0.05" : " --runs-scale 0.5") + " 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return {};
  const char* labels[] = {"4 KB ", "256 KB ", "4 MB ", "33.6 MB "};
  std::vector<double> ms;
  char line[512];
  while (std::fgets(line, sizeof line, pipe) != nullptr && ms.size() < sizes) {
    const std::string text = line;
    double value = 0;
    if (text.rfind(labels[ms.size()], 0) == 0 && std::sscanf(line + 9, "%lf", &value) == 1) ms.push_back(value);
  }
  ::pclose(pipe);
  if (ms.size() != sizes) return {};
  return ms;
}

// ddp::all_reduce (the public path: c10d's allreduce and wait_collective) of float32 tensors from
// 4 KB to 33.6 MB (mlp_b4's gradients), over the default group (shared memory when the ranks share
// this host) and over Gloo alone, interleaved: per round each size runs `reps` times on each group.
// Rank 0 prints the medians beside the shared-memory core's and writes allreduce_w<W>.json.
void allreduce_job(const Options& o, const Groups& groups) {
  const int rank = groups.ours->getRank(), world = groups.ours->getSize();
  const std::vector<int64_t> bytes = o.quick ? std::vector<int64_t>{4096, 262144}
                                             : std::vector<int64_t>{4096, 262144, 4194304, 33554432};
  const int rounds = o.quick ? 2 : 10, reps = o.quick ? 5 : 10;
  std::vector<std::vector<double>> shm(bytes.size()), gloo(bytes.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t b = 0; b < bytes.size(); ++b) {
      at::Tensor tensor = torch::ones({bytes[b] / 4});
      for (auto [group, times] : {std::pair{groups.ours, &shm[b]}, std::pair{groups.gloo, &gloo[b]}}) {
        ddp::barrier(groups.gloo);
        ddp::all_reduce(tensor, c10d::ReduceOp::SUM, group);  // warm (first use of a size)
        for (int r = 0; r < reps; ++r) {
          const auto start = std::chrono::steady_clock::now();
          ddp::all_reduce(tensor, c10d::ReduceOp::SUM, group);
          times->push_back(ms_since(start));
        }
      }
    }
  }
  if (rank != 0) return;
  const std::vector<double> core = core_allreduce_ms(world, bytes.size(), o.quick);
  json out = {{"world", world}, {"transport", ddp::transport(groups.ours)}, {"sizes", json::array()}};
  std::printf("allreduce of float32 at world %d: %s vs gloo (median of %d); core: the shared-memory core alone "
              "(ddp_shm_bench)\n", world, ddp::transport(groups.ours).c_str(), rounds * reps);
  std::printf("%12s %12s %12s %12s %8s\n", "bytes", "default ms", "core ms", "gloo ms", "ratio");
  for (size_t b = 0; b < bytes.size(); ++b) {
    const double a = median(shm[b]), g = median(gloo[b]);
    char core_ms[32] = "-";
    if (!core.empty()) std::snprintf(core_ms, sizeof core_ms, "%.4f", core[b]);
    std::printf("%12lld %12.4f %12s %12.3f %8.3f\n", static_cast<long long>(bytes[b]), a, core_ms, g, a / g);
    out["sizes"].push_back({{"bytes", bytes[b]}, {"default_ms", a}, {"gloo_ms", g}, {"ratio", a / g},
                            {"default_times_ms", shm[b]}, {"gloo_times_ms", gloo[b]}});
    if (!core.empty()) out["sizes"].back()["core_ms"] = core[b];
  }
  const std::string stem = (fs::path(o.out) / ("allreduce_w" + std::to_string(world))).string();
  std::ofstream(stem + ".json") << out.dump(1) << "\n";
  {
    // Columns: bytes, then median, 25th and 75th percentile for the default group and for Gloo.
    std::ofstream dat(stem + ".dat");
    for (size_t b = 0; b < bytes.size(); ++b) {
      dat << bytes[b];
      for (const auto* times : {&shm[b], &gloo[b]}) {
        dat << " " << median(*times) << " " << quantile(*times, 0.25) << " " << quantile(*times, 0.75);
      }
      dat << "\n";
    }
  }
  const std::string title = "world " + std::to_string(world) + ", " + ddp::transport(groups.ours) + " vs gloo";
  if (!plot("plot_allreduce.gp", stem + ".dat", stem + ".png", title)) {
    std::cerr << "gnuplot failed for " << stem << ".dat\n";
  }
}

// torch.distributed's other collectives through the public path, each over the default group and
// over Gloo alone, interleaved as above: reduce_scatter_tensor, all_gather_into_tensor and
// all_to_all_single of `bytes` (the larger side: the input scattered, the output gathered), and a
// ring of send/recv (each rank sends `bytes` to the next). Rank 0 prints the medians and their
// ratios and writes collectives_w<W>.json.
void collectives_job(const Options& o, const Groups& groups) {
  const int rank = groups.ours->getRank(), world = groups.ours->getSize();
  const std::vector<int64_t> bytes = o.quick ? std::vector<int64_t>{4096, 262144}
                                             : std::vector<int64_t>{4096, 262144, 4194304, 33554432};
  const int rounds = o.quick ? 2 : 5, reps = o.quick ? 3 : 6;
  // Each entry makes the timed call for a group and a size, its tensors allocated (and touched)
  // outside the timing.
  using Call = std::function<void()>;
  using Make = std::function<Call(const ddp::ProcessGroupPtr&, int64_t)>;
  const std::vector<std::pair<std::string, Make>> collectives = {
      {"reduce_scatter_tensor",
       [world](const ddp::ProcessGroupPtr& group, int64_t n) -> Call {
         auto input = torch::ones({n}), output = torch::zeros({n / world});
         return [=]() mutable { ddp::reduce_scatter_tensor(output, input, c10d::ReduceOp::SUM, group); };
       }},
      {"all_gather_into_tensor",
       [world](const ddp::ProcessGroupPtr& group, int64_t n) -> Call {
         auto input = torch::ones({n / world}), output = torch::zeros({n});
         return [=]() mutable { ddp::all_gather_into_tensor(output, input, group); };
       }},
      {"all_to_all_single",
       [](const ddp::ProcessGroupPtr& group, int64_t n) -> Call {
         auto input = torch::ones({n}), output = torch::zeros({n});
         return [=]() mutable { ddp::all_to_all_single(output, input, {}, {}, group); };
       }},
      {"send/recv ring",
       [rank, world](const ddp::ProcessGroupPtr& group, int64_t n) -> Call {
         auto out = torch::ones({n}), in = torch::zeros({n});
         return [=]() mutable {
           auto sent = ddp::isend(out, (rank + 1) % world, group);
           ddp::recv(in, (rank + world - 1) % world, group);
           ddp::wait_collective(sent, "the ring's send");
         };
       }}};
  // times[c][b]: {default group, gloo}
  std::vector<std::vector<std::array<std::vector<double>, 2>>> times(
      collectives.size(), std::vector<std::array<std::vector<double>, 2>>(bytes.size()));
  for (int round = 0; round < rounds; ++round) {
    for (size_t c = 0; c < collectives.size(); ++c) {
      for (size_t b = 0; b < bytes.size(); ++b) {
        const int64_t n = bytes[b] / 4 / world * world;  // whole chunks per rank
        for (int g = 0; g < 2; ++g) {
          const ddp::ProcessGroupPtr& group = g == 0 ? groups.ours : groups.gloo;
          Call call = collectives[c].second(group, n);
          ddp::barrier(groups.gloo);
          call();  // warm
          for (int r = 0; r < reps; ++r) {
            const auto start = std::chrono::steady_clock::now();
            call();
            times[c][b][g].push_back(ms_since(start));
          }
        }
      }
    }
  }
  if (rank != 0) return;
  json out = {{"world", world}, {"transport", ddp::transport(groups.ours)}, {"collectives", json::array()}};
  std::printf("collectives of float32 at world %d: %s vs gloo (median of %d)\n", world,
              ddp::transport(groups.ours).c_str(), rounds * reps);
  std::printf("%-24s %12s %12s %12s %8s\n", "collective", "bytes", "default ms", "gloo ms", "ratio");
  for (size_t c = 0; c < collectives.size(); ++c) {
    for (size_t b = 0; b < bytes.size(); ++b) {
      const double a = median(times[c][b][0]), g = median(times[c][b][1]);
      std::printf("%-24s %12lld %12.3f %12.3f %8.3f\n", collectives[c].first.c_str(), static_cast<long long>(bytes[b]),
                  a, g, a / g);
      out["collectives"].push_back({{"collective", collectives[c].first}, {"bytes", bytes[b]}, {"default_ms", a},
                                    {"gloo_ms", g}, {"ratio", a / g}});
    }
  }
  const std::string stem = (fs::path(o.out) / ("collectives_w" + std::to_string(world))).string();
  std::ofstream(stem + ".json") << out.dump(1) << "\n";
  {
    // A block per collective (plot_collectives.gp): its name, then bytes, default ms, gloo ms.
    std::ofstream dat(stem + ".dat");
    for (size_t c = 0; c < collectives.size(); ++c) {
      dat << (c ? "\n\n" : "") << collectives[c].first << " default gloo\n";
      for (size_t b = 0; b < bytes.size(); ++b) {
        dat << bytes[b] << " " << median(times[c][b][0]) << " " << median(times[c][b][1]) << "\n";
      }
    }
  }
  const std::string title = "world " + std::to_string(world) + ", " + ddp::transport(groups.ours);
  if (!plot("plot_collectives.gp", stem + ".dat", stem + ".png", title)) {
    std::cerr << "gnuplot failed for " << stem << ".dat\n";
  }
}

int run_rank(const Options& o) {
  torch::set_num_threads(1);
  ddp::InitOptions init{"gloo", "env://"};
  init.timeout = std::chrono::seconds(o.timeout_s);
  Groups groups;
  groups.ours = ddp::init_process_group(init);
  groups.gloo = ddp::new_group(ddp::NewGroupOptions().shared_memory(false));
  fs::create_directories(o.out);
  const char* job = std::getenv("DDP_BENCH_JOB");
  if (job == nullptr) {  // started by ddprun or torchrun: time every config
    for (const auto& config : o.configs) timing_job(o, config, groups);
    return 0;
  }
  const std::string what = job;
  if (what == "allreduce") {
    allreduce_job(o, groups);
    collectives_job(o, groups);
    return 0;
  }
  const ModelConfig& config = o.configs.at(std::stoul(std::getenv("DDP_BENCH_CONFIG")));
  if (what == "time") timing_job(o, config, groups);
  else memory_job(o, config, parse_variant(what.substr(what.find(':') + 1)), groups);
  return 0;
}

// ------------------------------------------------------------------------------------------------
// The parent: spawn ranks per job
// ------------------------------------------------------------------------------------------------

// Forks+execs this program once per rank; a rank that fails or a run past the timeout ends all.
bool spawn_world(int world, const std::string& job, size_t config_index, const Options& o, char** argv) {
  const std::string port = std::to_string(ddp::procutil::free_port());
  std::vector<std::string> args;
  for (char** arg = argv; *arg != nullptr; ++arg) args.push_back(*arg);  // the ranks get our arguments
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    ddp::procutil::SpawnOptions spawn;
    spawn.env = {{"RANK", std::to_string(rank)}, {"LOCAL_RANK", std::to_string(rank)},
                 {"WORLD_SIZE", std::to_string(world)}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                 {"OMP_NUM_THREADS", "1"},  // one compute thread per rank
                 {"DDP_BENCH_JOB", job}, {"DDP_BENCH_CONFIG", std::to_string(config_index)}};
    // glibc otherwise raises its mmap threshold as big blocks are freed and keeps freed memory
    // resident, so the memory pass would see the allocator's history, not the live tensors.
    if (job.rfind("memory:", 0) == 0) spawn.env["MALLOC_MMAP_THRESHOLD_"] = "65536";
    children.push_back(ddp::procutil::spawn_self(args, spawn));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout_s);
  bool ok = true;
  bool killed = false;
  size_t running = children.size();
  while (running > 0) {
    int status = 0;
    const pid_t done = waitpid(-1, &status, killed ? 0 : WNOHANG);
    if (done > 0) {
      --running;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
    } else if (std::chrono::steady_clock::now() > deadline) {
      std::cerr << job << " at world " << world << ": timed out after " << o.timeout_s << " s\n";
      ok = false;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!ok && !killed) {  // stop the others rather than wait for their collectives to time out
      for (pid_t child : children) kill(child, SIGTERM);
      killed = true;
    }
  }
  return ok;
}

// Memory is measured at the largest world size for the variants that differ in what they hold;
// the Adam variants' optimizer state at every world size (memory_worlds).
std::vector<VariantSpec> memory_variants(const Options& o) {
  std::vector<VariantSpec> specs{{Kind::local}, {Kind::naive}};
  for (double cap : o.view_caps) {
    specs.push_back({Kind::reducer, cap});
    specs.push_back({Kind::ours, cap});
    specs.push_back({Kind::ours_view, cap});
  }
  // The optimizer state per rank: Adam whole on every rank, and sharded by ZeRO (at the cap they
  // are timed at, so that the report finds them beside their timings).
  specs.push_back({Kind::ours_adam, hook_cap(o.caps)});
  specs.push_back({Kind::ours_zero_adam, hook_cap(o.caps)});
  specs.push_back({Kind::ours_zero_adam_overlap, hook_cap(o.caps)});
  specs.push_back({Kind::fsdp_adam});
  specs.push_back({Kind::fsdp_adam_prefetch});
  std::vector<VariantSpec> chosen;
  for (const auto& spec : specs) {
    if (selected(o, spec.kind_name())) chosen.push_back(spec);
  }
  return chosen;
}

// The worlds a memory variant runs at: ZeRO's shard shrinks with the world size, so the Adam
// variants run at each; the others at the largest.
std::vector<int> memory_worlds(const Options& o, const VariantSpec& spec) {
  if (holds_adam_state(spec)) return o.worlds;
  return {*std::max_element(o.worlds.begin(), o.worlds.end())};
}

int run_parent(const Options& o, char** argv) {
  const std::string load_at_start = load_average();
  fs::create_directories(o.out);
  for (const auto& entry : fs::directory_iterator(o.out)) {
    if (entry.path().extension() == ".json" && entry.path().filename().string().rfind("raw_", 0) == 0) {
      fs::remove(entry.path());  // stale rank output from an earlier run must not be merged
    }
  }
  for (int world : o.worlds) {
    if (world < 2 || !o.only.empty()) continue;
    std::cerr << "allreduce: shared memory vs gloo at world " << world << "\n";
    if (!spawn_world(world, "allreduce", 0, o, argv)) {
      std::cerr << "ddp_bench: the allreduce job failed\n";
      return 1;
    }
  }
  for (size_t c = 0; c < o.configs.size(); ++c) {
    for (int world : o.worlds) {
      std::cerr << o.configs[c].label() << ": timing at world " << world << "\n";
      if (!spawn_world(world, "time", c, o, argv)) {
        std::cerr << "ddp_bench: the timing job failed\n";
        return 1;
      }
    }
    if (!o.memory) continue;
    for (const auto& spec : memory_variants(o)) {
      for (int world : memory_worlds(o, spec)) {
        std::cerr << o.configs[c].label() << ": peak memory of " << spec.id() << " alone at world " << world << "\n";
        if (!spawn_world(world, "memory:" + spec.id(), c, o, argv)) {
          std::cerr << "ddp_bench: the memory job failed\n";
          return 1;
        }
      }
    }
  }
  return write_report(o, load_at_start) ? 0 : 1;
}

}  // namespace
}  // namespace bench

int main(int argc, char** argv) {
  try {
    const bench::Options options = bench::parse(argc, argv);
    if (std::getenv("RANK") != nullptr) return bench::run_rank(options);  // spawned by us, ddprun or torchrun
    return bench::run_parent(options, argv);
  } catch (const std::exception& error) {
    std::cerr << "ddp_bench: " << error.what() << "\n";
    return 1;
  }
}
