// A small GAN, data-parallel: a generator learns to draw points of a ring of 8 Gaussians from noise
// while a discriminator learns to tell its points from real ones. Two models, each wrapped in DDP,
// two optimizers, and ONE checkpoint holding all four, written after every epoch; a start finds the
// newest and resumes from it (or starts fresh when there is none).
//
//   ddprun --standalone --nproc-per-node 2 -- ./build/examples/gan/gan_ddp --checkpoint-dir /tmp/gan
//   # ddprun --max-restarts 1 ...: a rank that dies is restarted with the others, from the checkpoint
//
// Python's torch.load on a checkpoint gives {"generator": {...}, "discriminator": {...}}.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <torch/torch.h>

#include <ddp/ddp.h>

namespace {

constexpr int64_t kNoise = 8;  // the generator's input size

torch::nn::Sequential make_generator() {
  return torch::nn::Sequential(torch::nn::Linear(kNoise, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                               torch::nn::ReLU(), torch::nn::Linear(64, 2));
}

torch::nn::Sequential make_discriminator() {
  return torch::nn::Sequential(torch::nn::Linear(2, 64), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
                               torch::nn::Linear(64, 1));
}

// The real data: `n` points on a ring of 8 Gaussians, the same on every rank (its own generator).
torch::Tensor ring_of_gaussians(int64_t n) {
  const auto angle = torch::arange(n).remainder(8).to(torch::kFloat) * (2 * M_PI / 8);
  const auto noise = torch::randn({n, 2}, at::detail::createCPUGenerator(/*seed=*/1234));
  return torch::stack({angle.cos(), angle.sin()}, 1) * 2 + noise * 0.05;
}

struct Options {
  int64_t epochs = 20;
  int64_t samples = 4096;  // real points
  int64_t batch_size = 64;  // per rank
  std::string checkpoint_dir;
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--epochs") options.epochs = std::stoll(value);
    else if (flag == "--samples") options.samples = std::stoll(value);
    else if (flag == "--checkpoint-dir") options.checkpoint_dir = value;
    else throw std::invalid_argument("unknown flag " + flag + " (flags: --epochs N, --samples N, --checkpoint-dir DIR)");
  }
  if ((argc - 1) % 2 != 0) throw std::invalid_argument(std::string("flag ") + argv[argc - 1] + " needs a value");
  return options;
}

int run(const Options& options) {
  auto pg = ddp::init_process_group();
  const int rank = ddp::get_rank();
  torch::set_num_threads(1);

  torch::manual_seed(0);  // the same initial weights everywhere (DDP broadcasts rank 0's anyway)
  auto generator = make_generator();
  auto discriminator = make_discriminator();
  ddp::DistributedDataParallel G(generator, pg);
  ddp::DistributedDataParallel D(discriminator, pg);
  torch::optim::Adam optimizer_g(G.parameters(), torch::optim::AdamOptions(1e-3).betas({0.5, 0.999}));
  torch::optim::Adam optimizer_d(D.parameters(), torch::optim::AdamOptions(1e-3).betas({0.5, 0.999}));
  torch::manual_seed(1 + rank);  // each rank its own noise (the checkpoint keeps every rank's stream)

  const torch::Tensor real_points = ring_of_gaussians(options.samples);
  ddp::DistributedSampler sampler(options.samples);

  // What one checkpoint holds, by name, as torch.save({"generator": G.state_dict(), ...}) in Python
  // (every rank's RNG state comes along).
  const std::vector<ddp::CheckpointEntry> checkpoint = {
      {"generator", G}, {"discriminator", D}, {"optimizerG", optimizer_g}, {"optimizerD", optimizer_d}};

  // Resume from the newest checkpoint; a first start (none yet) starts fresh.
  int64_t start_epoch = 0;
  if (!options.checkpoint_dir.empty()) {
    if (rank == 0) std::filesystem::create_directories(options.checkpoint_dir);  // rank 0 writes there
    const auto restored = ddp::load_checkpoint_if_exists(options.checkpoint_dir, checkpoint);
    start_epoch = restored.state.epoch;
    if (rank == 0 && restored.loaded) {
      std::printf("resumed from %s at epoch %lld\n", restored.path.c_str(), static_cast<long long>(start_epoch + 1));
    } else if (rank == 0) {
      std::printf("no checkpoint in %s yet: starting from scratch\n", options.checkpoint_dir.c_str());
    }
  }

  for (int64_t epoch = start_epoch; epoch < options.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    double loss_d_sum = 0, loss_g_sum = 0;
    int64_t steps = 0;
    while (auto indices = sampler.next(options.batch_size)) {
      const auto real = real_points.index_select(0, torch::tensor(std::vector<int64_t>(indices->begin(), indices->end())));
      const int64_t n = real.size(0);
      const auto fake = G.forward(torch::randn({n, kNoise}));
      // Discriminator: real points are 1, generated ones 0; one forward of both halves.
      const auto scores = D.forward(torch::cat({real, fake.detach()}));
      const auto labels = torch::cat({torch::ones({n, 1}), torch::zeros({n, 1})});
      const auto loss_d = torch::binary_cross_entropy_with_logits(scores, labels);
      optimizer_d.zero_grad();
      loss_d.backward();
      optimizer_d.step();
      // Generator: make the discriminator call its points real. This pass also leaves gradients
      // in D, which optimizer_d.zero_grad() discards before D's next step: under no_sync() D does
      // not average them across the ranks for nothing (G's are averaged as usual).
      torch::Tensor loss_g;
      {
        auto skip_d = D.no_sync();
        loss_g = torch::binary_cross_entropy_with_logits(D.forward(fake), torch::ones({n, 1}));
        optimizer_g.zero_grad();
        loss_g.backward();
      }
      optimizer_g.step();
      loss_d_sum += loss_d.item<double>();
      loss_g_sum += loss_g.item<double>();
      ++steps;
    }
    // The mean losses over every rank's steps, all 17 digits of the double: a resumed run prints
    // exactly the straight run's numbers.
    auto losses = torch::tensor({loss_d_sum, loss_g_sum, static_cast<double>(steps)}, torch::kDouble);
    ddp::all_reduce(losses);
    if (rank == 0) {
      std::printf("epoch %lld/%lld: loss D %.17g G %.17g\n", static_cast<long long>(epoch + 1),
                  static_cast<long long>(options.epochs), losses[0].item<double>() / losses[2].item<double>(),
                  losses[1].item<double>() / losses[2].item<double>());
      std::fflush(stdout);
    }
    if (!options.checkpoint_dir.empty()) {
      ddp::TrainingState state;
      state.epoch = epoch + 1;
      ddp::save_checkpoint(ddp::checkpoint_path(options.checkpoint_dir, epoch + 1), checkpoint, state,
                           ddp::CheckpointOptions().keep_last(2));
    }
  }
  // Where the generator's points land: their mean distance from the centre (the ring's radius is 2).
  torch::NoGradGuard no_grad;
  const auto radius = G.forward(torch::randn({1000, kNoise})).norm(2, 1).mean();
  if (rank == 0) std::printf("generated points: mean radius %.17g (real: 2)\n", radius.item<double>());
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "gan_ddp: error: %s\n", error.what());
    return 1;
  }
}
