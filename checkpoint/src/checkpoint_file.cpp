// The sealed checkpoint file. A zip archive ends with its end-of-central-directory record (EOCD,
// 22 bytes + comment); we put the trailer in that comment, so zip readers (LibTorch, Python's
// torch.load) still accept the file while we can check its size and CRC-32.
#include <ddp/checkpoint_file.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <zlib.h>

#include "checkpoint/src/archive_check.h"
#include "checkpoint/src/error_line.h"
#include "checkpoint/src/pickle_check.h"
#include "checkpoint/src/tensor_check.h"

namespace ddp {
namespace {

constexpr char kDevicesRecord[] = "ddp_devices";
constexpr std::size_t kEocdSize = 22;
constexpr char kEocdSignature[] = {'P', 'K', 5, 6};
constexpr char kZipSignature[] = {'P', 'K', 3, 4};  // a zip archive's first local file header
// ASCII on purpose: hex digits can never form the binary EOCD signature a reader searches for.
constexpr char kTrailerPrefix[] = "torchddp-checkpoint v1 bytes=";
constexpr char kTrailerFormat[] = "torchddp-checkpoint v1 bytes=%016" PRIx64 " crc32=%08" PRIx32 "\n";
constexpr std::size_t kTrailerSize = sizeof(kTrailerPrefix) - 1 + 16 + 7 + 8 + 1;

uint32_t crc32_of(const char* data, std::size_t size, uint32_t running = 0) {
  uLong crc = running;
  while (size > 0) {  // zlib takes uInt lengths
    const uInt chunk = static_cast<uInt>(std::min<std::size_t>(size, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data), chunk);
    data += chunk;
    size -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

bool is_plain_eocd(const char* eocd) {
  return std::memcmp(eocd, kEocdSignature, 4) == 0 && eocd[20] == 0 && eocd[21] == 0;
}

bool ends_with_plain_eocd(const std::vector<char>& bytes) {
  return bytes.size() >= kEocdSize && is_plain_eocd(bytes.data() + bytes.size() - kEocdSize);
}

// "68 65 6c 6c" for the bytes "hell".
std::string hex_bytes(const char* data, std::size_t size) {
  std::string text;
  for (std::size_t i = 0; i < size; ++i) {
    char byte[4];
    std::snprintf(byte, sizeof(byte), "%s%02x", i ? " " : "", static_cast<unsigned char>(data[i]));
    text += byte;
  }
  return text;
}

std::string hex32(uint32_t value) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08" PRIx32, value);
  return text;
}


// --- Python's OrderedDict ---------------------------------------------------------------------------
// Python's torch.save(model.state_dict()) pickles a collections.OrderedDict (plus a _metadata
// attribute set by BUILD). LibTorch's C++ unpickler turns an OrderedDict into None and knows no
// SETITEM, so such a file would not load. Not a 1.13 quirk: 2.6's does the same (without this
// rewrite both fail "Expected GenericDict but got None"), so it stays
// here for every version rather than behind compat/versions.h. We rewrite just those two spots of the pickle: the root
// becomes a plain dict, the OrderedDict global stays in the memo (tensors reference it for their
// backward hooks) as a dummy entry removed after loading, and the trailing _metadata BUILD is cut.
constexpr char kHookKey[] = "__torchddp_ordered_dict__";

// Length of the opcode at `at` (with its argument); 0 when unknown. Covers what torch.save emits.
std::size_t opcode_length(const std::string& pickle, std::size_t at) {
  auto has = [&](std::size_t bytes) { return pickle.size() - at >= bytes; };  // for the length fields read here
  auto u32 = [&](std::size_t offset) {
    uint32_t value = 0;
    std::memcpy(&value, pickle.data() + offset, 4);
    return static_cast<std::size_t>(value);
  };
  switch (pickle[at]) {
    case '(': case ')': case '}': case ']': case 't': case 'R': case 'Q': case 'N': case 's': case 'u':
    case 'a': case 'e': case 'b': case '.': case '\x85': case '\x86': case '\x87': case '\x88': case '\x89':
    case '\x94':
      return 1;
    case 'q': case 'h': case 'K': case '\x80': return 2;
    case 'M': return 3;
    case 'r': case 'j': case 'J': return 5;
    case 'G': case '\x95': return 9;
    case 'X': return has(5) ? 5 + u32(at + 1) : 0;
    case '\x8c': case '\x8a': return has(2) ? 2 + static_cast<unsigned char>(pickle[at + 1]) : 0;
    case 'c': {  // two newline-terminated names
      const std::size_t first = pickle.find('\n', at);
      const std::size_t second = first == std::string::npos ? first : pickle.find('\n', first + 1);
      return second == std::string::npos ? 0 : second + 1 - at;
    }
    default: return 0;
  }
}

std::optional<std::string> plain_dict_pickle(const std::string& pickle) {
  const std::string prefix = std::string("\x80\x02" "ccollections\nOrderedDict\nq\x00)Rq\x01(", 34);
  if (pickle.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const std::string key = kHookKey;
  const uint32_t key_size = static_cast<uint32_t>(key.size());
  std::string out = std::string("\x80\x02}q\x01(X", 7);
  out.append(reinterpret_cast<const char*>(&key_size), 4);  // pickle is little endian, as are we
  out += key + std::string("ccollections\nOrderedDict\nq\x00", 27);
  // Walk to the end of the root's items: the SETITEMS that closes a mark opened at depth 0.
  int depth = 1;
  std::size_t at = prefix.size();
  while (at < pickle.size()) {
    const std::size_t length = opcode_length(pickle, at);
    if (length == 0 || at + length > pickle.size()) return std::nullopt;
    const char op = pickle[at];
    if (op == '(') ++depth;
    if (op == 't' || op == 'u' || op == 'e') --depth;
    at += length;
    if (depth == 0 && pickle[at] == '(') continue;  // the next batch of root items
    if (depth == 0) break;
  }
  out.append(pickle, prefix.size(), at - prefix.size());
  out += '.';  // STOP: the _metadata BUILD that may follow is dropped
  return out;
}

// The same archive with data.pkl rewritten by plain_dict_pickle, or nullopt if not needed.
std::optional<std::vector<char>> with_plain_dict(const std::vector<char>& zip) {
  auto reader = reader_of(zip);
  if (!reader.hasRecord("data.pkl")) return std::nullopt;
  auto [data, size] = reader.getRecord("data.pkl");
  const auto pickle = plain_dict_pickle(std::string(static_cast<const char*>(data.get()), size));
  if (!pickle) return std::nullopt;
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    out.insert(out.end(), static_cast<const char*>(bytes), static_cast<const char*>(bytes) + n);
    return n;
  });
  for (const auto& name : reader.getAllRecords()) {
    if (name == "version" || name == ".data/version" || name == ".data/serialization_id") continue;  // the writer adds its own
    if (name == "data.pkl") {
      writer.writeRecord(name, pickle->data(), pickle->size());
    } else {
      auto [record, record_size] = reader.getRecord(name);
      writer.writeRecord(name, record.get(), record_size);
    }
  }
  writer.writeEndOfFile();
  return out;
}

// A checksum says the file is as written, not that it was written by a zip writer: its zip
// structure is checked before any LibTorch reader gets it (archive_check.h).
std::vector<char> sound_archive(std::vector<char> bytes, const std::string& path) {
  try {
    archive_records(bytes, ArchiveKind::kPlain);
  } catch (const PickleError& error) {
    throw CheckpointError(path + " is not a sound zip archive: " + error.what());
  }
  return bytes;
}


// --- writing: a pickled root object with its tensors, as torch.save lays them out -------------------
c10::Dict<std::string, at::Tensor> cpu_dict(const StateDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) dict.insert(item.key(), item.value().detach().to(at::kCPU));
  return dict;
}

// "<device> <name>\n" per tensor; names may hold spaces, devices never do.
std::string devices_of(const StateDict& state) {
  std::string devices;
  for (const auto& item : state) devices += item.value().device().str() + " " + item.key() + "\n";
  return devices;
}

// A nested archive's device list of the model at `index` of its root dict.
std::string nested_devices_record(std::size_t index) { return std::string(kDevicesRecord) + "_" + std::to_string(index); }

std::vector<char> archive_of(const c10::IValue& root, const std::vector<std::pair<std::string, std::string>>& records) {
  // What torch::pickle_save does, with room for our records in the same archive, and without type
  // tags on the dict (torch.jit._pickle.restore_type_tag): Python's torch.load refuses that global
  // under weights_only=True, its default since PyTorch 2.6.
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* data, size_t size) { pickle.insert(pickle.end(), data, data + size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(root);
  pickler.stop();
  std::vector<char> zip;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    zip.insert(zip.end(), bytes, bytes + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
  for (const auto& [name, bytes] : records) writer.writeRecord(name, bytes.data(), bytes.size());
  writer.writeEndOfFile();
  return zip;
}

// --- reading ------------------------------------------------------------------------------------------
// The devices listed in `record` (name -> "cuda:1"); empty when the archive has no such record.
std::map<std::string, std::string> saved_devices_in(const std::vector<char>& zip, const std::string& record,
                                                    const std::string& path) {
  std::map<std::string, std::string> saved_devices;
  if (auto devices = read_archive_record(zip, record, path)) {
    std::istringstream lines(*devices);
    std::string line;
    while (std::getline(lines, line)) {
      const std::size_t space = line.find(' ');
      if (space == 0 || space == std::string::npos) {
        throw CheckpointError(path + " has a damaged device list: the line \"" + line + "\" is not \"<device> <name>\"");
      }
      saved_devices[line.substr(space + 1)] = line.substr(0, space);
    }
  }
  return saved_devices;
}

// The archive's root dict, checked before LibTorch's unpickler sees it.
c10::impl::GenericDict root_of(const std::vector<char>& zip, const std::string& path) {
  c10::IValue root;
  try {
    const auto rewritten = with_plain_dict(zip);
    const std::vector<char>& archive = rewritten ? *rewritten : zip;
    check_plain_archive(archive);  // what LibTorch's unpickler would crash on, refused first
    root = torch::jit::pickle_load(archive);
    if (rewritten && root.isGenericDict()) (void)root.toGenericDict().erase(kHookKey);  // 2.x marks erase nodiscard
  } catch (const std::exception& error) {
    throw CheckpointError("cannot read the model state in " + path + ": " + error_line(error));
  }
  if (!root.isGenericDict()) {
    throw CheckpointError(path + " does not hold a state_dict: its root object is a " + root.tagKind() +
                          ", not a dict of tensors");
  }
  return root.toGenericDict();
}

// A dict of tensors (`what` names it in errors), each placed by map_location from its saved device.
StateDict placed_state_dict(const c10::impl::GenericDict& dict, const std::map<std::string, std::string>& saved_devices,
                            const MapLocation& map_location, const std::string& what, const std::string& path) {
  StateDict state;
  for (const auto& item : dict) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw CheckpointError(what + " does not hold a state_dict: entry " + c10::str(item.key()) + " is a " +
                            item.value().tagKind() + ", not a tensor under a name");
    }
    const std::string& name = item.key().toStringRef();
    const at::Tensor& tensor = item.value().toTensor();
    if (const auto value = non_finite(tensor)) {  // a model trained on to NaN (or a damaged file) would train on so
      throw CheckpointError(what + " holds " + *value + " in " + name + " (a run that diverged, or a damaged file): "
                            "it is not loaded");
    }
    auto saved = saved_devices.find(name);
    const std::string from = saved == saved_devices.end() ? tensor.device().str() : saved->second;
    try {
      state.insert(name, tensor.to(map_location.device_for(from)));
    } catch (const std::exception& error) {  // a device this build lacks, or a name that is no device
      throw CheckpointError("cannot place " + name + " from " + path + " (saved on " + from +
                            ") where map_location puts it: " + error_line(error));
    }
  }
  return state;
}

// "generator, discriminator" when every value of the root dict is a dict: a checkpoint of named models.
std::optional<std::string> nested_names(const c10::impl::GenericDict& root) {
  if (root.empty()) return std::nullopt;
  std::string names;
  for (const auto& item : root) {
    if (!item.key().isString() || !item.value().isGenericDict()) return std::nullopt;
    names += (names.empty() ? "" : ", ") + item.key().toStringRef();
  }
  return names;
}

// --- reading a file by range, before it is read whole ----------------------------------------------
// An open file read by range; reading it whole is refused with an error, not std::bad_alloc, when
// it does not fit in memory.
class OpenFile {
 public:
  explicit OpenFile(const std::string& path) : in_(path, std::ios::binary) {
    if (!in_) throw CheckpointError("cannot open checkpoint " + path + ": " + std::strerror(errno));
    in_.seekg(0, std::ios::end);
    size_ = static_cast<uint64_t>(in_.tellg());
  }
  uint64_t size() const { return size_; }
  // [at, at + n), which lies inside the file.
  void copy(uint64_t at, std::size_t n, char* out) const {
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(at));
    in_.read(out, static_cast<std::streamsize>(n));
    if (static_cast<std::size_t>(in_.gcount()) != n) std::memset(out, 0, n);  // cut meanwhile: read as zeros, refused later
  }
  std::string bytes(uint64_t at, std::size_t n) const {
    std::string text(n, '\0');
    copy(at, n, text.data());
    return text;
  }
  // CRC-32 of the first `end` bytes, a chunk at a time.
  uint32_t crc32_to(uint64_t end) const {
    std::vector<char> chunk(std::size_t{1} << 20);
    uint32_t crc = 0;
    for (uint64_t at = 0; at < end; at += chunk.size()) {
      const std::size_t n = static_cast<std::size_t>(std::min<uint64_t>(chunk.size(), end - at));
      copy(at, n, chunk.data());
      crc = crc32_of(chunk.data(), n, crc);
    }
    return crc;
  }
  std::vector<char> read_whole(const std::string& path) const {
    std::vector<char> bytes;
    try {
      bytes.resize(static_cast<std::size_t>(size_));
    } catch (const std::exception&) {  // std::bad_alloc, std::length_error
      throw CheckpointError("cannot read checkpoint " + path + ": its " + std::to_string(size_) +
                            " bytes do not fit in this process's memory");
    }
    in_.clear();
    in_.seekg(0);
    in_.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (in_.bad()) throw CheckpointError("cannot read checkpoint " + path);
    bytes.resize(static_cast<std::size_t>(in_.gcount()));
    return bytes;
  }

