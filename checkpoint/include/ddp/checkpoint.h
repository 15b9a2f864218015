#pragma once
// Checkpoints of a whole training run, for DDP: rank 0 writes, everyone reads.
//
//   ddp::TrainingState state{epoch, step, sampler_state, {{"note", "lr warmup done"}}};
//   ddp::save_checkpoint(ddp::checkpoint_path(dir, step), model, &optimizer, state,
//                        ddp::CheckpointOptions().keep_last(3));
//   if (auto latest = ddp::latest_checkpoint(dir)) {
//     state = ddp::load_checkpoint(*latest, model, &optimizer,
//                                  ddp::LoadOptions().map_location(
//                                      ddp::MapLocation::cuda_for_local_rank(ddp::local_rank())));
//   }
//
// Several models and optimizers in one file, by name, as Python's
// torch.save({"generator": G.state_dict(), "optimizerG": optG.state_dict(), ...}):
//
//   ddp::save_checkpoint(path, {{"generator", G}, {"discriminator", D},
//                               {"optimizerG", optG}, {"optimizerD", optD}}, state);
//   auto restored = ddp::load_checkpoint_if_exists(dir, {{"generator", G}, {"discriminator", D},
//                                                       {"optimizerG", optG}, {"optimizerD", optD}});
//
// A model is any of: a torch::nn::Module, a LibTorch module holder (torch::nn::Sequential, a
// TORCH_MODULE such as DCGANGenerator), a std::shared_ptr to a module, or a wrapper such as
// ddp::DistributedDataParallel (its bare module is saved, so one checkpoint fits both), or
// ddp::fully_shard's FSDPModule (the root's): saved whole, as the same model unsharded would be
// (gathered on every rank first, shards of the optimizer's state too), and loaded into the shards
// of any world size; save and load are then collective on every rank of its group. With
// CheckpointOptions().full_state_dict(false) it is saved sharded instead, nothing gathered: one
// file per rank beside `path`, loaded by the same load_checkpoint call at any world size. Either
// load first learns whether every rank of the model read what it needs: if one could not, every
// rank throws, naming it and why, and no rank's model or optimizer has changed. A load that fails
// after it changed them (on one rank) puts back that rank's shards, buffers and optimizer state.
//
// One file: a PyTorch zip archive whose root object is the model's plain state_dict (Python:
// torch.load(path) returns it, tensors on CPU), or for named models {name: state_dict} (Python:
// torch.load(path)["generator"]), plus records holding the rest (training state, optimizer
// states: C++ only, Python does not see them), sealed with a checksum over everything
// (checkpoint_file.h).
//
// Thread-safety: save/load are collectives of the training thread; the model and optimizer must
// not train on another thread meanwhile.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <ddp/checkpoint_file.h>
#include <ddp/map_location.h>
#include <ddp/process_group.h>
#include <ddp/sampler_state.h>
#include <ddp/sharded_state.h>
#include <torch/arg.h>

#include <ddp/stateful.h>

namespace ddp {

struct TrainingState {
  int64_t epoch = 0;
  int64_t global_step = 0;
  SamplerState sampler;
  std::map<std::string, std::string> metadata;  // small user key/value pairs
  // Set by save_checkpoint (the group's size) and returned by load_checkpoint; ignored on input.
  int64_t world_size = 1;
};

struct CheckpointOptions {
  // The group whose rank 0 writes; null: the default group if initialized, else this process alone.
  TORCH_ARG(ProcessGroupPtr, group) = {};
  // After saving, delete all but the newest `n` checkpoints named like checkpoint_path() in the
  // same directory with the same prefix (0: keep all).
  TORCH_ARG(int, keep_last) = 0;
  TORCH_ARG(std::string, prefix) = "checkpoint";
  // Save every rank's RNG states (CPU generator, and the current CUDA device's when available).
  TORCH_ARG(bool, save_rng) = true;
  // For a model sharded by ddp::fully_shard (its FSDPModule), PyTorch's
  // StateDictOptions(full_state_dict=...): true writes the whole model into one file, gathered on
  // every rank (Python's torch.load reads it; it loads into any model, sharded or not); false
  // writes a sharded checkpoint, nothing gathered: every rank its own file "<path>.rank-<r>-of-<W>"
  // with its rows of every parameter and of their optimizer state, its RNG and states, and `path`
  // itself, written by rank 0 once every rank's file is complete, the index a load needs (each
  // parameter's full shape, the rows each file holds). load_checkpoint tells the two apart; a
  // sharded checkpoint loads into the fully_shard model at any world size. Ignored for a model
  // that is not sharded (its one file is the same either way). A full save into the path of a
  // sharded checkpoint removes that checkpoint's rank files, once the full file is on disk.
  TORCH_ARG(bool, full_state_dict) = true;

