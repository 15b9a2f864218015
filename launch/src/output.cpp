#include "output.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <stdexcept>

namespace ddprun {
namespace {

// The console all ranks share: which rank's progress line is on screen, unfinished (-1: none).
struct Console {
  int open_progress = -1;
  bool is_terminal[3] = {false, isatty(STDOUT_FILENO) != 0, isatty(STDERR_FILENO) != 0};
};
Console& console() {
  static Console instance;
  return instance;
}

// What a terminal shows of text with carriage returns: the part after the last "\r" that is not
// empty, without erase-to-end-of-line sequences.
std::string as_shown(const std::string& text) {
  std::string shown = text;
  for (size_t cr = shown.rfind('\r'); cr != std::string::npos; cr = shown.rfind('\r')) {
    if (cr + 1 < shown.size()) {
      shown.erase(0, cr + 1);
      break;
    }
    shown.erase(cr);  // a trailing "\r": the text before it is what stays on screen
  }
  for (size_t at; (at = shown.find("\033[K")) != std::string::npos;) shown.erase(at, 3);
  return shown;
}

void write_all(int fd, const std::string& out) {
  for (size_t written = 0; written < out.size();) {
    const ssize_t n = write(fd, out.data() + written, out.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // console gone: keep supervising anyway
    written += static_cast<size_t>(n);
  }
}

}  // namespace

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
  if (pending.find('\r') != std::string::npos) show_progress(stream, as_shown(pending));
}

void RankOutput::show_progress(int stream, const std::string& text) {
  Console& screen = console();
  if (!settings_.tee || !screen.is_terminal[stream] || text.empty()) return;
  const std::string prefix = settings_.prefix ? "[rank " + std::to_string(rank_) + "] " : std::string();
  // Another rank's unfinished progress line stays as it was; this one starts below it.
  const std::string start = screen.open_progress >= 0 && screen.open_progress != rank_ ? "\n" : "\r";
  write_all(stream == 2 ? STDERR_FILENO : STDOUT_FILENO, start + prefix + text + "\033[K");
  screen.open_progress = rank_;
}

void RankOutput::finish() {
  for (int stream : {1, 2}) {
    if (!pending_[stream].empty()) emit(stream, pending_[stream]);
    pending_[stream].clear();
  }
}

void RankOutput::emit(int stream, const std::string& raw) {
  const std::string line = as_shown(raw);
  tail_.push_back(line);
  if (tail_.size() > kTailLines) tail_.pop_front();
  if (log_ != nullptr) {
    std::fwrite(line.data(), 1, line.size(), log_);
    std::fputc('\n', log_);
    std::fflush(log_);  // a log must be complete even if ddprun is killed
  }
  if (!settings_.tee) return;
  Console& screen = console();
  std::string out;
  if (screen.open_progress >= 0) {
    // This rank's own progress line is replaced by the line; another rank's is left above it.
    out = screen.open_progress == rank_ ? "\r" : "\n";
    screen.open_progress = -1;
  }
  out += settings_.prefix ? "[rank " + std::to_string(rank_) + "] " : std::string();
  out += line;
  out += screen.is_terminal[stream] && out.front() == '\r' ? "\033[K\n" : "\n";
  write_all(stream == 2 ? STDERR_FILENO : STDOUT_FILENO, out);
}

void pump(int& fd, int stream, RankOutput& output) {
  char buffer[65536];
  while (fd >= 0) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      output.feed(stream, buffer, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      close(fd);
      fd = -1;
    } else if (errno == EAGAIN) {
      return;
    }
  }
}

void drain(int& stdout_fd, int& stderr_fd, RankOutput& output, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while ((stdout_fd >= 0 || stderr_fd >= 0) && std::chrono::steady_clock::now() < deadline) {
    pollfd fds[2] = {{stdout_fd, POLLIN, 0}, {stderr_fd, POLLIN, 0}};
    poll(fds, 2, 20);
    pump(stdout_fd, 1, output);
    pump(stderr_fd, 2, output);
  }
  for (int* fd : {&stdout_fd, &stderr_fd}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
  output.finish();
}

}  // namespace ddprun
