// Small files that would take gigabytes to load: a deflated data.pkl of 1 GiB, code
// records of 1 GiB each in the optimizer's archive, sparse files of 6 and 50 GiB. Each is built
// here, loaded in a child process, and refused with its message while the child's peak resident
// set (ru_maxrss, from wait4) stays under 400 MiB; a normal load peaks near 165 MiB with LibTorch
// 1.13 (where LibTorch's own libraries take more, as a build with CUDA's, the limit is a normal
// load's peak plus 100 MiB).
#ifndef _WIN32
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>
#include <zlib.h>

#include <ddp/checkpoint.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::contains;
using ckpt_test::ToyModel;

constexpr uint64_t kGiB = uint64_t{1} << 30;

// --- a zip writer of our own: records stored, or deflated from a stream never held whole --------------
struct ZipEntry {
  std::string name;  // without the archive's folder
  std::string data;  // as in the file: stored bytes or raw deflate
  uint32_t crc = 0;
  uint64_t size = 0;  // inflated
  uint16_t method = 0;
};

ZipEntry stored(const std::string& name, const std::string& content) {
  ZipEntry entry{name, content, 0, content.size(), 0};
  entry.crc = static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(content.data()), content.size()));
  return entry;
}

// `prefix` followed by zeros up to `total` bytes, deflated a MiB at a time.
ZipEntry deflated(const std::string& name, const std::string& prefix, uint64_t total) {
  ZipEntry entry{name, "", 0, total, 8};
  z_stream stream{};
  deflateInit2(&stream, Z_BEST_COMPRESSION, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY);
  std::vector<char> zeros(1 << 20, 0), out(1 << 20);
  uLong crc = crc32(0, Z_NULL, 0);
  auto feed = [&](const char* data, std::size_t n, int flush) {
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data), static_cast<uInt>(n));
    stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data));
    stream.avail_in = static_cast<uInt>(n);
    do {
      stream.next_out = reinterpret_cast<Bytef*>(out.data());
      stream.avail_out = static_cast<uInt>(out.size());
      deflate(&stream, flush);
      entry.data.append(out.data(), out.size() - stream.avail_out);
    } while (stream.avail_out == 0);
  };
  feed(prefix.data(), prefix.size(), Z_NO_FLUSH);
  for (uint64_t done = prefix.size(); done < total;) {
    const std::size_t n = static_cast<std::size_t>(std::min<uint64_t>(zeros.size(), total - done));
    done += n;
    feed(zeros.data(), n, done == total ? Z_FINISH : Z_NO_FLUSH);
  }
  deflateEnd(&stream);
  entry.crc = static_cast<uint32_t>(crc);
  return entry;
}

void put(std::vector<char>& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

// A plain zip archive (no ZIP64: everything here is under 4 GiB) of `entries` under "archive/".
std::vector<char> zip_of(const std::vector<ZipEntry>& entries) {
  std::vector<char> out, directory;
  for (const auto& entry : entries) {
    const std::string name = "archive/" + entry.name;
    const uint64_t local = out.size();
    for (auto* part : {&out, &directory}) {
      const bool central = part == &directory;
      put(*part, central ? 0x02014b50 : 0x04034b50, 4);
      if (central) put(*part, 20, 2);  // version made by
      put(*part, 20, 2);              // version needed
      put(*part, 0, 2);               // flags
      put(*part, entry.method, 2);
      put(*part, 0, 4);  // time, date
      put(*part, entry.crc, 4);
      put(*part, entry.data.size(), 4);
      put(*part, entry.size, 4);
      put(*part, name.size(), 2);
      put(*part, 0, 2);  // extra
      if (central) {
        put(*part, 0, 2);  // comment
        put(*part, 0, 4);  // disk, internal attributes
        put(*part, 0, 4);  // external attributes
        put(*part, local, 4);
      }
      part->insert(part->end(), name.begin(), name.end());
      if (!central) part->insert(part->end(), entry.data.begin(), entry.data.end());
    }
  }
  const uint64_t directory_at = out.size();
  out.insert(out.end(), directory.begin(), directory.end());
  put(out, 0x06054b50, 4);
  put(out, 0, 4);  // this disk, the directory's disk
  put(out, entries.size(), 2);
  put(out, entries.size(), 2);
  put(out, directory.size(), 4);
  put(out, directory_at, 4);
  put(out, 0, 2);  // comment
  return out;
}

// Every record of `zip`, stored.
std::vector<ZipEntry> entries_of(const std::vector<char>& zip) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(zip.data(), static_cast<off_t>(zip.size())));
  std::vector<ZipEntry> entries;
  for (const auto& name : reader.getAllRecords()) {
    auto [data, size] = reader.getRecord(name);
    entries.push_back(stored(name, std::string(static_cast<const char*>(data.get()), size)));
  }
  return entries;
}

