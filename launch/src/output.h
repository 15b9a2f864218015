#pragma once
// One rank's output: split into lines, copied to the console with a "[rank N] " prefix (one
// write() per line, so lines of different ranks never interleave mid-line), appended to the
// rank's log file, and its last lines kept for the failure report.
//
// Progress lines ("\r" redraws without a newline, like a progress bar): a line is what a terminal
// would end up showing, the text after its last "\r" (so a bar redrawn 1,000 times is one line, not
// one 4,000-character line). On a terminal the redraws are also shown as they arrive: the text
// after a "\r" as soon as it comes (a "\r"-ended segment at once, and a redraw that starts with
// "\r", as printf("\rstep %d", k) does, without waiting for the next one), drawn as
// "\r[rank N] text" over the console's one live line at the bottom. Every rank's redraws share
// that line (the latest wins); whole lines of any rank are printed above it and the live line is
// drawn again below them, so lines never mix. Text with no "\r" before it waits for its "\n".
// Where the redraws are not shown live (the console is a pipe or a file, or --no-tee), a progress
// line still unfinished 1 s after it began is written as a whole line of its current state (a
// snapshot), and again every 10 s while it changes: a rank whose bar never ends its line is seen
// progressing in a log or CI output, not only at its exit. The line that ends it is not repeated
// when it shows what the last snapshot did.
// At the rank's exit, text without a final "\n" is printed as a line of its own (finish()).
#include <chrono>
#include <cstdio>
#include <deque>
#include <string>

namespace ddprun {

struct OutputSettings {
  bool tee = true;
  bool prefix = true;
  std::string log_dir;  // empty: no log files
};

class RankOutput {
 public:
  static constexpr size_t kTailLines = 20;

  RankOutput(int rank, int restart, const OutputSettings& settings);
  ~RankOutput();
  RankOutput(const RankOutput&) = delete;
  RankOutput& operator=(const RankOutput&) = delete;

  // Bytes read from the rank's stdout (stream 1) or stderr (stream 2).
  void feed(int stream, const char* data, size_t size);
  // Writes the snapshot of a progress line that is due (see above); called by the loops that
  // read the ranks at least every few hundred milliseconds, as a rank that sleeps sends nothing.
  void tick();
  // Emits a last line that had no newline (at the rank's exit).
  void finish();
  const std::deque<std::string>& tail() const { return tail_; }
  const std::string& log_path() const { return log_path_; }

 private:
  void end_line(int stream, const std::string& raw);
  void emit(int stream, const std::string& line);
  bool shows_live(int stream) const;
  void show_progress(int stream, const std::string& text);
  void snapshot_if_due(int stream);
  std::string prefix() const;

  using Clock = std::chrono::steady_clock;
  // A progress line not shown live, per stream: when its first redraw came, and its last snapshot.
  struct Unfinished {
    bool started = false;
    Clock::time_point since;
    Clock::time_point snapshot_at;
    std::string snapshot;  // as written; empty: none yet
  };

  int rank_;
  OutputSettings settings_;
  std::string pending_[3];  // partial line per stream
  Unfinished unfinished_[3];
  std::deque<std::string> tail_;
  std::string log_path_;
  FILE* log_ = nullptr;
};

// Whether ddprun's stdout (stream 1) or stderr (stream 2) is a terminal, where redraws are shown live.
bool console_is_terminal(int stream);

// Feeds `output` whatever the non-blocking pipe `fd` holds (stream 1 or 2); closes it and sets
// it to -1 at EOF.
void pump(int& fd, int stream, RankOutput& output);

// A finished process's last output from its stdout/stderr pipes, then closes them and finishes
// `output`. Bounded by `limit`: a helper that escaped the process group may hold a pipe open.
void drain(int& stdout_fd, int& stderr_fd, RankOutput& output, std::chrono::milliseconds limit);

}  // namespace ddprun
