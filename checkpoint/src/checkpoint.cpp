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

#include "archive_check.h"
#include "error_text.h"
#include "optimizer_placement.h"

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

// Collective. Every rank gives the same number of byte blobs (uint8, 1-D, any lengths); rank 0
// gets every rank's (index = rank), the others nothing.
std::vector<std::vector<at::Tensor>> gather_blobs(const std::vector<at::Tensor>& own, const ProcessGroupPtr& group) {
  if (!group) return {own};
  const at::Device device = collective_device(group);
  // all_gather needs equal shapes: share the lengths, then pad every rank's concatenation to the longest.
  std::vector<int64_t> own_sizes;
  for (const auto& part : own) own_sizes.push_back(part.numel());
  auto sizes = all_gather(torch::tensor(own_sizes, at::kLong).to(device), group);
  int64_t longest = 0;
  for (const auto& size : sizes) longest = std::max(longest, size.sum().item<int64_t>());
  at::Tensor blob = torch::zeros({longest}, at::kByte);
  int64_t offset = 0;
  for (const auto& part : own) {
    blob.narrow(0, offset, part.numel()).copy_(part);
    offset += part.numel();
  }
  auto blobs = all_gather(blob.to(device), group);
  if (group->getRank() != 0) return {};
  std::vector<std::vector<at::Tensor>> gathered;
  for (size_t rank = 0; rank < blobs.size(); ++rank) {
    const at::Tensor rank_sizes = sizes[rank].cpu(), rank_blob = blobs[rank].cpu();
    std::vector<at::Tensor> parts;
    offset = 0;
    for (int64_t i = 0; i < rank_sizes.numel(); ++i) {
      const int64_t size = rank_sizes[i].item<int64_t>();
      parts.push_back(rank_blob.narrow(0, offset, size).clone());
      offset += size;
    }
    gathered.push_back(std::move(parts));
  }
  return gathered;
}

// Collective. Returns every rank's states on rank 0 (index = rank), nothing elsewhere.
std::vector<RngState> gather_rng_states(const ProcessGroupPtr& group) {
  const RngState own = own_rng_state();
  std::vector<RngState> states;
  for (auto& parts : gather_blobs({own.cpu, own.cuda.defined() ? own.cuda : torch::empty({0}, at::kByte)}, group)) {
    states.push_back({parts[0], parts[1].numel() > 0 ? parts[1] : at::Tensor()});
  }
  return states;
}

// --- Stateful objects (a GradScaler, a comm hook's state): each rank's snapshot, pickled --------------
at::Tensor pickled(const TensorDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [key, tensor] : state) dict.insert(key, tensor.detach().cpu().contiguous());
  std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  return torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte).clone();
}

TensorDict unpickled(const at::Tensor& bytes) {
  const at::Tensor contiguous = bytes.contiguous();
  std::vector<char> data(static_cast<const char*>(contiguous.data_ptr()),
                         static_cast<const char*>(contiguous.data_ptr()) + contiguous.numel());
  check_plain_archive(data);  // what LibTorch's unpickler would crash on, refused first
  TensorDict state;
  for (const auto& item : torch::pickle_load(data).toGenericDict()) {
    state[item.key().toStringRef()] = item.value().toTensor();
  }
  return state;
}

