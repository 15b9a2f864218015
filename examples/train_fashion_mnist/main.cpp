// train_fashion_mnist: a small CNN on Fashion-MNIST, data-parallel over the ranks of a process
// group. Each rank trains on its own shard (DistributedSampler), gradients are averaged by
// DistributedDataParallel, the test set is sharded for evaluation, and rank 0 prints the global
// figures of every epoch.
//
//   ddprun --nproc-per-node 2 train_fashion_mnist --epochs 3
//   # or by hand, one line per rank:
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2 RANK=0 train_fashion_mnist &
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2 RANK=1 train_fashion_mnist
// Without WORLD_SIZE in the environment it runs alone (world 1).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "command_line.h"

#include <ddp/comm_hooks.h>
#include <ddp/data_loader.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fully_shard.h>
#include <ddp/distributed_sampler.h>
#include <ddp/launch_environment.h>
#include <ddp/zero_redundancy_optimizer.h>
#include "fashion_mnist.h"
#include <ddp/metrics.h>
#include <ddp/process_group.h>
#if __has_include(<ddp/checkpoint.h>)
#include <ddp/checkpoint.h>
#define TRAIN_HAS_CHECKPOINT 1
#endif

namespace {

namespace F = torch::nn::functional;

struct Options {
  int epochs = 3;
  int64_t batch_size = 64;  // per rank
  double lr = 2e-3;  // Adam; 3 epochs at world 2 reach ~89% test accuracy
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  std::string backend = "gloo";
  std::string init_method = "env://";  // file:///path: ranks started by hand meet in a file (Windows)
  int64_t seed = 0;
  std::string data_dir = examples::FashionMNIST::kDefaultDir;
  int threads = 1;
  double timeout_s = 1800;  // bounds every collective: a dead or frozen rank ends the job after this long
  size_t limit_train = 0;   // 0: the whole training set
  std::string checkpoint_dir;
  std::string run_id;                   // "": the launcher's (run_identity)
  bool resume_from_other_run = false;
  std::string comm_hook = "none";  // none, fp16, bf16, powersgd
  int64_t powersgd_rank = 2;
  int64_t powersgd_start_iter = 10;
  bool zero = false;  // Adam's state sharded over the ranks (ZeroRedundancyOptimizer)
  bool fsdp = false;  // parameters, gradients and Adam's state sharded (ddp::fully_shard)
  bool sharded_checkpoint = false;  // with --fsdp: each rank saves its own shards, nothing gathered
  bool allow_nonfinite = false;  // keep training when the loss is NaN or infinite
  std::string device = "cpu";    // cpu, cuda (this rank's GPU: LOCAL_RANK modulo the GPUs) or cuda:N
};

// --device: where the model and each batch live.
c10::Device device_of(const Options& options) {
  if (options.device != "cuda") return c10::Device(options.device);
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(ddp::local_rank() % gpus));
}

// --device: cpu, or cuda[:N] where this process sees a GPU (N among them); refused before any work.
CLI::Validator device_flag() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text == "cpu") return "";
        const auto gpus = static_cast<int>(torch::cuda::device_count());
        if (text != "cuda" && text.rfind("cuda:", 0) != 0) return "must be cpu, cuda or cuda:N, got '" + text + "'";
        if (gpus == 0) return "'" + text + "' needs a CUDA GPU, and this process sees none (use cpu)";
        if (text == "cuda") return "";
        const auto index = examples::detail::parse_whole(text.substr(5));
        if (!index || *index < 0 || *index >= gpus) {
          return "'" + text + "': the GPUs this process sees are cuda:0 to cuda:" + std::to_string(gpus - 1);
        }
        return "";
      },
      "DEVICE");
}


// Two conv blocks and two linear layers: ~0.2M parameters, about 90% test accuracy in a few epochs.
struct Net : torch::nn::Module {
  Net()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(32 * 7 * 7, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, examples::FashionMNIST::kClasses))) {}

  // conv2 and fc1 (the largest layers) through ddp::sharded_forward: with --fsdp each is a block
  // of its own, gathered only while it computes; otherwise a plain call.
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);                          // [N, 16, 14, 14]
    x = torch::max_pool2d(torch::relu(ddp::sharded_forward(conv2, x)), 2);    // [N, 32, 7, 7]
    return fc2(torch::relu(ddp::sharded_forward(fc1, x.flatten(1))));         // logits [N, 10]
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

