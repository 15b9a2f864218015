#pragma once
// Small models shared by the checkpoint tests.
#include <string>

#include <torch/torch.h>

namespace ckpt_test {

// The PyTorch DDP tutorial's ToyModel.
struct ToyModelImpl : torch::nn::Module {
  ToyModelImpl()
      : net1(register_module("net1", torch::nn::Linear(10, 10))),
        net2(register_module("net2", torch::nn::Linear(10, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1, net2;
};
TORCH_MODULE(ToyModel);

// Same names, one different shape, one extra parameter, one missing: for mismatch errors.
struct OtherModelImpl : torch::nn::Module {
  OtherModelImpl()
      : net1(register_module("net1", torch::nn::Linear(10, 10))),
        net2(register_module("net2", torch::nn::Linear(10, 7))) {
    extra = register_parameter("extra", torch::zeros({3}));
  }
  torch::nn::Linear net1, net2;
  torch::Tensor extra;
};
TORCH_MODULE(OtherModel);

// Every parameter and buffer of `module` is exactly equal to `other`'s.
inline bool same_state(const torch::nn::Module& module, const torch::nn::Module& other) {
  auto a = module.named_parameters();
  auto b = other.named_parameters();
  if (a.size() != b.size()) return false;
  for (const auto& item : a) {
    const auto* peer = b.find(item.key());
    if (peer == nullptr || !torch::equal(item.value(), *peer)) return false;
  }
  return true;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace ckpt_test