 private:
  mutable std::ifstream in_;
  uint64_t size_ = 0;
};

// The zip archive in a file, as read_checkpoint_file hands it on: the bytes before the trailer,
// the directory record's comment length (the trailer's) read as 0.
class ArchiveView : public ZipBytes {
 public:
  ArchiveView(const OpenFile& file, uint64_t end, bool sealed) : file_(file), end_(end), sealed_(sealed) {}
  uint64_t size() const override { return end_; }
  void copy(uint64_t at, std::size_t n, char* out) const override {
    file_.copy(at, n, out);
    for (uint64_t byte = std::max(at, end_ - 2); sealed_ && byte < at + n; ++byte) out[byte - at] = 0;
  }

 private:
  const OpenFile& file_;
  uint64_t end_;
  bool sealed_;
};

struct Trailer {
  uint64_t size = 0;  // the bytes before it, as recorded
  uint32_t crc = 0;
};

// Where the archive ends in the file, and the trailer after it (none in a plain PyTorch file).
struct FileLayout {
  uint64_t payload = 0;
  std::optional<Trailer> trailer;
};

FileLayout layout_of(const OpenFile& file, const std::string& path, bool allow_plain) {
  const uint64_t size = file.size();
  const std::string trailer = size >= kTrailerSize + kEocdSize ? file.bytes(size - kTrailerSize, kTrailerSize) : "";
  if (trailer.compare(0, sizeof(kTrailerPrefix) - 1, kTrailerPrefix) != 0) {
    // Without one: not a checkpoint at all (every checkpoint, even a cut one, starts as a zip
    // archive does), a plain PyTorch file, or a cut write.
    const std::string head = file.bytes(0, static_cast<std::size_t>(std::min<uint64_t>(size, sizeof(kZipSignature))));
    if (!head.empty() && std::memcmp(head.data(), kZipSignature, head.size()) != 0) {
      throw CheckpointError(path + " is not a torchddp checkpoint: it is not a zip archive (its first bytes are " +
                            hex_bytes(head.data(), head.size()) + ", a checkpoint's are 50 4b 03 04)");
    }
    if (size >= kEocdSize && is_plain_eocd(file.bytes(size - kEocdSize, kEocdSize).data())) {
      if (allow_plain) return FileLayout{size, std::nullopt};
      throw CheckpointError(path + " is a plain PyTorch file without a torchddp checkpoint trailer "
                            "(written by torch.save?); read it with ddp::load_state_dict(path)");
    }
    // The trailer is the last thing written; without it the write never finished.
    throw CheckpointError("checkpoint " + path + " is truncated at byte " + std::to_string(size) +
                          ": its end-of-checkpoint trailer is missing (an interrupted write or a cut copy)");
  }
  Trailer parsed;
  if (std::sscanf(trailer.c_str(), "torchddp-checkpoint v1 bytes=%16" SCNx64 " crc32=%8" SCNx32, &parsed.size,
                  &parsed.crc) != 2 ||
      trailer.back() != '\n') {
    throw CheckpointError("checksum mismatch in " + path + ": its trailer is damaged");
  }
  const uint64_t payload = size - kTrailerSize;
  if (parsed.size != payload) {
    throw CheckpointError("checksum mismatch in " + path + ": trailer records " + std::to_string(parsed.size) +
                          " bytes before it, the file has " + std::to_string(payload));
  }
  return FileLayout{payload, parsed};
}

