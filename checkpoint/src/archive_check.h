#pragma once
// What of a checkpoint reaches LibTorch's readers, checked first (archive_check.cpp says how).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <caffe2/serialize/inline_container.h>

namespace ddp {

// The archive's records and their sizes, by the names LibTorch's reader uses ("data.pkl",
// "data/0"), from the zip's central directory. Throws PickleError unless everything a zip reader
// reads (directory records, local headers, data) lies inside the archive: LibTorch's
// readers copy whatever range the directory names, so this runs before any of them sees a zip.
std::map<std::string, uint64_t> archive_records(const std::vector<char>& zip);

// LibTorch's reader over `zip` (which must outlive it), reading through bounds-checked copies.
caffe2::serialize::PyTorchStreamReader reader_of(const std::vector<char>& zip);

// A plain archive (torch.save, torch::pickle_save, a checkpoint's model state): its data.pkl
// passes check_pickle. Throws PickleError naming the record.
void check_plain_archive(const std::vector<char>& zip);

// An archive written by torch::serialize::OutputArchive (a TorchScript module), checked and
// rebuilt from only what torch::serialize::InputArchive needs: code that declares classes the way
// OutputArchive writes them and nothing else, pickles that pass check_pickle, the tensor records.
// The debug records (source ranges) are dropped. Throws PickleError naming the record.
std::vector<char> checked_script_archive(const std::vector<char>& zip);

}  // namespace ddp
