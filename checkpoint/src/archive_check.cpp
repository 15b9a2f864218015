// The gate between a checkpoint's bytes and LibTorch's readers. The checksum proves a file is the
// one written, not that it was written by us: a file altered and re-sealed, or simply made by
// someone else, reaches LibTorch's zip reader, unpickler and TorchScript compiler, which trust
// their input (a crafted file segfaults the type parser or fails its assertions). So before LibTorch
// reads an archive: (1) the zip directory is read here, for each record's size and whether it is
// compressed (only where a writer compresses: TorchScript's code); (2) code, which a TorchScript
// archive carries and LibTorch compiles, is inflated one record at a time, each only if its size
// fits what the archive may inflate, and must be the class declarations
// torch::serialize::OutputArchive writes, line by line; (3) every pickle passes check_pickle,
// tensors checked against the sizes of their records; (4) a TorchScript archive is rebuilt from
// just those checked records, so nothing unchecked (debug records) is read.
#include "checkpoint/src/archive_check.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <string_view>

#include <caffe2/serialize/inline_container.h>

#include "checkpoint/src/pickle_check.h"

namespace ddp {
namespace {

uint64_t little_endian(const ZipBytes& zip, uint64_t at, std::size_t bytes) {
  if (at > zip.size() || zip.size() - at < bytes) throw PickleError("the zip directory points past the end of the archive");
  unsigned char field[8] = {};
  zip.copy(at, bytes, reinterpret_cast<char*>(field));
  uint64_t value = 0;
  for (std::size_t i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(field[i]) << (8 * i);
  return value;
}

bool lies_inside(const ZipBytes& zip, uint64_t at, uint64_t length) {
  return at <= zip.size() && length <= zip.size() - at;
}

bool signature_at(const ZipBytes& zip, uint64_t at, char kind_a, char kind_b) {
  if (!lies_inside(zip, at, 4)) return false;
  char signature[4];
  zip.copy(at, 4, signature);
  return signature[0] == 'P' && signature[1] == 'K' && signature[2] == kind_a && signature[3] == kind_b;
}

// An archive already in memory.
class VectorBytes : public ZipBytes {
 public:
  explicit VectorBytes(const std::vector<char>& bytes) : bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  void copy(uint64_t at, std::size_t n, char* out) const override { std::memcpy(out, bytes_.data() + at, n); }

 private:
  const std::vector<char>& bytes_;
};

// LibTorch's MemoryReadAdapter copies whatever range it is asked for; this one stops at the end.
class BoundedReadAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BoundedReadAdapter(const std::vector<char>& bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what = "") const override {
    if (pos >= bytes_.size()) return 0;
    const size_t count = std::min<uint64_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, count);
    return count;
  }

