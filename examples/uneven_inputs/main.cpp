// Uneven inputs with ddp::Join: every rank reads its own shard, and the shards differ in size
// (rank r has 200 + 37 r samples, as when each rank reads its own files), so the ranks run
// different numbers of batches per epoch. Without Join the rank with more batches would wait in its
// gradient allreduce until the timeout; inside Join::run it finishes, and every rank ends the epoch
// with the same model.
//   ddprun --standalone --nproc-per-node 2 ./build/examples/uneven_inputs/uneven_inputs_ddp
#include <iostream>

#include <torch/torch.h>

#include <ddp/ddp.h>

namespace {

constexpr int kBatch = 16;
constexpr int kEpochs = 3;

// Rank r's shard of a linear regression problem, y = x w* + noise; the same w* on every rank.
std::pair<torch::Tensor, torch::Tensor> shard_of(int rank) {
  torch::manual_seed(0);
  const torch::Tensor w = torch::randn({8, 1});
  torch::manual_seed(100 + rank);
  const torch::Tensor x = torch::randn({200 + 37 * rank, 8});
  return {x, x.matmul(w) + 0.1 * torch::randn({x.size(0), 1})};
}

int run() {
  auto pg = ddp::init_process_group(ddp::InitOptions{"gloo", "env://"});
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  auto [x, y] = shard_of(rank);

  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  ddp::DistributedDataParallel model(net, pg);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));
  // A progress line's running loss, summed over the ranks every batch (a collective in the loop:
  // made joinable, so that a rank that ran out adds zeros instead of leaving the others waiting).
  ddp::JoinableAllReduce running(torch::zeros({2}, torch::kDouble));  // [loss * samples, samples]

  for (int epoch = 1; epoch <= kEpochs; ++epoch) {
    const torch::Tensor order = torch::randperm(x.size(0));
    int64_t batches = 0;
    torch::Tensor mine = torch::zeros({2}, torch::kDouble), progress = torch::zeros({2}, torch::kDouble);
    ddp::Join join({model, running});  // in the order the loop runs their collectives
    join.run([&] {
      for (int64_t start = 0; start < x.size(0); start += kBatch) {
        const torch::Tensor idx = order.slice(0, start, std::min<int64_t>(start + kBatch, x.size(0)));
        optimizer.zero_grad();
        auto loss = torch::mse_loss(model.forward(x.index_select(0, idx)), y.index_select(0, idx));
        loss.backward();
        optimizer.step();
        const double n = static_cast<double>(idx.size(0));
        const torch::Tensor sums = torch::tensor({loss.item<double>() * n, n}, torch::kDouble);
        mine += sums;
        progress += running.all_reduce(sums);
        if (++batches == 10 && rank == 0) {
          std::cout << "epoch " << epoch << ", batch 10: running loss " << (progress[0] / progress[1]).item<double>()
                    << " over " << progress[1].item<double>() << " samples of all ranks" << std::endl;
        }
      }
    });  // returns on every rank once the last rank's loop has ended
    const auto counts = ddp::all_gather(torch::tensor({batches}));
    ddp::all_reduce(mine);  // the epoch's loss over every rank's samples
    if (rank == 0) {
      std::cout << "epoch " << epoch << ":";
      for (int r = 0; r < world; ++r) std::cout << " rank " << r << " ran " << counts[r].item<int64_t>() << " batches,";
      std::cout << " mean loss " << (mine[0] / mine[1]).item<double>() << " over " << mine[1].item<double>()
                << " samples" << std::endl;
    }
  }

  // Join handed every rank the model of a rank that trained until the end: the replicas are equal.
  auto checksum = torch::zeros({1});
  for (const auto& p : model.parameters()) checksum += p.sum();
  const auto sums = ddp::all_gather(checksum);
  for (const auto& other : sums) {
    if (!torch::equal(other, sums[0])) {
      std::cerr << "rank " << rank << ": replicas diverged" << std::endl;
      return 1;
    }
  }
  if (rank == 0) std::cout << "replicas identical after " << kEpochs << " epochs of uneven inputs" << std::endl;
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& error) {
    std::cerr << "uneven_inputs_ddp: error: " << error.what() << std::endl;
    return 1;
  }
}
