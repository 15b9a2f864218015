#pragma once
// The TORCHDDP_TIMELINE trace of this process: Chrome's JSON trace format ({"traceEvents": [...]}
// with "X" complete events, microseconds), one file per rank, opened by the first DDP model that
// finds the variable set, completed when the process exits normally (Perfetto and chrome://tracing
// also open a file cut short by a crash).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace ddp::detail {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Timeline {
 public:
  // The rows of the trace (Chrome calls them threads).
  enum Row { kTraining = 1, kBucketFill = 2, kCommunication = 3, kProgram = 4 };

  // This process's timeline; null when TORCHDDP_TIMELINE is unset or its file could not be opened
  // (said once on stderr).
  static Timeline* get();
  // The first call with TORCHDDP_TIMELINE set opens "<path>.rank<rank>.json" (a trailing ".json"
  // of the path is kept last) and returns it; later calls return the same timeline.
  static Timeline* open_for_rank(int rank);

  // One span on `row`. `args_json` (optional) is the body of a JSON object: "\"bucket\": 3".
  void span(Row row, const char* name, int64_t start_ns, int64_t end_ns, const std::string& args_json = {});
  void flush();
  const std::string& path() const { return path_; }

  Timeline(std::FILE* file, std::string path, int rank);
  ~Timeline();  // completes the JSON

 private:
  std::mutex mutex_;
  std::FILE* file_;
  std::string path_;
  int rank_;
};

}  // namespace ddp::detail