// One line, redrawn in place, on a terminal; nothing otherwise (plain per-epoch lines suffice).
class ProgressBar {
 public:
  ProgressBar(bool enabled, size_t total) : enabled_(enabled), total_(total) {}
  void update(size_t done, const std::string& label, double loss) {
    const auto now = std::chrono::steady_clock::now();
    if (!enabled_ || (done < total_ && now - last_ < std::chrono::milliseconds(100))) return;
    last_ = now;
    const int width = 30;
    const int filled = total_ ? static_cast<int>(width * done / total_) : width;
    std::printf("\r%s [%s%s] %3d%% loss %.4f", label.c_str(), std::string(filled, '#').c_str(),
                std::string(width - filled, '.').c_str(), total_ ? static_cast<int>(100 * done / total_) : 100, loss);
    std::fflush(stdout);
  }
  void finish() {
    if (enabled_) std::printf("\r\033[K");  // clear the bar; the epoch line replaces it
  }

 private:
  bool enabled_;
  size_t total_;
  std::chrono::steady_clock::time_point last_{};
};

// env:// under ddprun, torchrun, srun or mpirun; started alone, a world of one (launch_environment.h).
// --init-method file:///path: each rank started by hand with RANK and WORLD_SIZE, no launcher.
ddp::ProcessGroupPtr init(const Options& options) {
  ddp::InitOptions init;
  init.backend = options.backend;
  init.init_method = options.init_method;
  init.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000));
  return ddp::init_process_group(init);
}

// Global loss and accuracy on the test set, sharded over the ranks without shuffling. pad(false):
// the shards are disjoint and together hold every test sample exactly once (PyTorch's sampler would
// repeat some to even them out), so the summed figures are exact with no masking.
template <typename Model>
ddp::Metrics evaluate(Model& model, Net& net, const examples::FashionMNIST& test, int64_t batch_size,
                      const c10::Device& device) {
  ddp::DistributedSampler sampler(*test.size(), ddp::DistributedSamplerOptions().shuffle(false).pad(false));
  auto loader = torch::data::make_data_loader(examples::FashionMNIST(test).map(torch::data::transforms::Stack<>()),
                                              sampler, torch::data::DataLoaderOptions().batch_size(batch_size));
  // Through the model: with --fsdp, only it can gather the shards.
  torch::NoGradGuard no_grad;
  net.eval();
  ddp::Metrics local;
  local.add("loss", 0, 0);  // a rank with an empty shard still reduces the same names
  local.add("accuracy", 0, 0);
  for (auto& batch : *loader) {
    const double n = static_cast<double>(batch.data.size(0));
    const torch::Tensor output = model.forward(batch.data.to(device));
    const auto target = batch.target.to(device);
    local.add("loss", F::cross_entropy(output, target, F::CrossEntropyFuncOptions().reduction(torch::kSum))
                          .item<double>(), n);
    local.add("accuracy", output.argmax(1).eq(target).sum().item<double>(), n);
  }
  net.train();
  return local.all_reduce();
}

// --comm-hook: how each gradient bucket is reduced (ddp/comm_hooks.h).
void register_comm_hook(ddp::DistributedDataParallel<Net>& model, const Options& options) {
  if (options.comm_hook == "fp16") model.register_comm_hook(ddp::hooks::fp16_compress());
  if (options.comm_hook == "bf16") model.register_comm_hook(ddp::hooks::bf16_compress());
  if (options.comm_hook == "powersgd") {
    model.register_comm_hook(ddp::hooks::powersgd(ddp::hooks::PowerSGDOptions()
                                                      .matrix_approximation_rank(options.powersgd_rank)
                                                      .start_powerSGD_iter(options.powersgd_start_iter)));
  }
}

