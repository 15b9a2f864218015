#pragma once
// The networks ddp_bench trains: a communication-heavy MLP and a small ResNet-style conv net.
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace bench {

// A common base so one DistributedDataParallel<BenchNet> type wraps every model.
struct BenchNet : torch::nn::Module {
  virtual at::Tensor forward(at::Tensor x) = 0;
  // What fsdp_adam shards one by one (the forward calls them through ddp::sharded_forward).
  virtual std::vector<std::shared_ptr<torch::nn::Module>> shard_blocks() = 0;
};

// What one timing job trains: the model and the batch per rank.
struct ModelConfig {
  std::string model = "mlp";  // mlp | resnet
  int batch = 4;              // per rank
  int mlp_width = 1024;       // the MLP's input and hidden width
  int mlp_layers = 8;         // Linear(width, width) + ReLU layers before the 10-way head
  int rounds = 0;             // interleaved rounds for this config; 0 = the run's --rounds
  std::string label() const { return model + "_b" + std::to_string(batch); }
};

struct Batch {
  at::Tensor x, y;
};

// Seeded, so every variant starts from the same weights and does the same arithmetic.
// sync_batchnorm: the resnet's BatchNorms are ddp::SyncBatchNorm (same weights).
std::shared_ptr<BenchNet> make_model(const ModelConfig& config, bool sync_batchnorm = false);
// Each rank draws its own shard (seed depends on rank).
Batch make_batch(const ModelConfig& config, int rank);
int64_t parameter_count(const ModelConfig& config);

}  // namespace bench
