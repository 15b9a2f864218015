// Python interop: Python's torch.load reads our checkpoint as a plain state_dict, and a
// state_dict saved by Python's torch.save loads here. Skipped without python3 + torch.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "models.h"
#include "multiprocess.h"

namespace {

// The first interpreter that has torch: $DDP_PYTHON, python3 on PATH, Debian's /usr/bin/python3
// (python3-torch installs there; a pyenv or venv python3 earlier on PATH would not see it).
std::string python_with_torch() {
  std::vector<std::string> candidates = {"python3", "/usr/bin/python3"};
  if (const char* chosen = std::getenv("DDP_PYTHON")) candidates.insert(candidates.begin(), chosen);
  for (const auto& python : candidates) {
    if (std::system((python + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0) return python;
  }
  return "";
}

// Runs a Python script; returns its exit code and output.
int run_python(const std::string& dir, const std::string& script, std::string* output) {
  const std::string file = dir + "/script.py";
  std::ofstream(file) << script;
  FILE* pipe = popen((python_with_torch() + " " + file + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output->append(buffer, n);
  return pclose(pipe);
}


// The values both sides fill the ToyModel with: element i of a tensor is 0.25 * i - 1 (exact in float).
void fill_known(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& parameter : module.parameters()) {
    parameter.copy_(torch::arange(parameter.numel(), torch::kFloat).mul(0.25).sub(1).view(parameter.sizes()));
  }
}

constexpr char kPythonToyModel[] = R"(
import sys, torch
class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(10, 10)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5)
def known(t):
    return (torch.arange(t.numel(), dtype=torch.float32) * 0.25 - 1).view(t.shape)
)";

class PythonInterop : public ::testing::Test {
 protected:
  void SetUp() override {
    if (python_with_torch().empty()) {
      GTEST_SKIP() << "no python3 with torch (tried $DDP_PYTHON, python3, /usr/bin/python3; apt-get install python3-torch)";
    }
    dir_ = ddp::test::make_temp_dir("ckpt-python");
  }
  void TearDown() override {
    if (!dir_.empty()) ddp::test::remove_tree(dir_);
  }
  std::string dir_;
};

TEST_F(PythonInterop, PythonTorchLoadReadsOurCheckpointAsAPlainStateDict) {
  ckpt_test::ToyModel model;
  fill_known(*model);
  torch::optim::Adam optimizer(model->parameters());
  ddp::TrainingState state;
  state.global_step = 17;
  const std::string path = dir_ + "/ckpt.pt";
  ddp::save_checkpoint(path, *model, &optimizer, state);
  std::string output;
  const int status = run_python(dir_, std::string(kPythonToyModel) + R"(
sd = torch.load(sys.argv[0].replace('script.py', 'ckpt.pt'))
assert type(sd) is dict, type(sd)
assert sorted(sd) == ['net1.bias', 'net1.weight', 'net2.bias', 'net2.weight'], sorted(sd)
for name, tensor in sd.items():
    assert tensor.device.type == 'cpu'
    assert torch.equal(tensor, known(tensor)), name
model = ToyModel()
model.load_state_dict(sd)  # strict: same names and shapes as the Python module
print('python read', len(sd), 'tensors')
)", &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(ckpt_test::contains(output, "python read 4 tensors")) << output;
}

// A checkpoint of named models is what torch.save({"generator": G.state_dict(), ...}) writes: a
// plain dict of plain dicts, each loadable by the Python module of the same shape.
TEST_F(PythonInterop, PythonTorchLoadReadsNamedModelsAsANestedDict) {
  ckpt_test::ToyModel generator, discriminator;
  fill_known(*generator);
  fill_known(*discriminator);
  torch::NoGradGuard no_grad;
  discriminator->net2->bias.fill_(7);
  torch::optim::Adam optimizer(generator->parameters());
  const std::string path = dir_ + "/ckpt.pt";
  ddp::save_checkpoint(path, {{"generator", generator}, {"discriminator", discriminator}, {"optimizerG", optimizer}},
                       {});
  std::string output;
  const int status = run_python(dir_, std::string(kPythonToyModel) + R"(
ckpt = torch.load(sys.argv[0].replace('script.py', 'ckpt.pt'))
assert type(ckpt) is dict and list(ckpt) == ['generator', 'discriminator'], ckpt.keys()
for name, sd in ckpt.items():
    assert type(sd) is dict, type(sd)
    model = ToyModel()
    model.load_state_dict(sd)  # strict
    for key, tensor in sd.items():
        assert tensor.device.type == 'cpu'
        expected = torch.full_like(tensor, 7) if (name, key) == ('discriminator', 'net2.bias') else known(tensor)
        assert torch.equal(tensor, expected), (name, key)
print('python read', ' and '.join(ckpt))
)", &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(ckpt_test::contains(output, "python read generator and discriminator")) << output;
}

TEST_F(PythonInterop, PythonSavedStateDictLoadsInCpp) {
  std::string output;
  const int status = run_python(dir_, std::string(kPythonToyModel) + R"(
model = ToyModel()
with torch.no_grad():
    for p in model.parameters():
        p.copy_(known(p))
torch.save(model.state_dict(), sys.argv[0].replace('script.py', 'from_python.pt'))
ddp = {'module.' + k: v for k, v in model.state_dict().items()}  # what a Python DDP model saves
torch.save(ddp, sys.argv[0].replace('script.py', 'from_python_ddp.pt'))
)", &output);
  ASSERT_EQ(status, 0) << output;
  ckpt_test::ToyModel expected;
  fill_known(*expected);
  for (const char* name : {"/from_python.pt", "/from_python_ddp.pt"}) {
    ckpt_test::ToyModel loaded;
    ddp::load_state_dict(*loaded, ddp::load_state_dict(dir_ + name, ddp::MapLocation("cpu")), true, name);
    EXPECT_TRUE(ckpt_test::same_state(*loaded, *expected)) << name;
  }
}

}  // namespace

namespace {

// Made by Python (see CMakeLists.txt): Sequential(Linear(2, 3), BatchNorm1d(3)) with known values.
TEST(PythonFile, TorchSavedOrderedDictLoadsWithoutPython) {
  torch::nn::Sequential model(torch::nn::Linear(2, 3), torch::nn::BatchNorm1d(3));
  const auto state = ddp::load_state_dict(std::string(CKPT_TEST_DATA_DIR) + "/python_state_dict.pt");
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                                    "1.running_var", "1.num_batches_tracked"}));
  ddp::load_state_dict(*model, state);  // strict: no stray names from the OrderedDict rewrite
  const auto params = model->named_parameters();
  EXPECT_TRUE(torch::equal(params["0.weight"], torch::arange(6, torch::kFloat).view({3, 2}).mul(0.5)));
  EXPECT_TRUE(torch::equal(params["0.bias"], torch::tensor({1.0f, 2.0f, 3.0f})));
  EXPECT_TRUE(torch::equal(model->named_buffers()["1.running_mean"], torch::full({3}, 0.25)));
  EXPECT_EQ(model->named_buffers()["1.num_batches_tracked"].scalar_type(), torch::kLong);
}

}  // namespace
