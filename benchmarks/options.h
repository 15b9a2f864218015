#pragma once
#include <algorithm>
// What one ddp_bench run measures, and where its files go; shared by the ranks and the report.
#include <string>
#include <vector>

#include "models.h"
#include "variants.h"

namespace bench {

struct Options {
  // The three configurations: communication-heavy MLP, compute-heavy MLP (a step takes
  // seconds on one core, hence fewer rounds), a conv net.
  std::vector<ModelConfig> configs{{"mlp", 4}, {"mlp", 64, 1024, 8, 3}, {"resnet", 32}};
  std::vector<int> worlds{2};  // the targets are for 2 ranks; --world 1,2 adds each engine's own overhead
  std::vector<double> caps{0, 1, 5, 25, 100};  // MiB; 0 = one bucket per parameter
  std::vector<double> view_caps{25};           // ours_view, and the memory pass
  int warmup = 2;        // untimed steps per variant (both engines rebuild buckets after the first)
  int steps = 3;         // timed steps per variant per round
  int rounds = 10;       // interleaved rounds: short blocks, so load changes hit every variant alike
  int memory_steps = 3;  // steps after warm-up in the memory pass
  bool memory = true;
  bool hooks = true;     // ours+fp16/bf16/powersgd1/powersgd4 and reducer+fp16 at 25 MiB
  bool features = true;  // ours_join, ours_detail, ours_auto, ours_syncbn: what Join, DETAIL, autotuning, SyncBatchNorm cost
  bool quick = false;
  // --only: the variants to run (kind names: fsdp_adam, ours+adam, local, ...); empty: all. With a
  // list, the allreduce section is skipped too (a memory measurement of a big model, for one).
  std::vector<std::string> only;
  int timeout_s = 900;   // per job (one world of ranks)
  std::string out = "ddp_bench_out";
};

inline bool selected(const Options& o, const std::string& kind_name) {
  return o.only.empty() || std::find(o.only.begin(), o.only.end(), kind_name) != o.only.end();
}

inline std::string timing_file(const ModelConfig& config, int world) {
  return "raw_" + config.label() + "_w" + std::to_string(world) + ".json";
}

inline std::string memory_file(const ModelConfig& config, int world, const VariantSpec& spec) {
  std::string id = spec.id();
  for (char& c : id) if (c == '@' || c == '.') c = '_';
  return "raw_mem_" + config.label() + "_w" + std::to_string(world) + "_" + id + ".json";
}

}  // namespace bench
