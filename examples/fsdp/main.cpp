// fsdp_big_model: an MLP of --layers blocks of Linear(--width, --width) trained with Adam, fully
// sharded (ddp::fully_shard) or, with --ddp, by DistributedDataParallel for comparison. DDP+Adam
// keeps 16 bytes per parameter on every rank (parameters, gradients, two Adam moments) and its
// buckets; fully sharded, each rank keeps 16/W plus the blocks being gathered. At the defaults
// (width 4096, 6 blocks: 100.7 M parameters) DDP+Adam needs about 2 GB per rank and 4 fully
// sharded ranks about 0.5 GB each beyond the model's construction, so a rank capped at 1.5 GB
// (prlimit --as) trains fully sharded and runs out of memory under DDP:
//
//   ddprun --nproc-per-node 4 fsdp_big_model                  # fully sharded
//   ddprun --nproc-per-node 4 fsdp_big_model --ddp            # the same training through DDP
//
// A model that barely fits is sharded without prefetch (forward_prefetch(false),
// BackwardPrefetch::kNone): at most one block's full parameters and gradients at once. --prefetch
// uses fully_shard's defaults (FSDP2's prefetching: more overlap, up to about four blocks at once).
//
// Rank 0 prints the loss of each step and what a rank holds (the library's count).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ddp/ddp.h>

#include "command_line.h"

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct BigMlp : torch::nn::Module {
  BigMlp(int64_t width, int layers) {
    for (int i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(width)));
    head = register_module("head", torch::nn::Linear(width, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = ddp::sharded_forward(block, x);  // the port's one line per block call
    return head(x);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};

struct Options {
  int64_t width = 4096;
  int layers = 6;
  int steps = 3;
  int64_t batch = 8;
  bool ddp = false;
  bool prefetch = false;  // fully_shard's default prefetching instead of one block at a time
  bool vm_peak = false;  // print this rank's peak virtual memory (what prlimit --as caps) at the end
};

// VmPeak of /proc/self/status in MiB (Linux), or -1.
double vm_peak_mib() {
  FILE* status = std::fopen("/proc/self/status", "r");
  if (status == nullptr) return -1;
  char line[256];
  double kib = -1;
  while (std::fgets(line, sizeof line, status) != nullptr) {
    if (std::sscanf(line, "VmPeak: %lf kB", &kib) == 1) break;
  }
  std::fclose(status);
  return kib < 0 ? -1 : kib / 1024;
}

// The same data on every rank's slice of each step's batch.
std::pair<torch::Tensor, torch::Tensor> batch_of(const Options& options, int step, int rank) {
  torch::manual_seed(1000 + 31 * step + rank);
  return {torch::randn({options.batch, options.width}), torch::randint(10, {options.batch})};
}

template <typename Model>
void train(const Options& options, Model& model, torch::optim::Optimizer& optimizer, const char* what) {
  const int rank = ddp::get_rank();
  for (int step = 0; step < options.steps; ++step) {
    auto [x, y] = batch_of(options, step, rank);
    optimizer.zero_grad();
    torch::Tensor loss = torch::nn::functional::cross_entropy(model.forward(x), y);
    loss.backward();
    optimizer.step();
    double total = loss.item<double>();
    ddp::all_reduce(total);
    if (rank == 0) std::printf("%s step %d: mean loss %.4f\n", what, step + 1, total / ddp::get_world_size());
  }
}

int run(const Options& options) {
  ddp::init_process_group();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(0);
  auto net = std::make_shared<BigMlp>(options.width, options.layers);
  int64_t parameters = 0;
  for (const auto& param : net->parameters()) parameters += param.numel();
  if (rank == 0) {
    std::printf("fsdp_big_model: %.1f M parameters (%d blocks of %lld x %lld), world %d, %s\n", parameters / 1e6,
                options.layers, static_cast<long long>(options.width), static_cast<long long>(options.width), world,
                options.ddp ? "DistributedDataParallel + Adam" : "fully sharded (ddp::fully_shard) + Adam");
  }
  if (options.ddp) {
    ddp::DistributedDataParallel model(net);
    torch::optim::Adam optimizer(model.parameters(), 1e-4);
    train(options, model, optimizer, "ddp");
  } else {
    const auto sharding = options.prefetch ? ddp::FSDPOptions()
                                           : ddp::FSDPOptions().forward_prefetch(false).backward_prefetch(
                                                 ddp::BackwardPrefetch::kNone);
    for (auto& block : net->blocks) ddp::fully_shard(block, sharding);
    auto model = ddp::fully_shard(net, sharding);
    torch::optim::Adam optimizer(net->parameters(), 1e-4);
    train(options, model, optimizer, "fsdp");
    const auto stats = model.memory_stats();
    const double held = static_cast<double>(stats.parameter_bytes + stats.gradient_bytes +
                                            ddp::optimizer_state_bytes(optimizer));
    if (rank == 0) {
      std::printf("rank 0 holds %.2f bytes per parameter (DDP+Adam: 16), at most %.1f MiB unsharded at once\n",
                  held / parameters, stats.peak_unsharded_bytes / 1048576.0);
    }
  }
  if (options.vm_peak) std::printf("rank %d: peak virtual memory %.0f MiB\n", rank, vm_peak_mib());
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"An MLP too big for DDP+Adam on one rank, trained fully sharded (ddp::fully_shard)"};
  // Every number through one checked parser (command_line.h): a bad flag exits 2 before anything runs.
  app.add_option("--width", options.width, "features of each block's Linear(width, width)")
      ->check(examples::whole_number(1, 1 << 16));
  app.add_option("--layers", options.layers, "blocks")->check(examples::whole_number(1, 1 << 10));
  app.add_option("--steps", options.steps, "Adam steps")->check(examples::whole_number(0, 1 << 20));
  app.add_option("--batch", options.batch, "samples per step on each rank")->check(examples::batch_size());
  app.add_flag("--ddp", options.ddp, "train through DistributedDataParallel instead, for comparison");
  app.add_flag("--prefetch", options.prefetch,
               "fully_shard's default prefetching (more overlap, more blocks unsharded at once)");
  app.add_flag("--vm-peak", options.vm_peak, "print each rank's peak virtual memory (what prlimit --as caps)");
  if (const auto exit_code = examples::parse_command_line(app, argc, argv)) return *exit_code;
  try {
    return run(options);
  } catch (const std::exception& error) {
    // LibTorch's c10::Error appends a C++ backtrace to what(): its first part says what happened.
    const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
    const std::string text = torch_error ? torch_error->what_without_backtrace() : error.what();
    const bool memory = text.find("can't allocate memory") != std::string::npos ||
                        text.find("bad_alloc") != std::string::npos || text.find("Cannot allocate") != std::string::npos;
    std::fprintf(stderr, "fsdp_big_model: %s%s\n", memory ? "out of memory: " : "error: ", text.c_str());
    if (memory) std::fprintf(stderr, "fsdp_big_model: shard the model over more ranks (drop --ddp, or more ranks)\n");
    return 1;
  }
}
