// apex_recipe: the NVIDIA Apex + DDP training recipe, in C++ with torchddp, on Fashion-MNIST.
//
//   Apex (Python)                                  here
//   model = apex.parallel.convert_syncbn_model(m)  ddp::convert_sync_batchnorm(net)
//   model, opt = amp.initialize(model, opt)        ddp::GradScaler scaler; ddp::AutocastGuard (bf16 on CPU)
//   model = DistributedDataParallel(model)         ddp::DistributedDataParallel model(net)
//   DistributedSampler(train), (val)               ddp::DistributedSampler for both
//   sampler.set_epoch(epoch)                       sampler.set_epoch(epoch)
//   with amp.scale_loss(loss, opt) as s: s.backward()   scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
//   every 5 epochs rank 0 saves {model, opt, amp}  every --save-every epochs: save_checkpoint(..., state("scaler"))
//
//   ddprun --nproc-per-node 2 apex_recipe --epochs 3
//   ddprun --nproc-per-node 2 apex_recipe --precision fp32     # the same recipe without autocast
//
// A checkpoint directory makes a run resumable: a second start continues from the newest
// checkpoint with the model, optimizer, scaler and sampler exactly where they were.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <ddp/ddp.h>

#include "command_line.h"
#include "fashion_mnist.h"

namespace {

namespace F = torch::nn::functional;

struct Options {
  int epochs = 3;
  int64_t batch_size = 64;   // per rank
  double lr = 2e-3;          // Adam
  std::string precision = "bf16";  // bf16: autocast + GradScaler; fp32: neither
  std::string data_dir = examples::FashionMNIST::kDefaultDir;
  size_t limit_train = 0;    // 0: the whole training set
  std::string checkpoint_dir;
  int save_every = 1;        // epochs between checkpoints (the Apex recipe uses 5)
  int threads = 1;
  double timeout_s = 1800;   // bounds every collective: a dead or frozen rank ends the job after this long
  int64_t seed = 0;
};

// A small CNN with a BatchNorm after every hidden layer, held in a Sequential so that
// convert_sync_batchnorm can reach them (nn/include/ddp/sync_batchnorm.h says what it cannot reach).
torch::nn::Sequential make_net() {
  namespace nn = torch::nn;
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)), nn::BatchNorm2d(16), nn::ReLU(),
      nn::MaxPool2d(2),                                                     // [N, 16, 14, 14]
      nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1).bias(false)), nn::BatchNorm2d(32), nn::ReLU(),
      nn::MaxPool2d(2),                                                     // [N, 32, 7, 7]
      nn::Flatten(), nn::Linear(nn::LinearOptions(32 * 7 * 7, 64).bias(false)), nn::BatchNorm1d(64), nn::ReLU(),
      nn::Linear(64, examples::FashionMNIST::kClasses));                         // logits [N, 10]
}

// Validation with its own sampler: each rank evaluates a disjoint shard (pad(false): every test
// sample exactly once), the sums are added over the ranks, so the figures are those of the whole set.
// Eval mode: SyncBatchNorm uses its running statistics and does not communicate.
ddp::Metrics validate(torch::nn::SequentialImpl& net, const examples::FashionMNIST& test, const Options& options, bool bf16) {
  ddp::DistributedSampler sampler(*test.size(), ddp::DistributedSamplerOptions().shuffle(false).pad(false));
  auto loader = torch::data::make_data_loader(examples::FashionMNIST(test).map(torch::data::transforms::Stack<>()),
                                              sampler, torch::data::DataLoaderOptions().batch_size(options.batch_size));
  torch::NoGradGuard no_grad;
  net.eval();
  ddp::Metrics local;
  local.add("loss", 0, 0);  // a rank with an empty shard still reduces the same names
  local.add("accuracy", 0, 0);
  for (auto& batch : *loader) {
    torch::Tensor output;
    {
      ddp::AutocastGuard autocast(torch::kCPU, ddp::AutocastOptions().enabled(bf16));
      output = net.forward(batch.data);
    }
    output = output.to(torch::kFloat);
    const double n = static_cast<double>(batch.data.size(0));
    local.add("loss", F::cross_entropy(output, batch.target, F::CrossEntropyFuncOptions().reduction(torch::kSum))
                          .item<double>(), n);
    local.add("accuracy", output.argmax(1).eq(batch.target).sum().item<double>(), n);
  }
  net.train();
  return local.all_reduce();
}

