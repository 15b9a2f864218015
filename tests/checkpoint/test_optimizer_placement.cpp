// load_checkpoint puts each parameter's optimizer state on that parameter's device (issue 12), as
// PyTorch's Optimizer.load_state_dict does, for a model split over devices. No GPU here: the meta
// device stands in for the second one (a real device type, with shapes and no data), so the state
// of a parameter on meta must come back on meta. The CUDA test runs where a GPU exists.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "multiprocess.h"

namespace {

// A linear layer with its parameters made on `device`: LibTorch 1.13's Module::to cannot move a
// parameter to meta (set_data refuses the tensor type).
struct DenseImpl : torch::nn::Module {
  DenseImpl(int64_t in, int64_t out, const c10::Device& device)
      : weight(register_parameter("weight", (torch::randn({out, in}) / 3).to(device))),
        bias(register_parameter("bias", (torch::randn({out}) / 3).to(device))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::addmm(bias, x, weight.t()); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Dense);

// Model parallel as in PyTorch's tutorial: net1 on one device, net2 on another.
struct SplitModelImpl : torch::nn::Module {
  SplitModelImpl(const c10::Device& dev0, const c10::Device& dev1)
      : net1(register_module("net1", Dense(10, 10, dev0))), net2(register_module("net2", Dense(10, 5, dev1))),
        dev0(dev0), dev1(dev1) {}
  torch::Tensor forward(const torch::Tensor& x) { return net2(torch::relu(net1(x.to(dev0))).to(dev1)); }
  Dense net1, net2;
  c10::Device dev0, dev1;
};
TORCH_MODULE(SplitModel);

// The state tensors one parameter has, read from LibTorch's state types (torch/optim/*.h);
// optional ones left undefined (max_exp_avg_sq without amsgrad) are not counted.
std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& state) {
  std::vector<at::Tensor> fields;
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    fields = {sgd->momentum_buffer()};
  } else if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    fields = {adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()};
  } else {
    ADD_FAILURE() << "a state type this test does not know";
  }
  std::vector<at::Tensor> defined;
  for (const auto& field : fields) {
    if (field.defined()) defined.push_back(field);
  }
  return defined;
}

// Each parameter's state tensors, by parameter name. The model's four parameters have four shapes,
// so a state's shape names its parameter: this needs nothing of how LibTorch keys
// Optimizer::state() (text in 1.13, the pointer in 2.6).
std::map<std::string, std::vector<at::Tensor>> states_by_name(const torch::optim::Optimizer& optimizer,
                                                               const torch::nn::Module& model) {
  std::map<std::string, std::vector<at::Tensor>> states;
  for (const auto& entry : optimizer.state()) {
    const auto tensors = state_tensors(*entry.second);
    std::vector<std::string> owners;
    for (const auto& item : model.named_parameters()) {
      if (!tensors.empty() && item.value().sizes() == tensors.front().sizes()) owners.push_back(item.key());
    }
    if (owners.size() != 1) {
      ADD_FAILURE() << "a state whose shape fits " << owners.size() << " parameters";
      continue;
    }
    states[owners.front()] = tensors;
  }
  return states;
}

template <typename Optimizer>
void step(SplitModel& model, Optimizer& optimizer, int seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({8, 10});
  optimizer.zero_grad();
  model->forward(x).pow(2).mean().backward();
  optimizer.step();
}

