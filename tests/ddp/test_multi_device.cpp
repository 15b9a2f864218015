// Modules spread over several devices or dtypes (model parallel). On CPU, dtypes stand in for
// devices: buckets are keyed by (device, dtype), so a float + double model exercises the same
// grouping end to end. The CUDA tests run where a GPU exists and skip visibly elsewhere.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// The tutorial's model-parallel ToyMpModel: net1 on dev0, net2 on dev1 (here: devices or dtypes).
struct SplitModelImpl : torch::nn::Module {
  SplitModelImpl(c10::Device dev0, c10::Device dev1, c10::ScalarType dtype1) : dev0(dev0), dev1(dev1), dtype1(dtype1) {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
    net1->to(dev0);
    net2->to(dev1, dtype1);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(net1(x.to(dev0)));
    return net2(h.to(dev1, dtype1));  // the output stays where net2 put it
  }
  c10::Device dev0, dev1;
  c10::ScalarType dtype1;
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(SplitModel);


// Runs 3 DDP steps of a split model on W ranks and checks gradients against one process.
void check_split_model(c10::Device dev0, c10::Device dev1, c10::ScalarType dtype1) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(11);
  SplitModel local(dev0, dev1, dtype1), reference(dev0, dev1, dtype1);
  ddp::DistributedDataParallel model(local);  // device_ids unset: a multi-device module
  copy_parameters(*model.module(), *reference);
  for (const auto& bucket : model.reduction_stats().buckets) {
    const std::string prefix = bucket.front().substr(0, 5);
    for (const auto& name : bucket) require(name.substr(0, 5) == prefix, "a bucket mixes net1 and net2: " + name);
  }
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({6, 10});
    auto y = torch::randn({6, 5}).to(dev1, dtype1);
    model.zero_grad();
    reference->zero_grad();
    auto out = model.forward(x.narrow(0, rank * 6 / world, 6 / world));
    require(out.device() == dev1 && out.scalar_type() == dtype1, "output moved away from net2's device/dtype");
    torch::mse_loss(out, y.narrow(0, rank * 6 / world, 6 / world)).backward();
    torch::mse_loss(reference->forward(x), y).backward();
    auto got = model.parameters(), want = reference->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      require(torch::allclose(got[i].grad().cpu().to(torch::kDouble), want[i].grad().cpu().to(torch::kDouble), 1e-4, 1e-6),
              "gradient " + std::to_string(i) + " differs at step " + std::to_string(step));
    }
  }
}

DDP_WORKER(split_dtypes) {
  worker_init();
  check_split_model(torch::kCPU, torch::kCPU, torch::kDouble);
}
TEST(MultiDevice, FloatAndDoubleHalvesReduceInSeparateBucketsAndMatch) {
  EXPECT_WORKERS_OK(run_workers("split_dtypes", 2));
}

DDP_WORKER(device_ids_cpu) {
  worker_init();
  torch::nn::Linear linear(4, 2);
  ddp::DistributedDataParallel model(linear, ddp::DDPOptions().device_ids({torch::kCPU}).output_device(torch::kCPU));
  auto out = model.forward(torch::ones({3, 4}));
  require(out.device() == torch::Device(torch::kCPU), "output not on output_device");
  out.sum().backward();
  require(torch::allclose(model->weight.grad(), torch::full({2, 4}, 3.0f)), "gradient wrong");
}
TEST(MultiDevice, DeviceIdsAndOutputDevice) { EXPECT_WORKERS_OK(run_workers("device_ids_cpu", 2)); }

// to(): the module moves (here to double) and the buckets follow the parameters.
DDP_WORKER(move_to_double) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(9);
  torch::nn::Linear local(4, 3), reference(4, 3);
  ddp::DistributedDataParallel model(local);
  copy_parameters(*model.module(), *reference);
  model.to(torch::kDouble);
  reference->to(torch::kDouble);
  require(model.parameters()[0].scalar_type() == torch::kDouble, "to() did not reach the parameters");
  auto x = torch::randn({4, 4}, torch::kDouble);
  model.forward(x.narrow(0, rank * 4 / world, 4 / world)).pow(2).sum().backward();
  (reference->forward(x).pow(2).sum() / world).backward();
  auto got = model.parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    require(got[i].grad().scalar_type() == torch::kDouble, "gradient not double after to()");
    require(torch::allclose(got[i].grad(), want[i].grad(), 1e-10, 1e-12), "gradient after to() differs");
  }
}
TEST(MultiDevice, ToMovesParametersAndBuckets) { EXPECT_WORKERS_OK(run_workers("move_to_double", 2)); }