int run(const Options& options) {
  torch::set_num_threads(options.threads);
  ddp::InitOptions init{"gloo", "env://"};
  init.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000));
  auto pg = ddp::init_process_group(init);
  const int rank = ddp::get_rank();
  const bool leader = rank == 0;
  const bool bf16 = options.precision == "bf16";

  examples::FashionMNIST train(examples::FashionMNIST::Split::kTrain, options.data_dir);
  train.head(options.limit_train);
  const examples::FashionMNIST test(examples::FashionMNIST::Split::kTest, options.data_dir);

  // 1. The model with plain BatchNorms, converted: every BatchNorm now normalizes over the global batch.
  torch::manual_seed(options.seed);
  auto net = ddp::convert_sync_batchnorm(make_net());
  // 2. DDP (broadcasts rank 0's parameters and buffers), the optimizer over its parameters.
  ddp::DistributedDataParallel model(net, pg);
  torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(options.lr));
  // 3. Dynamic loss scaling; disabled for fp32, so the loop below is the same for both.
  ddp::GradScaler scaler(ddp::GradScalerOptions().enabled(bf16));
  // 4. The training sampler: a different shard per rank, a new shuffle per epoch.
  ddp::DistributedSampler sampler(*train.size(), ddp::DistributedSamplerOptions().shuffle(true).seed(options.seed));
  auto loader = torch::data::make_data_loader(examples::FashionMNIST(train).map(torch::data::transforms::Stack<>()),
                                              sampler, torch::data::DataLoaderOptions().batch_size(options.batch_size));

  // 5. Resume: model, optimizer, scaler and sampler from the newest checkpoint, if any.
  int start_epoch = 0;
  if (!options.checkpoint_dir.empty()) {
    if (auto latest = ddp::latest_checkpoint(options.checkpoint_dir)) {
      auto state = ddp::load_checkpoint(*latest, model, &optimizer, ddp::LoadOptions().state("scaler", &scaler));
      start_epoch = static_cast<int>(state.sampler.epoch);
      sampler.load_state(state.sampler);
      if (leader) std::printf("resumed from %s at epoch %d (loss scale %g)\n", latest->c_str(), start_epoch + 1, scaler.get_scale());
    }
  }
  if (leader) {
    std::printf("apex_recipe: world %d, %s, SyncBatchNorm, batch %lld per rank, %zu train / %zu test samples\n",
                ddp::get_world_size(), bf16 ? "bf16 autocast + GradScaler" : "fp32",
                static_cast<long long>(options.batch_size), *train.size(), *test.size());
  }

  for (int epoch = start_epoch; epoch < options.epochs; ++epoch) {
    if (sampler.epoch() != epoch) sampler.set_epoch(epoch);
    ddp::Metrics local;
    int64_t skipped = 0;
    const auto start = std::chrono::steady_clock::now();
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      // 6. Forward and loss in bf16 where autocast says so; parameters and gradients stay float32.
      torch::Tensor output, loss;
      {
        ddp::AutocastGuard autocast(torch::kCPU, ddp::AutocastOptions().enabled(bf16));
        output = model.forward(batch.data);
        loss = F::cross_entropy(output, batch.target);
      }
      // 7. Backward of the scaled loss (outside autocast); DDP averages the scaled gradients.
      scaler.scale(loss).backward();
      // 8. Step unless some rank's gradient overflowed (then every rank skips), and adapt the scale.
      if (!scaler.step(optimizer)) ++skipped;
      scaler.update();
      const double n = static_cast<double>(batch.data.size(0));
      local.add("loss", loss.item<double>() * n, n);
      local.add("accuracy", output.argmax(1).eq(batch.target).sum().item<double>(), n);
    }
    const auto trained = local.all_reduce();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // 9. Validation over every rank's shard of the test set.
    const auto validated = validate(*net, test, options, bf16);
    if (leader) {
      std::printf("epoch %d/%d: train loss %.4f acc %.2f%% | test loss %.4f acc %.2f%% (%.0f samples) | "
                  "%.0f samples/s, %.1f s | scale %g, %lld skipped\n",
                  epoch + 1, options.epochs, trained.mean("loss"), 100 * trained.mean("accuracy"),
                  validated.mean("loss"), 100 * validated.mean("accuracy"), validated.count("accuracy"),
                  trained.count("loss") / seconds, seconds, scaler.get_scale(), static_cast<long long>(skipped));
      std::fflush(stdout);
    }
    // 10. Every save_every epochs (and after the last): rank 0 writes {model, optimizer, scaler,
    // sampler position}; every rank returns once the file is complete.
    const bool last = epoch + 1 == options.epochs;
    if (!options.checkpoint_dir.empty() && ((epoch + 1) % options.save_every == 0 || last)) {
      std::filesystem::create_directories(options.checkpoint_dir);
      const ddp::TrainingState state{epoch + 1, /*global_step*/ 0, ddp::SamplerState{epoch + 1, 0}, {}};
      ddp::save_checkpoint(ddp::checkpoint_path(options.checkpoint_dir, epoch + 1), model, &optimizer, state,
                           ddp::CheckpointOptions().state("scaler", &scaler).keep_last(2));
    }
  }
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"The Apex recipe in C++: SyncBatchNorm + bf16 autocast + GradScaler + DDP on Fashion-MNIST"};
  // Every number through one checked parser, each rule once (command_line.h).
  app.add_option("--epochs", options.epochs, "passes over the training set")->check(examples::epochs());
  app.add_option("--batch-size", options.batch_size, "samples per step on each rank")->check(examples::batch_size());
  app.add_option("--lr", options.lr, "Adam learning rate")
      ->check(examples::finite_number(1e-9, 10, "must be a finite number from 1e-09 to 10"));
  app.add_option("--precision", options.precision, "bf16 (autocast + GradScaler) or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--data-dir", options.data_dir, "folder with the Fashion-MNIST *-ubyte.gz files")
      ->check(examples::fashion_mnist_directory());
  app.add_option("--limit-train", options.limit_train, "use only the first N training samples (0: all)")
      ->check(examples::limit_train());
  app.add_option("--checkpoint-dir", options.checkpoint_dir, "save checkpoints here and resume from the newest")
      ->check(examples::writable_directory());
  app.add_option("--save-every", options.save_every, "epochs between checkpoints")->check(examples::epochs());
  app.add_option("--threads", options.threads, "torch threads per rank")->check(examples::thread_count());
  app.add_option("--timeout", options.timeout_s, "seconds a collective may wait for the other ranks (a dead or frozen rank)")
      ->check(examples::timeout_seconds());
  app.add_option("--seed", options.seed, "model initialization and shuffle seed")->check(examples::seed());
  if (const auto exit_code = examples::parse_command_line(app, argc, argv)) return *exit_code;
  try {
    return run(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "apex_recipe: error: %s\n", error.what());
    return 1;
  }
}
