// save_checkpoint / load_checkpoint: the training state around the model's state_dict, and the
// rank-0-writes protocol.
#include <ddp/checkpoint.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <filesystem>
#include <memory>
#include <random>
#include <regex>
#include <typeinfo>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <ddp/atomic_file.h>

#include "checkpoint/src/archive_check.h"
#include "ddp/internal/compat/versions.h"
#include "checkpoint/src/directory_lock.h"
#include "checkpoint/src/error_line.h"
#include "checkpoint/src/optimizer_placement.h"
#include "checkpoint/src/state_dict_match.h"
#include "ddp/internal/compat/optimizer_state.h"
#include "checkpoint/src/tensor_check.h"

namespace ddp {
namespace {

constexpr char kTrainingRecord[] = "ddp_training_state";
constexpr char kOptimizerRecord[] = "ddp_optimizer_state";
// A sharded checkpoint's rank files: "<path>.rank-<r>-of-<W>".
constexpr char kRankFileInfix[] = ".rank-";
constexpr int64_t kFormatVersion = 1;
// A sharded checkpoint's files (its index and the ranks' files): builds that read only version 1
// refuse them by their version rather than load an empty model.
constexpr int64_t kShardedFormatVersion = 2;

// Whether the file `name` is a rank file of the checkpoint named `checkpoint` (file names both):
// "<checkpoint>.rank-<r>-of-<W>" exactly. What a save or a pruning removes; nothing else that
// begins alike ("<checkpoint>.rank-notes" is not ours).
bool is_rank_file_of(const std::string& name, const std::string& checkpoint) {
  const std::string head = checkpoint + kRankFileInfix;
  if (name.rfind(head, 0) != 0) return false;
  static const std::regex numbers("[0-9]+-of-[0-9]+");
  return std::regex_match(name.begin() + static_cast<std::ptrdiff_t>(head.size()), name.end(), numbers);
}

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

// --- what a file holds: one unnamed model, or named models and optimizers ------------------------------
// kOneModel: the root object is the model's state_dict, its optimizer (if any) in kOptimizerRecord.
// kNamed: the root is {name: state_dict}; the optimizers in "<kOptimizerRecord>_<i>", listed by name.
enum class Layout { kOneModel, kNamed };

template <typename ModuleType, typename OptimizerType>
struct Contents {
  Layout layout = Layout::kOneModel;
  std::vector<std::pair<std::string, ModuleType*>> models;        // kOneModel: one, named ""
  std::vector<std::pair<std::string, OptimizerType*>> optimizers;  // never null; kOneModel: none or one, named ""
};
using SavedContents = Contents<const torch::nn::Module, const torch::optim::Optimizer>;
using LoadedContents = Contents<torch::nn::Module, torch::optim::Optimizer>;

std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

// The format an optimizer type's state is saved in: a ZeroRedundancyOptimizer<Optim> writes and
// reads Optim's own (its state consolidated), so it and a plain Optim load each other's.
std::string state_format(const std::string& type) {
  const std::string zero = "ddp::ZeroRedundancyOptimizer<";
  if (type.rfind(zero, 0) != 0 || type.back() != '>') return type;
  return type.substr(zero.size(), type.size() - zero.size() - 1);
}

std::string optimizer_device(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    if (!group.params().empty()) return group.params().front().device().str();
  }
  return "cpu";
}

std::string optimizer_record(Layout layout, size_t index) {
  return layout == Layout::kOneModel ? kOptimizerRecord : kOptimizerRecord + std::string("_") + std::to_string(index);
}

std::string joined_names(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "" : ", ") + name;
  return text.empty() ? "none" : text;
}

// A Python dict has one value per key: so does a checkpoint, across models, optimizers and states.
void check_names(const std::vector<std::string>& names, const std::string& call) {
  std::vector<std::string> seen;
  for (const auto& name : names) {
    if (name.empty()) {
      throw std::invalid_argument(call + ": an entry has an empty name; give every model, optimizer and state a name");
    }
    if (std::find(seen.begin(), seen.end(), name) != seen.end()) {
      throw std::invalid_argument(call + ": the name \"" + name + "\" is used twice; every model, optimizer and state "
                                  "in one checkpoint needs its own name");
    }
    seen.push_back(name);
  }
}

// The named entries split into models and optimizers; Stateful entries and wrappers' comm hook
// states go to `add_state(name, state, required)`. Names are checked together with `state_names`.
template <typename ContentsType, typename AddState>
ContentsType contents_of(const std::vector<CheckpointEntry>& entries, std::vector<std::string> state_names,
                         const std::string& call, const AddState& add_state) {
  ContentsType contents;
  contents.layout = Layout::kNamed;
  std::vector<std::string> names;
  for (const auto& entry : entries) {
    names.push_back(entry.name());
    switch (entry.kind()) {
      case CheckpointEntry::Kind::kModel:
        contents.models.emplace_back(entry.name(), entry.module());
        // A resumed run may add a hook the saving run did not have: not required on load.
        if (Stateful* hook = entry.comm_hook_state()) {
          add_state(entry.name() + "/" + detail::kCommHookStateName, hook, /*required=*/false);
        }
        break;
      case CheckpointEntry::Kind::kOptimizer:
        contents.optimizers.emplace_back(entry.name(), entry.optimizer());
        break;
      case CheckpointEntry::Kind::kState:
        add_state(entry.name(), entry.state(), /*required=*/true);
        break;
    }
  }
  names.insert(names.end(), state_names.begin(), state_names.end());
  check_names(names, call);
  return contents;
}

std::string state_key(size_t index, size_t rank) {
  return "state_" + std::to_string(index) + "_" + std::to_string(rank);
}

// What a sharded checkpoint's file adds to its training record (none for a single-file checkpoint).
using MoreFields = std::function<void(torch::serialize::OutputArchive&)>;

