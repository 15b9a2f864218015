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
// One file: a PyTorch zip archive whose root object is the model's plain state_dict (Python:
// torch.load(path) returns it, tensors on CPU) plus a record "ddp_training_state" holding the
// rest, sealed with a checksum over everything (checkpoint_file.h).
//
// Thread-safety: save/load are collectives of the training thread; the model and optimizer must
// not train on another thread meanwhile.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ddp/checkpoint_file.h>
#include <ddp/map_location.h>
#include <ddp/process_group.h>
#include <ddp/sampler_state.h>
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
// rank 0 failed. `optimizer` may be null.
void save_checkpoint(const std::string& path, const torch::nn::Module& module,
                     const torch::optim::Optimizer* optimizer, const TrainingState& state,
                     const CheckpointOptions& options = {});

// Not collective: every rank reads the file. Verifies the checksum, copies the model state into
// `module` (error listing every mismatched name/shape), loads the optimizer state (read through
// map_location, then each parameter's state moved to that parameter's device, as PyTorch's
// Optimizer.load_state_dict does), restores this rank's RNG states, and returns the training state.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& module,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options = {});

// <dir>/<prefix>-<step, 8+ digits>.pt
std::string checkpoint_path(const std::string& dir, int64_t global_step,
                            const std::string& prefix = "checkpoint");
// The newest checkpoint in `dir` (by step in its name) that passes verification; others skipped.
std::optional<std::string> latest_checkpoint(const std::string& dir,
                                             const std::string& prefix = "checkpoint");

// Wrappers such as ddp::DistributedDataParallel (anything with .module() returning a pointer to
// the wrapped module) save and load the bare module, so one checkpoint fits both. A wrapper with a
// stateful comm hook (comm_hook_state(), e.g. PowerSGD) has that state saved and restored too,
// under the name "comm_hook"; a checkpoint saved without it leaves the hook's fresh state alone.
namespace detail {
template <typename Wrapper, typename = void>
struct HasCommHookState : std::false_type {};
template <typename Wrapper>
struct HasCommHookState<Wrapper, std::void_t<decltype(std::declval<const Wrapper&>().comm_hook_state())>>
    : std::true_type {};
constexpr char kCommHookStateName[] = "comm_hook";
}  // namespace detail

template <typename Wrapper, typename = decltype(*std::declval<const Wrapper&>().module())>
void save_checkpoint(const std::string& path, const Wrapper& wrapper,
                     const torch::optim::Optimizer* optimizer, const TrainingState& state,
                     const CheckpointOptions& options = {}) {
  CheckpointOptions with_hook = options;
  if constexpr (detail::HasCommHookState<Wrapper>::value) {
    if (const Stateful* hook_state = wrapper.comm_hook_state()) with_hook.state(detail::kCommHookStateName, hook_state);
  }
  save_checkpoint(path, static_cast<const torch::nn::Module&>(*wrapper.module()), optimizer, state,
                  with_hook);
}
template <typename Wrapper, typename = decltype(*std::declval<Wrapper&>().module())>
TrainingState load_checkpoint(const std::string& path, Wrapper& wrapper,
                              torch::optim::Optimizer* optimizer, const LoadOptions& options = {}) {
  LoadOptions with_hook = options;
  if constexpr (detail::HasCommHookState<Wrapper>::value) {
    if (Stateful* hook_state = wrapper.comm_hook_state()) {
      with_hook.optional_state(detail::kCommHookStateName, hook_state);
    }
  }
  return load_checkpoint(path, static_cast<torch::nn::Module&>(*wrapper.module()), optimizer, with_hook);
}

}  // namespace ddp