void replace_entry(std::vector<ZipEntry>& entries, const ZipEntry& with) {
  for (auto& entry : entries) {
    if (entry.name == with.name) {
      entry = with;
      return;
    }
  }
  ADD_FAILURE() << "no record " << with.name;
}

std::string content_of(const std::vector<ZipEntry>& entries, const std::string& name) {
  for (const auto& entry : entries) {
    if (entry.name == name) return entry.data;
  }
  ADD_FAILURE() << "no record " << name;
  return "";
}

// --- loading in a child, its peak resident set measured ------------------------------------------------
DDP_WORKER(load_checkpoint_and_report) {
  ToyModel model;
  torch::optim::Adam adam(model->parameters());
  std::string result = "loaded";
  try {
    ddp::load_checkpoint(std::getenv("CKPT_BOMB"), *model, &adam);
  } catch (const ddp::CheckpointError& error) {
    result = error.what();
  } catch (const std::exception& error) {
    result = std::string("not a CheckpointError: ") + error.what();
  }
  ddp::test::write_shared("result", result);
}

struct ChildLoad {
  std::string result;  // the error, "loaded", or what ended the child
  long peak_mib = 0;
};

ChildLoad load_in_child(const std::string& path, const std::string& dir) {
  std::filesystem::remove(dir + "/result");
  const pid_t pid = ddp::test::spawn_worker("load_checkpoint_and_report",
                                            {{"DDP_TEST_DIR", dir}, {"CKPT_BOMB", path}, {"OMP_NUM_THREADS", "1"}});
  rusage usage{};
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(3);
  while (::wait4(pid, &status, WNOHANG, &usage) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::wait4(pid, &status, 0, &usage);
      return {"timed out", usage.ru_maxrss / 1024};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(dir + "/result");
  std::stringstream text;
  text << in.rdbuf();
  const std::string ended = WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                                : "exited " + std::to_string(WEXITSTATUS(status));
  return {in ? text.str() : "no result (" + ended + ")", usage.ru_maxrss / 1024};
}

class Bombs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ddp::test::make_temp_dir("ckpt-bombs");
    path_ = dir_ + "/ckpt.pt";
    ToyModel model;
    torch::optim::Adam adam(model->parameters());
    ddp::save_checkpoint(path_, *model, &adam, {});
    archive_ = ddp::read_checkpoint_file(path_);
  }
  void TearDown() override { ddp::test::remove_tree(dir_); }

  // `entries` as a sealed checkpoint file named `name`.
  std::string write_sealed(const std::string& name, const std::vector<ZipEntry>& entries) {
    std::vector<char> zip = zip_of(entries);
    ddp::seal_archive(zip);
    const std::string file = dir_ + "/" + name;
    std::ofstream(file, std::ios::binary).write(zip.data(), static_cast<std::streamsize>(zip.size()));
    return file;
  }
  ChildLoad load(const std::string& file) {
    const ChildLoad loaded = load_in_child(file, dir_);
    std::cout << "[ bomb     ] " << std::filesystem::path(file).filename().string() << ": peak " << loaded.peak_mib
              << " MiB" << std::endl;
    return loaded;
  }
  // 400 MiB, or a normal load's peak plus 100 MiB where that is more (measured once).
  long peak_limit_mib() {
    static const long limit = [this] {
      const ChildLoad normal = load(path_);
      EXPECT_EQ(normal.result, "loaded");
      return std::max(400L, normal.peak_mib + 100);
    }();
    return limit;
  }

  std::string dir_, path_;
  std::vector<char> archive_;
};

// Before: loaded, 2.2 GB at its peak. No writer deflates data.pkl.
TEST_F(Bombs, ADeflatedModelPickleIsRefusedBeforeItInflates) {
  auto entries = entries_of(archive_);
  replace_entry(entries, deflated("data.pkl", content_of(entries, "data.pkl"), kGiB));
  const std::string file = write_sealed("deflated-pickle.pt", entries);
  ASSERT_LT(std::filesystem::file_size(file), 8u << 20);
  const ChildLoad loaded = load(file);
  EXPECT_EQ(loaded.result, file + " is not a sound zip archive: record data.pkl is compressed, where no checkpoint "
                                  "writer (nor torch.save) compresses");
  EXPECT_LT(loaded.peak_mib, peak_limit_mib());
}