// `rng` and `states` are those of ranks first_rank, first_rank + 1, ... (a sharded checkpoint's
// rank file holds its own rank's alone).
std::string training_record(const TrainingState& state, int64_t world_size, const SavedContents& contents,
                            const std::vector<RngState>& rng, const std::vector<std::string>& state_names,
                            const std::vector<std::vector<at::Tensor>>& states, size_t first_rank = 0,
                            const MoreFields& more = {}) {
  torch::serialize::OutputArchive archive;
  archive.write("format_version", c10::IValue(more ? kShardedFormatVersion : kFormatVersion));
  archive.write("epoch", c10::IValue(state.epoch));
  archive.write("global_step", c10::IValue(state.global_step));
  archive.write("world_size", c10::IValue(world_size));
  archive.write("sampler_epoch", c10::IValue(state.sampler.epoch));
  archive.write("sampler_consumed", c10::IValue(state.sampler.consumed));
  c10::Dict<std::string, std::string> metadata;
  for (const auto& [key, value] : state.metadata) metadata.insert(key, value);
  archive.write("metadata", c10::IValue(metadata));
  if (contents.layout == Layout::kOneModel) {
    const torch::optim::Optimizer* optimizer = contents.optimizers.empty() ? nullptr : contents.optimizers[0].second;
    archive.write("optimizer_type", c10::IValue(optimizer ? optimizer_type(*optimizer) : std::string()));
    archive.write("optimizer_device", c10::IValue(optimizer ? optimizer_device(*optimizer) : std::string("cpu")));
  } else {
    // Their presence marks a file of named models (older readers stop at the missing optimizer_type).
    std::vector<std::string> models, optimizers, types, devices;
    for (const auto& [name, module] : contents.models) models.push_back(name);
    for (const auto& [name, optimizer] : contents.optimizers) {
      optimizers.push_back(name);
      types.push_back(optimizer_type(*optimizer));
      devices.push_back(optimizer_device(*optimizer));
    }
    archive.write("model_names", c10::IValue(c10::List<std::string>(models)));
    archive.write("optimizer_names", c10::IValue(c10::List<std::string>(optimizers)));
    archive.write("optimizer_types", c10::IValue(c10::List<std::string>(types)));
    archive.write("optimizer_devices", c10::IValue(c10::List<std::string>(devices)));
  }
  archive.write("rng_ranks", c10::IValue(static_cast<int64_t>(rng.empty() ? 0 : first_rank + rng.size())));
  for (size_t i = 0; i < rng.size(); ++i) {
    const size_t rank = first_rank + i;
    archive.write("rng_cpu_" + std::to_string(rank), rng[i].cpu, /*is_buffer=*/true);
    archive.write("rng_cuda_" + std::to_string(rank),
                  rng[i].cuda.defined() ? rng[i].cuda : torch::empty({0}, at::kByte), /*is_buffer=*/true);
  }
  // Names are listed, records are numbered: archive keys may not hold the dots a name may have.
  archive.write("state_names", c10::IValue(c10::List<std::string>(state_names)));
  archive.write("state_ranks", c10::IValue(static_cast<int64_t>(states.empty() ? 0 : first_rank + states.size())));
  for (size_t k = 0; k < states.size(); ++k) {
    for (size_t i = 0; i < states[k].size(); ++i) {
      archive.write(state_key(i, first_rank + k), states[k][i], /*is_buffer=*/true);
    }
  }
  if (more) more(archive);
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

std::vector<std::string> read_strings(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  std::vector<std::string> strings;
  for (const auto& item : value.toListRef()) strings.push_back(item.toStringRef());
  return strings;
}

void write_checkpoint_file(const std::string& path, const SavedContents& contents, const TrainingState& state,
                           int64_t world_size, const std::vector<RngState>& rng,
                           const std::vector<std::string>& state_names,
                           const std::vector<std::vector<at::Tensor>>& states, size_t first_rank = 0,
                           const MoreFields& more = {}) {
  std::vector<std::pair<std::string, std::string>> records = {
      {kTrainingRecord, training_record(state, world_size, contents, rng, state_names, states, first_rank, more)}};
  for (size_t i = 0; i < contents.optimizers.size(); ++i) {
    torch::serialize::OutputArchive archive;
    contents.optimizers[i].second->save(archive);
    records.emplace_back(optimizer_record(contents.layout, i), bytes_of(archive));
  }
  std::vector<char> zip;
  if (contents.layout == Layout::kOneModel) {
    zip = make_state_dict_archive(state_dict(*contents.models.front().second), records);
  } else {
    NamedStateDicts models;
    for (const auto& [name, module] : contents.models) models.emplace_back(name, state_dict(*module));
    zip = make_nested_state_dict_archive(models, records);
  }
  seal_archive(zip);
  write_file_atomically(path, zip.data(), zip.size());
}

// The training record of a file, read.
struct SavedOptimizer {
  std::string name, type, device;
};
// A sharded checkpoint's index (its own file, `path`): the rows of each parameter each rank's file
// holds, by [rank * names.size() + parameter].
struct ShardedIndex {
  int64_t save_id = 0;
  int64_t world = 0;  // rank files
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;  // the whole parameters'
  std::vector<int64_t> first_rows, rows;
};
// One rank's file of a sharded checkpoint.
struct ShardFile {
  int64_t save_id = 0, rank = 0, world = 0;
};

struct SavedRecord {
  Layout layout = Layout::kOneModel;
  std::optional<ShardedIndex> sharded_index;
  std::optional<ShardFile> shard_file;
  TrainingState state;
  std::vector<std::string> model_names;     // kNamed
  std::vector<SavedOptimizer> optimizers;   // kOneModel: none or one, named ""
  int64_t rng_ranks = 0, state_ranks = 0;
  std::vector<std::string> state_names;
  torch::serialize::InputArchive archive;   // for the per-rank RNG and state entries
};

std::vector<int64_t> read_ints(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toIntVector();
}

void require_sound(bool sound, const std::string& what) {
  if (!sound) throw CheckpointError("its sharded index is damaged: " + what);
}

// A sharded checkpoint's fields, checked: the sizes come from a file.
void read_sharded_fields(torch::serialize::InputArchive& archive, SavedRecord& saved) {
  c10::IValue names;
  if (!archive.try_read("sharded_names", names)) {
    ShardFile file;
    file.save_id = read_int(archive, "sharded_save_id");
    file.rank = read_int(archive, "sharded_file_rank");
    file.world = read_int(archive, "sharded_world_size");
    saved.shard_file = file;
    return;
  }
  ShardedIndex index;
  index.save_id = read_int(archive, "sharded_save_id");
  index.world = read_int(archive, "sharded_world_size");
  for (const auto& name : names.toListRef()) index.names.push_back(name.toStringRef());
  const auto ndims = read_ints(archive, "sharded_ndims"), sizes = read_ints(archive, "sharded_sizes");
  index.first_rows = read_ints(archive, "sharded_first_rows");
  index.rows = read_ints(archive, "sharded_rows");
  const size_t count = index.names.size();
  require_sound(index.world >= 1 && index.world <= (int64_t{1} << 24),
                "a world size of " + std::to_string(index.world));
  require_sound(ndims.size() == count, std::to_string(count) + " parameters but " + std::to_string(ndims.size()) + " shapes");
  size_t at = 0;
  for (const int64_t ndim : ndims) {
    require_sound(ndim >= 0 && ndim <= 64 && at + ndim <= sizes.size(), "a shape of " + std::to_string(ndim) + " dimensions");
    index.shapes.emplace_back(sizes.begin() + at, sizes.begin() + at + ndim);
    for (const int64_t size : index.shapes.back()) require_sound(size >= 0, "a size of " + std::to_string(size));
    at += ndim;
  }
  require_sound(at == sizes.size(), "sizes left over after the shapes");
  const size_t cells = static_cast<size_t>(index.world) * count;
  require_sound(index.first_rows.size() == cells && index.rows.size() == cells,
                "the row table is not one row range per rank and parameter");
  for (size_t k = 0; k < cells; ++k) {
    const auto& shape = index.shapes[k % count];
    const int64_t rows = shape.empty() ? 1 : shape[0];
    require_sound(index.first_rows[k] >= 0 && index.rows[k] >= 0 && index.first_rows[k] <= rows &&
                      index.rows[k] <= rows - index.first_rows[k],
                  "rows out of range for " + index.names[k % count]);
  }
  saved.sharded_index = std::move(index);
}

void read_training_record(const std::vector<char>& zip, const std::string& path, SavedRecord& saved) {
  const auto record = read_archive_record(zip, kTrainingRecord, path);
  if (!record) {
    throw CheckpointError(path + " holds a model state but no training state (written by save_state_dict?); "
                          "read it with ddp::load_state_dict(path)");
  }
  torch::serialize::InputArchive& archive = saved.archive;
  TrainingState& state = saved.state;
  try {
    // Checked and rebuilt first: InputArchive compiles the code an archive carries (archive_check.h).
    const std::vector<char> checked = checked_script_archive(std::vector<char>(record->begin(), record->end()));
    archive.load_from(checked.data(), checked.size(), at::Device(at::kCPU));
    const int64_t version = read_int(archive, "format_version");
    if (version != kFormatVersion && version != kShardedFormatVersion) {
      throw CheckpointError("format version " + std::to_string(version) + " is not supported (this build reads " +
                            std::to_string(kFormatVersion) + " and " + std::to_string(kShardedFormatVersion) + ")");
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
    c10::IValue model_names;
    if (archive.try_read("model_names", model_names)) {
      saved.layout = Layout::kNamed;
      for (const auto& name : model_names.toListRef()) saved.model_names.push_back(name.toStringRef());
      const auto names = read_strings(archive, "optimizer_names");
      const auto types = read_strings(archive, "optimizer_types");
      const auto devices = read_strings(archive, "optimizer_devices");
      if (types.size() != names.size() || devices.size() != names.size()) {
        throw CheckpointError("it lists " + std::to_string(names.size()) + " optimizers but " +
                              std::to_string(types.size()) + " types and " + std::to_string(devices.size()) + " devices");
      }
      for (size_t i = 0; i < names.size(); ++i) saved.optimizers.push_back({names[i], types[i], devices[i]});
    } else {
      const std::string type = read_string(archive, "optimizer_type");
      const std::string device = read_string(archive, "optimizer_device");
      if (!type.empty()) saved.optimizers.push_back({"", type, device});
    }
    saved.rng_ranks = read_int(archive, "rng_ranks");
    // Checkpoints written before states existed have neither key.
    c10::IValue names_value;
    if (archive.try_read("state_names", names_value)) {
      for (const auto& name : names_value.toListRef()) saved.state_names.push_back(name.toStringRef());
      saved.state_ranks = read_int(archive, "state_ranks");
    }
    if (version == kShardedFormatVersion) read_sharded_fields(archive, saved);
  } catch (const std::exception& error) {
    throw CheckpointError("cannot read the training state in " + path + ": " + error_line(error));
  }
}

// A parameter's name in the models being loaded ("net1.weight", "net1.weight of the model
// \"generator\""), for errors about its optimizer state.
using ParameterNames = std::function<std::string(const at::Tensor&)>;
ParameterNames parameter_names(const LoadedContents& contents) {
  std::map<const void*, std::string> names;
  for (const auto& [model, module] : contents.models) {
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      names.emplace(item.value().unsafeGetTensorImpl(), item.key() + (model.empty() ? "" : " of the model \"" + model + "\""));
    }
  }
  return [names](const at::Tensor& param) {
    const auto found = names.find(param.unsafeGetTensorImpl());
    return found != names.end() ? found->second : "of shape " + shape_of(param) + " (in none of the models loaded)";
  };
}

// The optimizer state saved as `saved` (record `record`) for `optimizer`, read and checked as far
// as it can be without loading it: its type, a record that reads, a device map_location gives. `where`
// is "" for a single-model file, " under \"<name>\"" for a named one.
torch::serialize::InputArchive read_optimizer(const std::vector<char>& zip, const std::string& path,
                                              const SavedOptimizer& saved, const std::string& record,
                                              const std::string& where, const torch::optim::Optimizer& optimizer,
                                              const LoadOptions& options) {
  if (state_format(saved.type) != state_format(optimizer_type(optimizer))) {
    throw CheckpointError("checkpoint " + path + " holds " + saved.type + " state" + where + ", the optimizer is " +
                          optimizer_type(optimizer));
  }
  const auto bytes = read_archive_record(zip, record, path);
  if (!bytes) throw CheckpointError("checkpoint " + path + " lacks its optimizer record" + where);
  std::vector<char> checked;
  try {
    checked = checked_script_archive(std::vector<char>(bytes->begin(), bytes->end()));
  } catch (const std::exception& error) {
    throw CheckpointError("cannot read the optimizer state" + where + " in " + path + ": " + error_line(error));
  }
  c10::Device device = at::kCPU;
  try {  // the device string comes from the file
    device = options.map_location().device_for(saved.device);
  } catch (const std::exception& error) {
    throw CheckpointError("cannot place the optimizer state" + where + " from " + path + " (saved on " + saved.device +
                          ") where map_location puts it: " + error_line(error));
  }
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(checked.data(), checked.size(), device);
  } catch (const std::exception& error) {
    throw CheckpointError("cannot read the optimizer state" + where + " in " + path + ": " + error_line(error));
  }
  return archive;
}

