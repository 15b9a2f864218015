// save_checkpoint / load_checkpoint: the training state around the model's state_dict, and the
// rank-0-writes protocol.
#include <ddp/checkpoint.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <typeinfo>
#include <vector>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <ddp/atomic_file.h>

namespace ddp {
namespace {

constexpr char kTrainingRecord[] = "ddp_training_state";
constexpr char kOptimizerRecord[] = "ddp_optimizer_state";
constexpr int64_t kFormatVersion = 1;

ProcessGroupPtr resolve_group(const ProcessGroupPtr& group) {
  if (group) return group;
  return is_initialized() ? default_group() : ProcessGroupPtr();
}

std::string bytes_of(torch::serialize::OutputArchive& archive) {
  std::string bytes;
  archive.save_to([&](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  return bytes;
}

// --- RNG states: every rank's own, gathered to rank 0 ---------------------------------------------
struct RngState {
  at::Tensor cpu;   // uint8
  at::Tensor cuda;  // uint8, undefined without CUDA
};

at::Generator cuda_generator() {
  // One device per rank, as DDP places it: this rank's generator is the one on cuda:<local rank>.
  const auto count = static_cast<int>(torch::cuda::device_count());
  return at::globalContext().defaultGenerator(at::Device(at::kCUDA, local_rank() % count));
}

RngState own_rng_state() {
  RngState state;
  at::Generator cpu = at::globalContext().defaultGenerator(at::kCPU);
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    state.cpu = cpu.get_state();
  }
  if (torch::cuda::is_available()) {
    at::Generator cuda = cuda_generator();
    std::lock_guard<std::mutex> lock(cuda.mutex());
    state.cuda = cuda.get_state();
  }
  return state;
}

// Collective. Returns every rank's states on rank 0 (index = rank), nothing elsewhere.
std::vector<RngState> gather_rng_states(const ProcessGroupPtr& group) {
  RngState own = own_rng_state();
  if (!group) return {own};
  const at::Device device = collective_device(group);
  const int64_t cuda_size = own.cuda.defined() ? own.cuda.numel() : 0;
  // all_gather needs equal shapes: share the sizes, then pad every blob to the largest.
  auto sizes = all_gather(torch::tensor({own.cpu.numel(), cuda_size}, at::kLong).to(device), group);
  int64_t longest = 0;
  for (const auto& size : sizes) longest = std::max(longest, size.sum().item<int64_t>());
  at::Tensor blob = torch::zeros({longest}, at::kByte);
  blob.narrow(0, 0, own.cpu.numel()).copy_(own.cpu);
  if (cuda_size > 0) blob.narrow(0, own.cpu.numel(), cuda_size).copy_(own.cuda);
  auto blobs = all_gather(blob.to(device), group);
  if (group->getRank() != 0) return {};
  std::vector<RngState> states;
  for (size_t rank = 0; rank < blobs.size(); ++rank) {
    const at::Tensor rank_sizes = sizes[rank].cpu();
    const int64_t cpu_size = rank_sizes[0].item<int64_t>(), rank_cuda_size = rank_sizes[1].item<int64_t>();
    const at::Tensor rank_blob = blobs[rank].cpu();
    RngState state;
    state.cpu = rank_blob.narrow(0, 0, cpu_size).clone();
    if (rank_cuda_size > 0) state.cuda = rank_blob.narrow(0, cpu_size, rank_cuda_size).clone();
    states.push_back(state);
  }
  return states;
}

void restore_rng_state(const at::Tensor& cpu_state, const at::Tensor& cuda_state) {
  at::Generator cpu = at::globalContext().defaultGenerator(at::kCPU);
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(cpu_state);
  }
  if (cuda_state.defined() && cuda_state.numel() > 0 && torch::cuda::is_available()) {
    at::Generator cuda = cuda_generator();
    std::lock_guard<std::mutex> lock(cuda.mutex());
    cuda.set_state(cuda_state);
  }
}

// --- the records ------------------------------------------------------------------------------------
std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

std::string optimizer_device(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    if (!group.params().empty()) return group.params().front().device().str();
  }
  return "cpu";
}

std::string training_record(const TrainingState& state, int64_t world_size,
                            const torch::optim::Optimizer* optimizer, const std::vector<RngState>& rng) {
  torch::serialize::OutputArchive archive;
  archive.write("format_version", c10::IValue(kFormatVersion));
  archive.write("epoch", c10::IValue(state.epoch));
  archive.write("global_step", c10::IValue(state.global_step));
  archive.write("world_size", c10::IValue(world_size));
  archive.write("sampler_epoch", c10::IValue(state.sampler.epoch));
  archive.write("sampler_consumed", c10::IValue(state.sampler.consumed));
  c10::Dict<std::string, std::string> metadata;
  for (const auto& [key, value] : state.metadata) metadata.insert(key, value);
  archive.write("metadata", c10::IValue(metadata));
  archive.write("optimizer_type", c10::IValue(optimizer ? optimizer_type(*optimizer) : std::string()));
  archive.write("optimizer_device", c10::IValue(optimizer ? optimizer_device(*optimizer) : std::string("cpu")));
  archive.write("rng_ranks", c10::IValue(static_cast<int64_t>(rng.size())));
  for (size_t rank = 0; rank < rng.size(); ++rank) {
    archive.write("rng_cpu_" + std::to_string(rank), rng[rank].cpu, /*is_buffer=*/true);
    archive.write("rng_cuda_" + std::to_string(rank),
                  rng[rank].cuda.defined() ? rng[rank].cuda : torch::empty({0}, at::kByte), /*is_buffer=*/true);
  }
  return bytes_of(archive);
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toInt();
}

std::string read_string(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toStringRef();
}

void write_checkpoint_file(const std::string& path, const torch::nn::Module& module,
                           const torch::optim::Optimizer* optimizer, const TrainingState& state,
                           int64_t world_size, const std::vector<RngState>& rng) {
  std::vector<std::pair<std::string, std::string>> records = {
      {kTrainingRecord, training_record(state, world_size, optimizer, rng)}};
  if (optimizer != nullptr) {
    torch::serialize::OutputArchive archive;
    optimizer->save(archive);
    records.emplace_back(kOptimizerRecord, bytes_of(archive));
  }
  std::vector<char> zip = make_state_dict_archive(state_dict(module), records);
  seal_archive(zip);
  write_file_atomically(path, zip.data(), zip.size());
}

// Files named like checkpoint_path() in `dir`, newest step first.
std::vector<std::pair<int64_t, std::string>> checkpoints_in(const std::string& dir, const std::string& prefix) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) return found;
  // Only our exact names: temporary files ("....pt.tmp.<pid>") never match.
  const std::regex name("([0-9]+)\\.pt");
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string file = entry.path().filename().string();
    std::smatch match;
    const std::string head = prefix + "-";
    if (file.rfind(head, 0) != 0) continue;
    const std::string rest = file.substr(head.size());
    if (!std::regex_match(rest, match, name)) continue;
    found.emplace_back(std::stoll(match[1].str()), entry.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

void keep_newest(const std::string& path, const std::string& prefix, int keep) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const auto found = checkpoints_in(dir, prefix);
  for (size_t i = static_cast<size_t>(keep); i < found.size(); ++i) {
    std::error_code ignored;  // a file someone else removed first is fine
    std::filesystem::remove(found[i].second, ignored);
  }
}

}  // namespace

