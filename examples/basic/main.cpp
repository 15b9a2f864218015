// The "ToyModel" of PyTorch's DDP tutorial, in C++.
// Run two ranks on one machine (ddprun sets the variables for you):
//   ddprun --nproc-per-node 2 ./build/examples/basic/basic_ddp
// or by hand:
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 ./basic_ddp &
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 ./basic_ddp
#include <iostream>

#include <torch/torch.h>

#include <ddp/ddp.h>

struct ToyModelImpl : torch::nn::Module {
  ToyModelImpl() {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(ToyModel);

int run() {
  auto pg = ddp::init_process_group(ddp::InitOptions{"gloo", "env://"});
  const int rank = ddp::get_rank();
  std::cout << "Running basic DDP example on rank " << rank << " of " << ddp::get_world_size() << "." << std::endl;

  ToyModel model;
  ddp::DistributedDataParallel ddp_model(model, pg);  // every rank now holds rank 0's weights
  torch::optim::SGD optimizer(ddp_model.parameters(), torch::optim::SGDOptions(0.001));

  torch::manual_seed(rank);  // each rank sees different data
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    auto outputs = ddp_model.forward(torch::randn({20, 10}));
    auto loss = torch::mse_loss(outputs, torch::randn({20, 5}));
    loss.backward();  // gradients are averaged across ranks here
    optimizer.step();
    std::cout << "rank " << rank << " step " << step << " loss " << loss.item<float>() << std::endl;
  }

  // Proof that training kept the replicas identical: compare a checksum of the weights.
  auto checksum = torch::zeros({1});
  for (const auto& p : ddp_model.parameters()) checksum += p.sum();
  auto sums = ddp::all_gather(checksum);
  for (const auto& other : sums) {
    if (!torch::equal(other, sums[0])) {
      std::cerr << "rank " << rank << ": replicas diverged" << std::endl;
      return 1;
    }
  }
  if (rank == 0) std::cout << "replicas identical after 5 steps (weight checksum " << checksum.item<float>() << ")" << std::endl;
  ddp::destroy_process_group();
  return 0;
}

// An error (a peer that died, a bad checkpoint path) ends the program with its message and exit
// code 1, not an abort.
int main() {
  try {
    return run();
  } catch (const std::exception& error) {
    std::cerr << "basic_ddp: error: " << error.what() << std::endl;
    return 1;
  }
}
