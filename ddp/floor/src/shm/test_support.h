#pragma once
// What the shared-memory core's tests share (communicator_test.cpp, halves_test.cpp): ranks forked
// as processes over a file-based rendezvous, reporting through files; test tensors made from
// deterministic pseudo-random numbers; references computed independently (in double, in rank
// order; the 16-bit formats decoded with ldexp), never with the code under test.
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/reduce_kernels.h"

namespace shm_test {

namespace shm = ddp::detail::shm;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- Harness -----------------------------------------------------------------------------------

inline std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

inline void write_file(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream file(temporary);
    file << text;
  }
  std::rename(temporary.c_str(), path.c_str());  // readers see the whole file or none
}

inline bool file_exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

inline std::int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// The rendezvous over files in one folder: a key is a file, written atomically; get() polls.
class FileRendezvous : public shm::Rendezvous {
 public:
  explicit FileRendezvous(std::string folder, std::chrono::milliseconds timeout = 20s) : folder_(std::move(folder)), timeout_(timeout) {}

  void set(const std::string& key, const std::string& value) override { write_file(path(key), value); }

  std::string get(const std::string& key) override {
    const auto deadline = Clock::now() + timeout_;
    while (!file_exists(path(key))) {
      if (Clock::now() >= deadline) throw std::runtime_error("rendezvous key " + key + " not set within " + std::to_string(timeout_.count()) + " ms");
      std::this_thread::sleep_for(1ms);
    }
    return read_file(path(key));
  }

 private:
  std::string path(std::string key) const {
    std::replace(key.begin(), key.end(), '/', '_');
    return folder_ + "/key_" + key;
  }
  std::string folder_;
  std::chrono::milliseconds timeout_;
};

// A fresh folder and segment-name prefix per test.
struct Scratch {
  std::string folder;
  std::string prefix;  // "/ddpshmtest-<pid>-<n>"
  Scratch() {
    static int counter = 0;
    char path[] = "/tmp/ddp_shm_test_XXXXXX";
    folder = ::mkdtemp(path);
    prefix = "/ddpshmtest-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  }
  ~Scratch() { std::system(("rm -rf '" + folder + "'").c_str()); }
};

// Names in /dev/shm that start with `prefix` (without its slash).
inline std::vector<std::string> leftovers(const std::string& prefix) {
  std::vector<std::string> found;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* entry = ::readdir(dir)) {
      if (std::strncmp(entry->d_name, prefix.c_str() + 1, prefix.size() - 1) == 0) found.emplace_back(entry->d_name);
    }
    ::closedir(dir);
  }
  return found;
}

struct Outcome {
  std::string report;      // what the rank's body returned ("" = all good)
  bool finished = false;   // the body returned and the process exited normally
  std::string exit;        // how the process ended, when not normally
};

struct RunOptions {
  std::chrono::seconds limit{240};
  // Runs in the parent while the ranks run (e.g. to kill one); gets their pids.
  std::function<void(const std::vector<pid_t>&)> meanwhile;
};