// Loads `archive` (read_optimizer's) into `optimizer`, which LibTorch alone knows how to read: what
// does not fit the optimizer, or its parameters, is found only here, with the optimizer changed.
void apply_optimizer(torch::serialize::InputArchive& archive, const std::string& path, const std::string& where,
                     torch::optim::Optimizer& optimizer, const ParameterNames& name_of, bool check_fits = true) {
  try {
    optimizer.load(archive);
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& error) {
    throw CheckpointError("the optimizer state" + where + " in " + path + " does not fit the optimizer: " +
                          error_line(error));
  }
  try {
    // Read onto one device above; each parameter's state now joins its parameter.
    place_state_with_parameters(optimizer);
  } catch (const std::exception& error) {
    throw CheckpointError("cannot move the optimizer state" + where + " in " + path + " to its parameters' devices: " +
                          error_line(error));
  }
  if (!check_fits) return;  // a sharded checkpoint's other rank: its rows, checked once assembled
  try {  // what LibTorch would meet only at the next step(), or train on to NaN
    check_state_fits_parameters(optimizer, name_of);
  } catch (const std::invalid_argument& error) {
    throw CheckpointError("the optimizer state" + where + " in " + path + " is refused: " + error.what());
  }
}

// The file's entry for the optimizer called `name`; a CheckpointError naming what it holds if none.
std::vector<SavedOptimizer>::const_iterator saved_optimizer(const std::string& path, const SavedRecord& saved,
                                                            Layout layout, const std::string& name) {
  const auto found = std::find_if(saved.optimizers.begin(), saved.optimizers.end(),
                                  [&](const SavedOptimizer& entry) { return entry.name == name; });
  if (found != saved.optimizers.end()) return found;
  if (layout == Layout::kOneModel) throw CheckpointError("checkpoint " + path + " holds no optimizer state");
  std::vector<std::string> names;
  for (const auto& entry : saved.optimizers) names.push_back(entry.name);
  throw CheckpointError("checkpoint " + path + " holds no optimizer named \"" + name + "\" (its optimizers: " +
                        joined_names(names) + ")");
}

// Whether the file holds what `contents` is (one model, or named ones) in a form it loads from.
void check_layout(const std::string& path, const SavedRecord& saved, const LoadedContents& contents) {
  if (saved.sharded_index) {
    throw CheckpointError("checkpoint " + path + " is sharded (one file per rank beside it, saved with "
                          "CheckpointOptions().full_state_dict(false)): load it into the model sharded by "
                          "ddp::fully_shard, giving load_checkpoint its FSDPModule, which reads the rank files; "
                          "a plain module needs a checkpoint saved with full_state_dict(true)");
  }
  if (saved.shard_file) {
    throw CheckpointError(path + " is the file of rank " + std::to_string(saved.shard_file->rank) + " of " +
                          std::to_string(saved.shard_file->world) + " of a sharded checkpoint: load the checkpoint "
                          "through its index, the file named without \".rank-...\"");
  }
  if (saved.layout != contents.layout) {
    throw CheckpointError(
        saved.layout == Layout::kNamed
            ? path + " holds several named models (" + joined_names(saved.model_names) +
                  "), not one: load them with ddp::load_checkpoint(path, {{\"<name>\", model}, ...})"
            : "checkpoint " + path + " holds one unnamed model (saved by save_checkpoint(path, model, &optimizer, "
                  "state)): load it with ddp::load_checkpoint(path, model, &optimizer)");
  }
  // An optimizer the file has no state for, or state of another type: refused before a model changes.
  for (const auto& [name, optimizer] : contents.optimizers) {
    const auto found = saved_optimizer(path, saved, contents.layout, name);
    if (state_format(found->type) != state_format(optimizer_type(*optimizer))) {
      throw CheckpointError("checkpoint " + path + " holds " + found->type + " state" +
                            (contents.layout == Layout::kOneModel ? std::string() : " under \"" + name + "\"") +
                            ", the optimizer is " + optimizer_type(*optimizer));
    }
  }
}

// A plain load's models and optimizers as the file holds them, read and checked against
// `contents` (prepare_load); nothing has changed yet.
struct PreparedLoad {
  struct Optimizer {
    torch::optim::Optimizer* optimizer;
    std::string where;  // as read_optimizer's
    torch::serialize::InputArchive archive;
  };
  std::vector<MatchedStateDict> models;
  std::vector<Optimizer> optimizers;
};

// The models and optimizers of `contents` from the file, which must have the same layout: every
// check that needs no change made (the optimizers' fit to their parameters needs them loaded).
PreparedLoad prepare_load(const std::vector<char>& zip, const std::string& path, const SavedRecord& saved,
                          const LoadedContents& contents, const LoadOptions& options) {
  check_layout(path, saved, contents);
  PreparedLoad load;
  if (contents.layout == Layout::kOneModel) {
    load.models.push_back(match_state_dict(*contents.models.front().second,
                                           parse_state_dict_archive(zip, path, options.map_location()),
                                           options.strict(), "checkpoint " + path));
  } else if (!contents.models.empty()) {
    const NamedStateDicts models = parse_nested_state_dict_archive(zip, path, options.map_location());
    for (const auto& named_model : contents.models) {
      // Named, not a structured binding: clang before 16 cannot capture a binding in a lambda.
      const std::string& name = named_model.first;
      const auto& module = named_model.second;
      auto found = std::find_if(models.begin(), models.end(), [&](const auto& model) { return model.first == name; });
      if (found == models.end()) {
        throw CheckpointError("checkpoint " + path + " holds no model named \"" + name +
                              "\" (its models: " + joined_names(saved.model_names) + ")");
      }
      load.models.push_back(match_state_dict(*module, found->second, options.strict(),
                                             "checkpoint " + path + " (model \"" + name + "\")"));
    }
  }
  for (const auto& [name, optimizer] : contents.optimizers) {
    const auto found = saved_optimizer(path, saved, contents.layout, name);
    const size_t index = found - saved.optimizers.begin();
    std::string where = contents.layout == Layout::kOneModel ? "" : " under \"" + name + "\"";
    auto archive = read_optimizer(zip, path, *found, optimizer_record(contents.layout, index), where, *optimizer, options);
    load.optimizers.push_back({optimizer, std::move(where), std::move(archive)});
  }
  return load;
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
    // A sharded checkpoint's rank files go with it.
    const std::string checkpoint = std::filesystem::path(found[i].second).filename().string();
    for (const auto& entry : std::filesystem::directory_iterator(dir, ignored)) {
      if (is_rank_file_of(entry.path().filename().string(), checkpoint)) std::filesystem::remove(entry.path(), ignored);
    }
  }
}