// Reads the file through once for its checksum: a fault found before reading it whole is named as
// corruption when the checksum disagrees.
void check_checksum(const OpenFile& file, const Trailer& trailer, const std::string& path) {
  const uint32_t actual_crc = file.crc32_to(trailer.size);
  if (actual_crc != trailer.crc) {
    throw CheckpointError("checksum mismatch in " + path + ": stored crc32 " + hex32(trailer.crc) + ", computed " +
                          hex32(actual_crc) + " (the file is corrupted)");
  }
}

// The trailer is the whole comment of the zip directory record just before it, as seal_archive
// wrote it: anything else would show zip readers other bytes than we check.
void check_trailer_record(const ArchiveView& archive, const Trailer& trailer, const OpenFile& file,
                          const std::string& path) {
  const uint64_t payload = archive.size();
  const std::string eocd = file.bytes(payload - kEocdSize, kEocdSize);
  std::string fault;
  if (std::memcmp(eocd.data(), kEocdSignature, 4) != 0) {
    fault = "the zip directory record does not end where the checkpoint trailer begins (byte " +
            std::to_string(payload) + ")";
  } else if (const std::size_t comment = static_cast<unsigned char>(eocd[20]) |
                                         static_cast<std::size_t>(static_cast<unsigned char>(eocd[21])) << 8;
             comment != kTrailerSize) {
    fault = "the zip directory record gives its comment " + std::to_string(comment) +
            " bytes, but the checkpoint trailer after it is " + std::to_string(kTrailerSize);
  }
  if (fault.empty()) return;
  check_checksum(file, trailer, path);
  throw CheckpointError(path + " is not a sound zip archive: " + fault);
}

}  // namespace