 public:
  // Also save `state` (a GradScaler, a comm hook's state, ...) under `name`: every rank's own
  // snapshot (they may differ: PowerSGD's error feedback does). Every rank names the same states.
  // Not owned: it must outlive the call.
  CheckpointOptions& state(std::string name, const Stateful* state) {
    states_.emplace_back(std::move(name), state);
    return *this;
  }
  const std::vector<std::pair<std::string, const Stateful*>>& states() const { return states_; }

 private:
  std::vector<std::pair<std::string, const Stateful*>> states_;
};

struct LoadOptions {
  TORCH_ARG(MapLocation, map_location) = {};
  // Missing or unexpected parameter names are errors (shape mismatches always are).
  TORCH_ARG(bool, strict) = true;
  // Restore this rank's RNG states (saved per rank; a rank the checkpoint has no entry for keeps its own).
  TORCH_ARG(bool, restore_rng) = true;
  // Which rank this process is for RNG and state restore; null: the default group if initialized,
  // else rank 0.
  TORCH_ARG(ProcessGroupPtr, group) = {};

 public:
  struct StateEntry {
    std::string name;
    Stateful* state;
    bool required;  // false for a DDP wrapper's comm hook: a run may add a hook when it resumes
  };
  // Restore `state` from the snapshot this rank saved under `name` (rank 0's for a rank the saving
  // world did not have). A checkpoint without `name` is an error naming what it holds.
  LoadOptions& state(std::string name, Stateful* state) {
    states_.push_back({std::move(name), state, /*required=*/true});
    return *this;
  }
  // The same for a state a checkpoint may lack (a DDP wrapper's comm hook state: a resumed run may
  // add a hook the saving run did not have).
  LoadOptions& optional_state(std::string name, Stateful* state) {
    states_.push_back({std::move(name), state, /*required=*/false});
    return *this;
  }
  const std::vector<StateEntry>& states() const { return states_; }

