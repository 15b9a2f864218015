#pragma once
// What of a checkpoint reaches LibTorch's readers, checked first (archive_check.cpp says how).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <caffe2/serialize/inline_container.h>

namespace ddp {

// The bytes of a zip archive by range: in memory, or a file whose directory is checked before it
// is read whole.
class ZipBytes {
 public:
  virtual ~ZipBytes() = default;
  virtual uint64_t size() const = 0;
  // Copies [at, at + n), which lies inside size() (the caller checks), to `out`.
  virtual void copy(uint64_t at, std::size_t n, char* out) const = 0;
};

struct ZipRecord {
  uint64_t size = 0;      // inflated
  bool deflated = false;  // else stored
};
using ZipRecords = std::map<std::string, ZipRecord>;

// kPlain: torch.save, torch::pickle_save and our checkpoints store every record. kScript:
// torch::serialize::OutputArchive (TorchScript) deflates its code/ records, nothing else.
enum class ArchiveKind { kPlain, kScript };

// The archive's records, by the names LibTorch's reader uses ("data.pkl", "data/0"), from the
// zip's central directory. Throws PickleError naming the record unless everything a zip reader
// reads (directory records, local headers, data) lies inside the archive (LibTorch's readers copy
// whatever range the directory names, so this runs before any of them sees a zip), and unless
// each record is stored, or deflated where `kind` says a writer deflates.
ZipRecords archive_records(const ZipBytes& zip, ArchiveKind kind);
ZipRecords archive_records(const std::vector<char>& zip, ArchiveKind kind);

// LibTorch's reader over `zip` (which must outlive it), reading through bounds-checked copies.
caffe2::serialize::PyTorchStreamReader reader_of(const std::vector<char>& zip);

// A plain archive (torch.save, torch::pickle_save, a checkpoint's model state): its data.pkl
// passes check_pickle. Throws PickleError naming the record.
void check_plain_archive(const std::vector<char>& zip);

// An archive written by torch::serialize::OutputArchive (a TorchScript module), checked and
// rebuilt from only what torch::serialize::InputArchive needs: code that declares classes the way
// OutputArchive writes them and nothing else, pickles that pass check_pickle, the tensor records.
// The debug records (source ranges) are dropped. Code records are inflated one at a time, each
// only once its size fits what is left of the archive's budget (32 times the archive's size, at
// most 256 MiB in all). Throws PickleError naming the record.
std::vector<char> checked_script_archive(const std::vector<char>& zip);

}  // namespace ddp