void seal_archive(std::vector<char>& zip) {
  if (!ends_with_plain_eocd(zip)) {
    throw CheckpointError("internal error: archive to seal does not end with a plain zip directory record");
  }
  // EOCD comment length (little endian, last two bytes of the record) = trailer size.
  zip[zip.size() - 2] = static_cast<char>(kTrailerSize & 0xff);
  zip[zip.size() - 1] = static_cast<char>(kTrailerSize >> 8);
  char trailer[kTrailerSize + 1];
  std::snprintf(trailer, sizeof(trailer), kTrailerFormat, static_cast<uint64_t>(zip.size()),
                crc32_of(zip.data(), zip.size()));
  zip.insert(zip.end(), trailer, trailer + kTrailerSize);
}

std::vector<char> read_checkpoint_file(const std::string& path, bool allow_plain) {
  // 1. A regular file only: a directory fails obscurely in a stream, and a device such as
  //    /dev/zero would be read until memory runs out.
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (std::filesystem::is_directory(status)) {
    throw CheckpointError("cannot read checkpoint " + path + ": it is a directory, not a checkpoint file "
                          "(ddp::latest_checkpoint(dir) finds the newest checkpoint in a directory)");
  }
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
    throw CheckpointError("cannot read checkpoint " + path + ": it is not a regular file (a device, pipe or socket)");
  }
  // 2. Its first bytes, its end and its zip directory, read by range: a file of any size that is
  //    no checkpoint is refused before it is read whole.
  const OpenFile file(path);
  const uint64_t size = file.size();
  const FileLayout layout = layout_of(file, path, allow_plain);
  const ArchiveView archive(file, layout.payload, layout.trailer.has_value());
  if (layout.trailer) check_trailer_record(archive, *layout.trailer, file, path);
  try {
    archive_records(archive, ArchiveKind::kPlain);
  } catch (const PickleError& fault) {
    if (layout.trailer) check_checksum(file, *layout.trailer, path);  // a damaged file is named as damaged
    throw CheckpointError(path + " is not a sound zip archive: " + fault.what());
  }
  // 3. The whole file, checked again as read (it may have changed since): checksum, then structure.
  std::vector<char> bytes = file.read_whole(path);
  if (bytes.size() != size) {
    throw CheckpointError("cannot read checkpoint " + path + ": it changed size while being read (" +
                          std::to_string(size) + " bytes, then " + std::to_string(bytes.size()) + ")");
  }
  if (!layout.trailer) return sound_archive(std::move(bytes), path);
  const uint32_t actual_crc = crc32_of(bytes.data(), layout.payload);
  if (actual_crc != layout.trailer->crc) {
    throw CheckpointError("checksum mismatch in " + path + ": stored crc32 " + hex32(layout.trailer->crc) +
                          ", computed " + hex32(actual_crc) + " (the file is corrupted)");
  }
  bytes.resize(layout.payload);  // what zip readers see is unchanged: the comment is simply shorter
  bytes[layout.payload - 2] = 0;
  bytes[layout.payload - 1] = 0;
  return sound_archive(std::move(bytes), path);
}