// Rank 0, before it writes: a missing directory is made (what every program did by hand before its
// first save), and locked: one job per directory, since another's saves would overwrite and prune ours.
void prepare_directory(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir);
  lock_checkpoint_directory(dir.string());
}

// Every rank, once rank 0 wrote `path` or failed (`failure`, rank 0's error): doubles as the
// barrier, so no rank leaves before rank 0 has renamed the complete file.
void finish_save(const std::string& path, const std::string& failure, int rank, const ProcessGroupPtr& group) {
  if (group) {
    at::Tensor ok = torch::tensor({failure.empty() ? 1 : 0}, at::kInt).to(collective_device(group));
    broadcast(ok, 0, group);
    if (rank != 0 && ok.cpu().item<int>() == 0) {
      throw CheckpointError("rank 0 failed to save checkpoint " + path + " (its error is in rank 0's output)");
    }
  }
  if (!failure.empty()) throw CheckpointError("cannot save checkpoint " + path + ": " + failure);
}

std::string rank_file_path(const std::string& path, int64_t rank, int64_t world);

// The rank files of the sharded checkpoint whose index is at `path` now, those that exist:
// "<path>.rank-<r>-of-<W>" for r < W, its W. None when `path` is no sharded index, or one that
// cannot be read (nothing is known to be its then): a save removes no file that is not its own.
std::vector<std::string> rank_files_of_index(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path file(path);
  const fs::path dir = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  // Reading a full checkpoint to learn it is no index would cost its size: only when rank 0's file
  // of some world size lies beside it.
  const std::string first = file.filename().string() + kRankFileInfix + "0-of-";
  bool beside = false;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    beside = beside || entry.path().filename().string().rfind(first, 0) == 0;
  }
  if (!beside) return {};
  SavedRecord saved;
  try {
    read_training_record(read_checkpoint_file(path), path, saved);
  } catch (const std::exception&) {
    return {};
  }
  if (!saved.sharded_index) return {};
  std::vector<std::string> files;
  for (int64_t r = 0; r < saved.sharded_index->world; ++r) {
    const std::string rank_file = rank_file_path(path, r, saved.sharded_index->world);
    if (fs::is_regular_file(fs::symlink_status(rank_file, error))) files.push_back(rank_file);
  }
  return files;
}

// The collective save of any contents: every rank's RNG and states gathered, rank 0 writes.
void save_contents(const std::string& path, const SavedContents& contents, const TrainingState& state,
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
      prepare_directory(path);
      const std::vector<std::string> replaced = rank_files_of_index(path);
      write_checkpoint_file(path, contents, state, world_size, rng, state_names, states);
      // A sharded checkpoint's files this one replaced, once it is on disk: a crash before leaves
      // that checkpoint whole, one after leaves files nothing reads.
      for (const std::string& file : replaced) {
        std::error_code ignored;  // a file someone else removed first is fine
        std::filesystem::remove(file, ignored);
      }
      if (options.keep_last() > 0) keep_newest(path, options.prefix(), options.keep_last());
    } catch (const std::exception& error) {
      failure = error_line(error);
    }
  }
  finish_save(path, failure, rank, group);
}

// This rank's states and RNG as the file holds them, read and checked before anything changes: a
// required state the file lacks, or an entry that cannot be read, fails here.
struct RankState {
  std::vector<std::pair<const LoadOptions::StateEntry*, TensorDict>> states;  // in the order of options
  at::Tensor rng_cpu, rng_cuda;  // undefined: the RNG is not restored
};

RankState read_rank_state(SavedRecord& saved, const std::string& path, const LoadOptions& options) {
  const ProcessGroupPtr group = resolve_group(options.group());
  const int rank = group ? group->getRank() : 0;
  RankState read;
  std::vector<std::string> missing;
  for (const auto& entry : options.states()) {
    if (entry.required && std::find(saved.state_names.begin(), saved.state_names.end(), entry.name) ==
                              saved.state_names.end()) {
      missing.push_back("\"" + entry.name + "\"");
    }
  }
  if (!missing.empty()) {
    throw CheckpointError("checkpoint " + path + " holds no state named " + joined_names(missing) + " (it holds: " +
                          joined_names(saved.state_names) + "); save it with CheckpointOptions().state(\"" +
                          missing.front().substr(1, missing.front().size() - 2) + "\", ...)");
  }
  for (const auto& entry : options.states()) {
    const auto found = std::find(saved.state_names.begin(), saved.state_names.end(), entry.name);
    if (found == saved.state_names.end()) continue;  // optional, and not saved
    // A rank the saving world did not have takes rank 0's snapshot.
    const size_t from_rank = rank < saved.state_ranks ? rank : 0;
    at::Tensor bytes;
    try {
      saved.archive.read(state_key(found - saved.state_names.begin(), from_rank), bytes, /*is_buffer=*/true);
      read.states.emplace_back(&entry, unpickled(bytes));
    } catch (const std::exception& error) {
      throw CheckpointError("cannot restore the state \"" + entry.name + "\" from " + path + ": " + error_line(error));
    }
  }
  if (options.restore_rng() && rank < saved.rng_ranks) {
    try {
      saved.archive.read("rng_cpu_" + std::to_string(rank), read.rng_cpu, /*is_buffer=*/true);
      saved.archive.read("rng_cuda_" + std::to_string(rank), read.rng_cuda, /*is_buffer=*/true);
    } catch (const std::exception& error) {
      throw CheckpointError("cannot restore the RNG state of rank " + std::to_string(rank) + " from " + path + ": " +
                            error_line(error));
    }
  }
  return read;
}

// The states a load changed, as they were: put back when a later step of the load fails.
class StatesBefore {
 public:
  void keep(Stateful* state) { before_.emplace_back(state, state->state_dict()); }
  void restore() noexcept {
    for (auto it = before_.rbegin(); it != before_.rend(); ++it) {
      try {
        it->first->load_state_dict(it->second);
      } catch (...) {
        // Its own snapshot: nothing better to put back.
      }
    }
    before_.clear();
  }

 private:
  std::vector<std::pair<Stateful*, TensorDict>> before_;
};

// Every state or none: one whose saved entry its load_state_dict refuses (a field missing) puts
// back those loaded before it, and itself.
StatesBefore apply_states(const RankState& read, const std::string& path) {
  StatesBefore before;
  for (const auto& [entry, dict] : read.states) {
    before.keep(entry->state);
    try {
      entry->state->load_state_dict(dict);
    } catch (const std::exception& error) {
      before.restore();
      throw CheckpointError("cannot restore the state \"" + entry->name + "\" from " + path + ": " + error_line(error) +
                            "; no state was changed: load another checkpoint, or one saved with a complete \"" +
                            entry->name + "\"");
    }
  }
  return before;
}

// LibTorch's own check of a CPU generator's state, on a scratch generator: a state it refuses
// fails with the other checks, before anything changed, not at the end of the load.
void check_rng(const RankState& read, const std::string& path) {
  if (!read.rng_cpu.defined()) return;
  try {
    at::Generator scratch = at::make_generator<at::CPUGeneratorImpl>();
    scratch.set_state(read.rng_cpu);
  } catch (const std::exception& error) {
    throw CheckpointError("cannot restore the RNG state from " + path + ": " + error_line(error));
  }
}

void apply_rng(const RankState& read) {
  if (read.rng_cpu.defined()) restore_rng_state(read.rng_cpu, read.rng_cuda);
}

// The optimizer as it was, put back bitwise when a load fails after changing it (a fresh optimizer
// comes back with no state): its per-parameter state and groups' options, and what it keeps
// beyond them (stateful.h: ZeroRedundancyOptimizer's shard and snapshot).
class OptimizerBefore {
 public:
  explicit OptimizerBefore(torch::optim::Optimizer* optimizer) : optimizer_(optimizer) {
    if (optimizer_ == nullptr) return;
    copy_ = std::make_unique<detail::OptimizerCopy>(*optimizer_);
    if (auto* beyond = dynamic_cast<KeepsStateBeyondOptimizer*>(optimizer_)) restore_beyond_ = beyond->keep_for_restore();
  }
  void restore() {
    if (optimizer_ == nullptr) return;
    copy_->restore(*optimizer_);
    if (restore_beyond_) std::exchange(restore_beyond_, nullptr)();
  }