// Before: every code record was inflated into a map before any was checked, 4.4 GB for three.
TEST_F(Bombs, CodeRecordsAreInflatedOnlyWithinTheBudget) {
  auto inner = entries_of([&] {
    const std::string bytes = content_of(entries_of(archive_), "ddp_optimizer_state");
    return std::vector<char>(bytes.begin(), bytes.end());
  }());
  const ZipEntry bomb = deflated("code/__torch__/bomb0.py", "", kGiB);
  for (const char* name : {"code/__torch__/bomb0.py", "code/__torch__/bomb1.py", "code/__torch__/bomb2.py"}) {
    ZipEntry copy = bomb;
    copy.name = name;
    inner.push_back(copy);
  }
  const std::vector<char> inner_zip = zip_of(inner);
  auto entries = entries_of(archive_);
  replace_entry(entries, stored("ddp_optimizer_state", std::string(inner_zip.begin(), inner_zip.end())));
  const std::string file = write_sealed("code-bombs.pt", entries);
  ASSERT_LT(std::filesystem::file_size(file), 8u << 20);
  const ChildLoad loaded = load(file);
  EXPECT_EQ(loaded.result.rfind("cannot read the optimizer state in " + file +
                                    ": record code/__torch__/bomb0.py would inflate to 1073741824 bytes, more than the ",
                                0),
            0u)
      << loaded.result;
  EXPECT_TRUE(contains(loaded.result, " left of what this archive may inflate (32 times its " +
                                          std::to_string(inner_zip.size()) + " bytes, at most 256 MiB)"))
      << loaded.result;
  EXPECT_LT(loaded.peak_mib, peak_limit_mib());
}

// A small record deflated where no writer deflates reached LibTorch's zip reader unchecked (one
// zipped by Python's zipfile loaded: tests/fuzz/corpus/regression-deflated-tensor).
TEST_F(Bombs, CompressedRecordsAreRefusedWhereNoWriterCompresses) {
  auto entries = entries_of(archive_);
  const std::string weight = content_of(entries, "data/0");
  replace_entry(entries, deflated("data/0", weight, weight.size()));
  const std::string tensor = write_sealed("deflated-tensor.pt", entries);
  EXPECT_EQ(load(tensor).result, tensor + " is not a sound zip archive: record data/0 is compressed, where no "
                                          "checkpoint writer (nor torch.save) compresses");

  entries = entries_of(archive_);
  const std::string optimizer = content_of(entries, "ddp_optimizer_state");
  auto inner = entries_of(std::vector<char>(optimizer.begin(), optimizer.end()));
  const std::string pickle = content_of(inner, "data.pkl");
  replace_entry(inner, deflated("data.pkl", pickle, pickle.size()));
  const std::vector<char> inner_zip = zip_of(inner);
  replace_entry(entries, stored("ddp_optimizer_state", std::string(inner_zip.begin(), inner_zip.end())));
  const std::string nested = write_sealed("deflated-optimizer-pickle.pt", entries);
  EXPECT_EQ(load(nested).result, "cannot read the optimizer state in " + nested + ": record data.pkl is compressed, "
                                 "where no checkpoint writer (nor torch.save) compresses");
}

// --- sparse files: huge on paper, nothing on disk ----------------------------------------------------------

// CRC-32 of `n` zero bytes, by doubling (crc32_combine), without reading them.
uLong crc_of_zeros(uint64_t n) {
  const std::vector<char> block(1 << 20, 0);
  uLong total = crc32(0, Z_NULL, 0), power = crc32(0, reinterpret_cast<const Bytef*>(block.data()), block.size());
  uint64_t power_size = block.size();
  for (uint64_t blocks = n / block.size(); blocks > 0; blocks >>= 1) {
    if (blocks & 1) total = crc32_combine(total, power, static_cast<z_off_t>(power_size));
    power = crc32_combine(power, power, static_cast<z_off_t>(power_size));
    power_size *= 2;
  }
  const std::size_t rest = static_cast<std::size_t>(n % block.size());
  return crc32_combine(total, crc32(0, reinterpret_cast<const Bytef*>(block.data()), rest), static_cast<z_off_t>(rest));
}