// A loss that is not a finite number (too high a learning rate diverges) would make this step's
// update poison every parameter, on every rank once averaged: stop before it, unless told to go on.
void check_finite_loss(double loss, const std::string& epoch_label, int64_t step, int rank, const Options& options) {
  if (std::isfinite(loss) || options.allow_nonfinite) return;
  const std::string value = std::isnan(loss) ? "nan" : loss > 0 ? "inf" : "-inf";
  char lr[32];
  std::snprintf(lr, sizeof(lr), "%g", options.lr);
  throw std::runtime_error(epoch_label + ", step " + std::to_string(step) + " (rank " + std::to_string(rank) +
                           "): the training loss is " + value +
                           ", not a finite number, so training stopped before this step's update; try a lower --lr "
                           "(this run's is " + lr + "), or pass --allow-nonfinite to keep going");
}

#ifdef TRAIN_HAS_CHECKPOINT
// Which run this process belongs to, written into every checkpoint it saves: --run-id, else the
// launcher's (ddprun's TORCHDDP_RUN_ID, the same across its --max-restarts; torchrun's --rdzv-id;
// Slurm's job and step), else none. torchrun's default --rdzv-id, "none", names no run.
std::string run_identity(const Options& options) {
  if (!options.run_id.empty()) return options.run_id;
  const std::string launcher = ddp::launch_environment().run_id;
  return launcher == "none" ? "" : launcher;
}

// The run that wrote a checkpoint ("" for a run without an id, or a checkpoint from before ids).
std::string writer_of(const ddp::TrainingState& state) {
  const auto stored = state.metadata.find("run_id");
  return stored == state.metadata.end() ? "" : stored->second;
}

std::string describe_run(const std::string& id) {
  return id.empty() ? "a run without an id (no --run-id, and no launcher's run id)" : "run '" + id + "'";
}

// Two jobs sharing a --checkpoint-dir must not silently continue each other's training: a
// checkpoint of another run (or of a run without an id) is resumed only with
// --resume-from-other-run. Every rank reads the same file and has the same id, so all decide alike.
void check_run(const std::string& path, const ddp::TrainingState& state, const Options& options) {
  const std::string writer = writer_of(state);
  const std::string self = run_identity(options);
  if ((!self.empty() && writer == self) || options.resume_from_other_run) return;
  throw std::runtime_error(path + " was written by " + describe_run(writer) + ", and this is " + describe_run(self) +
                           ": resuming it would continue another job's training. To continue it, pass "
                           "--resume-from-other-run" + (writer.empty() ? "" : " (or start with --run-id " + writer + ")") +
                           "; otherwise give this job its own --checkpoint-dir");
}
#endif

template <typename Model>
int train_and_test(const Options& options, Model& model, Net& net, torch::optim::Optimizer& optimizer_ref,
                   examples::FashionMNIST& train, const examples::FashionMNIST& test, const c10::Device& device,
                   const char* optimizer_name);

int run(const Options& options) {
  torch::set_num_threads(options.threads);
  auto pg = init(options);
  const int rank = ddp::get_rank();
  const int world = ddp::get_world_size();
  const bool leader = rank == 0;

  examples::FashionMNIST train(examples::FashionMNIST::Split::kTrain, options.data_dir);
  train.head(options.limit_train);
  const examples::FashionMNIST test(examples::FashionMNIST::Split::kTest, options.data_dir);

  torch::manual_seed(options.seed);  // the same start everywhere (DDP also broadcasts rank 0's)
  auto net = std::make_shared<Net>();
  const c10::Device device = device_of(options);
  net->to(device);
  if (options.fsdp) {
    // Each block's parameters, gradients and Adam's state sharded over the ranks; the root the rest.
    auto model = ddp::fully_shard(net, {}, net->conv2, net->fc1);
    auto optimizer = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(options.lr));
    return train_and_test(options, model, *net, *optimizer, train, test, device, "Adam (fully sharded: ddp::fully_shard)");
  }
  ddp::DistributedDataParallel model(net, pg, ddp::DDPOptions().bucket_cap_mb(options.bucket_cap_mb).first_bucket_cap_mb(options.first_bucket_cap_mb));
  register_comm_hook(model, options);
  // --zero: each rank keeps Adam's state for its shard of the parameters only (ZeRO stage 1); the
  // updates are the same as plain Adam's.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (options.zero) {
    optimizer = std::make_unique<ddp::ZeroRedundancyOptimizer<torch::optim::Adam>>(
        model.parameters(), ddp::ZeroRedundancyOptimizerOptions().process_group(pg), torch::optim::AdamOptions(options.lr));
  } else {
    optimizer = std::make_unique<torch::optim::Adam>(model.parameters(), torch::optim::AdamOptions(options.lr));
  }
  const int code = train_and_test(options, model, *net, *optimizer, train, test, device,
                                  options.zero ? "Adam (ZeRO: state sharded over the ranks)" : "Adam");
  const auto* powersgd = dynamic_cast<const ddp::hooks::PowerSGDState*>(model.comm_hook_state());
  if (powersgd != nullptr && rank == 0) {
    std::printf("powersgd: %.1fx fewer gradient elements sent in the compressed steps\n",
                powersgd->compression_stats().compress_rate);
  }
  ddp::destroy_process_group();
  return code;
}