 private:
  torch::optim::Optimizer* optimizer_;
  std::unique_ptr<detail::OptimizerCopy> copy_;
  std::function<void()> restore_beyond_;
};

// Not collective: the contents, this rank's states and RNG from the file (already read: `zip`); the
// training state returned. Everything that can be checked without changing anything is checked
// first (prepare_load, and read_rank_state before); then the optimizers load, put back if LibTorch
// or their parameters refuse what they read, before any state or model changes.
TrainingState load_contents(const std::vector<char>& zip, const std::string& path, const LoadedContents& contents,
                            const LoadOptions& options, SavedRecord& saved, const RankState& read) {
  PreparedLoad load = prepare_load(zip, path, saved, contents, options);
  check_rng(read, path);
  std::vector<OptimizerBefore> optimizers_before;
  for (const auto& optimizer : load.optimizers) optimizers_before.emplace_back(optimizer.optimizer);
  auto restore_optimizers = [&] {
    for (auto it = optimizers_before.rbegin(); it != optimizers_before.rend(); ++it) it->restore();
  };
  try {
    const ParameterNames name_of = parameter_names(contents);
    for (auto& optimizer : load.optimizers) {
      apply_optimizer(optimizer.archive, path, optimizer.where, *optimizer.optimizer, name_of);
    }
  } catch (...) {
    restore_optimizers();
    throw;
  }
  StatesBefore states;
  try {
    states = apply_states(read, path);  // every state or none
    for (const auto& model : load.models) copy_matched(model);  // checked: copies alone are left
  } catch (...) {
    states.restore();
    restore_optimizers();
    throw;
  }
  apply_rng(read);
  return saved.state;
}

TrainingState load_contents(const std::vector<char>& zip, const std::string& path, const LoadedContents& contents,
                            const LoadOptions& options) {
  SavedRecord saved;
  read_training_record(zip, path, saved);
  check_layout(path, saved, contents);
  const RankState read = read_rank_state(saved, path, options);
  return load_contents(zip, path, contents, options, saved, read);
}

TrainingState load_contents(const std::string& path, const LoadedContents& contents, const LoadOptions& options) {
  return load_contents(read_checkpoint_file(path), path, contents, options);
}

LoadedContents one_model(torch::nn::Module& module, torch::optim::Optimizer* optimizer) {
  LoadedContents contents;
  contents.models.emplace_back("", &module);
  if (optimizer != nullptr) contents.optimizers.emplace_back("", optimizer);
  return contents;
}

std::vector<std::string> state_names_of(const LoadOptions& options) {
  std::vector<std::string> names;
  for (const auto& entry : options.states()) names.push_back(entry.name);
  return names;
}

// The named entries as contents, their states added to `options`.
LoadedContents named_contents(const std::vector<CheckpointEntry>& entries, LoadOptions& options) {
  return contents_of<LoadedContents>(entries, state_names_of(options), "load_checkpoint",
                                     [&](const std::string& name, Stateful* state, bool required) {
                                       if (required) {
                                         options.state(name, state);
                                       } else {
                                         options.optional_state(name, state);
                                       }
                                     });
}

// --- load_checkpoint_if_exists: rank 0 decides, every rank follows ------------------------------------

// The file to load for `path_or_dir`, or "" when there is none (decided on rank 0 only).
std::string existing_checkpoint(const std::string& path_or_dir) {
  std::error_code error;
  const auto status = std::filesystem::status(path_or_dir, error);
  if (std::filesystem::is_directory(status)) return latest_checkpoint(path_or_dir).value_or("");
  // Anything else that exists is loaded, and refused there if it is no checkpoint: only absence means "start fresh".
  return std::filesystem::exists(std::filesystem::symlink_status(path_or_dir, error)) ? path_or_dir : "";
}

Restored load_if_exists(const std::string& path_or_dir, const LoadOptions& options,
                        const std::function<TrainingState(const std::string&)>& load) {
  const ProcessGroupPtr group = resolve_group(options.group());
  const int rank = group ? group->getRank() : 0;
  // 1. Rank 0 looks, every rank hears its answer: ranks never split into fresh and resumed.
  std::string chosen = rank == 0 ? existing_checkpoint(path_or_dir) : std::string();
  if (group) broadcast_bytes(chosen, 0, group);
  if (chosen.empty()) return Restored{};
  // 2. Every rank loads; then all learn whether all succeeded, so none trains on alone.
  Restored restored{true, chosen, {}};
  std::exception_ptr failure;
  try {
    restored.state = load(chosen);
  } catch (...) {
    failure = std::current_exception();
  }
  if (group) {
    at::Tensor failed_rank = torch::tensor({failure ? static_cast<int64_t>(rank) : int64_t{-1}}, at::kLong)
                                 .to(collective_device(group));
    all_reduce(failed_rank, c10d::ReduceOp::MAX, group);
    const int64_t other = failed_rank.cpu().item<int64_t>();
    if (!failure && other >= 0) {
      throw CheckpointError("rank " + std::to_string(other) + " failed to load checkpoint " + chosen +
                            " (its error is in its output)");
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (rank == 0) {
    std::fprintf(stderr, "ddp: resumed from %s: epoch %" PRId64 ", global step %" PRId64 "\n", chosen.c_str(),
                 restored.state.epoch, restored.state.global_step);
  }
  return restored;
}

// --- sharded checkpoints: every rank its own file, nothing gathered ----------------------------------
// `path` is the index, written by rank 0 last; "<path>.rank-<r>-of-<W>" holds rank r's rows of every
// parameter (its root object: the model's state_dict as that rank holds it, the shards, and the
// buffers), its optimizer state of them, its RNG and states. Every file carries the save's id, so a
// save that stopped halfway (some rank files replaced, the index not) is refused at load.

std::string rank_file_path(const std::string& path, int64_t rank, int64_t world) {
  return path + kRankFileInfix + std::to_string(rank) + "-of-" + std::to_string(world);
}

// A parameter as a matrix of rows (dim 0; a 0-dim parameter is one row of one element).
int64_t row_numel_of(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (size_t d = 1; d < shape.size(); ++d) numel *= shape[d];
  return numel;
}

// The shape of `rows` rows of a parameter of `shape`.
std::vector<int64_t> rows_shape(const std::vector<int64_t>& shape, int64_t rows) {
  std::vector<int64_t> local = shape.empty() ? std::vector<int64_t>{1} : shape;
  local[0] = rows;
  return local;
}

std::string sizes_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t d = 0; d < shape.size(); ++d) text += (d == 0 ? "" : ", ") + std::to_string(shape[d]);
  return text + "]";
}

int64_t new_save_id() {
  std::random_device device;  // not LibTorch's generator: a save must not move the training's random stream
  return static_cast<int64_t>((static_cast<uint64_t>(device()) << 32) | device());
}

// The index's record: each parameter's name and whole shape, and the rows of each in each rank's
// file (`table`: [W, 1 + 2P], columns 1.. the first rows, 1 + P.. the row counts).
MoreFields index_fields(int64_t save_id, int64_t world, const std::vector<LocalShard>& shards, const at::Tensor& table) {
  return [=](torch::serialize::OutputArchive& archive) {
    std::vector<std::string> names;
    std::vector<int64_t> ndims, sizes, first_rows, rows;
    for (const auto& shard : shards) {
      names.push_back(shard.name);
      ndims.push_back(static_cast<int64_t>(shard.shape.size()));
      sizes.insert(sizes.end(), shard.shape.begin(), shard.shape.end());
    }
    const auto count = static_cast<int64_t>(shards.size());
    const auto cells = table.accessor<int64_t, 2>();
    for (int64_t r = 0; r < world; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        first_rows.push_back(cells[r][1 + i]);
        rows.push_back(cells[r][1 + count + i]);
      }
    }
    archive.write("sharded_save_id", c10::IValue(save_id));
    archive.write("sharded_world_size", c10::IValue(world));
    archive.write("sharded_names", c10::IValue(c10::List<std::string>(names)));
    archive.write("sharded_ndims", c10::IValue(ndims));
    archive.write("sharded_sizes", c10::IValue(sizes));
    archive.write("sharded_first_rows", c10::IValue(first_rows));
    archive.write("sharded_rows", c10::IValue(rows));
  };
}