// Forks `world` ranks, each running body(rank) and reporting through a file; waits at most
// `limit` for all of them (SIGKILLs the rest) and returns their outcomes.
inline std::vector<Outcome> run_ranks(int world, const Scratch& scratch, const std::function<std::string(int)>& body, RunOptions options = {}) {
  std::fflush(nullptr);
  std::vector<pid_t> pids(world);
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::string report;
      try {
        report = body(rank);
      } catch (const std::exception& e) {
        report = std::string("uncaught exception: ") + e.what();
      } catch (...) {
        report = "uncaught exception";
      }
      write_file(scratch.folder + "/report-" + std::to_string(rank), report);
      ::_exit(0);
    }
    pids[rank] = pid;
  }
  if (options.meanwhile) options.meanwhile(pids);
  std::vector<Outcome> outcomes(world);
  std::vector<bool> done(world, false);
  const auto deadline = Clock::now() + options.limit;
  for (int remaining = world; remaining > 0;) {
    for (int rank = 0; rank < world; ++rank) {
      if (done[rank]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[rank], &status, WNOHANG);
      if (got == 0) continue;
      done[rank] = true;
      --remaining;
      if (got < 0) {
        outcomes[rank].exit = "already reaped";
      } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        outcomes[rank].finished = true;
      } else {
        outcomes[rank].exit = WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status)) : "exit status " + std::to_string(WEXITSTATUS(status));
      }
    }
    if (remaining == 0) break;
    if (Clock::now() >= deadline) {
      for (int rank = 0; rank < world; ++rank) {
        if (done[rank]) continue;
        ::kill(pids[rank], SIGCONT);
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], nullptr, 0);
        outcomes[rank].exit = "did not finish within the test's limit (killed)";
      }
      break;
    }
    std::this_thread::sleep_for(2ms);
  }
  for (int rank = 0; rank < world; ++rank) {
    const std::string path = scratch.folder + "/report-" + std::to_string(rank);
    if (file_exists(path)) outcomes[rank].report = read_file(path);
  }
  return outcomes;
}

// Every rank finished and reported nothing wrong.
inline void expect_all_good(const std::vector<Outcome>& outcomes) {
  for (std::size_t rank = 0; rank < outcomes.size(); ++rank) {
    EXPECT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit;
    EXPECT_EQ(outcomes[rank].report, "") << "rank " << rank;
  }
}

inline shm::Options test_options() {
  shm::Options options;
  options.timeout = 30s;
  options.chunk_bytes = 64 << 10;  // small, so chunk boundaries are cheap to cross
  options.one_step_bytes = 1 << 10;
  return options;
}

// Deterministic pseudo-random numbers: the same on every rank, for any (seed, rank, index).
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline std::uint64_t random_bits(std::uint64_t seed, int rank, std::size_t index) { return mix(mix(seed * 1000003 + rank) + index); }

inline std::uint64_t fnv1a(const void* data, std::size_t bytes) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ static_cast<const unsigned char*>(data)[i]) * 0x100000001b3ull;
  return hash;
}

// ---- Independent numerics ----------------------------------------------------------------------