// The epochs: the same loop for DDP's wrapper and fully_shard's root.
template <typename Model>
int train_and_test(const Options& options, Model& model, Net& net, torch::optim::Optimizer& optimizer_ref,
                   examples::FashionMNIST& train, const examples::FashionMNIST& test, const c10::Device& device,
                   const char* optimizer_name) {
  const int rank = ddp::get_rank();
  const int world = ddp::get_world_size();
  const bool leader = rank == 0;
  torch::optim::Optimizer* optimizer = &optimizer_ref;
  auto* zero = dynamic_cast<ddp::ZeroRedundancyOptimizerBase*>(optimizer);

  ddp::DistributedSampler sampler(*train.size(), ddp::DistributedSamplerOptions()
                                                     .num_replicas(world).rank(rank).shuffle(true).seed(options.seed));
  // ddp::make_data_loader: LibTorch's loader, whose sampler state() counts what reached the loop.
  auto loader = ddp::make_data_loader(examples::FashionMNIST(train).map(torch::data::transforms::Stack<>()),
                                      sampler, torch::data::DataLoaderOptions().batch_size(options.batch_size));

  int start_epoch = 0;
#ifdef TRAIN_HAS_CHECKPOINT
  // Resume from the newest checkpoint: model, optimizer and where the sampler stood. Rank 0 looks
  // for it and every rank follows, so all resume or all start fresh.
  if (!options.checkpoint_dir.empty()) {
    const auto restored = ddp::load_checkpoint_if_exists(options.checkpoint_dir, model, optimizer);
    if (restored.loaded) {
      check_run(restored.path, restored.state, options);
      start_epoch = static_cast<int>(restored.state.sampler.epoch);
      sampler.load_state(restored.state.sampler);
      const std::string writer = writer_of(restored.state);
      const bool other = writer.empty() || writer != run_identity(options);  // resumed with the flag
      if (leader) {
        std::printf("resumed from %s at epoch %d%s\n", restored.path.c_str(), start_epoch + 1,
                    other ? (" (written by " + describe_run(writer) + ")").c_str() : "");
      }
    } else if (leader) {
      std::printf("no checkpoint in %s yet: starting from scratch\n", options.checkpoint_dir.c_str());
    }
  }
#else
  if (!options.checkpoint_dir.empty() && leader) {
    std::printf("note: --checkpoint-dir ignored, this build has no <ddp/checkpoint.h>\n");
  }
#endif

  if (leader) {
    std::printf("train_fashion_mnist: world %d (%s), on %s, batch %lld per rank (%lld global), lr %g, %zu train / %zu "
                "test samples, %d thread(s) per rank, comm hook %s, optimizer %s\n",
                world, ddp::transport().c_str(), device.str().c_str(), static_cast<long long>(options.batch_size),
                static_cast<long long>(options.batch_size * world), options.lr, *train.size(), *test.size(),
                options.threads, options.comm_hook.c_str(), optimizer_name);
  }
  // On a terminal: ours, or ddprun's, which shows our "\r" redraws live (launch/README.md).
  const char* ddprun_terminal = std::getenv("DDPRUN_TERMINAL");
  const bool on_terminal = isatty(STDOUT_FILENO) || (ddprun_terminal && std::string(ddprun_terminal) == "1");
  const bool show_bar = leader && on_terminal;
  for (int epoch = start_epoch; epoch < options.epochs; ++epoch) {
    sampler.set_epoch(epoch);  // a new shuffle, the same on every rank (after a resume: keeps its position)
    ProgressBar bar(show_bar, sampler.size());
    const std::string label = "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(options.epochs);
    ddp::Metrics local;
    const auto start = std::chrono::steady_clock::now();
    int64_t step = 0;  // in this epoch
    for (auto& batch : *loader) {
      ++step;
      const auto data = batch.data.to(device), target = batch.target.to(device);
      const torch::Tensor output = model.forward(data);
      torch::Tensor loss = F::cross_entropy(output, target);
      const double loss_value = loss.item<double>();
      check_finite_loss(loss_value, label, step, rank, options);
      optimizer->zero_grad();
      loss.backward();  // averaged gradients arrive here
      {
        ddp::TimelineSpan span("optimizer.step");  // a row of its own in a TORCHDDP_TIMELINE trace
        optimizer->step();
      }
      const double n = static_cast<double>(batch.data.size(0));
      local.add("loss", loss_value * n, n);
      local.add("accuracy", output.argmax(1).eq(target).sum().item<double>(), n);
      bar.update(sampler.state().consumed, label, loss_value);
    }
    const auto global = local.all_reduce();  // also waits for the slowest rank
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    bar.finish();
    const auto tested = evaluate(model, net, test, options.batch_size, device);
    if (leader) {
      std::printf("%s: train loss %.4f acc %.2f%% | test loss %.4f acc %.2f%% (%.0f samples) | %.0f samples/s, %.1f s\n",
                  label.c_str(), global.mean("loss"), 100 * global.mean("accuracy"), tested.mean("loss"),
                  100 * tested.mean("accuracy"), tested.count("accuracy"), global.count("loss") / seconds, seconds);
      std::fflush(stdout);
    }
#ifdef TRAIN_HAS_CHECKPOINT
    if (!options.checkpoint_dir.empty()) {
      const ddp::TrainingState state{epoch + 1, /*global_step*/ 0, ddp::SamplerState{epoch + 1, 0},
                                     {{"run_id", run_identity(options)}}};
      if (zero) zero->consolidate_state_dict(0);  // every rank: rank 0 writes the whole state
      // --sharded-checkpoint: every rank its own file beside the index; the resume above reads either kind.
      ddp::save_checkpoint(ddp::checkpoint_path(options.checkpoint_dir, epoch + 1), model, optimizer, state,
                           ddp::CheckpointOptions().keep_last(2).full_state_dict(!options.sharded_checkpoint));
    }
#endif
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  // Every number through one checked parser, each rule once (command_line.h): a bad value exits 2
  // naming the flag before any work, not once the ranks have met and the data is loaded.
  CLI::App app{"Train a small CNN on Fashion-MNIST with DistributedDataParallel (one process per rank)"};
  app.add_option("--epochs", options.epochs, "passes over the training set")->check(examples::epochs());
  app.add_option("--batch-size", options.batch_size, "samples per step on each rank")->check(examples::batch_size());
  // Above 1e37 LibTorch's Adam fails at its first step ("cannot be converted to type float");
  // below, a learning rate that diverges stops the job at its first non-finite loss.
  app.add_option("--lr", options.lr, "Adam learning rate")
      ->check(examples::finite_number(std::numeric_limits<double>::denorm_min(), 1e37,
                                      "must be a finite number above 0 and at most 1e+37 (Adam's first step, 10 x lr, "
                                      "must fit the parameters' 32-bit floats)"));
  app.add_flag("--allow-nonfinite", options.allow_nonfinite,
               "keep training when the loss is NaN or infinite (by default the job stops at that step, exit code 1)");
  // DistributedDataParallel's own range for both caps: it refuses others, but only once the job runs.
  const CLI::Validator bucket_cap = examples::finite_number(
      0, 1e12, "must be a finite number of MiB from 0 to 1e+12 (a cap above the model's size already puts every "
               "gradient in one bucket)");
  app.add_option("--bucket-cap-mb", options.bucket_cap_mb, "gradient bucket size in MiB")->check(bucket_cap);
  app.add_option("--first-bucket-cap-mb", options.first_bucket_cap_mb,
                 "size of the first bucket (the last layers' gradients) in MiB")->check(bucket_cap);
  app.add_option("--backend", options.backend, "gloo, nccl or auto")->check(CLI::IsMember({"gloo", "nccl", "auto"}));
  app.add_option("--init-method", options.init_method,
                 "where the ranks meet: env:// (MASTER_ADDR/MASTER_PORT), tcp://host:port or file:///path")
      ->check(examples::init_method());
  app.add_option("--seed", options.seed, "model initialization and shuffle seed")->check(examples::seed());
  app.add_option("--data-dir", options.data_dir, "folder with the Fashion-MNIST *-ubyte.gz files")
      ->check(examples::fashion_mnist_directory());
  app.add_option("--threads", options.threads, "torch threads per rank")->check(examples::thread_count());
  app.add_option("--timeout", options.timeout_s,
                 "seconds any rendezvous or collective may wait for the other ranks before the job fails (a dead or "
                 "frozen rank)")->check(examples::timeout_seconds());
  app.add_option("--limit-train", options.limit_train, "use only the first N training samples (0: all)")
      ->check(examples::limit_train());
  app.add_option("--checkpoint-dir", options.checkpoint_dir, "save a checkpoint each epoch and resume from the newest")
      ->check(examples::writable_directory());
  app.add_option("--run-id", options.run_id,
                 "this run's name, written into its checkpoints (default: the launcher's run id, e.g. ddprun's, kept "
                 "across its restarts)");
  app.add_flag("--resume-from-other-run", options.resume_from_other_run,
               "resume the newest checkpoint even if another run (another --run-id or launcher job) wrote it");
  app.add_option("--comm-hook", options.comm_hook, "how gradients are reduced: none, fp16, bf16 or powersgd")
      ->check(CLI::IsMember({"none", "fp16", "bf16", "powersgd"}));
  app.add_option("--powersgd-rank", options.powersgd_rank, "PowerSGD's matrix_approximation_rank")
      ->check(examples::whole_number(1, 1 << 20));
  app.add_option("--powersgd-start-iter", options.powersgd_start_iter,
                 "steps of plain allreduce before PowerSGD starts (> 1)")->check(examples::whole_number(2, 1 << 30));
  app.add_option("--device", options.device,
                 "where the model and batches live: cpu, cuda (this rank's GPU: LOCAL_RANK modulo the GPUs) or cuda:N")
      ->check(device_flag());
  app.add_flag("--fsdp", options.fsdp,
               "fully sharded data parallel (ddp::fully_shard): parameters, gradients and Adam's state 1/world per "
               "rank, the same training as DDP's");
  app.add_flag("--sharded-checkpoint", options.sharded_checkpoint,
               "with --fsdp and --checkpoint-dir: save each checkpoint sharded, every rank its own rows in its own "
               "file beside the index, nothing gathered (resumable at another world size)");
  app.add_flag("--zero", options.zero,
               "shard Adam's state over the ranks (ZeroRedundancyOptimizer, ZeRO stage 1): the same updates, about "
               "1/world of the optimizer memory per rank");
  if (const auto exit_code = examples::parse_command_line(app, argc, argv)) return *exit_code;
  if (options.fsdp && (options.zero || options.comm_hook != "none")) {
    std::fprintf(stderr, "train_fashion_mnist: --fsdp shards Adam's state and reduces gradients itself; it does not "
                         "combine with --zero or --comm-hook\n");
    return 2;
  }
  if (options.sharded_checkpoint && (!options.fsdp || options.checkpoint_dir.empty())) {
    std::fprintf(stderr, "train_fashion_mnist: --sharded-checkpoint saves the shards of --fsdp into --checkpoint-dir; "
                         "give it with both (without --fsdp the model is whole on every rank: its checkpoint is one "
                         "file)\n");
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "train_fashion_mnist: error: %s\n", error.what());
    return 1;
  }
}