 private:
  std::vector<StateEntry> states_;
};

// Collective: every rank of the group calls it. Rank 0 writes `path` crash-safely; every rank
// returns only once the file is complete and visible, and throws CheckpointError on every rank if
// rank 0 failed. `optimizer` may be null. Rank 0 first takes the lock of `path`'s directory for
// the rest of its life (".torchddp-checkpoint.lock", naming the run id, pid and host): a save of
// another job (another run id, or none) into that directory while this process lives is refused,
// naming this one; the lock of a process that ended is taken over.
void save_checkpoint(const std::string& path, const torch::nn::Module& module,
                     const torch::optim::Optimizer* optimizer, const TrainingState& state,
                     const CheckpointOptions& options = {});

// Not collective: every rank reads the file. Verifies the checksum, copies the model state into
// `module` (error listing every mismatched name/shape), loads the optimizer state (read through
// map_location, then each parameter's state moved to that parameter's device, as PyTorch's
// Optimizer.load_state_dict does), restores this rank's RNG states, and returns the training state.
// Refused with a CheckpointError naming the file (and the tensor or parameter): a model state
// holding NaN or an infinity, an optimizer state that does (or whose tensors are not shaped like
// their parameters: LibTorch would fail only at the next step()), and any file that is no sound
// checkpoint (checkpoint_file.h), before LibTorch reads it. The states (LoadOptions::state, named
// entries) are read and checked before anything changes and restored all or none: a required one
// the file lacks, one that cannot be read, or one its load_state_dict refuses (a field missing)
// leaves the model, the optimizer and every state as they were.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& module,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options = {});

// <dir>/<prefix>-<step, 8+ digits>.pt
std::string checkpoint_path(const std::string& dir, int64_t global_step,
                            const std::string& prefix = "checkpoint");
// The newest checkpoint in `dir` (by step in its name) that passes verification; others skipped.
std::optional<std::string> latest_checkpoint(const std::string& dir,
                                             const std::string& prefix = "checkpoint");

// A model given as a LibTorch module holder, a std::shared_ptr to a module, or a wrapper with
// .module() (ddp::DistributedDataParallel). A wrapper with a stateful comm hook (comm_hook_state(),
// e.g. PowerSGD) has that state saved and restored too, under the name "comm_hook"; a checkpoint
// saved without it leaves the hook's fresh state alone.
namespace detail {
template <typename T, typename = void>
struct HasModule : std::false_type {};
template <typename T>
struct HasModule<T, std::void_t<decltype(*std::declval<const T&>().module())>> : std::true_type {};
template <typename T>
struct IsSharedModule : std::false_type {};
template <typename T>
struct IsSharedModule<std::shared_ptr<T>> : std::is_base_of<torch::nn::Module, T> {};
template <typename T>
constexpr bool is_module_handle =
    !std::is_base_of_v<torch::nn::Module, T> &&
    (torch::detail::is_module_holder<T>::value || IsSharedModule<T>::value || HasModule<T>::value);
template <typename T>
constexpr bool is_model = std::is_base_of_v<torch::nn::Module, T> || is_module_handle<T>;

template <typename Wrapper, typename = void>
struct HasCommHookState : std::false_type {};
template <typename Wrapper>
struct HasCommHookState<Wrapper, std::void_t<decltype(std::declval<const Wrapper&>().comm_hook_state())>>
    : std::true_type {};
constexpr char kCommHookStateName[] = "comm_hook";

// A model sharded across the ranks (ddp::fully_shard's FSDPModule) offers sharded_state().
template <typename T, typename = void>
struct HasShardedState : std::false_type {};
template <typename T>
struct HasShardedState<T, std::void_t<decltype(std::declval<const T&>().sharded_state())>> : std::true_type {};
template <typename Model>
ShardedState* sharded_state_of(const Model& model) {
  if constexpr (HasShardedState<Model>::value) {
    return model.sharded_state();
  } else {
    return nullptr;
  }
}
// The model whole while alive (collective: every rank); back to the shards after, of the whole
// values once keep() was called (a load that succeeded), else as they were.
class WholeWhileAlive {
 public:
  WholeWhileAlive(ShardedState* state, torch::optim::Optimizer* optimizer) : state_(state), optimizer_(optimizer) {
    if (state_) state_->gather_whole(optimizer_);
  }
  ~WholeWhileAlive() {
    if (state_) state_->shard_again(optimizer_, keep_);
  }
  WholeWhileAlive(const WholeWhileAlive&) = delete;
  WholeWhileAlive& operator=(const WholeWhileAlive&) = delete;
  void keep() { keep_ = true; }

