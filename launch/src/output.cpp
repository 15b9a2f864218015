#include "output.h"

#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <stdexcept>

namespace ddprun {

RankOutput::RankOutput(int rank, int restart, const OutputSettings& settings) : rank_(rank), settings_(settings) {
  if (settings_.log_dir.empty()) return;
  std::error_code ignored;
  std::filesystem::create_directories(settings_.log_dir, ignored);
  log_path_ = settings_.log_dir + "/rank_" + std::to_string(rank) + ".log";
  // Appending keeps the output of earlier attempts next to the restart that followed them.
  log_ = std::fopen(log_path_.c_str(), restart == 0 ? "w" : "a");
  if (log_ == nullptr) throw std::runtime_error("cannot write log file " + log_path_);
  if (restart > 0) std::fprintf(log_, "===== ddprun: restart %d =====\n", restart);
  std::fflush(log_);
}

RankOutput::~RankOutput() {
  finish();
  if (log_ != nullptr) std::fclose(log_);
}

void RankOutput::feed(int stream, const char* data, size_t size) {
  std::string& pending = pending_[stream];
  pending.append(data, size);
  size_t start = 0;
  for (size_t newline; (newline = pending.find('\n', start)) != std::string::npos; start = newline + 1) {
    emit(stream, pending.substr(start, newline - start));
  }
  pending.erase(0, start);
}

void RankOutput::finish() {
  for (int stream : {1, 2}) {
    if (!pending_[stream].empty()) emit(stream, pending_[stream]);
    pending_[stream].clear();
  }
}

void RankOutput::emit(int stream, const std::string& line) {
  tail_.push_back(line);
  if (tail_.size() > kTailLines) tail_.pop_front();
  if (log_ != nullptr) {
    std::fwrite(line.data(), 1, line.size(), log_);
    std::fputc('\n', log_);
    std::fflush(log_);  // a log must be complete even if ddprun is killed
  }
  if (!settings_.tee) return;
  std::string out = settings_.prefix ? "[rank " + std::to_string(rank_) + "] " : std::string();
  out += line;
  out += '\n';
  const int fd = stream == 2 ? STDERR_FILENO : STDOUT_FILENO;
  for (size_t written = 0; written < out.size();) {
    const ssize_t n = write(fd, out.data() + written, out.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // console gone: keep supervising anyway
    written += static_cast<size_t>(n);
  }
}

}  // namespace ddprun