 private:
  const std::vector<char>& bytes_;
};

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }
bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// --- (2) code: what OutputArchive declares, and nothing else ---------------------------------------
bool is_identifier(std::string_view text) {
  if (text.empty() || std::isdigit(static_cast<unsigned char>(text[0]))) return false;
  for (char c : text) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

// An attribute name as OutputArchive quotes it: "params/0", "0x55a7cf7aec90".
bool eat_quoted_key(std::string_view& line) {
  if (line.empty() || line[0] != '"') return false;
  std::size_t end = 1;
  while (end < line.size() && end <= 256 &&
         (std::isalnum(static_cast<unsigned char>(line[end])) || std::strchr("_./-", line[end]) != nullptr)) {
    ++end;
  }
  if (end == 1 || end >= line.size() || line[end] != '"') return false;
  line.remove_prefix(end + 1);
  return true;
}

// ["a", "b", ] or []
bool is_name_list(std::string_view list) {
  if (list.empty() || list[0] != '[') return false;
  list.remove_prefix(1);
  while (!list.empty() && list[0] != ']') {
    if (!eat_quoted_key(list) || !starts_with(list, ", ")) return false;
    list.remove_prefix(2);
  }
  return list == "]";
}

bool is_declaration(std::string_view line, const std::set<std::string>& classes) {
  if (starts_with(line, "  __parameters__ = ")) return is_name_list(line.substr(19));
  if (starts_with(line, "  __buffers__ = ")) return is_name_list(line.substr(16));
  if (line == "  __annotations__ = []") return true;
  if (starts_with(line, "  __annotations__[")) {
    line.remove_prefix(18);
    return eat_quoted_key(line) && starts_with(line, "] = ") && is_known_type(line.substr(4), classes);
  }
  const std::size_t colon = line.find(" : ");
  return starts_with(line, "  ") && colon != std::string_view::npos && is_identifier(line.substr(2, colon - 2)) &&
         is_known_type(line.substr(colon + 3), classes);
}

// "code/__torch__.py" -> "__torch__.Module", "code/__torch__/___torch_mangle_3.py" ->
// "__torch__.___torch_mangle_3.Module"; empty when the file name is not one OutputArchive writes.
std::string class_of_code_file(std::string_view name) {
  if (!starts_with(name, "code/") || !ends_with(name, ".py")) return "";
  std::string_view path = name.substr(5, name.size() - 8);
  std::string qualified;
  while (true) {
    const std::size_t slash = path.find('/');
    const std::string_view part = path.substr(0, slash);
    if (!is_identifier(part)) return "";
    qualified += std::string(part) + ".";
    if (slash == std::string_view::npos) break;
    path.remove_prefix(slash + 1);
  }
  return starts_with(qualified, "__torch__.") ? qualified + "Module" : "";
}

void check_code(const std::string& name, const std::string& code, const std::set<std::string>& classes) {
  std::size_t line_number = 0, start = 0;
  bool declared = false;
  while (start < code.size()) {
    std::size_t end = code.find('\n', start);
    if (end == std::string::npos) end = code.size();
    const std::string_view line(code.data() + start, end - start);
    ++line_number;
    start = end + 1;
    if (line.empty()) continue;
    const bool ok = declared ? is_declaration(line, classes) : line == "class Module(Module):";
    if (!ok) {
      throw PickleError("record " + name + ", line " + std::to_string(line_number) +
                        ": code that is not a class declaration as torch::serialize writes it");
    }
    declared = true;
  }
  if (!declared) throw PickleError("record " + name + " declares no class");
}

// --- (3) pickles ---------------------------------------------------------------------------------------
void check_pickle_record(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name,
                         const ZipRecords& records, const std::string& tensor_prefix,
                         const std::set<std::string>& classes) {
  if (!records.count(name)) throw PickleError("the archive has no record " + name);
  auto [data, size] = reader.getRecord(name);
  PickleRules rules;
  rules.classes = classes;
  rules.storage_size = [&](const std::string& key) -> std::optional<uint64_t> {
    auto found = records.find(tensor_prefix + key);
    return found == records.end() ? std::nullopt : std::optional<uint64_t>(found->second.size);
  };
  try {
    check_pickle(std::string_view(static_cast<const char*>(data.get()), size), rules);
  } catch (const PickleError& error) {
    throw PickleError("record " + name + ", " + error.what());
  }
}

}  // namespace

caffe2::serialize::PyTorchStreamReader reader_of(const std::vector<char>& zip) {
  return caffe2::serialize::PyTorchStreamReader(std::make_shared<BoundedReadAdapter>(zip));
}

