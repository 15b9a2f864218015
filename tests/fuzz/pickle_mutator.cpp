// libFuzzer's custom mutator for load_checkpoint_fuzzer (issue 28): mutations inside the pickles
// of a checkpoint, with the archive rewritten around them as someone re-sealing a file would.
//
// Byte mutations of the whole file alone rarely get deep into a pickle: growing one shifts every
// zip offset after it, so the zip checks refuse the input before any pickle is read. So half the
// mutations here take one pickle out of the archive (the model's data.pkl, or the data.pkl or
// constants.pkl inside the training-state and optimizer records), change it, and write the
// archive again with LibTorch's writer:
//   - libFuzzer's own mutations of the pickle's bytes, which also insert the pickle opcodes of
//     tests/fuzz/pickle.dict (scripts/fuzz.sh passes it with -dict);
//   - a nest: lists, dicts or tuples, 1 to 2^16 deep, inserted where a value may start, so the
//     depth bound and whatever lies behind it are reached (one mutation, not thousands).
// The other half are libFuzzer's byte mutations of the whole file (the zip structure itself).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <ddp/checkpoint_file.h>

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace {

using Bytes = std::vector<char>;

// The file sound() checks archives in; removed when the process exits normally.
struct ScratchFile {
  ScratchFile() {
    const char* dir = std::getenv("TMPDIR");
    path = std::string(dir && *dir ? dir : "/tmp") + "/torchddp-mutate-" + std::to_string(::getpid()) + ".zip";
  }
  ~ScratchFile() { std::remove(path.c_str()); }
  std::string path;
};

// `zip` if its structure is sound (the checks load_checkpoint runs first), else nothing: only
// then may LibTorch's reader open it.
std::optional<Bytes> sound(const Bytes& zip) {
  static const ScratchFile file;
  std::ofstream(file.path, std::ios::binary | std::ios::trunc).write(zip.data(), static_cast<std::streamsize>(zip.size()));
  try {
    return ddp::read_checkpoint_file(file.path, /*allow_plain=*/true);
  } catch (const ddp::CheckpointError&) {
    return std::nullopt;
  }
}

// A pickle of lists, dicts (under the key 0) or tuples, `depth` deep, as LibTorch's unpickler reads them.
std::string nest(int kind, int depth) {
  std::string text;
  for (int i = 1; i < depth; ++i) text += kind == 0 ? "](" : kind == 1 ? std::string("}(K\0", 4) : "(";
  text += kind == 0 ? "]" : kind == 1 ? "}" : "(";
  return text + std::string(kind == 2 ? depth : depth - 1, kind == 0 ? 'e' : kind == 1 ? 'u' : 't');
}

// One of the two pickle mutations, within `room` more bytes.
std::string mutate_pickle(std::string pickle, std::size_t room, std::minstd_rand& random) {
  if (random() % 2 == 0) {
    std::vector<uint8_t> buffer(pickle.begin(), pickle.end());
    buffer.resize(pickle.size() + room);
    buffer.resize(LLVMFuzzerMutate(buffer.data(), pickle.size(), buffer.size()));
    return std::string(buffer.begin(), buffer.end());
  }
  // Where a value may start: after the protocol header, or after a MARK.
  std::vector<std::size_t> starts = {std::min<std::size_t>(2, pickle.size())};
  for (std::size_t i = 0; i < pickle.size(); ++i) {
    if (pickle[i] == '(') starts.push_back(i + 1);
  }
  const int kind = static_cast<int>(random() % 3);
  const int depth = 1 + static_cast<int>(random() % (1u << (random() % 17)));
  const std::string inserted = nest(kind, depth);
  if (inserted.size() > room) return pickle;
  pickle.insert(starts[random() % starts.size()], inserted);
  return pickle;
}

// `zip` with the record `name` ("ddp_optimizer_state/data.pkl": a record of a record) replaced by
// `content`, written by LibTorch's writer (which adds its own version records).
Bytes rewrite(const Bytes& zip, const std::string& name, const std::string& content) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(zip.data(), static_cast<off_t>(zip.size())));
  const std::size_t slash = name.find('/');
  const std::string head = slash == std::string::npos ? name : name.substr(0, slash);
  Bytes out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    out.insert(out.end(), static_cast<const char*>(bytes), static_cast<const char*>(bytes) + n);
    return n;
  });
  for (const auto& record : reader.getAllRecords()) {
    if (record == "version" || record == ".data/version" || record == ".data/serialization_id") continue;
    auto [data, size] = reader.getRecord(record);
    std::string bytes(static_cast<const char*>(data.get()), size);
    if (record == head && slash == std::string::npos) bytes = content;
    if (record == head && slash != std::string::npos) {
      const Bytes inner = rewrite(Bytes(bytes.begin(), bytes.end()), name.substr(slash + 1), content);
      bytes.assign(inner.begin(), inner.end());
    }
    writer.writeRecord(record, bytes.data(), bytes.size());
  }
  writer.writeEndOfFile();
  return out;
}

// The record `name` of the sound archive `zip` (nested as in rewrite), or nothing when it has no
// such record or an archive inside it is not sound.
std::optional<std::string> record_of(const Bytes& zip, const std::string& name) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(zip.data(), static_cast<off_t>(zip.size())));
  const std::size_t slash = name.find('/');
  const std::string head = slash == std::string::npos ? name : name.substr(0, slash);
  if (!reader.hasRecord(head)) return std::nullopt;
  auto [data, size] = reader.getRecord(head);
  std::string bytes(static_cast<const char*>(data.get()), size);
  if (slash == std::string::npos) return bytes;
  const auto inner = sound(Bytes(bytes.begin(), bytes.end()));
  return inner ? record_of(*inner, name.substr(slash + 1)) : std::nullopt;
}

}  // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  std::minstd_rand random(seed);
  if (random() % 2 == 0) return LLVMFuzzerMutate(data, size, max_size);
  static const char* const kPickles[] = {"data.pkl", "ddp_training_state/data.pkl", "ddp_training_state/constants.pkl",
                                         "ddp_optimizer_state/data.pkl"};
  const std::string name = kPickles[random() % 4];
  try {
    const auto zip = sound(Bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size));
    const auto pickle = zip ? record_of(*zip, name) : std::nullopt;
    if (!pickle) return LLVMFuzzerMutate(data, size, max_size);
    const std::size_t room = max_size > size ? max_size - size : 0;
    const Bytes out = rewrite(*zip, name, mutate_pickle(*pickle, room, random));
    if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
    std::memcpy(data, out.data(), out.size());
    return out.size();
  } catch (const std::exception&) {  // a record LibTorch's reader refuses (the zip structure is checked)
    return LLVMFuzzerMutate(data, size, max_size);
  }
}
