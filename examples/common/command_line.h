#pragma once
// What the examples' command lines share: one rule per kind of value, and one exit code for a bad
// command line. CLI11's own checks let NaN through (every comparison with NaN is false, so
// Range(1, 10) accepts "nan") and its parse errors exit with CLI11's codes (105, 109, 114, ...);
// here a bad flag exits 2, as ddprun and most Unix tools do, after CLI11 printed what was wrong.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

namespace examples {

// A finite number in [lo, hi]; otherwise "<rule>, got '<text>'" (CLI11 puts the flag in front).
inline CLI::Validator finite_number(double lo, double hi, const std::string& rule) {
  return CLI::Validator(
      [lo, hi, rule](std::string& text) -> std::string {
        size_t used = 0;
        double value = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used > 0 && used == text.size() && std::isfinite(value) && value >= lo && value <= hi) return "";
        return rule + ", got '" + text + "'";
      },
      "NUMBER");
}

// > 0 and finite: "inf" as a learning rate trains to NaN, "nan" passes any "> 0" written backwards.
inline CLI::Validator positive() {
  return finite_number(std::numeric_limits<double>::denorm_min(), std::numeric_limits<double>::max(),
                       "must be a finite number above 0");
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
  return finite_number(1, 4.0 * cpus,
                       "must be a whole number from 1 to " + std::to_string(4 * cpus) + " (4 x the " +
                           std::to_string(cpus) +
                           " CPUs this process may run on: more threads than CPUs only take turns)");
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
