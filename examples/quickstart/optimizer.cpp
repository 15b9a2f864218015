// Quick start (README): a small classifier trained on Fashion-MNIST (MNIST's format and size), then
// its loss and accuracy on the whole test set. single_process.cpp is the program for one process;
// ddp.cpp (DDP's model wrapper) and optimizer.cpp (a DistributedOptimizer, no wrapper) are the same
// program on any number of ranks: `diff single_process.cpp ddp.cpp` (or optimizer.cpp) shows every
// line a port changed. Usage: <program> [epochs]
#include <cstdio>
#include <cstdlib>

#include <torch/torch.h>
#include <ddp/ddp.h>

#include "fashion_mnist.h"

namespace F = torch::nn::functional;
using examples::FashionMNIST;

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(28 * 28, 128))};
  torch::nn::Dropout dropout{register_module("dropout", torch::nn::Dropout(0.2))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
  torch::Tensor forward(torch::Tensor x) { return fc2(dropout(torch::relu(fc1(x.flatten(1))))); }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 2;
  ddp::init_process_group();  // rank and world from ddprun, torchrun, srun or mpirun; alone, a world of 1
  ddp::manual_seed(1);        // 1 + rank: each rank its own dropout noise
  Net model;  // made first: its weights do not depend on the loaders' random draws
  ddp::DistributedOptimizer<torch::optim::Adam> optimizer(model->parameters(), 1e-3);  // averages in backward
  ddp::broadcast_parameters(model);  // every rank starts from rank 0's weights
  auto train_set = FashionMNIST(FashionMNIST::Split::kTrain).map(torch::data::transforms::Stack<>());
  auto test_set = FashionMNIST(FashionMNIST::Split::kTest).map(torch::data::transforms::Stack<>());
  const size_t test_size = test_set.size().value();
  ddp::DistributedSampler train_sampler(train_set.size().value());  // this rank's shard, reshuffled each epoch
  auto train_loader = ddp::make_data_loader(std::move(train_set), train_sampler,
      torch::data::DataLoaderOptions().batch_size(64).workers(2));
  auto test_loader = torch::data::make_data_loader(std::move(test_set),
      ddp::DistributedSampler(test_size, ddp::DistributedSamplerOptions().pad(false)), 1000);  // disjoint shards

  for (int epoch = 0; epoch < epochs; ++epoch) {
    train_sampler.set_epoch(epoch);
    model->train();
    for (auto& batch : *train_loader) {
      optimizer.zero_grad();
      auto loss = F::cross_entropy(model->forward(batch.data), batch.target);
      loss.backward();
      optimizer.step();
    }
  }

  model->eval();
  torch::NoGradGuard no_grad;
  auto test_loss = torch::zeros({}, torch::kDouble);
  auto correct = torch::zeros({}, torch::kLong);
  for (auto& batch : *test_loader) {
    auto output = model->forward(batch.data);
    test_loss += F::cross_entropy(output, batch.target, F::CrossEntropyFuncOptions().reduction(torch::kSum));
    correct += output.argmax(1).eq(batch.target).sum();
  }
  ddp::all_reduce(test_loss);  // the sums over all ranks: the whole test set, each sample once
  ddp::all_reduce(correct);
  if (!ddp::is_main_process()) return 0;
  std::printf("after %d epochs: test loss %.4f, accuracy %lld/%zu\n", epochs, test_loss.item<double>() / test_size,
              static_cast<long long>(correct.item<int64_t>()), test_size);
  return 0;
}
