#include "ddp/engine/src/observe/timeline.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include <ddp/logging.h>

namespace ddp::detail {
namespace {

std::mutex g_open_mutex;
std::unique_ptr<Timeline> g_timeline;  // destroyed at exit: completes the file
bool g_tried = false;

// trace.json -> trace.rank<r>.json beside it. A directory (an existing one, or a path ending in
// '/') gets <dir>/timeline.rank<r>.json inside it: what a user naming a folder expects (PyTorch's
// profiler trace handler takes a folder the same way), not a sibling file or a hidden ".rank0.json".
std::string rank_path(std::string path, int rank) {
  std::error_code error;
  if (path.back() == '/' || std::filesystem::is_directory(path, error)) {
    if (path.back() != '/') path += '/';
    path += "timeline";
  }
  const std::string suffix = ".json";
  if (path.size() > suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    path.resize(path.size() - suffix.size());
  }
  return path + ".rank" + std::to_string(rank) + suffix;
}

// Names of strings we write ourselves (span names, row names): only quotes and backslashes to escape.
std::string quoted(const char* text) {
  std::string out = "\"";
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c == '"' || *c == '\\') out += '\\';
    out += *c;
  }
  return out + "\"";
}

}  // namespace

Timeline* Timeline::get() {
  std::lock_guard<std::mutex> lock(g_open_mutex);
  return g_timeline.get();
}

Timeline* Timeline::open_for_rank(int rank) {
  std::lock_guard<std::mutex> lock(g_open_mutex);
  if (g_tried) return g_timeline.get();
  g_tried = true;
  const char* base = std::getenv("TORCHDDP_TIMELINE");
  if (base == nullptr || *base == '\0') return nullptr;
  const std::string path = rank_path(base, rank);
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    std::cerr << "torchddp: TORCHDDP_TIMELINE: cannot write " << path << "; no timeline is recorded\n";
    return nullptr;
  }
  g_timeline = std::make_unique<Timeline>(file, path, rank);
  return g_timeline.get();
}

Timeline::Timeline(std::FILE* file, std::string path, int rank) : file_(file), path_(std::move(path)), rank_(rank) {
  std::fprintf(file_, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  std::fprintf(file_, "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": \"rank %d\"}}",
               rank_, rank_);
  const std::pair<Row, const char*> rows[] = {{kTraining, "training (forward, backward, wait)"},
                                              {kBucketFill, "gradient buckets filling"},
                                              {kCommunication, "bucket reductions (launch to done)"},
                                              {kProgram, "program (TimelineSpan)"}};
  for (const auto& [row, name] : rows) {
    std::fprintf(file_, ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": %s}}",
                 rank_, static_cast<int>(row), quoted(name).c_str());
  }
}

void Timeline::span(Row row, const char* name, int64_t start_ns, int64_t end_ns, const std::string& args_json) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::fprintf(file_, ",\n{\"ph\": \"X\", \"name\": %s, \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, \"args\": {%s}}",
               quoted(name).c_str(), rank_, static_cast<int>(row), start_ns / 1000.0,
               (end_ns > start_ns ? end_ns - start_ns : 0) / 1000.0, args_json.c_str());
}

void Timeline::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::fflush(file_);
}

Timeline::~Timeline() {
  std::fprintf(file_, "\n]}\n");
  std::fclose(file_);
}

}  // namespace ddp::detail

namespace ddp {

TimelineSpan::TimelineSpan(std::string name) : name_(std::move(name)) {
  if (detail::Timeline::get() != nullptr) start_ns_ = detail::now_ns();
}

TimelineSpan::~TimelineSpan() {
  if (start_ns_ < 0) return;
  if (auto* timeline = detail::Timeline::get()) {
    timeline->span(detail::Timeline::kProgram, name_.c_str(), start_ns_, detail::now_ns());
  }
}

}  // namespace ddp
