#pragma once
// The on-disk format, one file per checkpoint (the same for save_state_dict files):
//
//   a PyTorch zip archive, exactly what torch.save / torch::pickle_save write:
//     <archive>/data.pkl, <archive>/data/<n>   the model's state_dict: a plain dict
//                                              name -> CPU tensor, no "module." prefix; for a
//                                              checkpoint of named models {model name: state_dict}
//     <archive>/ddp_devices                    "<device> <name>" lines: where each tensor lived
//                                              when saved (what map_location gets); named models:
//                                              ddp_devices_<i> for the i-th model of the root
//     <archive>/ddp_training_state             checkpoints only: a torch::serialize archive with
//                                              epoch, global step, sampler position, world size,
//                                              metadata, optimizer type/device, per-rank RNG states
//     <archive>/ddp_optimizer_state            checkpoints only: optimizer.save() archive (named:
//                                              ddp_optimizer_state_<i>, the i-th optimizer name)
//   whose zip comment (the last bytes of the file) is our ASCII trailer:
//     "torchddp-checkpoint v1 bytes=<16 hex digits> crc32=<8 hex digits>\n"
//   bytes = the file size before the trailer; crc32 (zlib's) over all those bytes, so every
//   record, zip header and the directory is covered.
//
// Python: sd = torch.load(path) returns the state_dict (zip readers ignore extra records and the
// comment); model.load_state_dict(sd) works. Python-saved state_dicts (OrderedDict or dict) load
// here with ddp::load_state_dict(path).
// Truncation is detected as a missing trailer (it is written last), anything else by the CRC.
//
// Thread-safety: reads and checks of different files are independent; any thread.
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
// A plain PyTorch file (torch.save, no trailer) is returned without a checksum to check when
// allow_plain is true. Before the file is read whole, its first bytes, its end and its zip
// directory are read by range and checked, so a file of any size that is no checkpoint is refused
// without being read (and one that does not fit in memory is refused too). Every record must be
// stored, as our writers and torch.save store them, never compressed. Throws CheckpointError:
// "checkpoint <path> is truncated at byte N ...", "checksum mismatch in <path> ...",
// "<path> is a plain PyTorch file ...", "<path> is not a sound zip archive: ...".
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
// Several models: the root is {name: state_dict} (Python: torch.load(path)["generator"]), each
// model's devices in a record "ddp_devices_<its index in the root>". Names must differ.
using NamedStateDicts = std::vector<std::pair<std::string, StateDict>>;
std::vector<char> make_nested_state_dict_archive(
    const NamedStateDicts& states, const std::vector<std::pair<std::string, std::string>>& extra_records = {});
// The named state_dicts of an archive made by make_nested_state_dict_archive, in its order,
// placed by map_location. parse_state_dict_archive refuses such an archive, naming its models.
NamedStateDicts parse_nested_state_dict_archive(const std::vector<char>& zip, const std::string& path,
                                                const MapLocation& map_location = {});
// The bytes of one extra record, or nullopt when the archive has none of that name.
std::optional<std::string> read_archive_record(const std::vector<char>& zip, const std::string& name,
                                               const std::string& path);

}  // namespace ddp