// Collective: broadcast, all_reduce and broadcast of a few integers; the parameters and the
// optimizer's state stay where they are.
void save_sharded(const std::string& path, const torch::nn::Module& module, ShardedState& sharded,
                  const torch::optim::Optimizer* optimizer, const TrainingState& state,
                  const CheckpointOptions& options) {
  std::vector<std::string> state_names;
  for (const auto& [name, own] : options.states()) {
    if (own == nullptr) throw std::invalid_argument("save_checkpoint: the state named \"" + name + "\" is null");
    state_names.push_back(name);
  }
  check_names(state_names, "save_checkpoint");
  const ProcessGroupPtr group = resolve_group(options.group());
  const int rank = group ? group->getRank() : 0;
  const int64_t world = group ? group->getSize() : 1;
  const at::Device device = group ? collective_device(group) : at::Device(at::kCPU);
  const std::vector<LocalShard> shards = sharded.local_shards();

  // 1. Rank 0 readies the directory and names this save.
  std::string failure;
  int64_t save_id = 0;
  if (rank == 0) {
    try {
      prepare_directory(path);
      save_id = new_save_id();
    } catch (const std::exception& error) {
      failure = error_line(error);
    }
  }
  if (group) {
    at::Tensor start = torch::tensor({failure.empty() ? int64_t{1} : int64_t{0}, save_id}, at::kLong).to(device);
    broadcast(start, 0, group);
    start = start.cpu();
    if (rank != 0 && start[0].item<int64_t>() == 0) {
      throw CheckpointError("rank 0 failed to save checkpoint " + path + " (its error is in rank 0's output)");
    }
    save_id = start[1].item<int64_t>();
  }
  if (!failure.empty()) throw CheckpointError("cannot save checkpoint " + path + ": " + failure);

  // 2. Every rank writes its own file, crash-safely as a one-file checkpoint.
  SavedContents contents;
  contents.models.emplace_back("", &module);
  if (optimizer != nullptr) contents.optimizers.emplace_back("", optimizer);
  const std::string own_file = rank_file_path(path, rank, world);
  try {
    std::vector<RngState> rng;
    if (options.save_rng()) rng.push_back(own_rng_state());
    std::vector<std::vector<at::Tensor>> states;
    if (!options.states().empty()) {
      states.emplace_back();
      for (const auto& entry : options.states()) states.back().push_back(pickled(entry.second->state_dict()));
    }
    write_checkpoint_file(own_file, contents, state, world, rng, state_names, states, static_cast<size_t>(rank),
                          [&](torch::serialize::OutputArchive& archive) {
                            archive.write("sharded_save_id", c10::IValue(save_id));
                            archive.write("sharded_file_rank", c10::IValue(static_cast<int64_t>(rank)));
                            archive.write("sharded_world_size", c10::IValue(world));
                          });
  } catch (const std::exception& error) {
    failure = error_line(error);
  }

  // 3. Every rank learns whether every file is complete, and the rows each holds.
  const auto count = static_cast<int64_t>(shards.size());
  at::Tensor table = torch::zeros({world, 1 + 2 * count}, at::kLong);
  {
    auto cells = table.accessor<int64_t, 2>();
    cells[rank][0] = failure.empty() ? 0 : 1;
    for (int64_t i = 0; i < count; ++i) {
      cells[rank][1 + i] = shards[i].first_row;
      cells[rank][1 + count + i] = shards[i].rows;
    }
  }
  if (group) {
    at::Tensor summed = table.to(device);
    all_reduce(summed, c10d::ReduceOp::SUM, group);
    table = summed.cpu();
  }
  if (!failure.empty()) throw CheckpointError("cannot save checkpoint " + path + ": writing " + own_file + ": " + failure);
  for (int64_t r = 0; r < world; ++r) {
    if (table[r][0].item<int64_t>() != 0) {
      throw CheckpointError("rank " + std::to_string(r) + " failed to write " + rank_file_path(path, r, world) +
                            ", its file of checkpoint " + path + " (its error is in its output); " + path +
                            " was not written");
    }
  }

  // 4. Rank 0 writes the index once every rank's file is in place: its presence makes the files a
  //    checkpoint. Then the barrier, as for one file.
  if (rank == 0) {
    try {
      const std::string record = training_record(state, world, contents, {}, state_names, {}, 0,
                                                 index_fields(save_id, world, shards, table));
      std::vector<char> zip = make_state_dict_archive(StateDict(), {{kTrainingRecord, record}});
      seal_archive(zip);
      write_file_atomically(path, zip.data(), zip.size());
      // Rank files of an earlier save into `path` at another world size.
      const std::filesystem::path file(path);
      const std::string mine = file.filename().string(), current = "-of-" + std::to_string(world);
      std::error_code ignored;
      const std::filesystem::path dir = file.parent_path().empty() ? std::filesystem::path(".") : file.parent_path();
      for (const auto& entry : std::filesystem::directory_iterator(dir, ignored)) {
        const std::string name = entry.path().filename().string();
        if (is_rank_file_of(name, mine) && (name.size() < current.size() ||
                                            name.compare(name.size() - current.size(), current.size(), current) != 0)) {
          std::filesystem::remove(entry.path(), ignored);
        }
      }
      if (options.keep_last() > 0) keep_newest(path, options.prefix(), options.keep_last());
    } catch (const std::exception& error) {
      failure = error_line(error);
    }
  }
  finish_save(path, failure, rank, group);
}

// --- a sharded model's load: every rank reads first, then all agree before anything changes ----------

// Collective over `group`: the failures every rank of it knows (`lines`, "" when none), in rank
// order. One small all_reduce when no rank failed; then one broadcast per rank that did.
std::string failures_across(const std::string& lines, const ProcessGroupPtr& group) {
  if (!group) return lines;
  std::vector<int64_t> failed(static_cast<size_t>(group->getSize()), 0);
  failed[static_cast<size_t>(group->getRank())] = lines.empty() ? 0 : 1;
  all_reduce(failed, c10d::ReduceOp::SUM, group);
  std::string all;
  for (size_t r = 0; r < failed.size(); ++r) {
    if (failed[r] == 0) continue;
    std::string text = lines;
    broadcast_bytes(text, static_cast<int>(r), group);
    all += text;
  }
  return all;
}

// Collective over every rank of the sharded model: when any rank could not read `what` of
// checkpoint `path` (`failure`: this rank's error, "" when it read), every rank throws, naming
// each such rank and its error, before any rank changed its model or optimizer. Otherwise the
// ranks would wait in the load's collectives for the one that gave up, or load it without it.
void require_every_rank_read(const ShardedState& sharded, const std::string& path, const std::string& what,
                             const std::string& failure) {
  std::string lines;
  if (!failure.empty()) {
    const ProcessGroupPtr world = resolve_group({});
    lines = "\n  rank " + std::to_string(world ? world->getRank() : 0) + ": " + failure;
  }
  for (const ProcessGroupPtr& group : sharded.groups()) lines = failures_across(lines, group);
  if (lines.empty()) return;
  throw CheckpointError("checkpoint " + path + " was not loaded: not every rank could read " + what + ":" + lines +
                        "\nNo rank's model or optimizer was changed. Every rank reads the checkpoint: put it where "
                        "every rank sees it whole (a directory they share), or load another checkpoint (one that "
                        "holds every state the load requires)");
}

// One rank's file of a sharded checkpoint, read and checked against the index.
struct RankFile {
  int64_t rank = 0;  // whose file, of the saving world
  std::string path;
  std::vector<char> zip;
  SavedRecord saved;
  StateDict tensors;
};

void read_rank_file(const std::string& path, const ShardedIndex& index, int64_t rank, const LoadOptions& options,
                    RankFile& file) {
  file.rank = rank;
  file.path = rank_file_path(path, rank, index.world);
  const std::string whose = "the file of rank " + std::to_string(rank) + " of the " + std::to_string(index.world) +
                            " that saved the sharded checkpoint " + path;
  std::error_code error;
  if (!std::filesystem::exists(file.path, error)) {
    throw CheckpointError(file.path + " is missing: it is " + whose + ". Every rank reads the files it needs of "
                          "every rank, so they must all lie beside " + path + " in a directory every rank sees; "
                          "put it back, or load another checkpoint");
  }
  file.zip = read_checkpoint_file(file.path);  // names the file when truncated or damaged
  read_training_record(file.zip, file.path, file.saved);
  const auto& own = file.saved.shard_file;
  if (!own || own->save_id != index.save_id || own->rank != rank || own->world != index.world) {
    throw CheckpointError(file.path + " is not " + whose + ": it is another save's (a save into " + path +
                          " that stopped before it completed replaced it); load another checkpoint");
  }
  file.tensors = parse_state_dict_archive(file.zip, file.path, options.map_location());
}

