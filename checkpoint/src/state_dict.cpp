// state_dict: a module's named tensors, loading them back with a full list of mismatches, and
// the Python-compatible file.
#include <ddp/state_dict.h>

#include <sstream>
#include <vector>

#include <torch/torch.h>

#include <ddp/atomic_file.h>
#include <ddp/checkpoint_file.h>

#include "checkpoint/src/state_dict_match.h"

namespace ddp {
namespace {

std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

std::string joined(const std::vector<std::string>& items) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : ", ") + item;
  return text;
}

// Python's DDP saves "module.fc.weight"; a bare module calls it "fc.weight".
bool all_keys_prefixed(const StateDict& state, const std::string& prefix) {
  if (state.is_empty()) return false;
  for (const auto& item : state) {
    if (item.key().rfind(prefix, 0) != 0) return false;
  }
  return true;
}

}  // namespace

StateDict state_dict(const torch::nn::Module& module) {
  StateDict state;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) state.insert(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) state.insert(item.key(), item.value().detach());
  return state;
}

MatchedStateDict match_state_dict(torch::nn::Module& module, const StateDict& state, bool strict,
                                  const std::string& source) {
  StateDict target = state_dict(module);
  const std::string prefix = "module.";
  const bool strip = all_keys_prefixed(state, prefix) && !all_keys_prefixed(target, prefix);
  auto name_in_model = [&](const std::string& key) { return strip ? key.substr(prefix.size()) : key; };

  std::vector<std::string> missing, unexpected, wrong_shape;
  for (const auto& item : state) {
    const at::Tensor* destination = target.find(name_in_model(item.key()));
    if (destination == nullptr) {
      unexpected.push_back(item.key());
    } else if (!destination->sizes().equals(item.value().sizes())) {
      wrong_shape.push_back(item.key() + " is " + shape_text(item.value().sizes()) + " in " + source +
                            ", " + shape_text(destination->sizes()) + " in the model");
    }
  }
  for (const auto& item : target) {
    const std::string key = strip ? prefix + item.key() : item.key();
    if (state.find(key) == nullptr) missing.push_back(item.key());
  }
  std::string problems;
  if (!wrong_shape.empty()) problems += "\n  shape mismatch: " + joined(wrong_shape);
  if (strict && !missing.empty()) problems += "\n  missing in " + source + ": " + joined(missing);
  if (strict && !unexpected.empty()) problems += "\n  unexpected in " + source + " (not in the model): " + joined(unexpected);
  if (!problems.empty()) throw CheckpointError(source + " does not match the model:" + problems);

  MatchedStateDict matched;
  for (const auto& item : state) {
    if (const at::Tensor* destination = target.find(name_in_model(item.key()))) {
      matched.emplace_back(*destination, item.value());
    }
  }
  return matched;
}

void copy_matched(const MatchedStateDict& matched) {
  torch::NoGradGuard no_grad;
  for (const auto& [destination, source] : matched) destination.copy_(source);
}

void load_state_dict(torch::nn::Module& module, const StateDict& state, bool strict, const std::string& source) {
  copy_matched(match_state_dict(module, state, strict, source));
}

void save_state_dict(const std::string& path, const torch::nn::Module& module) {
  std::vector<char> zip = make_state_dict_archive(state_dict(module));
  seal_archive(zip);
  write_file_atomically(path, zip.data(), zip.size());
}

StateDict load_state_dict(const std::string& path, const MapLocation& map_location) {
  return parse_state_dict_archive(read_checkpoint_file(path, /*allow_plain=*/true), path, map_location);
}

}  // namespace ddp