// --- (1) the zip directory -------------------------------------------------------------------------------
namespace {

// Where the central directory is, from the records after it.
struct Directory {
  uint64_t entries, offset, size;
};

// A checkpoint is one zip file, its end written the way LibTorch's and Python's writers do:
//   central directory | [ZIP64 directory record | ZIP64 locator] | directory record (EOCD)
// each part where the one after it says, on disk 0 of 1, with the same counts in every record.
// Anything else is refused, with the field named: an edit there is accepted by some zip
// readers and not by others.
Directory locate_directory(const ZipBytes& zip) {
  const uint64_t total = zip.size();
  // The EOCD closes the archive, without a comment: so every writer of ours and torch.save leave
  // it, and where it is, miniz finds it too.
  if (total < 22 || !signature_at(zip, total - 22, 5, 6) || little_endian(zip, total - 2, 2) != 0) {
    throw PickleError("the zip archive does not end with its directory record");
  }
  const uint64_t eocd = total - 22;
  auto one_disk = [](const std::string& record, uint64_t disk, uint64_t directory_disk) {
    if (disk != 0 || directory_disk != 0) {
      throw PickleError("the " + record + " is on disk " + std::to_string(disk) + " and names disk " +
                        std::to_string(directory_disk) + " for the directory (a checkpoint is one file: disk 0 for both)");
    }
  };
  auto same_count = [](const std::string& record, uint64_t on_disk, uint64_t in_all) {
    if (on_disk != in_all) {
      throw PickleError("the " + record + " counts " + std::to_string(on_disk) + " entries on this disk and " +
                        std::to_string(in_all) + " in all (a checkpoint is one file: the same number)");
    }
  };
  auto meets = [](const std::string& part, uint64_t from, uint64_t size, const std::string& next, uint64_t next_at) {
    if (from > next_at || size != next_at - from) {
      throw PickleError("the " + part + " (" + std::to_string(size) + " bytes from byte " + std::to_string(from) +
                        ") does not end where the " + next + " begins (byte " + std::to_string(next_at) + ")");
    }
  };
  one_disk("zip directory record", little_endian(zip, eocd + 4, 2), little_endian(zip, eocd + 6, 2));
  same_count("zip directory record", little_endian(zip, eocd + 8, 2), little_endian(zip, eocd + 10, 2));
  Directory directory{little_endian(zip, eocd + 10, 2), little_endian(zip, eocd + 16, 4), little_endian(zip, eocd + 12, 4)};
  uint64_t directory_end = eocd;  // where the directory must end
  std::string after_directory = "zip directory record";
  if (eocd >= 20 && signature_at(zip, eocd - 20, 6, 7)) {  // ZIP64: the real numbers are in its own record
    const uint64_t locator = eocd - 20, zip64 = little_endian(zip, locator + 8, 8);
    if (little_endian(zip, locator + 4, 4) != 0 || little_endian(zip, locator + 16, 4) != 1) {
      throw PickleError("the ZIP64 locator names disk " + std::to_string(little_endian(zip, locator + 4, 4)) + " of " +
                        std::to_string(little_endian(zip, locator + 16, 4)) + " (a checkpoint is one file: disk 0 of 1)");
    }
    if (zip64 >= locator || locator - zip64 < 56 || !signature_at(zip, zip64, 6, 6)) {
      throw PickleError("the zip archive's ZIP64 directory record is missing");
    }
    const uint64_t record_size = little_endian(zip, zip64 + 4, 8) + 12;  // its size field leaves out 12 bytes
    meets("ZIP64 directory record", zip64, record_size, "ZIP64 locator", locator);
    one_disk("ZIP64 directory record", little_endian(zip, zip64 + 16, 4), little_endian(zip, zip64 + 20, 4));
    same_count("ZIP64 directory record", little_endian(zip, zip64 + 24, 8), little_endian(zip, zip64 + 32, 8));
    const Directory wide{little_endian(zip, zip64 + 32, 8), little_endian(zip, zip64 + 48, 8), little_endian(zip, zip64 + 40, 8)};
    // The EOCD's fields hold the same numbers, or all ones where they do not fit ("see ZIP64").
    auto agree = [](const std::string& what, uint64_t narrow, uint64_t all_ones, uint64_t wide_value) {
      if (narrow != wide_value && narrow != all_ones) {
        throw PickleError("the zip directory record and its ZIP64 record disagree on the " + what + " (" +
                          std::to_string(narrow) + " and " + std::to_string(wide_value) + ")");
      }
    };
    agree("number of entries", directory.entries, 0xffff, wide.entries);
    agree("directory's size", directory.size, 0xffffffff, wide.size);
    agree("directory's offset", directory.offset, 0xffffffff, wide.offset);
    directory = wide;
    directory_end = zip64;
    after_directory = "ZIP64 directory record";
  }
  if (!lies_inside(zip, directory.offset, directory.size)) throw PickleError("the zip directory lies outside the archive");
  meets("zip directory", directory.offset, directory.size, after_directory, directory_end);
  return directory;
}

// Where a writer compresses: torch::serialize (TorchScript) deflates its code and debug records;
// the tensors and pickles of every archive, and every record of torch.save's, are stored.
bool may_be_deflated(const std::string& name, ArchiveKind kind) {
  return kind == ArchiveKind::kScript && starts_with(name, "code/");
}

}  // namespace

