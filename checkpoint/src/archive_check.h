#pragma once
// What of a checkpoint reaches LibTorch's readers, checked first (archive_check.cpp says how).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ddp {

// The archive's records and their sizes, by the names LibTorch's reader uses ("data.pkl",
// "data/0"), from the zip's central directory. Throws PickleError when the directory is damaged.
std::map<std::string, uint64_t> archive_records(const std::vector<char>& zip);

// A plain archive (torch.save, torch::pickle_save, a checkpoint's model state): its data.pkl
// passes check_pickle. Throws PickleError naming the record.
void check_plain_archive(const std::vector<char>& zip);

// An archive written by torch::serialize::OutputArchive (a TorchScript module), checked and
// rebuilt from only what torch::serialize::InputArchive needs: code that declares classes the way
// OutputArchive writes them and nothing else, pickles that pass check_pickle, the tensor records.
// The debug records (source ranges) are dropped. Throws PickleError naming the record.
std::vector<char> checked_script_archive(const std::vector<char>& zip);

}  // namespace ddp
