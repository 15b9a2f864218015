// ddp::convert_sync_batchnorm on a nested ResNet-like model: every BatchNorm replaced, the same
// tensors under the same names, eval outputs bitwise equal, a checkpoint saved before loads after;
// a BatchNorm held by a member field is refused with its path, and nothing changes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/sync_batchnorm.h>

#include "error_of.h"
#include "multiprocess.h"

namespace {

// A norm layer fetched from a ModuleList or ModuleDict, before or after conversion: the way the
// header tells such code to call it.
torch::Tensor run_norm(const std::shared_ptr<torch::nn::Module>& norm, const torch::Tensor& x) {
  if (auto sync = std::dynamic_pointer_cast<ddp::SyncBatchNormImpl>(norm)) return sync->forward(x);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(norm)) return bn->forward(x);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(norm)) return bn->forward(x);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(norm)) return bn->forward(x);
  throw std::logic_error("not a norm layer");
}

torch::nn::Conv2d conv(int channels) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).padding(1).bias(false));
}

// A residual block: a custom module whose layers sit in a Sequential.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int c) {
    body = register_module("body", torch::nn::Sequential(conv(c), torch::nn::BatchNorm2d(c), torch::nn::ReLU(),
                                                         conv(c), torch::nn::BatchNorm2d(c)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(body->forward(x) + x); }
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(Block);

// stem (Sequential) -> two Blocks (a ModuleList of custom modules) -> a BatchNorm2d in a
// ModuleList -> BatchNorm3d and BatchNorm1d in a ModuleDict -> Linear. Eight BatchNorms.
struct ResNetLikeImpl : torch::nn::Module {
  ResNetLikeImpl() {
    stem = register_module("stem", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                                                         torch::nn::BatchNorm2d(8), torch::nn::ReLU()));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(8), Block(8)));
    norms = register_module("norms", torch::nn::ModuleList(torch::nn::BatchNorm2d(8)));
    heads = register_module("heads", torch::nn::ModuleDict());
    heads->update({{"volume", torch::nn::BatchNorm3d(8).ptr()}, {"pooled", torch::nn::BatchNorm1d(8).ptr()}});
    fc = register_module("fc", torch::nn::Linear(8, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = stem->forward(x);
    for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
    x = run_norm(norms[0], x);
    x = x + run_norm(heads["volume"], x.unsqueeze(2)).squeeze(2);
    return fc->forward(run_norm(heads["pooled"], x.mean({2, 3})));
  }
  torch::nn::Sequential stem{nullptr};
  torch::nn::ModuleList blocks{nullptr}, norms{nullptr};
  torch::nn::ModuleDict heads{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNetLike);

// Non-trivial weights and running statistics, so that eval outputs depend on all of them.
void randomize(torch::nn::Module& net) {
  torch::NoGradGuard no_grad;
  for (auto& p : net.named_parameters()) p.value().uniform_(0.5, 1.5);
  for (auto& b : net.named_buffers()) {
    if (b.key().find("num_batches_tracked") != std::string::npos) b.value().fill_(7);
    else if (b.key().find("running_var") != std::string::npos) b.value().uniform_(0.5, 2);
    else b.value().uniform_(-1, 1);
  }
}

template <typename T>
int count_modules(torch::nn::Module& net) {
  int count = 0;
  for (const auto& m : net.modules()) count += m->as<T>() != nullptr ? 1 : 0;
  return count;
}

TEST(ConvertSyncBatchNorm, ReplacesEveryBatchNormKeepingTensorsNamesModesAndOutputs) {
  torch::manual_seed(0);
  ResNetLike net;
  randomize(*net);
  net->train();
  net->heads["pooled"]->eval();  // one layer in another mode than the rest
  const auto params_before = net->named_parameters();
  const auto buffers_before = net->named_buffers();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::string dir = ddp::test::make_temp_dir("convert_syncbn");
  const std::string path = dir + "/before.pt";
  ddp::save_checkpoint(path, *net, &optimizer, ddp::TrainingState{});
  net->eval();
  const auto x = torch::randn({2, 3, 6, 6});
  const auto before = net->forward(x);
  net->train();
  net->heads["pooled"]->eval();
  const int batchnorms = count_modules<torch::nn::BatchNorm1dImpl>(*net) + count_modules<torch::nn::BatchNorm2dImpl>(*net) +
                         count_modules<torch::nn::BatchNorm3dImpl>(*net);
  ASSERT_EQ(batchnorms, 8);

  const auto converted = ddp::convert_sync_batchnorm(net);
  EXPECT_EQ(converted.get(), net.get());  // the same module, converted in place
  EXPECT_EQ(count_modules<ddp::SyncBatchNormImpl>(*net), 8);
  EXPECT_EQ(count_modules<torch::nn::BatchNorm1dImpl>(*net) + count_modules<torch::nn::BatchNorm2dImpl>(*net) +
                count_modules<torch::nn::BatchNorm3dImpl>(*net),
            0);
  // Reached through each container's own list, not only through its children.
  EXPECT_TRUE(net->stem[1]->as<ddp::SyncBatchNormImpl>() != nullptr);
  EXPECT_TRUE(net->norms[0]->as<ddp::SyncBatchNormImpl>() != nullptr);
  EXPECT_TRUE(net->heads["volume"]->as<ddp::SyncBatchNormImpl>() != nullptr);
  // The same tensor objects under the same names (the optimizer built before still holds them).
  const auto params_after = net->named_parameters();
  const auto buffers_after = net->named_buffers();
  ASSERT_EQ(params_after.keys(), params_before.keys());
  ASSERT_EQ(buffers_after.keys(), buffers_before.keys());
  for (const auto& p : params_before) EXPECT_TRUE(params_after[p.key()].is_same(p.value())) << p.key();
  for (const auto& b : buffers_before) EXPECT_TRUE(buffers_after[b.key()].is_same(b.value())) << b.key();
  // Training mode kept per layer; the options came along.
  EXPECT_FALSE(net->heads["pooled"]->is_training());
  EXPECT_TRUE(net->norms[0]->is_training());
  EXPECT_EQ(net->heads["pooled"]->as<ddp::SyncBatchNormImpl>()->options.num_features(), 8);

  net->eval();
  EXPECT_TRUE(torch::equal(net->forward(x), before));

  // A checkpoint saved before conversion restores the converted model exactly.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.zero_();
    for (auto& b : net->buffers()) b.zero_();
  }
  ddp::load_checkpoint(path, *net, &optimizer);
  EXPECT_TRUE(torch::equal(net->forward(x), before));
  ddp::test::remove_tree(dir);
}