// A file of `size` bytes holding `head` at its start and `tail` at its end, zeros (a hole) between.
std::string sparse_file(const std::string& path, uint64_t size, const std::string& head, const std::string& tail) {
  {
    std::ofstream out(path, std::ios::binary);
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
  }
  std::filesystem::resize_file(path, size - tail.size());
  std::ofstream(path, std::ios::binary | std::ios::app).write(tail.data(), static_cast<std::streamsize>(tail.size()));
  EXPECT_EQ(std::filesystem::file_size(path), size);
  return path;
}

// Before: read whole before its first bytes were looked at (6 GiB: 6.4 GB resident; 50 GiB:
// std::bad_alloc, the file not named).
TEST_F(Bombs, SparseFilesAreRefusedBeforeTheyAreReadWhole) {
  const std::string zip_head("PK\3\4", 4);
  const std::string huge = sparse_file(dir_ + "/huge.pt", 50 * kGiB, zip_head, "");
  ChildLoad loaded = load(huge);
  EXPECT_EQ(loaded.result, "checkpoint " + huge + " is truncated at byte " + std::to_string(50 * kGiB) +
                               ": its end-of-checkpoint trailer is missing (an interrupted write or a cut copy)");
  EXPECT_LT(loaded.peak_mib, peak_limit_mib());

  const std::string zeros = sparse_file(dir_ + "/zeros.pt", 6 * kGiB, "", "");
  loaded = load(zeros);
  EXPECT_EQ(loaded.result, zeros + " is not a torchddp checkpoint: it is not a zip archive (its first bytes are "
                                   "00 00 00 00, a checkpoint's are 50 4b 03 04)");
  EXPECT_LT(loaded.peak_mib, peak_limit_mib());

  // A real checkpoint after a hole: its trailer counts fewer bytes than the file has.
  const std::string checkpoint = [&] {
    std::ifstream in(path_, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const std::string padded = sparse_file(dir_ + "/padded.pt", 6 * kGiB, zip_head, checkpoint.substr(4));
  loaded = load(padded);
  EXPECT_EQ(loaded.result, "checksum mismatch in " + padded + ": trailer records " +
                               std::to_string(checkpoint.size() - 61) + " bytes before it, the file has " +
                               std::to_string(6 * kGiB - 61));
  EXPECT_LT(loaded.peak_mib, peak_limit_mib());

  // Sealed with a valid checksum, its directory records (ZIP64: the file is past 4 GiB) pointing
  // at zeros: the directory is read (and the checksum computed a chunk at a time) before the file.
  const uint64_t payload = 6 * kGiB - 61, zip64_at = payload - 22 - 20 - 56;
  std::vector<char> end;
  put(end, 0x06064b50, 4);  // the ZIP64 directory record
  put(end, 44, 8);          // its size after this field
  put(end, 45, 2);
  put(end, 45, 2);
  put(end, 0, 8);           // this disk, the directory's disk
  put(end, 1, 8);
  put(end, 1, 8);
  put(end, 46, 8);              // the directory's size
  put(end, zip64_at - 46, 8);   // and where it starts: zeros just before these records
  put(end, 0x07064b50, 4);  // its locator
  put(end, 0, 4);
  put(end, zip64_at, 8);
  put(end, 1, 4);
  put(end, 0x06054b50, 4);  // the directory record, "see ZIP64" where the numbers do not fit
  put(end, 0, 4);
  put(end, 1, 2);
  put(end, 1, 2);
  put(end, 46, 4);
  put(end, 0xffffffffu, 4);
  put(end, 61, 2);  // the comment: the trailer
  uLong crc = crc32(0, reinterpret_cast<const Bytef*>(zip_head.data()), 4);
  crc = crc32_combine(crc, crc_of_zeros(zip64_at - 4), static_cast<z_off_t>(zip64_at - 4));
  crc = crc32_combine(crc, crc32(0, reinterpret_cast<const Bytef*>(end.data()), end.size()), static_cast<z_off_t>(end.size()));
  char trailer[62];
  std::snprintf(trailer, sizeof(trailer), "torchddp-checkpoint v1 bytes=%016llx crc32=%08lx\n",
                static_cast<unsigned long long>(payload), static_cast<unsigned long>(crc));
  const std::string sealed = sparse_file(dir_ + "/sealed.pt", 6 * kGiB, zip_head,
                                         std::string(end.begin(), end.end()) + std::string(trailer, 61));
  loaded = load(sealed);
  EXPECT_EQ(loaded.result, sealed + " is not a sound zip archive: the zip directory entry 0 is damaged");
  EXPECT_LT(loaded.peak_mib, peak_limit_mib());
}

}  // namespace
#endif  // _WIN32
