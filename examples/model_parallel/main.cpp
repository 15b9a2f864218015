// The model-parallel demo of PyTorch's DDP tutorial, in C++: one model split across two devices
// (net1 on dev0, net2 on dev1), wrapped in DistributedDataParallel with device_ids unset, so DDP
// reduces each device's gradients in its own buckets and leaves the output where net2 put it.
//
//   ddprun --nproc-per-node 2 ./build/examples/model_parallel/model_parallel_ddp
//
// Devices per rank: two GPUs each (cuda:2r, cuda:2r+1) when there are enough, as in the tutorial;
// with fewer GPUs net1 stays on the CPU and net2 goes to cuda:(LOCAL_RANK % GPUs); on a machine
// without CUDA both halves run on the CPU and the program says so.
#include <iostream>
#include <string>

#include <torch/torch.h>

#include <ddp/ddp.h>

struct ToyMpModelImpl : torch::nn::Module {
  ToyMpModelImpl(torch::Device dev0, torch::Device dev1) : dev0(dev0), dev1(dev1) {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
    net1->to(dev0);
    net2->to(dev1);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto hidden = torch::relu(net1(x.to(dev0)));
    return net2(hidden.to(dev1));
  }
  torch::Device dev0, dev1;
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(ToyMpModel);

// Where this rank puts its two halves, and a sentence saying why.
std::pair<torch::Device, torch::Device> pick_devices(int local_rank, std::string& why) {
  const int gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  const int local_world = std::stoi(std::getenv("LOCAL_WORLD_SIZE") ? std::getenv("LOCAL_WORLD_SIZE") : "1");
  if (gpus >= 2 * local_world) {
    why = "two GPUs per rank";
    return {torch::Device(torch::kCUDA, 2 * local_rank), torch::Device(torch::kCUDA, 2 * local_rank + 1)};
  }
  if (gpus > 0) {
    why = "fewer than two GPUs per rank: net1 on the CPU, net2 on a GPU";
    return {torch::Device(torch::kCPU), torch::Device(torch::kCUDA, local_rank % gpus)};
  }
  why = "no CUDA device here: both halves run on the CPU (the split, the buckets and the gradient "
        "averaging are the same code path)";
  return {torch::Device(torch::kCPU), torch::Device(torch::kCPU)};
}

int run() {
  auto pg = ddp::init_process_group(ddp::InitOptions{"gloo", "env://"});
  const int rank = ddp::get_rank();
  std::string why;
  const auto [dev0, dev1] = pick_devices(ddp::local_rank(), why);
  std::cout << "Running DDP with model parallel example on rank " << rank << ": net1 on " << dev0
            << ", net2 on " << dev1 << " (" << why << ")." << std::endl;

  ToyMpModel model(dev0, dev1);
  ddp::DistributedDataParallel ddp_model(model, pg);  // device_ids unset: a multi-device module
  torch::optim::SGD optimizer(ddp_model.parameters(), torch::optim::SGDOptions(0.001));

  torch::manual_seed(rank);  // each rank sees different data
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    auto outputs = ddp_model.forward(torch::randn({20, 10}));  // the output is on dev1
    auto labels = torch::randn({20, 5}).to(dev1);
    auto loss = torch::mse_loss(outputs, labels);
    loss.backward();
    optimizer.step();
    std::cout << "rank " << rank << " step " << step << " loss " << loss.item<float>() << std::endl;
  }

  // One bucket never mixes devices; the replicas stay identical.
  const auto stats = ddp_model.reduction_stats();
  auto checksum = torch::zeros({1});
  for (const auto& p : ddp_model.parameters()) checksum += p.sum().cpu();
  auto sums = ddp::all_gather(checksum);
  for (const auto& other : sums) {
    if (!torch::equal(other, sums[0])) {
      std::cerr << "rank " << rank << ": replicas diverged" << std::endl;
      return 1;
    }
  }
  if (rank == 0) {
    for (size_t b = 0; b < stats.buckets.size(); ++b) {
      std::cout << "bucket " << b << ":";
      for (const auto& name : stats.buckets[b]) std::cout << " " << name;
      std::cout << std::endl;
    }
    std::cout << "replicas identical after 5 steps (weight checksum " << checksum.item<float>() << ")" << std::endl;
  }
  ddp::destroy_process_group();
  return 0;
}

// An error (a peer that died, a bad checkpoint path) ends the program with its message and exit
// code 1, not an abort.
int main() {
  try {
    return run();
  } catch (const std::exception& error) {
    std::cerr << "model_parallel_ddp: error: " << error.what() << std::endl;
    return 1;
  }
}