// A BatchNorm that the module calls through its own member field cannot be swapped: refused with
// its path, before anything changes.
struct FieldBlockImpl : torch::nn::Module {
  FieldBlockImpl() {
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    seq = register_module("seq", torch::nn::Sequential(torch::nn::BatchNorm2d(4)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return seq->forward(bn->forward(x)); }
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Sequential seq{nullptr};
};
TORCH_MODULE(FieldBlock);

TEST(ConvertSyncBatchNorm, RefusesABatchNormHeldByAMemberFieldAndChangesNothing) {
  auto outer = std::make_shared<torch::nn::Module>();
  FieldBlock block;
  outer->register_module("block", block);
  const auto message = ddp::test::error_of<std::invalid_argument>([&] { ddp::convert_sync_batchnorm(outer); });
  EXPECT_NE(message.find("cannot replace the BatchNorm at 'block.bn'"), std::string::npos) << message;
  EXPECT_NE(message.find("member field"), std::string::npos) << message;
  EXPECT_EQ(message.find("block.seq"), std::string::npos) << message;  // that one was convertible
  EXPECT_TRUE(block->seq[0]->as<torch::nn::BatchNorm2dImpl>() != nullptr);
  EXPECT_TRUE(block->named_children()["bn"]->as<torch::nn::BatchNorm2dImpl>() != nullptr);

  const auto root = ddp::test::error_of<std::invalid_argument>([] { ddp::convert_sync_batchnorm(torch::nn::BatchNorm2d(4)); });
  EXPECT_NE(root.find("the module is itself a BatchNorm"), std::string::npos) << root;
}

}  // namespace