// A 16-bit floating value from its bits, by the definition of the format.
inline double decode16(std::uint16_t bits, int mantissa_bits, int bias) {
  const int exponent_bits = 15 - mantissa_bits;
  const bool negative = bits >> 15;
  const int exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  double magnitude;
  if (exponent == (1 << exponent_bits) - 1) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, 1 - bias - mantissa_bits);
  } else {
    magnitude = std::ldexp(mantissa + (1 << mantissa_bits), exponent - bias - mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}
inline double decode_bf16(std::uint16_t bits) { return decode16(bits, 7, 127); }
inline double decode_half(std::uint16_t bits) { return decode16(bits, 10, 15); }

// One unit in the last place of `format` at |x| (mantissa bits, smallest exponent).
inline double ulp(double x, int mantissa_bits, int min_exponent) {
  int exponent = 0;
  std::frexp(std::fabs(x), &exponent);  // |x| = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - mantissa_bits);
}

struct Format {
  shm::DType dtype;
  bool floating;
  int mantissa_bits;  // of the stored format
  int min_exponent;
  double accumulate_epsilon;  // unit roundoff of the type the kernel accumulates in
};

inline const Format kFormats[] = {
    {shm::DType::kFloat32, true, 23, -126, 0x1p-24},  {shm::DType::kFloat64, true, 52, -1022, 0x1p-53},
    {shm::DType::kBFloat16, true, 7, -126, 0x1p-24},  {shm::DType::kFloat16, true, 10, -14, 0x1p-24},
    {shm::DType::kInt32, false, 0, 0, 0},             {shm::DType::kInt64, false, 0, 0, 0},
    {shm::DType::kUInt8, false, 0, 0, 0},
};
inline const shm::Op kOps[] = {shm::Op::kSum, shm::Op::kAvg, shm::Op::kMax, shm::Op::kMin, shm::Op::kProduct};

// Rank `rank`'s element `i` of a test tensor, as the value the test means (double) and as stored.
// Values suit the op: products stay near 1 and integer sums do not overflow (except uint8,
// which wraps on purpose).
struct Element {
  double value;
  std::int64_t integer;
};

inline std::uint16_t random_16bit(std::uint64_t r, int mantissa_bits, int bias, shm::Op op) {
  const std::uint16_t sign = static_cast<std::uint16_t>((r & 1) << 15);
  const std::uint16_t mantissa = static_cast<std::uint16_t>((r >> 1) & ((1u << mantissa_bits) - 1));
  int exponent;
  if (op == shm::Op::kProduct) {
    exponent = bias - 1 + static_cast<int>((r >> 20) % 2);  // [0.5, 2)
  } else if ((r >> 24) % 16 == 0) {
    exponent = 0;  // now and then a subnormal
  } else {
    exponent = bias - 6 + static_cast<int>((r >> 28) % 10);  // [2^-6, 2^4)
  }
  return static_cast<std::uint16_t>(sign | (exponent << mantissa_bits) | mantissa);
}

// Writes rank `rank`'s element i into `out` (typed storage) and returns its meaning.
inline Element make_element(const Format& format, shm::Op op, std::uint64_t seed, int rank, std::size_t i, void* out) {
  const std::uint64_t r = random_bits(seed, rank, i);
  const double unit = static_cast<double>(r >> 11) * 0x1p-53;  // [0, 1)
  switch (format.dtype) {
    case shm::DType::kFloat32: {
      const float v = op == shm::Op::kProduct ? static_cast<float>((r & 1 ? -1 : 1) * (0.5 + 1.5 * unit)) : static_cast<float>(32 * unit - 16);
      static_cast<float*>(out)[i] = v;
      return {v, 0};
    }
    case shm::DType::kFloat64: {
      const double v = op == shm::Op::kProduct ? (r & 1 ? -1 : 1) * (0.5 + 1.5 * unit) : 32 * unit - 16;
      static_cast<double*>(out)[i] = v;
      return {v, 0};
    }
    case shm::DType::kBFloat16: {
      const std::uint16_t bits = random_16bit(r, 7, 127, op);
      static_cast<std::uint16_t*>(out)[i] = bits;
      return {decode_bf16(bits), 0};
    }
    case shm::DType::kFloat16: {
      const std::uint16_t bits = random_16bit(r, 10, 15, op);
      static_cast<std::uint16_t*>(out)[i] = bits;
      return {decode_half(bits), 0};
    }
    case shm::DType::kInt32: {
      const std::int32_t v = op == shm::Op::kProduct ? static_cast<std::int32_t>(r % 7) - 3
                             : op == shm::Op::kSum   ? static_cast<std::int32_t>(r % 2000001) - 1000000
                                                     : static_cast<std::int32_t>(static_cast<std::uint32_t>(r));
      static_cast<std::int32_t*>(out)[i] = v;
      return {0, v};
    }
    case shm::DType::kInt64: {
      const std::int64_t v = op == shm::Op::kProduct ? static_cast<std::int64_t>(r % 7) - 3
                             : op == shm::Op::kSum   ? static_cast<std::int64_t>(r >> 24) - (std::int64_t{1} << 39)
                                                     : static_cast<std::int64_t>(r);
      static_cast<std::int64_t*>(out)[i] = v;
      return {0, v};
    }
    case shm::DType::kUInt8: {
      const std::uint8_t v = static_cast<std::uint8_t>(r);
      static_cast<std::uint8_t*>(out)[i] = v;
      return {0, v};
    }
  }
  return {0, 0};
}

inline double stored_value(const Format& format, const void* data, std::size_t i) {
  switch (format.dtype) {
    case shm::DType::kFloat32: return static_cast<const float*>(data)[i];
    case shm::DType::kFloat64: return static_cast<const double*>(data)[i];
    case shm::DType::kBFloat16: return decode_bf16(static_cast<const std::uint16_t*>(data)[i]);
    case shm::DType::kFloat16: return decode_half(static_cast<const std::uint16_t*>(data)[i]);
    default: return 0;
  }
}

inline std::int64_t stored_integer(const Format& format, const void* data, std::size_t i) {
  switch (format.dtype) {
    case shm::DType::kInt32: return static_cast<const std::int32_t*>(data)[i];
    case shm::DType::kInt64: return static_cast<const std::int64_t*>(data)[i];
    case shm::DType::kUInt8: return static_cast<const std::uint8_t*>(data)[i];
    default: return 0;
  }
}

// The integer reduction in 64-bit two's complement, cast to the type's width like the storage does.
inline std::int64_t wrap(const Format& format, std::uint64_t x) {
  switch (format.dtype) {
    case shm::DType::kInt32: return static_cast<std::int32_t>(static_cast<std::uint32_t>(x));
    case shm::DType::kUInt8: return static_cast<std::uint8_t>(x);
    default: return static_cast<std::int64_t>(x);
  }
}

// Elements [first, last) of `got_data`, the result of reducing the test tensor made with `seed` over
// `world` ranks with `op` (times `scale`), against the reference computed here in double (integers
// in 64 bits), in rank order. Returns "" or the first three elements that differ.
inline std::string compare_with_reference(const Format& format, shm::Op op, std::uint64_t seed, int world, double scale,
                                   const void* got_data, std::size_t first, std::size_t last) {
  std::vector<unsigned char> scratch(std::max<std::size_t>(1, last) * shm::dtype_size(format.dtype));
  std::ostringstream errors;
  int shown = 0;
  for (std::size_t i = first; i < last && shown < 3; ++i) {
    if (format.floating) {
      double reference = 0, magnitude = 0;
      for (int r = 0; r < world; ++r) {
        const double x = make_element(format, op, seed, r, i, scratch.data()).value;
        if (r == 0) {
          reference = x;
        } else if (op == shm::Op::kSum || op == shm::Op::kAvg) {
          reference += x;
        } else if (op == shm::Op::kProduct) {
          reference *= x;
        } else if (op == shm::Op::kMax) {
          reference = std::max(reference, x);
        } else {
          reference = std::min(reference, x);
        }
        magnitude += std::fabs(x);
      }
      if (op == shm::Op::kAvg) {
        reference /= world;
        magnitude /= world;
      }
      reference *= scale;  // one more rounding in the accumulation type, covered by the (world + 1) below
      magnitude *= scale;
      if (op == shm::Op::kProduct) magnitude = std::fabs(reference);
      const double got = stored_value(format, got_data, i);
      // MAX and MIN pick an input exactly. Otherwise: one rounding to the stored format (half a unit
      // in the last place), plus the roundings of accumulating world values (and dividing) in the
      // accumulation type.
      const double rounding = 0.5 * ulp(std::max(std::fabs(reference), std::fabs(got)), format.mantissa_bits, format.min_exponent);
      const double tolerance =
          (op == shm::Op::kMax || op == shm::Op::kMin) ? 0 : rounding + (world + 1) * format.accumulate_epsilon * magnitude;
      if (!(std::fabs(got - reference) <= tolerance)) {
        errors << "  element " << i << ": got " << got << ", reference " << reference << " (tolerance " << tolerance << ")\n";
        ++shown;
      }
    } else {
      std::uint64_t acc = 0;
      std::int64_t extreme = 0;
      for (int r = 0; r < world; ++r) {
        const std::int64_t x = make_element(format, op, seed, r, i, scratch.data()).integer;
        const std::uint64_t u = static_cast<std::uint64_t>(x);
        if (r == 0) {
          acc = u;
          extreme = x;
        } else if (op == shm::Op::kSum) {
          acc += u;
        } else if (op == shm::Op::kProduct) {
          acc *= u;
        } else {
          extreme = op == shm::Op::kMax ? std::max(extreme, x) : std::min(extreme, x);
        }
      }
      const std::int64_t reference = (op == shm::Op::kMax || op == shm::Op::kMin) ? extreme : wrap(format, acc);
      const std::int64_t got = stored_integer(format, got_data, i);
      if (got != reference) {
        errors << "  element " << i << ": got " << got << ", reference " << reference << "\n";
        ++shown;
      }
    }
  }
  return errors.str();
}

// Splits a report into its lines starting with `tag`.
inline std::vector<std::string> lines_with(const std::string& text, const std::string& tag) {
  std::vector<std::string> found;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(tag, 0) == 0) found.push_back(line);
  }
  return found;
}