ZipRecords archive_records(const ZipBytes& zip, ArchiveKind kind) {
  // Every range LibTorch's zip reader (miniz, through adapters that do not check bounds) will read
  // is checked to lie inside the archive, with sums that cannot overflow.
  auto inside = [&](uint64_t at, uint64_t length) { return lies_inside(zip, at, length); };
  const Directory found = locate_directory(zip);
  const uint64_t entries = found.entries, directory = found.offset, directory_size = found.size;
  ZipRecords records;
  std::string prefix;  // every name starts with the archive's folder ("archive/"), which LibTorch drops
  uint64_t at = directory;
  const uint64_t directory_end = directory + directory_size;
  for (uint64_t i = 0; i < entries; ++i) {
    const std::string entry = "zip directory entry " + std::to_string(i);
    if (at > directory_end || directory_end - at < 46 || !signature_at(zip, at, 1, 2)) {
      throw PickleError("the " + entry + " is damaged");
    }
    const uint64_t method = little_endian(zip, at + 10, 2);
    uint64_t compressed = little_endian(zip, at + 20, 4);
    uint64_t size = little_endian(zip, at + 24, 4);
    const uint64_t name_size = little_endian(zip, at + 28, 2);
    const uint64_t extra_size = little_endian(zip, at + 30, 2);
    const uint64_t comment_size = little_endian(zip, at + 32, 2);
    uint64_t local = little_endian(zip, at + 42, 4);
    if (directory_end - at - 46 < name_size + extra_size + comment_size) throw PickleError("the " + entry + " is cut short");
    std::string name(static_cast<std::size_t>(name_size), '\0');
    zip.copy(at + 46, name.size(), name.data());
    // ZIP64: the fields that read 0xffffffff follow in the extra block 0x0001, in this order.
    for (uint64_t field = at + 46 + name_size, end = field + extra_size; field + 4 <= end;) {
      const uint64_t id = little_endian(zip, field, 2), length = little_endian(zip, field + 2, 2);
      if (length > end - field - 4) throw PickleError("the " + entry + " (" + name + ") has a damaged extra field");
      uint64_t value = field + 4;
      for (uint64_t* wide : {&size, &compressed, &local}) {
        if (id == 1 && *wide == 0xffffffffu && value + 8 <= field + 4 + length) {
          *wide = little_endian(zip, value, 8);
          value += 8;
        }
      }
      field += 4 + length;
    }
    if (i == 0) prefix = name.substr(0, name.find('/') + 1);
    if (prefix.empty() || !starts_with(name, prefix)) throw PickleError("the zip archive's records are not in one folder");
    const std::string record = name.substr(prefix.size());
    // Stored, or deflated where a writer deflates (its inflated size is checked against the
    // archive's budget before anything inflates it: inflated_budget); the data inside the archive.
    const bool stored = method == 0 && compressed == size, deflated = method == 8;
    if (deflated && !may_be_deflated(record, kind)) {
      throw PickleError("record " + record + " is compressed, where no checkpoint writer (nor torch.save) compresses");
    }
    if (!stored && !deflated) throw PickleError("record " + record + " is stored in a way no checkpoint is");
    if (!inside(local, 30) || !signature_at(zip, local, 3, 4)) {
      throw PickleError("record " + record + " has no header where the directory says");
    }
    const uint64_t data = local + 30 + little_endian(zip, local + 26, 2) + little_endian(zip, local + 28, 2);
    if (!inside(data, compressed)) throw PickleError("record " + record + " runs past the end of the archive");
    if (!records.emplace(record, ZipRecord{size, deflated}).second) throw PickleError("the zip archive holds " + name + " twice");
    at += 46 + name_size + extra_size + comment_size;
  }
  if (at != directory_end) {  // the rest would be entries only some readers see
    throw PickleError("the zip directory's " + std::to_string(entries) + " entries take " + std::to_string(at - directory) +
                      " bytes, its directory record says " + std::to_string(directory_size));
  }
  return records;
}

