// The checkpoint demo of PyTorch's DDP tutorial ("Save and Load Checkpoints"), in C++:
// rank 0 saves, every rank waits until the file is complete, every rank loads it with a
// map_location, then training goes on.
// Run two ranks on one machine (ddprun sets the variables for you):
//   ddprun --nproc-per-node 2 ./build/examples/checkpoint/checkpoint_ddp [checkpoint path]
// Without a path the checkpoint goes into a new directory of its own in $TMPDIR (or /tmp), which
// only this user may enter, removed at the end.
// or by hand:
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 ./checkpoint_ddp &
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 ./checkpoint_ddp
// The file is also a plain state_dict for Python: torch.load(path) returns {"net1.weight": ...}.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>

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

// A new directory only this user may enter (made by rank 0, named to every rank): a fixed name
// in world-writable /tmp could be another user's link, and the save would write where it points.
std::filesystem::path private_directory() {
  std::string name;
  if (ddp::get_rank() == 0) {
    std::random_device random;
    for (int attempt = 0; name.empty() && attempt < 100; ++attempt) {
      const auto candidate = std::filesystem::temp_directory_path() / ("torchddp-checkpoint-" + std::to_string(random()));
      if (std::filesystem::create_directory(candidate)) name = candidate.string();  // false: it exists, try another
    }
    if (name.empty()) throw std::runtime_error("cannot make a directory of its own in " +
                                               std::filesystem::temp_directory_path().string());
    std::filesystem::permissions(name, std::filesystem::perms::owner_all, std::filesystem::perm_options::replace);
  }
  ddp::broadcast_bytes(name);
  return name;
}

int run(int argc, char** argv) {
  auto pg = ddp::init_process_group(ddp::InitOptions{"gloo", "env://"});
  const int rank = ddp::get_rank();
  const std::filesystem::path own_directory = argc > 1 ? std::filesystem::path() : private_directory();
  const std::string path = argc > 1 ? argv[1] : (own_directory / "model.checkpoint").string();

  torch::manual_seed(rank);  // different initial weights per rank: the checkpoint makes them equal
  ToyModel model;
  ddp::DistributedDataParallel ddp_model(model, pg);
  torch::optim::SGD optimizer(ddp_model.parameters(), torch::optim::SGDOptions(0.001));

  // The file is removed at the end only if this run creates it: PATH may name something of yours.
  std::error_code error;
  const bool created = rank == 0 && !std::filesystem::exists(std::filesystem::symlink_status(path, error));

  // Only rank 0 writes; save_checkpoint is also the barrier: no rank returns before the file is
  // complete on disk, so the loads below never see a partial file.
  ddp::TrainingState state;
  state.metadata = {{"example", "checkpoint_ddp"}};
  ddp::save_checkpoint(path, ddp_model, &optimizer, state);

  // Written on rank 0's device, loaded onto ours: {"cuda:0" -> "cuda:<local rank>"} on GPUs; on
  // CPU the same rule maps nothing. ddp::MapLocation("cpu") would force everything to CPU.
  const auto location = ddp::MapLocation::cuda_for_local_rank(ddp::local_rank());
  ddp::load_checkpoint(path, ddp_model, &optimizer, ddp::LoadOptions().map_location(location));

  optimizer.zero_grad();
  auto outputs = ddp_model.forward(torch::randn({20, 10}));
  auto loss = torch::mse_loss(outputs, torch::randn({20, 5}));
  loss.backward();
  optimizer.step();
  std::cout << "rank " << rank << " loaded " << path << " and trained a step, loss " << loss.item<float>()
            << std::endl;

  // The replicas must agree after loading and stepping.
  auto checksum = torch::zeros({1});
  for (const auto& p : ddp_model.parameters()) checksum += p.sum();
  auto sums = ddp::all_gather(checksum);
  for (const auto& other : sums) {
    if (!torch::equal(other, sums[0])) {
      std::cerr << "rank " << rank << ": replicas differ after loading the checkpoint" << std::endl;
      return 1;
    }
  }
  ddp::barrier();  // every rank has finished with the file
  if (rank == 0) {
    // std::remove, not std::filesystem::remove_all: PyPI's torch 2.11 exports a broken copy of the
    // latter from libtorch.so, which a program linked to it calls instead of libstdc++'s.
    if (created) std::remove(path.c_str());
    if (!own_directory.empty()) {  // the file and the lock beside it, then the directory
      for (const auto& entry : std::filesystem::directory_iterator(own_directory)) std::remove(entry.path().string().c_str());
      std::remove(own_directory.string().c_str());
    }
    std::cout << "replicas identical (weight checksum " << checksum.item<float>() << ")" << std::endl;
  }
  ddp::destroy_process_group();
  return 0;
}

// An error (a peer that died, a bad checkpoint path) ends the program with its message and exit
// code 1, not an abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "checkpoint_ddp: error: " << error.what() << std::endl;
    return 1;
  }
}