// One collective's check of one test tensor: check_allreduce, or allreduce_shared's.
using NumericsCheck = std::function<std::string(shm::Communicator& comm, const Format& format, shm::Op op, std::size_t count,
                                                std::uint64_t seed, double scale, std::string& hashes)>;

// Every format and reduction at sizes around one step, 64 bytes per rank and chunks; the floating
// sums also scaled by 1/world (DDP's average). The reports carry the results' hashes, so the parent
// checks that every rank got the same bits.
// `sizes` replaces the sizes (given the element count of 64 bytes per rank).
inline void run_numerics(int world, const NumericsCheck& check,
                  const std::function<std::vector<std::size_t>(std::size_t per_rank_64)>& sizes_of = nullptr) {
  Scratch scratch;
  const auto outcomes = run_ranks(world, scratch, [&](int rank) {
    FileRendezvous rendezvous(scratch.folder);
    const shm::Options options = test_options();
    shm::Communicator comm(rendezvous, scratch.prefix, rank, world, options);
    std::string errors, hashes;
    std::uint64_t seed = 1;
    for (const Format& format : kFormats) {
      const std::size_t element = shm::dtype_size(format.dtype), w = static_cast<std::size_t>(world);
      const std::size_t chunk = options.chunk_bytes / element, one_step = options.one_step_bytes / element;
      const std::size_t parts_of_64 = w * (64 / element);  // every rank's part 64 bytes (allreduce_shared)
      std::vector<std::size_t> sizes = {0, 1, w - 1, one_step - 1, one_step, one_step + 1, parts_of_64 - 1, parts_of_64,
                                        parts_of_64 + 1, chunk - 1, chunk, chunk + 1, 2 * chunk + w, 1000003};
      if (sizes_of) sizes = sizes_of(parts_of_64);
      std::sort(sizes.begin(), sizes.end());
      sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
      for (const shm::Op op : kOps) {
        if (!shm::supported(format.dtype, op)) continue;
        for (const std::size_t count : sizes) errors += check(comm, format, op, count, seed++, 1.0, hashes);
      }
      if (format.floating) {
        for (const std::size_t count : sizes) errors += check(comm, format, shm::Op::kSum, count, seed++, 1.0 / world, hashes);
      }
    }
    return errors + (errors.empty() ? "" : "\n") + hashes;
  });
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit << "\n" << outcomes[rank].report;
    const auto& report = outcomes[rank].report;
    EXPECT_EQ(report.find("HASH "), 0u) << "rank " << rank << " found mismatches:\n" << report.substr(0, report.find("HASH "));
    EXPECT_EQ(lines_with(report, "HASH ").size(), lines_with(outcomes[0].report, "HASH ").size());
    EXPECT_EQ(lines_with(report, "HASH "), lines_with(outcomes[0].report, "HASH ")) << "rank " << rank << " and rank 0 got different bits";
  }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

}  // namespace shm_test