 private:
  ShardedState* state_;
  torch::optim::Optimizer* optimizer_;
  bool keep_ = false;
};

// The save and load of one model that may be sharded (`sharded` null when it is not): the single
// model calls below with the sharded model's gather around them, or the sharded format.
void save_model_checkpoint(const std::string& path, const torch::nn::Module& module, ShardedState* sharded,
                           const torch::optim::Optimizer* optimizer, const TrainingState& state,
                           const CheckpointOptions& options);
TrainingState load_model_checkpoint(const std::string& path, torch::nn::Module& module, ShardedState* sharded,
                                    torch::optim::Optimizer* optimizer, const LoadOptions& options);

// The module a model names (throws std::invalid_argument for an empty one).
template <typename Model>
torch::nn::Module& module_of(Model& model) {
  static_assert(is_model<std::remove_const_t<Model>>, "a checkpoint model must be a torch::nn::Module, a module "
                "holder, a std::shared_ptr to a module or a wrapper with .module()");
  if constexpr (std::is_base_of_v<torch::nn::Module, std::remove_const_t<Model>>) {
    static_assert(!std::is_const_v<Model>, "pass the module itself, not a const reference: loading writes into it");
    return model;
  } else if constexpr (torch::detail::is_module_holder<Model>::value) {
    return *model.ptr();  // an empty holder throws here, naming itself
  } else {
    torch::nn::Module* module = nullptr;
    if constexpr (IsSharedModule<std::remove_const_t<Model>>::value) {
      module = model.get();
    } else {
      module = model.module().get();
    }
    if (module == nullptr) throw std::invalid_argument("a checkpoint model is an empty pointer: it holds no module");
    return *module;
  }
}
// A wrapper's comm hook state, or null.
template <typename Model>
Stateful* comm_hook_state_of(const Model& model) {
  if constexpr (HasCommHookState<Model>::value) {
    return model.comm_hook_state();
  } else {
    return nullptr;
  }
}
}  // namespace detail

template <typename Model, typename = std::enable_if_t<detail::is_module_handle<Model>>>
void save_checkpoint(const std::string& path, const Model& model, const torch::optim::Optimizer* optimizer,
                     const TrainingState& state, const CheckpointOptions& options = {}) {
  CheckpointOptions with_hook = options;
  if (const Stateful* hook_state = detail::comm_hook_state_of(model)) {
    with_hook.state(detail::kCommHookStateName, hook_state);
  }
  detail::save_model_checkpoint(path, static_cast<const torch::nn::Module&>(detail::module_of(model)),
                                detail::sharded_state_of(model), optimizer, state, with_hook);
}
template <typename Model, typename = std::enable_if_t<detail::is_module_handle<Model>>>
TrainingState load_checkpoint(const std::string& path, const Model& model, torch::optim::Optimizer* optimizer,
                              const LoadOptions& options = {}) {
  LoadOptions with_hook = options;
  if (Stateful* hook_state = detail::comm_hook_state_of(model)) {
    with_hook.optional_state(detail::kCommHookStateName, hook_state);
  }
  return detail::load_model_checkpoint(path, detail::module_of(model), detail::sharded_state_of(model), optimizer,
                                       with_hook);
}

// --- several models, optimizers and states in one checkpoint, by name -----------------------------

namespace detail {
// A program value (a step counter, the current learning rate, a tensor) as a Stateful entry: one
// tensor "value", integers as int64 and floating point as double, so that it comes back bitwise.
template <typename T>
class ValueState final : public Stateful {
 public:
  explicit ValueState(T& value) : value_(&value) {}
  TensorDict state_dict() const override {
    if constexpr (std::is_same_v<T, at::Tensor>) {
      return {{"value", value_->detach().clone()}};
    } else if constexpr (std::is_floating_point_v<T>) {
      return {{"value", at::scalar_tensor(static_cast<double>(*value_), at::kDouble)}};
    } else {
      return {{"value", at::scalar_tensor(static_cast<int64_t>(*value_), at::kLong)}};
    }
  }
  void load_state_dict(const TensorDict& state) override {
    const auto it = state.find("value");
    if (it == state.end()) throw std::invalid_argument("the saved value is missing");
    if constexpr (std::is_same_v<T, at::Tensor>) {
      *value_ = value_->defined() ? it->second.to(value_->device()) : it->second;
    } else if constexpr (std::is_floating_point_v<T>) {
      *value_ = static_cast<T>(it->second.template item<double>());
    } else {
      *value_ = static_cast<T>(it->second.template item<int64_t>());
    }
  }

