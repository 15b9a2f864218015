#pragma once
// Small models shared by the DDP tests.
#include <map>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "multiprocess.h"

namespace ddp::test {

struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(MLP);

// Input [N, 1, 8, 8] flattened from 64 features so both models share the data.
struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3).padding(1)));
    head = register_module("head", torch::nn::Linear(8 * 4 * 4, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv1(x.view({-1, 1, 8, 8})));
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    return head(x.flatten(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

// Registered in the opposite order to their use: the observed gradient order differs from the
// reverse registration order, so the bucket rebuild has something to change.
struct ReorderedImpl : torch::nn::Module {
  ReorderedImpl() {
    last = register_module("last", torch::nn::Linear(16, 5));
    first = register_module("first", torch::nn::Linear(10, 16));
  }
  torch::Tensor forward(torch::Tensor x) { return last(torch::relu(first(x))); }
  torch::nn::Linear last{nullptr}, first{nullptr};
};
TORCH_MODULE(Reordered);

// A branch that forward may skip.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(10, 8));
    branch = register_module("branch", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 5));
  }
  torch::Tensor forward(torch::Tensor x, bool use_branch) {
    auto h = torch::relu(trunk(x));
    if (use_branch) h = h + branch(h);
    return head(h);
  }
  torch::nn::Linear trunk{nullptr}, branch{nullptr}, head{nullptr};
};
TORCH_MODULE(Branchy);

// The same data on every rank (seeded by step); rank r trains on its slice. 12 rows divide by
// world sizes 1, 2, 3.
inline std::pair<torch::Tensor, torch::Tensor> batch(int step, int64_t features = 10, int64_t rows = 12) {
  torch::manual_seed(1000 + step);
  return {torch::randn({rows, features}), torch::randn({rows, 5})};
}
inline torch::Tensor shard(const torch::Tensor& t, int rank, int world) {
  const int64_t per = t.size(0) / world;
  return t.narrow(0, rank * per, per);
}

// Gives `to` the weights of `from` (same architecture): references start where DDP models start.
inline void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters(), dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

// Fails naming `what` and the first parameter of `got` that is not bitwise equal to `want`'s.
inline void expect_bitwise(MLP& got, MLP& want, const std::string& what) {
  const auto params = got->parameters(), expected = want->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    require(torch::equal(params[i], expected[i]), what + ": parameter " + std::to_string(i) + " differs by " +
                                                      std::to_string((params[i] - expected[i]).abs().max().item<double>()));
  }
}

// Adam's state, tensor by tensor, by its key in the optimizer's state map (copies; without amsgrad
// max_exp_avg_sq is an empty tensor).
inline auto adam_state(torch::optim::Adam& optimizer) {
  using Key = std::decay_t<decltype(optimizer.state().begin()->first)>;
  std::map<Key, std::vector<torch::Tensor>> state;
  for (const auto& [key, value] : optimizer.state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*value);
    const torch::Tensor amsgrad = adam.max_exp_avg_sq().defined() ? adam.max_exp_avg_sq().clone() : torch::zeros({0});
    state[key] = {adam.exp_avg().clone(), adam.exp_avg_sq().clone(), amsgrad, torch::tensor(adam.step())};
  }
  return state;
}

}  // namespace ddp::test