// Collective. Rank 0 gets [rank][state] pickled snapshots, in the order of `states`.
std::vector<std::vector<at::Tensor>> gather_states(const std::vector<std::pair<std::string, const Stateful*>>& states,
                                                   const ProcessGroupPtr& group) {
  std::vector<at::Tensor> own;
  for (const auto& [name, state] : states) {
    if (state == nullptr) throw std::invalid_argument("save_checkpoint: the state named \"" + name + "\" is null");
    own.push_back(pickled(state->state_dict()));
  }
  return gather_blobs(own, group);
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

std::string state_key(size_t index, size_t rank) {
  return "state_" + std::to_string(index) + "_" + std::to_string(rank);
}

std::string training_record(const TrainingState& state, int64_t world_size,
                            const torch::optim::Optimizer* optimizer, const std::vector<RngState>& rng,
                            const std::vector<std::string>& state_names,
                            const std::vector<std::vector<at::Tensor>>& states) {
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
  // Names are listed, records are numbered: archive keys may not hold the dots a name may have.
  archive.write("state_names", c10::IValue(c10::List<std::string>(state_names)));
  archive.write("state_ranks", c10::IValue(static_cast<int64_t>(states.size())));
  for (size_t rank = 0; rank < states.size(); ++rank) {
    for (size_t i = 0; i < states[rank].size(); ++i) {
      archive.write(state_key(i, rank), states[rank][i], /*is_buffer=*/true);
    }
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
                           int64_t world_size, const std::vector<RngState>& rng,
                           const std::vector<std::string>& state_names,
                           const std::vector<std::vector<at::Tensor>>& states) {
  std::vector<std::pair<std::string, std::string>> records = {
      {kTrainingRecord, training_record(state, world_size, optimizer, rng, state_names, states)}};
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
  const ProcessGroupPtr group = resolve_group(options.group());
  const int rank = group ? group->getRank() : 0;
  const int64_t world_size = group ? group->getSize() : 1;
  // Every rank takes part: each has its own RNG stream.
  const std::vector<RngState> rng = options.save_rng() ? gather_rng_states(group) : std::vector<RngState>();
  std::vector<std::string> state_names;
  for (const auto& entry : options.states()) state_names.push_back(entry.first);
  const auto states = options.states().empty() ? std::vector<std::vector<at::Tensor>>()
                                              : gather_states(options.states(), group);

  std::string failure;
  if (rank == 0) {
    try {
      write_checkpoint_file(path, module, optimizer, state, world_size, rng, state_names, states);
      if (options.keep_last() > 0) keep_newest(path, options.prefix(), options.keep_last());
    } catch (const std::exception& error) {
      failure = error_text(error);
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
  const auto record = read_archive_record(zip, kTrainingRecord, path);
  if (!record) {
    throw CheckpointError(path + " holds a model state but no training state (written by save_state_dict?); "
                          "read it with ddp::load_state_dict(path)");
  }
  load_state_dict(module, parse_state_dict_archive(zip, path, options.map_location()), options.strict(),
                  "checkpoint " + path);

  TrainingState state;
  torch::serialize::InputArchive archive;
  std::string saved_optimizer, saved_optimizer_device;
  int64_t rng_ranks = 0, state_ranks = 0;
  std::vector<std::string> state_names;
  c10::IValue names_value;
  try {
    // Checked and rebuilt first: InputArchive compiles the code an archive carries (archive_check.h).
    const std::vector<char> checked = checked_script_archive(std::vector<char>(record->begin(), record->end()));
    archive.load_from(checked.data(), checked.size(), at::Device(at::kCPU));
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
    // Checkpoints written before states existed have neither key.
    if (archive.try_read("state_names", names_value)) {
      for (const auto& name : names_value.toListRef()) state_names.push_back(name.toStringRef());
      state_ranks = read_int(archive, "state_ranks");
    }
  } catch (const std::exception& error) {
    throw CheckpointError("cannot read the training state in " + path + ": " + error_text(error));
  }

  if (optimizer != nullptr) {
    if (saved_optimizer.empty()) throw CheckpointError("checkpoint " + path + " holds no optimizer state");
    if (saved_optimizer != optimizer_type(*optimizer)) {
      throw CheckpointError("checkpoint " + path + " holds " + saved_optimizer + " state, the optimizer is " +
                            optimizer_type(*optimizer));
    }
    const auto bytes = read_archive_record(zip, kOptimizerRecord, path);
    if (!bytes) throw CheckpointError("checkpoint " + path + " lacks its optimizer record");
    std::vector<char> checked;
    try {
      checked = checked_script_archive(std::vector<char>(bytes->begin(), bytes->end()));
    } catch (const std::exception& error) {
      throw CheckpointError("cannot read the optimizer state in " + path + ": " + error_text(error));
    }
    c10::Device device = at::kCPU;
    try {  // the device string comes from the file
      device = options.map_location().device_for(saved_optimizer_device);
    } catch (const std::exception& error) {
      throw CheckpointError("cannot place the optimizer state from " + path + " (saved on " + saved_optimizer_device +
                            ") where map_location puts it: " + error_text(error));
    }
    try {
      torch::serialize::InputArchive optimizer_archive;
      optimizer_archive.load_from(checked.data(), checked.size(), device);
      optimizer->load(optimizer_archive);
    } catch (const CheckpointError&) {
      throw;
    } catch (const std::exception& error) {
      throw CheckpointError("the optimizer state in " + path + " does not fit the optimizer: " + error_text(error));
    }
    try {
      // Read onto one device above; each parameter's state now joins its parameter.
      place_state_with_parameters(*optimizer);
    } catch (const std::exception& error) {
      throw CheckpointError("cannot move the optimizer state in " + path + " to its parameters' devices: " +
                            error_text(error));
    }
  }

  const ProcessGroupPtr group = resolve_group(options.group());
  const int rank = group ? group->getRank() : 0;
  for (const auto& entry : options.states()) {
    const auto found = std::find(state_names.begin(), state_names.end(), entry.name);
    if (found == state_names.end()) {
      if (!entry.required) continue;
      std::string saved;
      for (const auto& name : state_names) saved += (saved.empty() ? "" : ", ") + name;
      throw CheckpointError("checkpoint " + path + " holds no state named \"" + entry.name + "\" (it holds: " +
                            (saved.empty() ? "none" : saved) + "); save it with CheckpointOptions().state(\"" +
                            entry.name + "\", ...)");
    }
    // A rank the saving world did not have takes rank 0's snapshot.
    const size_t from_rank = rank < state_ranks ? rank : 0;
    at::Tensor bytes;
    try {
      archive.read(state_key(found - state_names.begin(), from_rank), bytes, /*is_buffer=*/true);
      entry.state->load_state_dict(unpickled(bytes));
    } catch (const std::exception& error) {
      throw CheckpointError("cannot restore the state \"" + entry.name + "\" from " + path + ": " + error_text(error));
    }
  }

  if (options.restore_rng()) {
    if (rank < rng_ranks) {
      try {
        at::Tensor cpu_state, cuda_state;
        archive.read("rng_cpu_" + std::to_string(rank), cpu_state, /*is_buffer=*/true);
        archive.read("rng_cuda_" + std::to_string(rank), cuda_state, /*is_buffer=*/true);
        restore_rng_state(cpu_state, cuda_state);
      } catch (const std::exception& error) {
        throw CheckpointError("cannot restore the RNG state of rank " + std::to_string(rank) + " from " + path + ": " +
                              error_text(error));
      }
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