// A parameter this rank loads, assembled from the files' rows.
struct Needed {
  const LocalShard* shard = nullptr;
  size_t saved = 0;  // its place in the index
  int64_t row_numel = 1;
  at::Tensor rows;                      // [shard->rows, row_numel]
  std::vector<bool> covered;            // which of those rows a file gave
  std::vector<at::Tensor> state_rows;   // the optimizer's state, tensor by tensor (undefined: not shard-shaped)
};

// The whole rows [from, to) of a parameter that rank r's file holds and this rank needs.
std::pair<int64_t, int64_t> rows_from(const ShardedIndex& index, const Needed& need, int64_t r) {
  const size_t k = static_cast<size_t>(r) * index.names.size() + need.saved;
  const int64_t from = std::max(index.first_rows[k], need.shard->first_row);
  const int64_t to = std::min(index.first_rows[k] + index.rows[k], need.shard->first_row + need.shard->rows);
  return {from, std::max(from, to)};
}

// The files this rank needs, read and checked, in the order their rows are taken: its own first
// (rank 0's for a rank the saving world did not have), then each other file that holds a row no
// earlier one does. Changes nothing: a file that cannot be read fails here, before any rank loads.
std::vector<std::unique_ptr<RankFile>> read_needed_files(const std::string& path, const ShardedIndex& index,
                                                         int64_t rank, const std::vector<Needed>& needs,
                                                         const LoadOptions& options) {
  const int64_t home = rank < index.world ? rank : 0;
  std::vector<int64_t> order{home};
  for (int64_t r = 0; r < index.world; ++r) {
    if (r != home) order.push_back(r);
  }
  std::vector<std::vector<bool>> covered;
  for (const auto& need : needs) covered.emplace_back(static_cast<size_t>(need.shard->rows), false);
  std::vector<std::unique_ptr<RankFile>> files;
  for (const int64_t r : order) {
    bool adds_rows = r == home;
    for (size_t i = 0; i < needs.size(); ++i) {
      const auto range = rows_from(index, needs[i], r);
      for (int64_t row = range.first; row < range.second; ++row) {
        const auto at = static_cast<size_t>(row - needs[i].shard->first_row);
        adds_rows = adds_rows || !covered[i][at];
        covered[i][at] = true;
      }
    }
    if (!adds_rows) continue;
    files.push_back(std::make_unique<RankFile>());
    read_rank_file(path, index, r, options, *files.back());
  }
  return files;
}

std::unique_ptr<RankFile> assemble_shards(const std::string& path, const SavedRecord& index_record,
                                          torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                                          const LoadOptions& options, std::vector<Needed>& needs, bool same_layout,
                                          std::vector<std::unique_ptr<RankFile>> files);

// Collective over the model's ranks (whether every rank read its files; nothing else): this rank's
// rows of every parameter and of their optimizer state from the files that hold them (its own file
// alone when the world and layout are those it was saved at), its RNG and states from its own file
// (rank 0's states for a rank the saving world did not have).
TrainingState load_sharded(const std::string& path, const SavedRecord& index_record, torch::nn::Module& module,
                           ShardedState& sharded, torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  const ShardedIndex& index = *index_record.sharded_index;
  const ProcessGroupPtr group = resolve_group(options.group());
  const int64_t rank = group ? group->getRank() : 0;
  const auto count = static_cast<int64_t>(index.names.size());
  if (optimizer != nullptr && index_record.optimizers.empty()) {
    throw CheckpointError("checkpoint " + path + " holds no optimizer state");
  }
  const std::vector<LocalShard> shards = sharded.local_shards();
  std::vector<Needed> needs;
  std::vector<std::string> wrong_shape;
  for (const auto& shard : shards) {
    const auto found = std::find(index.names.begin(), index.names.end(), shard.name);
    if (found == index.names.end()) continue;  // missing: load_state_dict names it
    Needed need;
    need.shard = &shard;
    need.saved = static_cast<size_t>(found - index.names.begin());
    if (index.shapes[need.saved] != shard.shape) {
      wrong_shape.push_back(shard.name + " is " + sizes_text(index.shapes[need.saved]) + " in " + path + ", " +
                            sizes_text(shard.shape) + " in the model");
      continue;
    }
    need.row_numel = row_numel_of(shard.shape);
    need.rows = at::zeros({shard.rows, need.row_numel}, at::TensorOptions().dtype(shard.tensor.scalar_type()));
    need.covered.assign(static_cast<size_t>(shard.rows), false);
    needs.push_back(std::move(need));
  }
  if (!wrong_shape.empty()) {
    throw CheckpointError("checkpoint " + path + " does not match the model:\n  shape mismatch: " + joined_names(wrong_shape));
  }
  std::vector<std::unique_ptr<RankFile>> files;
  RankState read;
  std::string failure;
  try {
    files = read_needed_files(path, index, rank, needs, options);
    // This rank's states and RNG from its own file (rank 0's for a rank the saving world did not have).
    read = read_rank_state(files.front()->saved, files.front()->path, options);
  } catch (const std::exception& error) {
    failure = error_line(error);
  }
  require_every_rank_read(sharded, path, "the files it needs", failure);
  bool same_layout = rank < index.world;  // this rank's file holds exactly its rows
  for (const auto& need : needs) {
    const size_t k = static_cast<size_t>(rank * count) + need.saved;
    same_layout = same_layout && index.first_rows[k] == need.shard->first_row && index.rows[k] == need.shard->rows;
  }
  // What a load that fails after changing anything puts back: the shards and the optimizer as they
  // were (at another layout every needed file's optimizer state is loaded in turn to cut its rows from).
  check_rng(read, files.front()->path);
  OptimizerBefore optimizer_before(optimizer);
  std::vector<at::Tensor> shards_before;
  for (const auto& shard : shards) shards_before.push_back(shard.tensor.detach().clone());
  std::vector<at::Tensor> buffers = module.buffers(), buffers_before;
  for (const auto& buffer : buffers) buffers_before.push_back(buffer.detach().clone());
  StatesBefore states = apply_states(read, files.front()->path);
  try {
    assemble_shards(path, index_record, module, optimizer, options, needs, same_layout, std::move(files));
  } catch (...) {
    states.restore();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < shards.size(); ++i) shards[i].tensor.detach().copy_(shards_before[i]);
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].detach().copy_(buffers_before[i]);
    optimizer_before.restore();
    throw;
  }
  apply_rng(read);
  return index_record.state;
}