std::vector<char> make_state_dict_archive(
    const StateDict& state, const std::vector<std::pair<std::string, std::string>>& extra_records) {
  std::vector<std::pair<std::string, std::string>> records = {{kDevicesRecord, devices_of(state)}};
  records.insert(records.end(), extra_records.begin(), extra_records.end());
  return archive_of(c10::IValue(cpu_dict(state)), records);
}

std::vector<char> make_nested_state_dict_archive(
    const NamedStateDicts& states, const std::vector<std::pair<std::string, std::string>>& extra_records) {
  c10::Dict<std::string, c10::Dict<std::string, at::Tensor>> root;
  std::vector<std::pair<std::string, std::string>> records;
  for (const auto& [name, state] : states) {
    if (!root.insert(name, cpu_dict(state)).second) {
      throw std::invalid_argument("internal error: the model name \"" + name + "\" is in a checkpoint twice");
    }
    records.emplace_back(nested_devices_record(records.size()), devices_of(state));
  }
  records.insert(records.end(), extra_records.begin(), extra_records.end());
  return archive_of(c10::IValue(root), records);
}

StateDict parse_state_dict_archive(const std::vector<char>& zip, const std::string& path,
                                   const MapLocation& map_location) {
  const auto saved_devices = saved_devices_in(zip, kDevicesRecord, path);
  const auto root = root_of(zip, path);
  if (const auto names = nested_names(root)) {
    throw CheckpointError(path + " holds several named models (" + *names + "), not one state_dict: load them with "
                          "ddp::load_checkpoint(path, {{\"<name>\", model}, ...})");
  }
  return placed_state_dict(root, saved_devices, map_location, path, path);
}