ZipRecords archive_records(const std::vector<char>& zip, ArchiveKind kind) { return archive_records(VectorBytes(zip), kind); }

void check_plain_archive(const std::vector<char>& zip) {
  const auto records = archive_records(zip, ArchiveKind::kPlain);
  auto reader = reader_of(zip);
  check_pickle_record(reader, "data.pkl", records, "data/", {});
}

namespace {

// What an archive may inflate in all: a multiple of its own size, so a small file cannot claim
// gigabytes, and never more than a fixed cap. Code, the only thing deflated, is a small part of
// an archive whose tensors are stored.
constexpr uint64_t kInflatedPerArchiveByte = 32;
constexpr uint64_t kInflatedCap = uint64_t{256} << 20;

// Charges a deflated record's size to `budget` before it is inflated (the zip reader allocates
// the size the directory gives, then inflates into it).
void charge_inflated(const std::string& name, const ZipRecord& record, uint64_t archive_size, uint64_t& budget) {
  if (record.size > budget) {
    throw PickleError("record " + name + " would inflate to " + std::to_string(record.size) + " bytes, more than the " +
                      std::to_string(budget) + " left of what this archive may inflate (" +
                      std::to_string(kInflatedPerArchiveByte) + " times its " + std::to_string(archive_size) +
                      " bytes, at most " + std::to_string(kInflatedCap >> 20) + " MiB)");
  }
  budget -= record.size;
}

std::string record_text(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

}  // namespace

std::vector<char> checked_script_archive(const std::vector<char>& zip) {
  const auto records = archive_records(zip, ArchiveKind::kScript);
  auto reader = reader_of(zip);
  // (2) The classes first, by file name (the code and pickles may name them), then each file read
  // and checked in turn: nothing is inflated before its size fits the budget.
  std::set<std::string> classes;
  for (const auto& [name, record] : records) {
    if (!starts_with(name, "code/") || ends_with(name, ".debug_pkl")) continue;
    const std::string qualified = class_of_code_file(name);
    if (qualified.empty()) throw PickleError("record " + name + ": code in a file torch::serialize never writes");
    classes.insert(qualified);
  }
  uint64_t budget = std::min(kInflatedCap, kInflatedPerArchiveByte * zip.size());
  std::map<std::string, std::string> code;
  for (const auto& [name, record] : records) {
    if (!starts_with(name, "code/") || ends_with(name, ".debug_pkl")) continue;
    charge_inflated(name, record, zip.size(), budget);
    std::string text = record_text(reader, name);
    check_code(name, text, classes);
    code.emplace(name, std::move(text));
  }
  // (3)
  check_pickle_record(reader, "data.pkl", records, "data/", classes);
  check_pickle_record(reader, "constants.pkl", records, "constants/", classes);
  // (4) Code (as checked), pickles and tensors; the writer adds its own version records.
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    out.insert(out.end(), static_cast<const char*>(bytes), static_cast<const char*>(bytes) + n);
    return n;
  });
  for (const auto& [name, text] : code) writer.writeRecord(name, text.data(), text.size());
  for (const auto& [name, record] : records) {
    const bool keep = name == "data.pkl" || name == "constants.pkl" || starts_with(name, "data/") ||
                      starts_with(name, "constants/");
    if (!keep) continue;
    auto [data, data_size] = reader.getRecord(name);
    writer.writeRecord(name, data.get(), data_size);
  }
  writer.writeEndOfFile();
  return out;
}

}  // namespace ddp
