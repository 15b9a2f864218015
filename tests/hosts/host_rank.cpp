// One rank of a job whose ranks run on several simulated hosts (sim_hosts.sh); two_hosts_test.sh
// starts it with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) and HOST_GROUP_INIT, a tcp:// address on this host for a group of its ranks only.
// It prints one line of facts per step, for the test to check:
//   rank=R host=H world_transport=T   the hostname it runs on; how the world group moves data
//   world_sum=S                       all_reduce(rank + 1) over the world
//   host_transport=T host_sum=S       the same over the group of this host's ranks
//   ddp_grads=match|differ            DDP's averaged gradients on the world against one process
//                                     on the whole batch (computed here, without DDP)
// Exit 0 when every step ran (the test judges the values), 1 with the error otherwise.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include <ddp/ddp.h>

namespace {

constexpr auto kTimeout = std::chrono::seconds(60);  // a lost peer fails the test, never hangs it

std::string env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) throw std::runtime_error(std::string(name) + " is not set");
  return value;
}

std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

float sum_of_ranks_plus_one(const ddp::ProcessGroupPtr& group) {
  auto value = torch::full({4}, static_cast<float>(ddp::get_rank(group) + 1));
  ddp::all_reduce(value, c10d::ReduceOp::SUM, group);
  return value[0].item<float>();
}

// A Linear layer's gradients after one DDP backward over this rank's quarter of a fixed batch,
// against one process's on the whole batch: the same model (same seed), mean-squared error.
bool ddp_gradients_match(const ddp::ProcessGroupPtr& world) {
  const int rank = ddp::get_rank(world), size = ddp::get_world_size(world);
  const int64_t rows = 4 * size;
  torch::manual_seed(1);
  const auto inputs = torch::randn({rows, 8}), targets = torch::randn({rows, 3});

  torch::manual_seed(0);
  torch::nn::Linear reference(8, 3);
  torch::mse_loss(reference(inputs), targets).backward();

  torch::manual_seed(0);
  torch::nn::Linear model(8, 3);
  ddp::DistributedDataParallel ddp_model(model.ptr(), world);
  const auto mine = torch::indexing::Slice(4 * rank, 4 * (rank + 1));
  torch::mse_loss(ddp_model.forward(inputs.index({mine})), targets.index({mine})).backward();

  return torch::allclose(model->weight.grad(), reference->weight.grad(), 1e-5, 1e-6) &&
         torch::allclose(model->bias.grad(), reference->bias.grad(), 1e-5, 1e-6);
}

int run() {
  ddp::InitOptions world_options{"gloo", "env://"};
  world_options.timeout = kTimeout;
  auto world = ddp::init_process_group(world_options);
  const int rank = ddp::get_rank();
  std::cout << "rank=" << rank << " host=" << hostname() << " world_transport=" << ddp::transport(world) << std::endl;
  std::cout << "rank=" << rank << " world_sum=" << sum_of_ranks_plus_one(world) << std::endl;

  ddp::InitOptions host_options{"gloo", env("HOST_GROUP_INIT")};
  host_options.rank = std::stoi(env("LOCAL_RANK"));
  host_options.world_size = std::stoi(env("LOCAL_WORLD_SIZE"));
  host_options.timeout = kTimeout;
  auto host = ddp::new_process_group(host_options);
  std::cout << "rank=" << rank << " host_transport=" << ddp::transport(host)
            << " host_sum=" << sum_of_ranks_plus_one(host) << std::endl;

  std::cout << "rank=" << rank << " ddp_grads=" << (ddp_gradients_match(world) ? "match" : "differ") << std::endl;
  ddp::barrier();  // nobody tears down the store while a peer still needs it
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& error) {
    std::cerr << "host_rank: error: " << error.what() << std::endl;
    return 1;
  }
}