// load_sharded's assembly: the rows of the parameters and of the optimizer's state that `files`
// (read_needed_files's, in its order) hold into `needs`, then into the model and the optimizer.
// Returns this rank's own file (rank 0's for a rank the saving world did not have).
std::unique_ptr<RankFile> assemble_shards(const std::string& path, const SavedRecord& index_record,
                                          torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                                          const LoadOptions& options, std::vector<Needed>& needs, bool same_layout,
                                          std::vector<std::unique_ptr<RankFile>> files) {
  const ShardedIndex& index = *index_record.sharded_index;
  const auto count = static_cast<int64_t>(index.names.size());
  const ParameterNames name_of = parameter_names(one_model(module, optimizer));
  auto overlap = [&](const Needed& need, int64_t r) { return rows_from(index, need, r); };
  auto take_state_rows = [&](int64_t r) {
    auto& states = optimizer->state();
    for (auto& need : needs) {
      const auto found = states.find(compat::optimizer_state_key(states, need.shard->tensor));
      if (found == states.end()) continue;  // never stepped
      const size_t k = static_cast<size_t>(r * count) + need.saved;
      const auto saved_shape = rows_shape(need.shard->shape, index.rows[k]);
      const auto range = overlap(need, r);  // named, not bound: clang before 16 cannot capture a binding
      const int64_t from = range.first, to = range.second;
      size_t slot = 0;
      const bool known = detail::for_each_state_tensor(*found->second, [&](at::Tensor& tensor) {
        if (need.state_rows.size() <= slot) need.state_rows.emplace_back();
        at::Tensor& rows = need.state_rows[slot++];
        if (!tensor.defined() || !tensor.sizes().equals(saved_shape)) return;
        if (!rows.defined()) rows = at::zeros({need.shard->rows, need.row_numel}, tensor.options());
        if (to > from) {
          rows.narrow(0, from - need.shard->first_row, to - from)
              .copy_(tensor.reshape({index.rows[k], need.row_numel}).narrow(0, from - index.first_rows[k], to - from));
        }
      });
      if (!known) {
        throw CheckpointError("checkpoint " + path + " was saved at another world size or layout, and the state of " +
                              optimizer_type(*optimizer) + " cannot be cut into new shards (its tensors are not known "
                              "here): load it at the world size it was saved at");
      }
    }
  };

  StateDict loaded;  // what goes into the model: the assembled shards, then the buffers
  for (const auto& file : files) {
    const int64_t r = file->rank;
    for (auto& need : needs) {
      const std::string& name = need.shard->name;
      const size_t k = static_cast<size_t>(r * count) + need.saved;
      const at::Tensor* saved = file->tensors.find(name);
      if (saved == nullptr) {
        throw CheckpointError(file->path + " lacks the parameter " + name + ", which its index " + path + " lists");
      }
      const auto expected = rows_shape(need.shard->shape, index.rows[k]);
      if (!saved->sizes().equals(expected)) {
        throw CheckpointError(file->path + " holds " + name + " of shape " + shape_of(*saved) + ", where its index " +
                              path + " says " + sizes_text(expected));
      }
      const auto [from, to] = overlap(need, r);
      if (to == from) continue;
      need.rows.narrow(0, from - need.shard->first_row, to - from)
          .copy_(saved->reshape({index.rows[k], need.row_numel}).narrow(0, from - index.first_rows[k], to - from));
      for (int64_t row = from; row < to; ++row) need.covered[static_cast<size_t>(row - need.shard->first_row)] = true;
    }
    if (optimizer != nullptr) {
      if (file->saved.optimizers.empty()) {
        throw CheckpointError(file->path + " holds no optimizer state, which its index " + path + " lists");
      }
      auto archive = read_optimizer(file->zip, file->path, file->saved.optimizers.front(), kOptimizerRecord, "",
                                    *optimizer, options);
      apply_optimizer(archive, file->path, "", *optimizer, name_of, /*check_fits=*/same_layout);
      if (!same_layout) take_state_rows(r);
    }
  }
  std::unique_ptr<RankFile> home_file = std::move(files.front());
  for (const auto& need : needs) {
    const auto missing = std::find(need.covered.begin(), need.covered.end(), false);
    if (missing != need.covered.end()) {
      throw CheckpointError("checkpoint " + path + " is damaged: no rank file holds row " +
                            std::to_string(need.shard->first_row + (missing - need.covered.begin())) + " of " +
                            need.shard->name);
    }
    loaded.insert(need.shard->name, need.rows.view(need.shard->tensor.sizes()));
  }
  for (const auto& item : home_file->tensors) {
    if (loaded.find(item.key()) == nullptr) loaded.insert(item.key(), item.value());  // buffers
  }
  load_state_dict(module, loaded, options.strict(), "checkpoint " + path);
  if (optimizer != nullptr && !same_layout) {
    auto& states = optimizer->state();
    for (auto& need : needs) {
      const auto found = states.find(compat::optimizer_state_key(states, need.shard->tensor));
      if (found == states.end()) continue;
      size_t slot = 0;
      detail::for_each_state_tensor(*found->second, [&](at::Tensor& tensor) {
        const size_t k = slot++;
        if (k < need.state_rows.size() && need.state_rows[k].defined()) {
          tensor = need.state_rows[k].view(need.shard->tensor.sizes()).to(need.shard->tensor.device());
        }
      });
    }
    try {
      check_state_fits_parameters(*optimizer, name_of);
    } catch (const std::invalid_argument& error) {
      throw CheckpointError("the optimizer state in " + path + " is refused: " + error.what());
    }
  }
  return home_file;
}

}  // namespace

void save_checkpoint(const std::string& path, const torch::nn::Module& module,
                     const torch::optim::Optimizer* optimizer, const TrainingState& state,
                     const CheckpointOptions& options) {
  std::vector<std::string> state_names;
  for (const auto& entry : options.states()) state_names.push_back(entry.first);
  check_names(state_names, "save_checkpoint");
  SavedContents contents;
  contents.models.emplace_back("", &module);
  if (optimizer != nullptr) contents.optimizers.emplace_back("", optimizer);
  save_contents(path, contents, state, options);
}

void save_checkpoint(const std::string& path, const std::vector<CheckpointEntry>& entries,
                     const TrainingState& state, const CheckpointOptions& options) {
  CheckpointOptions with_states = options;
  std::vector<std::string> state_names;
  for (const auto& entry : options.states()) state_names.push_back(entry.first);
  const SavedContents contents = contents_of<SavedContents>(
      entries, state_names, "save_checkpoint",
      [&](const std::string& name, const Stateful* state, bool) { with_states.state(name, state); });
  save_contents(path, contents, state, with_states);
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& module,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  check_names(state_names_of(options), "load_checkpoint");
  return load_contents(path, one_model(module, optimizer), options);
}

TrainingState load_checkpoint(const std::string& path, const std::vector<CheckpointEntry>& entries,
                              const LoadOptions& options) {
  LoadOptions with_states = options;
  const LoadedContents contents = named_contents(entries, with_states);
  return load_contents(path, contents, with_states);
}

Restored load_checkpoint_if_exists(const std::string& path_or_dir, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  return load_if_exists(path_or_dir, options,
                        [&](const std::string& path) { return load_checkpoint(path, module, optimizer, options); });
}

Restored load_checkpoint_if_exists(const std::string& path_or_dir, const std::vector<CheckpointEntry>& entries,
                                   const LoadOptions& options) {
  return load_if_exists(path_or_dir, options,
                        [&](const std::string& path) { return load_checkpoint(path, entries, options); });
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

namespace detail {

void save_model_checkpoint(const std::string& path, const torch::nn::Module& module, ShardedState* sharded,
                           const torch::optim::Optimizer* optimizer, const TrainingState& state,
                           const CheckpointOptions& options) {
  if (sharded != nullptr && !options.full_state_dict()) {
    save_sharded(path, module, *sharded, optimizer, state, options);
    return;
  }
  WholeWhileAlive whole(sharded, const_cast<torch::optim::Optimizer*>(optimizer));
  save_checkpoint(path, module, optimizer, state, options);
}

TrainingState load_model_checkpoint(const std::string& path, torch::nn::Module& module, ShardedState* sharded,
                                    torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  if (sharded == nullptr) return load_checkpoint(path, module, optimizer, options);
  check_names(state_names_of(options), "load_checkpoint");
  // Which format decides whether the model is gathered: the file is read first, on every rank
  // before any gathers (a rank that could not would leave the others waiting in the gather).
  std::vector<char> zip;
  SavedRecord saved;
  RankState read;
  std::string failure;
  try {
    zip = read_checkpoint_file(path);
    read_training_record(zip, path, saved);
    // A full checkpoint's states and RNG, checked before the gather; a sharded one's are in the rank files.
    if (!saved.sharded_index) {
      check_layout(path, saved, one_model(module, optimizer));
      read = read_rank_state(saved, path, options);
    }
  } catch (const std::exception& error) {
    failure = error_line(error);
  }
  require_every_rank_read(*sharded, path, "it", failure);
  if (saved.sharded_index) return load_sharded(path, saved, module, *sharded, optimizer, options);
  // The optimizer as it was: a failed load's shard_again puts back the shards it gathered, but not
  // state the load created (a fresh optimizer's) or replaced.
  OptimizerBefore optimizer_before(optimizer);
  try {
    WholeWhileAlive whole(sharded, optimizer);
    TrainingState loaded = load_contents(zip, path, one_model(module, optimizer), options, saved, read);
    whole.keep();
    return loaded;
  } catch (...) {
    optimizer_before.restore();  // after `whole` put the shards back
    throw;
  }
}

Restored load_model_checkpoint_if_exists(const std::string& path_or_dir, torch::nn::Module& module,
                                         ShardedState* sharded, torch::optim::Optimizer* optimizer,
                                         const LoadOptions& options) {
  return load_if_exists(path_or_dir, options, [&](const std::string& path) {
    return load_model_checkpoint(path, module, sharded, optimizer, options);
  });
}

}  // namespace detail

}  // namespace ddp