// Saves after one step of a model in one device layout, loads into a model in another and checks
// every state tensor: on its parameter's device, same shape and dtype, and, where it holds data
// (not meta), the saved values. Without meta, the next step must also match the saved model's.
template <typename Optimizer, typename Options>
void check_placement(const Options& options, const c10::Device& save0, const c10::Device& save1,
                     const c10::Device& load0, const c10::Device& load1, size_t tensors_per_param) {
  const std::string dir = ddp::test::make_temp_dir("ckpt_place_");
  const std::string path = dir + "/ckpt.pt";
  torch::manual_seed(1);
  SplitModel saved(save0, save1);
  Optimizer saved_optimizer(saved->parameters(), options);
  step(saved, saved_optimizer, 2);
  ddp::save_checkpoint(path, *saved, &saved_optimizer, {});

  torch::manual_seed(3);
  SplitModel loaded(load0, load1);
  Optimizer loaded_optimizer(loaded->parameters(), options);
  ddp::load_checkpoint(path, *loaded, &loaded_optimizer);

  const auto saved_params = saved->named_parameters();
  const auto loaded_states = states_by_name(loaded_optimizer, *loaded);
  const auto saved_states = states_by_name(saved_optimizer, *saved);
  ASSERT_EQ(loaded_states.size(), 4u);
  ASSERT_EQ(saved_states.size(), 4u);
  for (const auto& item : loaded->named_parameters()) {
    const at::Tensor& param = item.value();
    const auto& tensors = loaded_states.at(item.key());
    const auto& expected = saved_states.at(item.key());
    ASSERT_EQ(tensors.size(), tensors_per_param);
    ASSERT_EQ(expected.size(), tensors_per_param);
    for (size_t i = 0; i < tensors.size(); ++i) {
      SCOPED_TRACE(item.key() + ", state tensor " + std::to_string(i));
      EXPECT_EQ(tensors[i].device(), param.device()) << "state on " << tensors[i].device() << ", parameter on "
                                                     << param.device();
      EXPECT_EQ(tensors[i].sizes(), expected[i].sizes());
      EXPECT_EQ(tensors[i].scalar_type(), expected[i].scalar_type());
      if (!tensors[i].is_meta()) {
        EXPECT_TRUE(torch::equal(tensors[i].cpu(), expected[i].cpu()));
      }
    }
  }
  if (!load0.is_meta() && !load1.is_meta()) {
    step(saved, saved_optimizer, 5);
    step(loaded, loaded_optimizer, 5);  // throws if a state tensor is on another device than its parameter
    for (const auto& item : loaded->named_parameters()) {
      EXPECT_TRUE(torch::allclose(item.value().cpu(), saved_params[item.key()].cpu(), 1e-5, 1e-6)) << item.key();
    }
  }
  ddp::test::remove_tree(dir);
}

const c10::Device kCpu(torch::kCPU);
const c10::Device kMeta(torch::kMeta);

TEST(OptimizerPlacement, SgdMomentumFollowsEachParameterToItsDevice) {
  check_placement<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9), kCpu, kCpu, kCpu, kMeta, 1);
}

TEST(OptimizerPlacement, AdamStateFollowsEachParameterToItsDevice) {
  // amsgrad: max_exp_avg_sq exists too. The first parameter is on CPU, so the one device the state
  // is read onto is CPU; net2's state must leave it.
  check_placement<torch::optim::Adam>(torch::optim::AdamOptions(0.01).amsgrad(true), kCpu, kCpu, kCpu, kMeta, 3);
}

TEST(OptimizerPlacement, AFirstParameterMovedSinceSavingGetsItsStateToo) {
  // Saved all on CPU (so read onto CPU), loaded with net1, the first parameters, on meta.
  // Without amsgrad: max_exp_avg_sq stays undefined.
  check_placement<torch::optim::Adam>(torch::optim::AdamOptions(0.01), kCpu, kCpu, kMeta, kCpu, 2);
}

// A model split over a GPU and the CPU (or two GPUs where there are two), saved in that layout and
// in the swapped one, loaded in that layout, then stepped.
TEST(OptimizerPlacement, CudaSplitModelGetsItsStateOnEachDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: GPU placement not tested here";
  const c10::Device dev0("cuda:0");
  const c10::Device dev1 = torch::cuda::device_count() > 1 ? c10::Device("cuda:1") : kCpu;
  const auto options = torch::optim::AdamOptions(0.01).amsgrad(true);
  check_placement<torch::optim::Adam>(options, dev0, dev1, dev0, dev1, 3);
  check_placement<torch::optim::Adam>(options, dev1, dev0, dev0, dev1, 3);
}

}  // namespace
