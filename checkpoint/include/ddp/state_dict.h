#pragma once
// A module's state_dict (parameters and buffers by name, as Python's module.state_dict()) and a
// file format for it that Python's torch.load / torch.save share.
//
// Thread-safety: the module must not train on another thread meanwhile.
#include <string>

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <ddp/map_location.h>

namespace ddp {

using StateDict = torch::OrderedDict<std::string, torch::Tensor>;

// Parameters, then buffers, detached, under their registered names ("fc1.weight").
StateDict state_dict(const torch::nn::Module& module);

// Copies `state` into the module's parameters and buffers (in place, on their current devices).
// Keys that all start with "module." (a Python DDP state_dict) are accepted for a bare module.
// With strict, any missing or unexpected name or any shape mismatch throws CheckpointError listing
// all of them; without strict, only shape mismatches throw. `source` names the origin in errors.
void load_state_dict(torch::nn::Module& module, const StateDict& state, bool strict = true,
                     const std::string& source = "state_dict");

// Writes the module's state_dict (tensors copied to CPU) atomically; Python reads it with
// torch.load(path) as a plain dict of tensors. Sealed like a checkpoint (see checkpoint_file.h).
void save_state_dict(const std::string& path, const torch::nn::Module& module);

// Reads a state_dict written by save_state_dict, save_checkpoint (its model part) or Python's
// torch.save(model.state_dict(), path). Tensors are placed by `map_location`.
StateDict load_state_dict(const std::string& path, const MapLocation& map_location = {});

}  // namespace ddp
