#pragma once
// The sealed checkpoint file: a PyTorch zip archive (what torch.save writes, so Python's
// torch.load reads it) whose zip comment holds an ASCII trailer with the byte count and a CRC-32
// of everything before it. The checksum covers the whole archive: model state, training state,
// zip headers and directory.
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ddp/state_dict.h>

namespace ddp {

// A checkpoint that cannot be used: truncated, corrupted, not a checkpoint, or not matching the
// model. what() names the file and the problem.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Appends the trailer to a complete zip archive (as written by PyTorchStreamWriter).
void seal_archive(std::vector<char>& zip);

// Reads `path` and checks its trailer and checksum; returns the bytes (a valid zip archive).
// A plain PyTorch file (torch.save, no trailer) is returned unchecked when allow_plain is true.
// Throws CheckpointError: "checkpoint <path> is truncated at byte N ...",
// "checksum mismatch in <path> ...", "<path> is a plain PyTorch file ...".
std::vector<char> read_checkpoint_file(const std::string& path, bool allow_plain = false);

// A PyTorch zip archive whose root object is `state` as a plain dict (tensors copied to CPU, so
// Python loads it anywhere), a record "ddp_devices" with each tensor's original device (for
// map_location), and extra named records; torch.load ignores the records. Not yet sealed.
std::vector<char> make_state_dict_archive(
    const StateDict& state, const std::vector<std::pair<std::string, std::string>>& extra_records = {});
// The root dict of tensors of a zip archive, each placed by map_location applied to its original
// device (from "ddp_devices"; for a file from Python, where torch.save put it). `path` names the
// file in errors.
StateDict parse_state_dict_archive(const std::vector<char>& zip, const std::string& path,
                                   const MapLocation& map_location = {});
// The bytes of one extra record, or nullopt when the archive has none of that name.
std::optional<std::string> read_archive_record(const std::vector<char>& zip, const std::string& name);

}  // namespace ddp