void save_checkpoint(const std::string& path, const torch::nn::Module& module,
                     const torch::optim::Optimizer* optimizer, const TrainingState& state,
                     const CheckpointOptions& options) {
  const ProcessGroupPtr group = resolve_group(options.group_);
  const int rank = group ? group->getRank() : 0;
  const int64_t world_size = group ? group->getSize() : 1;
  // Every rank takes part: each has its own RNG stream.
  const std::vector<RngState> rng = options.save_rng_ ? gather_rng_states(group) : std::vector<RngState>();

  std::string failure;
  if (rank == 0) {
    try {
      write_checkpoint_file(path, module, optimizer, state, world_size, rng);
      if (options.keep_last_ > 0) keep_newest(path, options.prefix_, options.keep_last_);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  if (group) {
    // Doubles as the barrier: no rank leaves before rank 0 has renamed the complete file.
    at::Tensor ok = torch::tensor({failure.empty() ? 1 : 0}, at::kInt).to(collective_device(group));
    broadcast(ok, 0, group);
    if (rank != 0 && ok.cpu().item<int>() == 0) {
      throw CheckpointError("rank 0 failed to save checkpoint " + path + " (its error is in rank 0's output)");
    }
  }
  if (!failure.empty()) throw CheckpointError("cannot save checkpoint " + path + ": " + failure);
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& module,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  const std::vector<char> zip = read_checkpoint_file(path);
  const auto record = read_archive_record(zip, kTrainingRecord);
  if (!record) {
    throw CheckpointError(path + " holds a model state but no training state (written by save_state_dict?); "
                          "read it with ddp::load_state_dict(path)");
  }
  load_state_dict(module, parse_state_dict_archive(zip, path, options.map_location_), options.strict_,
                  "checkpoint " + path);

  TrainingState state;
  torch::serialize::InputArchive archive;
  std::string saved_optimizer, saved_optimizer_device;
  int64_t rng_ranks = 0;
  try {
    archive.load_from(record->data(), record->size(), at::Device(at::kCPU));
    const int64_t version = read_int(archive, "format_version");
    if (version != kFormatVersion) {
      throw CheckpointError("format version " + std::to_string(version) + " is not supported (this build reads " +
                            std::to_string(kFormatVersion) + ")");
    }
    state.epoch = read_int(archive, "epoch");
    state.global_step = read_int(archive, "global_step");
    state.world_size = read_int(archive, "world_size");
    state.sampler.epoch = read_int(archive, "sampler_epoch");
    state.sampler.consumed = read_int(archive, "sampler_consumed");
    c10::IValue metadata;
    archive.read("metadata", metadata);
    for (const auto& item : metadata.toGenericDict()) {
      state.metadata[item.key().toStringRef()] = item.value().toStringRef();
    }
    saved_optimizer = read_string(archive, "optimizer_type");
    saved_optimizer_device = read_string(archive, "optimizer_device");
    rng_ranks = read_int(archive, "rng_ranks");
  } catch (const std::exception& error) {
    throw CheckpointError("cannot read the training state in " + path + ": " + error.what());
  }

  if (optimizer != nullptr) {
    if (saved_optimizer.empty()) throw CheckpointError("checkpoint " + path + " holds no optimizer state");
    if (saved_optimizer != optimizer_type(*optimizer)) {
      throw CheckpointError("checkpoint " + path + " holds " + saved_optimizer + " state, the optimizer is " +
                            optimizer_type(*optimizer));
    }
    const auto bytes = read_archive_record(zip, kOptimizerRecord);
    if (!bytes) throw CheckpointError("checkpoint " + path + " lacks its optimizer record");
    try {
      torch::serialize::InputArchive optimizer_archive;
      optimizer_archive.load_from(bytes->data(), bytes->size(),
                                  options.map_location_.device_for(saved_optimizer_device));
      optimizer->load(optimizer_archive);
    } catch (const CheckpointError&) {
      throw;
    } catch (const std::exception& error) {
      throw CheckpointError("the optimizer state in " + path + " does not fit the optimizer: " + error.what());
    }
  }

  if (options.restore_rng_) {
    const ProcessGroupPtr group = resolve_group(options.group_);
    const int rank = group ? group->getRank() : 0;
    if (rank < rng_ranks) {
      at::Tensor cpu_state, cuda_state;
      archive.read("rng_cpu_" + std::to_string(rank), cpu_state, /*is_buffer=*/true);
      archive.read("rng_cuda_" + std::to_string(rank), cuda_state, /*is_buffer=*/true);
      restore_rng_state(cpu_state, cuda_state);
    }
  }
  return state;
}

std::string checkpoint_path(const std::string& dir, int64_t global_step, const std::string& prefix) {
  if (global_step < 0) throw std::invalid_argument("checkpoint_path: global_step must be >= 0, got " + std::to_string(global_step));
  char step[32];
  std::snprintf(step, sizeof(step), "%08" PRId64, global_step);
  return (std::filesystem::path(dir) / (prefix + "-" + step + ".pt")).string();
}

std::optional<std::string> latest_checkpoint(const std::string& dir, const std::string& prefix) {
  for (const auto& [step, path] : checkpoints_in(dir, prefix)) {
    try {
      read_checkpoint_file(path);
      return path;
    } catch (const CheckpointError&) {
      // A torn or corrupted file: fall back to the previous one.
    }
  }
  return std::nullopt;
}

}  // namespace ddp
