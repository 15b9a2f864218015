#include "output.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace ddprun {
namespace {

// The console all ranks share, and its one live line: the latest progress redraw of any rank,
// unfinished, at the bottom of the screen.
struct Console {
  bool is_terminal[3] = {false, isatty(STDOUT_FILENO) != 0, isatty(STDERR_FILENO) != 0};
  int live_rank = -1;     // whose redraw is on the live line (-1: no live line)
  int live_stream = 0;    // the rank's stream it came from, and ddprun's it is drawn on
  std::string live_text;  // as drawn: prefix and text
};
Console& console() {
  static Console instance;
  return instance;
}

// Off a terminal, how long a progress line may stay unfinished before its state is written as a
// line, and how often again while it changes: soon enough to see a rank moving, rare enough that
// an hour-long bar is a few hundred lines, and none for a burst of redraws that ends its line
// within the second.
constexpr auto kFirstSnapshot = std::chrono::seconds(1);
constexpr auto kSnapshotEvery = std::chrono::seconds(10);

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

// Opens a rank's log without following a link another user could have planted there: the file is
// a regular file of ours with one name, or it is refused (O_NONBLOCK: a planted FIFO cannot block).
FILE* open_log(const std::string& path, bool truncate) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | (truncate ? 0 : O_APPEND),
                      0666);
  if (fd < 0) {
    throw std::runtime_error("cannot write log file " + path + ": " +
                             (errno == ELOOP ? std::string("it is a symbolic link, which ddprun does not follow")
                                             : std::string(strerror(errno))));
  }
  struct stat info {};
  if (fstat(fd, &info) != 0 || !S_ISREG(info.st_mode) || info.st_uid != geteuid() || info.st_nlink != 1) {
    close(fd);
    throw std::runtime_error("cannot write log file " + path +
                             ": it is not a regular file of this user with a single name (remove it, or pick another "
                             "--log-dir)");
  }
  if (truncate) (void)!ftruncate(fd, 0);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fdopen(fd, truncate ? "w" : "a");
}

}  // namespace

RankOutput::RankOutput(int rank, int restart, const OutputSettings& settings) : rank_(rank), settings_(settings) {
  if (settings_.log_dir.empty()) return;
  std::error_code ignored;
  std::filesystem::create_directories(settings_.log_dir, ignored);
  log_path_ = settings_.log_dir + "/rank_" + std::to_string(rank) + ".log";
  // Appending keeps the output of earlier attempts next to the restart that followed them.
  log_ = open_log(log_path_, restart == 0);
  if (restart > 0) std::fprintf(log_, "===== ddprun: restart %d =====\n", restart);
  std::fflush(log_);
}

RankOutput::~RankOutput() {
  finish();
  if (log_ != nullptr) std::fclose(log_);
}

bool console_is_terminal(int stream) { return console().is_terminal[stream]; }

void RankOutput::feed(int stream, const char* data, size_t size) {
  std::string& pending = pending_[stream];
  pending.append(data, size);
  size_t start = 0;
  for (size_t newline; (newline = pending.find('\n', start)) != std::string::npos; start = newline + 1) {
    end_line(stream, pending.substr(start, newline - start));
  }
  pending.erase(0, start);
  if (pending.find('\r') == std::string::npos) return;  // a plain partial line waits for its "\n"
  const std::string shown = as_shown(pending);
  show_progress(stream, shown);
  // Only what a terminal shows is kept (and a final "\r", after which the next text replaces it),
  // so a bar redrawn for an hour without a newline neither grows nor is rescanned in full per read.
  pending = "\r" + shown + (pending.back() == '\r' ? "\r" : "");
  if (shows_live(stream)) return;
  Unfinished& progress = unfinished_[stream];
  if (!progress.started) {
    progress.started = true;
    progress.since = Clock::now();
  }
  snapshot_if_due(stream);  // a bar redrawn without pause gets its snapshots here, not from tick()
}

void RankOutput::tick() {
  for (int stream : {1, 2}) {
    if (unfinished_[stream].started) snapshot_if_due(stream);
  }
}

bool RankOutput::shows_live(int stream) const { return settings_.tee && console().is_terminal[stream]; }

void RankOutput::snapshot_if_due(int stream) {
  Unfinished& progress = unfinished_[stream];
  const std::string shown = as_shown(pending_[stream]);
  if (shown.empty() || shown == progress.snapshot) return;  // erased, or written already
  const auto now = Clock::now();
  const bool due = progress.snapshot.empty() ? now - progress.since >= kFirstSnapshot
                                             : now - progress.snapshot_at >= kSnapshotEvery;
  if (!due) return;
  emit(stream, shown);
  progress.snapshot = shown;
  progress.snapshot_at = now;
}

std::string RankOutput::prefix() const {
  return settings_.prefix ? "[rank " + std::to_string(rank_) + "] " : std::string();
}

void RankOutput::show_progress(int stream, const std::string& text) {
  Console& screen = console();
  if (!shows_live(stream)) return;
  const bool ours = screen.live_rank == rank_ && screen.live_stream == stream;
  if (text.empty()) {
    // The rank erased its progress line ("\r\033[K"): so does the console.
    if (ours) {
      write_all(stream == 2 ? STDERR_FILENO : STDOUT_FILENO, "\r\033[K");
      screen.live_rank = -1;
    }
    return;
  }
  const std::string drawn = prefix() + text;
  if (ours && screen.live_text == drawn) return;  // unchanged
  // "\r" returns to the start of the live line (this rank's or another's), "\033[K" erases what is
  // left of a longer one.
  write_all(stream == 2 ? STDERR_FILENO : STDOUT_FILENO, "\r" + drawn + "\033[K");
  screen.live_rank = rank_;
  screen.live_stream = stream;
  screen.live_text = drawn;
}

// The rank's last text without a "\n" is printed as a line of its own (not lost), unless all a
// terminal would show of it is nothing (a progress line the rank erased as it ended).
void RankOutput::finish() {
  for (int stream : {1, 2}) {
    if (!as_shown(pending_[stream]).empty()) end_line(stream, pending_[stream]);
    pending_[stream].clear();
    unfinished_[stream] = Unfinished{};
  }
}

// A line the rank ended: written, unless a snapshot already wrote exactly what it shows.
void RankOutput::end_line(int stream, const std::string& raw) {
  const std::string written = unfinished_[stream].snapshot;
  unfinished_[stream] = Unfinished{};
  if (written.empty() || as_shown(raw) != written) emit(stream, raw);
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
  const int fd = stream == 2 ? STDERR_FILENO : STDOUT_FILENO;
  // Off a terminal (or with no live line) a line is just written, one write() per line.
  if (screen.live_rank < 0 || !screen.is_terminal[stream]) {
    write_all(fd, prefix() + line + "\n");
    return;
  }
  // The line takes the live line's place on screen ("\033[K" erases the rest of it).
  write_all(fd, "\r" + prefix() + line + "\033[K\n");
  if (screen.live_rank == rank_ && screen.live_stream == stream) {
    screen.live_rank = -1;  // this line is how the rank ended its own progress line
  } else {
    // Another rank's (or stream's) progress line is still going: draw it again below.
    write_all(screen.live_stream == 2 ? STDERR_FILENO : STDOUT_FILENO, screen.live_text + "\033[K");
  }
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
