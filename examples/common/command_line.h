#pragma once
// What the examples' command lines share: one rule per kind of value, and one exit code for a bad
// command line. CLI11's own checks let NaN through (every comparison with NaN is false, so
// Range(1, 10) accepts "nan") and its parse errors exit with CLI11's codes (105, 109, 114, ...);
// here a bad flag exits 2, as ddprun and most Unix tools do, after CLI11 printed what was wrong.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "fashion_mnist.h"

namespace examples {

// The one checked parser of the examples' numbers: the whole text is a number in [lo, hi];
// otherwise "<rule>, got '<text>'" (CLI11 puts the flag in front). CLI11's own conversion, which
// runs after this check, would take "-1" as a huge size_t and 99999999999999999999 as -1.
namespace detail {

// A finite real number as strtod reads it ("1e-3", "2.5"), the whole text ("nan" and "inf" are not).
inline std::optional<double> parse_real(const std::string& text) {
  size_t used = 0;
  try {
    const double value = std::stod(text, &used);
    if (used > 0 && used == text.size() && std::isfinite(value)) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// Decimal digits with an optional '-', the whole text, in range of int64_t ("1.5", "1e3", "+2"
// and "99999999999999999999" are not).
inline std::optional<int64_t> parse_whole(const std::string& text) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc() || stop != end) return std::nullopt;
  return value;
}

template <typename T>
CLI::Validator checked(std::optional<T> (*parse)(const std::string&), T lo, T hi, const std::string& rule,
                       const std::string& kind) {
  return CLI::Validator(
      [parse, lo, hi, rule](std::string& text) -> std::string {
        const std::optional<T> value = parse(text);
        if (value && *value >= lo && *value <= hi) return "";
        return rule + ", got '" + text + "'";
      },
      kind);
}

}  // namespace detail

// A finite number in [lo, hi].
inline CLI::Validator finite_number(double lo, double hi, const std::string& rule) {
  return detail::checked<double>(detail::parse_real, lo, hi, rule, "NUMBER");
}

// A whole number in [lo, hi]: "must be a whole number from <lo> to <hi>[ (<why>)]".
inline CLI::Validator whole_number(int64_t lo, int64_t hi, const std::string& why = "") {
  return detail::checked<int64_t>(detail::parse_whole, lo, hi,
                                  "must be a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) +
                                      (why.empty() ? "" : " (" + why + ")"),
                                  "INT");
}

// The rules of the flags several examples share, one each.
// --epochs and --batch-size: 2^20 is far above any run of these examples and keeps products small.
inline CLI::Validator epochs() { return whole_number(1, 1 << 20); }
inline CLI::Validator batch_size() { return whole_number(1, 1 << 20, "samples per rank"); }
// --seed: any 64-bit seed; PyTorch's generator takes a negative one as 2^64 plus it, and so do we.
inline CLI::Validator seed() {
  return whole_number(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
}
// --limit-train: 0 for the whole training set, else at most its size.
inline CLI::Validator limit_train() {
  return whole_number(0, FashionMNIST::kTrainSamples,
                      "0: all " + std::to_string(FashionMNIST::kTrainSamples) + " training samples");
}
// --timeout: a week bounds a collective's wait; under a second every slow step would fail.
inline CLI::Validator timeout_seconds() {
  return finite_number(1, 86400 * 7, "must be a finite number of seconds from 1 to 604800");
}

// --data-dir: a folder holding the four Fashion-MNIST files, each readable: checked before the job
// starts, not by the reader once every rank has joined.
inline CLI::Validator fashion_mnist_directory() {
  return CLI::Validator(
      [](std::string& dir) -> std::string {
        for (const auto split : {FashionMNIST::Split::kTrain, FashionMNIST::Split::kTest}) {
          for (const std::string& name : {FashionMNIST::images_file(split), FashionMNIST::labels_file(split)}) {
            const std::string path = dir + "/" + name;
            if (access(path.c_str(), R_OK) != 0) {
              return "cannot read '" + path + "' (" + std::strerror(errno) + "); " + FashionMNIST::kWhereToGetIt;
            }
          }
        }
        return "";
      },
      "DIR");
}

// The CPUs this process may run on (its affinity mask: what taskset, cgroups' cpusets and Slurm
// give it), at least 1.
inline int usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// --threads: 1 to 4 x the usable CPUs. Threads beyond the CPUs only take turns on them; the factor
// leaves room to try oversubscription, while 100000 (thousands of OS threads per rank) is refused.
inline CLI::Validator thread_count() {
  const int cpus = usable_cpus();
  return whole_number(1, 4 * cpus,
                      "4 x the " + std::to_string(cpus) +
                          " CPUs this process may run on: more threads than CPUs only take turns");
}

// --checkpoint-dir: a directory that exists or is created now, and that this process may write
// in: checked before the job starts, not when the first epoch's checkpoint is saved.
inline CLI::Validator writable_directory() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        std::error_code error;
        if (std::filesystem::exists(path, error) && !std::filesystem::is_directory(path, error)) {
          return "'" + path + "' exists and is not a directory: name a directory for the checkpoints";
        }
        std::filesystem::create_directories(path, error);
        if (error) {
          return "cannot create the directory '" + path + "': " + error.message() +
                 " (name a directory this user may create)";
        }
        if (access(path.c_str(), W_OK | X_OK) != 0) {
          return "cannot write in '" + path + "': " + std::strerror(errno) +
                 " (name a directory this user may write in)";
        }
        return "";
      },
      "DIR");
}

// --init-method: one of the forms ddp::init_process_group takes, env://, tcp://HOST:PORT or
// file:///PATH; refused here rather than once the job has started.
inline CLI::Validator init_method() {
  return CLI::Validator(
      [](std::string& url) -> std::string {
        const auto starts = [&url](const char* scheme) { return url.rfind(scheme, 0) == 0; };
        if (starts("env://")) return "";
        if (starts("file://") && url.size() > 7) return "";
        if (starts("tcp://")) {
          const size_t colon = url.rfind(':');  // the port's; "tcp://" has its own at 3
          const auto port = detail::parse_whole(url.substr(colon + 1));
          if (colon > 6 && port && *port >= 1 && *port <= 65535) return "";
        }
        return "must be env://, tcp://HOST:PORT (a port from 1 to 65535) or file:///PATH, got '" + url + "'";
      },
      "URL");
}

// Parses the command line. Returns the code to exit with now (0 after --help; 2 for a bad command
// line, CLI11 having printed why and "Run with --help"), or nothing when the program should run.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace examples