NamedStateDicts parse_nested_state_dict_archive(const std::vector<char>& zip, const std::string& path,
                                                const MapLocation& map_location) {
  const auto root = root_of(zip, path);
  NamedStateDicts states;
  for (const auto& item : root) {
    if (!item.key().isString() || !item.value().isGenericDict()) {
      throw CheckpointError(path + " does not hold named models: its entry " + c10::str(item.key()) + " is a " +
                            item.value().tagKind() + ", not a state_dict under a name");
    }
    const std::string& name = item.key().toStringRef();
    const auto saved_devices = saved_devices_in(zip, nested_devices_record(states.size()), path);
    states.emplace_back(name, placed_state_dict(item.value().toGenericDict(), saved_devices, map_location,
                                                "the model \"" + name + "\" in " + path, path));
  }
  return states;
}

std::optional<std::string> read_archive_record(const std::vector<char>& zip, const std::string& name,
                                               const std::string& path) {
  try {
    auto reader = reader_of(zip);
    if (!reader.hasRecord(name)) return std::nullopt;
    auto [data, size] = reader.getRecord(name);
    return std::string(static_cast<const char*>(data.get()), size);
  } catch (const std::exception& error) {  // its checksum holds, but its zip archive is not sound
    throw CheckpointError("cannot read record " + name + " of " + path + ": " + error_line(error));
  }
}

}  // namespace ddp