 private:
  T* value_;
};

// A sampler's position (ddp::DistributedSampler, or anything with its state()/load_state()).
template <typename Sampler>
class SamplerStateful final : public Stateful {
 public:
  explicit SamplerStateful(Sampler& sampler) : sampler_(&sampler) {}
  TensorDict state_dict() const override {
    const SamplerState state = sampler_->state();
    return {{"epoch", at::scalar_tensor(state.epoch, at::kLong)}, {"consumed", at::scalar_tensor(state.consumed, at::kLong)}};
  }
  void load_state_dict(const TensorDict& state) override {
    const auto epoch = state.find("epoch"), consumed = state.find("consumed");
    if (epoch == state.end() || consumed == state.end()) throw std::invalid_argument("the saved sampler position is incomplete");
    sampler_->load_state(SamplerState{epoch->second.template item<int64_t>(), consumed->second.template item<int64_t>()});
  }

 private:
  Sampler* sampler_;
};

template <typename T, typename = void>
struct IsSampler : std::false_type {};
template <typename T>
struct IsSampler<T, std::void_t<decltype(std::declval<T&>().load_state(std::declval<const T&>().state()))>>
    : std::is_same<decltype(std::declval<const T&>().state()), SamplerState> {};
template <typename T>
constexpr bool is_value = std::is_same_v<T, at::Tensor> || (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>);
}  // namespace detail

// One entry of a named checkpoint, as one key of the dict a Python program saves: a model (any kind
// above), an optimizer, a Stateful (a GradScaler, your own state), a DistributedSampler (its
// position: a resumed loader continues at the next batch), or a program value (an int64_t, a
// double, a size_t, ... or a tensor: a step counter, the current learning rate), each restored
// bitwise. Models and optimizers are saved once (rank 0's); states, samplers and values are each
// rank's own. Holds pointers only: the objects must outlive the save or load call.
//   ddp::save_checkpoint(path, {{"model", model}, {"optimizer", optimizer}, {"sampler", sampler},
//                               {"iteration", iteration}, {"learning_rate", learning_rate}}, state);
class CheckpointEntry {
 public:
  enum class Kind { kModel, kOptimizer, kState };

  template <typename Model, typename = std::enable_if_t<detail::is_model<std::remove_const_t<Model>>>>
  CheckpointEntry(std::string name, Model& model)
      : name_(std::move(name)), kind_(Kind::kModel), module_(&detail::module_of(model)),
        comm_hook_state_(detail::comm_hook_state_of(model)) {
    static_assert(!detail::HasShardedState<std::remove_const_t<Model>>::value,
                  "a model sharded by ddp::fully_shard (its FSDPModule) is checkpointed by the one-model "
                  "save_checkpoint(path, model, &optimizer, state) and load_checkpoint(path, model, &optimizer): "
                  "a named entry would hold this rank's shards as if they were the model");
  }
  CheckpointEntry(std::string name, torch::optim::Optimizer& optimizer)
      : name_(std::move(name)), kind_(Kind::kOptimizer), optimizer_(&optimizer) {}
  CheckpointEntry(std::string name, Stateful& state) : name_(std::move(name)), kind_(Kind::kState), state_(&state) {}
  template <typename Sampler, std::enable_if_t<detail::IsSampler<Sampler>::value, int> = 0>
  CheckpointEntry(std::string name, Sampler& sampler)
      : name_(std::move(name)), kind_(Kind::kState), owned_(std::make_shared<detail::SamplerStateful<Sampler>>(sampler)),
        state_(owned_.get()) {}
  template <typename T, std::enable_if_t<detail::is_value<T>, int> = 0>
  CheckpointEntry(std::string name, T& value)
      : name_(std::move(name)), kind_(Kind::kState), owned_(std::make_shared<detail::ValueState<T>>(value)),
        state_(owned_.get()) {}

  const std::string& name() const { return name_; }
  Kind kind() const { return kind_; }
  torch::nn::Module* module() const { return module_; }              // kModel
  torch::optim::Optimizer* optimizer() const { return optimizer_; }  // kOptimizer
  Stateful* state() const { return state_; }                         // kState
  // kModel: a DDP wrapper's comm hook state (saved as "<name>/comm_hook"), or null.
  Stateful* comm_hook_state() const { return comm_hook_state_; }