TEST(MultiDevice, MoreThanOneDeviceIdIsRejected) {
  // Checked before any collective, so no process group is needed beyond a world of one.
  const std::string dir = make_temp_dir("ddp_ids_");
  ddp::InitOptions options{"gloo", "file://" + dir + "/store"};
  options.rank = 0;
  options.world_size = 1;
  auto group = ddp::new_process_group(options);
  torch::nn::Linear linear(2, 2);
  try {
    ddp::DistributedDataParallel model(linear, group, ddp::DDPOptions().device_ids({torch::kCPU, torch::kCPU}));
    FAIL() << "two device_ids were accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("device_ids takes at most one device"), std::string::npos) << error.what();
  }
  remove_tree(dir);
}

// --- CUDA: these run on a GPU machine and skip, saying why, on CPU-only ones ----------------------
#define SKIP_WITHOUT_CUDA()                                                                 \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: GPU path not tested here"

DDP_WORKER(gloo_cuda) {
  worker_init();
  check_split_model(torch::Device("cuda:0"), torch::Device("cuda:0"), torch::kFloat);
}
TEST(Cuda, GlooWithCudaTensorsTwoRanksMatchSingleProcess) {
  SKIP_WITHOUT_CUDA();
  EXPECT_WORKERS_OK(run_workers("gloo_cuda", 2));
}

DDP_WORKER(split_cpu_cuda) {
  worker_init();
  check_split_model(torch::kCPU, torch::Device("cuda:0"), torch::kFloat);
}
TEST(Cuda, ModelSplitAcrossCpuAndCudaMatchesSingleProcess) {
  SKIP_WITHOUT_CUDA();
  EXPECT_WORKERS_OK(run_workers("split_cpu_cuda", 2));
}

// device_ids puts a CPU-built module on cuda:0 and moves CPU inputs there; output_device brings
// the output back to the CPU. Gradients (on the GPU) must match one CPU process on the whole batch.
DDP_WORKER(cuda_device_ids_cpu_output) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(12);
  torch::nn::Linear local(4, 3), reference(4, 3);
  copy_parameters(*local, *reference);
  const torch::Device gpu("cuda:0");
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().device_ids({gpu}).output_device(torch::kCPU));
  require(model->weight.device() == gpu, "device_ids did not move the module to cuda:0");
  auto x = torch::randn({4, 4}), y = torch::randn({4, 3});
  auto out = model.forward(x.narrow(0, rank * 4 / world, 4 / world));  // a CPU input
  require(out.device().is_cpu(), "output is on " + out.device().str() + ", not on output_device cpu");
  torch::mse_loss(out, y.narrow(0, rank * 4 / world, 4 / world)).backward();
  torch::mse_loss(reference->forward(x), y).backward();
  auto got = model.parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    require(got[i].grad().device() == gpu, "gradient left the GPU");
    require(torch::allclose(got[i].grad().cpu(), want[i].grad(), 1e-5, 1e-6), "gradient differs from one CPU process");
  }
}
TEST(Cuda, DeviceIdsOnGpuWithCpuOutputDevice) {
  SKIP_WITHOUT_CUDA();
  EXPECT_WORKERS_OK(run_workers("cuda_device_ids_cpu_output", 2));
}

DDP_WORKER(nccl_world1) {
  ddp::InitOptions options{"nccl", "file://" + std::string(std::getenv("DDP_TEST_STORE"))};
  ddp::init_process_group(options);
  for (bool as_view : {false, true}) {
    torch::manual_seed(4);
    torch::nn::Sequential local(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
    torch::nn::Sequential reference(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
    local->to(torch::kCUDA);
    reference->to(torch::kCUDA);
    ddp::DistributedDataParallel model(local, ddp::DDPOptions().gradient_as_bucket_view(as_view));
    copy_parameters(*model.module(), *reference);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({32, 64}, torch::kCUDA);
      model.zero_grad();
      reference->zero_grad();
      model.forward(x).pow(2).mean().backward();
      reference->forward(x).pow(2).mean().backward();
      auto got = model.parameters(), want = reference->parameters();
      for (size_t i = 0; i < got.size(); ++i) {
        require(torch::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-6), "NCCL gradient differs from plain training");
      }
    }
  }
}
TEST(Cuda, NcclWorldOneMatchesPlainTraining) {
  SKIP_WITHOUT_CUDA();
#ifndef DDP_HAVE_NCCL
  GTEST_SKIP() << "this LibTorch has no NCCL";
#endif
  EXPECT_WORKERS_OK(run_workers("nccl_world1", 1));
}

}  // namespace
