#include "models.h"

#include <stdexcept>
#include <vector>

#include <ddp/fully_shard.h>
#include <ddp/sync_batchnorm.h>

namespace bench {
namespace {

constexpr int kClasses = 10;

// 8 x (Linear(1024, 1024) + ReLU) and a 10-way head: 8.4M parameters, 33.6 MB of gradients.
struct Mlp : BenchNet {
  explicit Mlp(const ModelConfig& c) {
    for (int i = 0; i < c.mlp_layers; ++i) {
      hidden.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(c.mlp_width, c.mlp_width)));
    }
    head = register_module("head", torch::nn::Linear(c.mlp_width, kClasses));
  }
  at::Tensor forward(at::Tensor x) override {
    for (auto& layer : hidden) x = torch::relu(ddp::sharded_forward(layer, x));
    return head->forward(x);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> shard_blocks() override {
    std::vector<std::shared_ptr<torch::nn::Module>> all;
    for (auto& layer : hidden) all.push_back(layer.ptr());
    return all;
  }
  std::vector<torch::nn::Linear> hidden;
  torch::nn::Linear head{nullptr};
};

torch::nn::Conv2d conv(int in, int out, int kernel, int stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// conv-BN-ReLU-conv-BN plus the input (through a strided 1x1 conv when the shape changes), ReLU.
// Norm: torch::nn::BatchNorm2d, or ddp::SyncBatchNorm (the ours_syncbn variant).
template <typename Norm>
struct ResidualBlock : torch::nn::Module {
  ResidualBlock(int in, int out, int stride) {
    conv1 = register_module("conv1", conv(in, out, 3, stride));
    bn1 = register_module("bn1", Norm(out));
    conv2 = register_module("conv2", conv(out, out, 3, 1));
    bn2 = register_module("bn2", Norm(out));
    if (stride != 1 || in != out) {
      shortcut = register_module("shortcut", conv(in, out, 1, stride));
      shortcut_bn = register_module("shortcut_bn", Norm(out));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = torch::relu(bn1->forward(conv1->forward(x)));
    y = bn2->forward(conv2->forward(y));
    return torch::relu(y + (shortcut ? shortcut_bn->forward(shortcut->forward(x)) : x));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, shortcut{nullptr};
  Norm bn1{nullptr}, bn2{nullptr}, shortcut_bn{nullptr};
};

// 3x32x32 images; a strided stem, then four blocks of 32, 64, 128, 256 channels that halve the
// resolution each time (the wide layers run on small maps): 1.2M parameters, 20 BatchNorms.
template <typename Norm>
struct SmallResNet : BenchNet {
  SmallResNet() {
    stem = register_module("stem", conv(3, 32, 3, 2));
    stem_bn = register_module("stem_bn", Norm(32));
    const int widths[] = {32, 64, 128, 256};
    int in = 32;
    for (int i = 0; i < 4; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i),
                                       std::make_shared<ResidualBlock<Norm>>(in, widths[i], i == 0 ? 1 : 2)));
      in = widths[i];
    }
    head = register_module("head", torch::nn::Linear(in, kClasses));
  }
  at::Tensor forward(at::Tensor x) override {
    x = torch::relu(stem_bn->forward(stem->forward(x)));
    for (auto& block : blocks) x = ddp::sharded_forward(block, x);
    return head->forward(x.mean({2, 3}));
  }
  torch::nn::Conv2d stem{nullptr};
  Norm stem_bn{nullptr};
  std::vector<std::shared_ptr<torch::nn::Module>> shard_blocks() override {
    return std::vector<std::shared_ptr<torch::nn::Module>>(blocks.begin(), blocks.end());
  }
  std::vector<std::shared_ptr<ResidualBlock<Norm>>> blocks;
  torch::nn::Linear head{nullptr};
};

}  // namespace

std::shared_ptr<BenchNet> make_model(const ModelConfig& config, bool sync_batchnorm) {
  torch::manual_seed(1);
  if (config.model == "mlp") return std::make_shared<Mlp>(config);
  if (config.model == "resnet" && sync_batchnorm) return std::make_shared<SmallResNet<ddp::SyncBatchNorm>>();
  if (config.model == "resnet") return std::make_shared<SmallResNet<torch::nn::BatchNorm2d>>();
  throw std::invalid_argument("unknown model '" + config.model + "' (mlp or resnet)");
}

Batch make_batch(const ModelConfig& config, int rank) {
  torch::manual_seed(100 + rank);
  at::Tensor x = config.model == "mlp" ? torch::randn({config.batch, config.mlp_width})
                                       : torch::randn({config.batch, 3, 32, 32});
  return {x, torch::randint(kClasses, {config.batch})};
}

int64_t parameter_count(const ModelConfig& config) {
  int64_t count = 0;
  for (const auto& param : make_model(config)->parameters()) count += param.numel();
  return count;
}

}  // namespace bench