 private:
  std::string name_;
  Kind kind_;
  std::shared_ptr<Stateful> owned_;  // the adapter of a sampler or a value
  torch::nn::Module* module_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  Stateful* state_ = nullptr;
  Stateful* comm_hook_state_ = nullptr;
};

// Collective, as the single-model save: rank 0 writes one file holding every entry (atomically:
// a crash leaves the previous file or the complete new one, never half of the models), every rank
// returns once it is complete. Stateful entries are each rank's own snapshot, as
// CheckpointOptions::state (which may add more). Throws std::invalid_argument on every rank,
// before anything is written, for an empty name or a name used twice (across models, optimizers
// and states: a Python dict has one value per key).
void save_checkpoint(const std::string& path, const std::vector<CheckpointEntry>& entries,
                     const TrainingState& state, const CheckpointOptions& options = {});

// Not collective: restores each entry from the entry of the same name in a checkpoint written by
// the save above, and returns the training state. Any subset of the saved names may be loaded
// (the generator alone, to sample). Throws CheckpointError naming the file and the entry for a
// name the file lacks (listing what it holds), a model whose parameters do not match (every
// mismatched name and shape, as the single-model load), an optimizer of another type; and
// std::invalid_argument for a name given twice. A single-model checkpoint is refused with the call
// that loads it, and the single-model load refuses a named checkpoint the same way.
TrainingState load_checkpoint(const std::string& path, const std::vector<CheckpointEntry>& entries,
                              const LoadOptions& options = {});

// --- resuming when there may be nothing to resume from ---------------------------------------------

// What load_checkpoint_if_exists found: `loaded` is false (and `state` the default) when there
// was no checkpoint; `path` is the file it loaded.
struct Restored {
  bool loaded = false;
  std::string path;
  TrainingState state;
};

// Collective (every rank of LoadOptions::group calls it): the first start of a job and a restart
// after a checkpoint use the same line. `path_or_dir` names a checkpoint file, or a directory
// whose newest valid checkpoint (latest_checkpoint(dir), prefix "checkpoint") is loaded. Rank 0
// decides whether there is one and which, and tells every rank, so all ranks load the same file or
// all start fresh: nothing is loaded when the file, or the directory, or any checkpoint in it does
// not exist. Everything else is an error on every rank: a file that exists but cannot be loaded
// (damaged, another model) throws that error on the rank that met it and CheckpointError("rank R
// failed to load checkpoint P") on the others, so no rank trains on alone.
// Rank 0 says on stderr what it resumed from ("ddp: resumed from <path>: epoch E, global step S").
// Resume in two lines: save the sampler (and any program values) as entries beside the model,
// then start the epoch loop at the restored epoch; the loader continues at the saved batch.
//   auto restored = ddp::load_checkpoint_if_exists(dir, {{"model", model}, {"optimizer", opt}, {"sampler", sampler}});
//   for (int64_t epoch = restored.state.epoch; epoch < epochs; ++epoch) { sampler.set_epoch(epoch); ... }
// (PyTorch has no such call: its programs test os.path.exists on each rank.)
Restored load_checkpoint_if_exists(const std::string& path_or_dir, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer, const LoadOptions& options = {});
Restored load_checkpoint_if_exists(const std::string& path_or_dir, const std::vector<CheckpointEntry>& entries,
                                   const LoadOptions& options = {});
namespace detail {
Restored load_model_checkpoint_if_exists(const std::string& path_or_dir, torch::nn::Module& module,
                                         ShardedState* sharded, torch::optim::Optimizer* optimizer,
                                         const LoadOptions& options);
}  // namespace detail
template <typename Model, typename = std::enable_if_t<detail::is_module_handle<Model>>>
Restored load_checkpoint_if_exists(const std::string& path_or_dir, const Model& model,
                                   torch::optim::Optimizer* optimizer, const LoadOptions& options = {}) {
  LoadOptions with_hook = options;
  if (Stateful* hook_state = detail::comm_hook_state_of(model)) {
    with_hook.optional_state(detail::kCommHookStateName, hook_state);
  }
  return detail::load_model_checkpoint_if_exists(path_or_dir, detail::module_of(model), detail::sharded_state_of(model),
                                                 optimizer, with_hook);
}

}  // namespace ddp
