#pragma once
// Checks a pickle before LibTorch's unpickler runs it (pickle_check.cpp says how).
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ddp {

class PickleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PickleRules {
  // Size in bytes of the record holding the data of the storage with this persistent key
  // ("0" -> data/0); nullopt when the archive has no such record.
  std::function<std::optional<uint64_t>(const std::string& key)> storage_size;
  // Classes the archive's code defines ("__torch__.___torch_mangle_3.Module"); objects of other
  // classes are refused. Empty for a plain pickle (torch.save, torch::pickle_save).
  std::set<std::string> classes;
};

// Throws PickleError("byte N: what is wrong") unless the pickle only builds what a checkpoint
// holds: numbers, strings, tuples, lists, dicts, tensors inside their storage, objects of
// `classes`, and type tags a TorchScript type can parse.
void check_pickle(std::string_view pickle, const PickleRules& rules);

// True for a TorchScript type the checkpoint format writes: Tensor, int, float, bool, str,
// NoneType, List/Optional/Dict/Tuple of them, and the classes in `classes`.
bool is_known_type(std::string_view type, const std::set<std::string>& classes);

}  // namespace ddp
