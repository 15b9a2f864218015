#include "supervisor.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "output.h"
#include "process.h"
#include "signals.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

struct Rank {
  int global = 0;
  Child child;
  std::unique_ptr<RankOutput> output;
};

class Round {
 public:
  Round(const Options& options, const RoundInfo& info, int round, Rendezvous& rendezvous)
      : options_(options), info_(info), round_(round), rendezvous_(rendezvous) {}

  RoundResult run() {
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      const auto& shown = options_.console_ranks;
      const bool on_console =
          options_.tee && (shown.empty() || std::find(shown.begin(), shown.end(), local) != shown.end());
      const OutputSettings settings{on_console, options_.prefix, options_.log_dir};
      Rank rank;
      rank.global = info_.rank_offset + local;
      try {
        rank.output = std::make_unique<RankOutput>(rank.global, round_, settings);
      } catch (const std::exception& error) {  // its log file: the ranks started so far are stopped
        return fail(RoundResult::kCouldNotStart, "rank " + std::to_string(rank.global) + ": " + error.what(), -1);
      }
      try {
        rank.child = spawn(options_.program_path, options_.command,
                           rank_environment(options_, info_, local, round_));
      } catch (const std::exception& error) {
        ranks_.push_back(std::move(rank));
        return fail(RoundResult::kCouldNotStart, "rank " + std::to_string(info_.rank_offset + local) + ": " + error.what(),
                    ranks_.size() - 1);
      }
      ranks_.push_back(std::move(rank));
    }

    auto next_peer_check = Clock::now();
    // Woken at least twice a second whatever --monitor-interval says: a rank that sleeps with its
    // progress line unfinished sends nothing, and its snapshot (output.h) is due all the same.
    const auto wake_every = std::min(std::chrono::milliseconds(static_cast<long long>(options_.monitor_interval_s * 1000)),
                                     std::chrono::milliseconds(500));
    while (true) {
      wait_for_activity(wake_every);
      for (auto& rank : ranks_) rank.output->tick();
      if (const int signal = stop_signal()) {
        RoundResult result = fail(RoundResult::kInterrupted, "ddprun received signal " + std::to_string(signal), -1,
                                  signal);
        return result;
      }
      bool all_done = true;
      for (size_t i = 0; i < ranks_.size(); ++i) {
        Rank& rank = ranks_[i];
        reap_if_exited(rank.child);
        if (rank.child.running) {
          all_done = false;
        } else if (!rank.child.status.ok()) {
          drain(rank, std::chrono::milliseconds(200));
          // A rank often dies *because* another node failed first (its peers vanished): name
          // that first failure, which is already in the store, rather than this cascade.
          if (options_.nnodes > 1) {
            if (auto why = rendezvous_.peer_failure(round_)) return fail(RoundResult::kPeerFailed, *why, -1);
          }
          return fail(RoundResult::kRankFailed,
                      "rank " + std::to_string(rank.global) + " (local rank " + std::to_string(i) + " on node " +
                          std::to_string(options_.node_rank) + ", pid " + std::to_string(rank.child.pid) + ") " +
                          rank.child.status.describe(),
                      i);
        }
      }
      if (all_done) {
        for (auto& rank : ranks_) drain(rank, std::chrono::milliseconds(200));
        return {};
      }
      if (options_.nnodes > 1 && Clock::now() >= next_peer_check) {
        next_peer_check = Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.monitor_interval_s * 1000));
        if (auto why = rendezvous_.peer_failure(round_)) return fail(RoundResult::kPeerFailed, *why, -1);
      }
    }
  }

 private:
  // Sleeps until output arrives, a signal (SIGCHLD included) comes, or the timeout passes.
  void wait_for_activity(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds{{wake_fd(), POLLIN, 0}};
    std::vector<std::pair<int*, std::pair<int, RankOutput*>>> sources;
    for (auto& rank : ranks_) {
      for (auto [fd, stream] : {std::pair{&rank.child.stdout_fd, 1}, std::pair{&rank.child.stderr_fd, 2}}) {
        if (*fd < 0) continue;
        fds.push_back({*fd, POLLIN, 0});
        sources.push_back({fd, {stream, rank.output.get()}});
      }
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) <= 0) return;
    if (fds[0].revents != 0) drain_wakeups();
    for (size_t i = 0; i < sources.size(); ++i) {
      if (fds[i + 1].revents != 0) pump(*sources[i].first, sources[i].second.first, *sources[i].second.second);
    }
  }

  // Collects a finished rank's last output (bounded, see output.h).
  void drain(Rank& rank, std::chrono::milliseconds limit) {
    ddprun::drain(rank.child.stdout_fd, rank.child.stderr_fd, *rank.output, limit);
  }

  RoundResult fail(RoundResult::Outcome outcome, const std::string& reason, long failed_index, int signal = 0) {
    RoundResult result;
    result.outcome = outcome;
    result.reason = reason;
    result.signal = signal;
    if (outcome == RoundResult::kRankFailed || outcome == RoundResult::kCouldNotStart) rendezvous_.report_failure(round_, "node " + std::to_string(options_.node_rank) + ": " + reason);
    stop_all(signal == 0 ? SIGTERM : signal);
    if (failed_index >= 0) {
      result.tail = ranks_[failed_index].output->tail();
      result.log_path = ranks_[failed_index].output->log_path();
    }
    return result;
  }

  // Polite stop, then a forced one; returns once every rank is reaped.
  void stop_all(int signal) {
    for (auto& rank : ranks_) signal_group(rank.child, signal);
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<long long>(options_.grace_period_s * 1000));
    bool forced = false;
    while (true) {
      bool running = false;
      for (auto& rank : ranks_) running |= !reap_if_exited(rank.child) && rank.child.running;
      if (!running) break;
      if (!forced && Clock::now() >= deadline) {
        for (auto& rank : ranks_) signal_group(rank.child, SIGKILL);
        forced = true;
      }
      wait_for_activity(std::chrono::milliseconds(20));
    }
    for (auto& rank : ranks_) drain(rank, std::chrono::milliseconds(100));
  }

  const Options& options_;
  const RoundInfo& info_;
  int round_;
  Rendezvous& rendezvous_;
  std::vector<Rank> ranks_;
};

}  // namespace

// A rank's stdout is a pipe to ddprun, which C's stdio buffers in 4 KiB blocks: printf output
// would arrive in bursts (two epochs at once, the last at exit), and a "\r" progress line not
// before its line ends. coreutils' libstdbuf (what `stdbuf -o0`/`stdbuf -oL` preload) sets stdout's
// buffering as the program starts; std::cout follows, as it writes through stdio (synced with it
// unless the program calls std::ios::sync_with_stdio(false)).
// - ddprun's stdout is a terminal: unbuffered, so every "\r" redraw reaches ddprun when it is
//   printed, flushed or not, and is shown live (output.h); lines are still relayed whole.
// - otherwise line-buffered, as on a terminal: off a terminal a redraw only counts once its line
//   ends, and one write() per line costs less than one per printf.
// Why a preload and not a pseudo-terminal per rank: a pty would make isatty(1) true in the rank
// (programs change behaviour: colours, their own progress bars), merge its stdout and stderr,
// translate "\n" to "\r\n" unless put in raw mode, and still leave stdout line-buffered, so an
// unflushed redraw would still wait for its newline.
// Left as it is with --keep-output-buffering, when _STDBUF_O is set already (the user's choice) or
// without libstdbuf (then `note` says so). Statically linked programs ignore the preload.
StdoutBuffering stdout_buffering(const Options& options) {
  static const char* const kLibstdbuf[] = {"/usr/libexec/coreutils/libstdbuf.so", "/usr/lib/coreutils/libstdbuf.so"};
  StdoutBuffering buffering;
  if (options.keep_output_buffering || std::getenv("_STDBUF_O") != nullptr) return buffering;
  for (const char* path : kLibstdbuf) {
    if (access(path, R_OK) != 0) continue;
    buffering.libstdbuf = path;
    buffering.mode = console_is_terminal(1) ? "0" : "L";
    return buffering;
  }
  buffering.note = "coreutils' libstdbuf is not installed: the ranks' stdout stays block-buffered, so printf "
                   "output arrives in 4 KiB bursts unless the program flushes it (--keep-output-buffering "
                   "silences this note)";
  return buffering;
}

bool sets_omp_num_threads(const Options& options) {
  return options.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
}

std::vector<std::string> rank_environment(const Options& options, const RoundInfo& info, int local_rank, int round) {
  const std::map<std::string, std::string> ours{
      {"RANK", std::to_string(info.rank_offset + local_rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(info.world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(options.nnodes)},
      {"MASTER_ADDR", info.master_addr},
      {"MASTER_PORT", std::to_string(info.master_port)},
      {"DDPRUN_RESTART_COUNT", std::to_string(round)},
      {"TORCHDDP_RUN_ID", info.run_id},
      {"DDPRUN_MAX_RESTARTS", std::to_string(options.max_restarts)},
  };
  std::vector<std::string> env;
  for (const auto& entry : current_environment()) {
    const std::string name = entry.substr(0, entry.find('='));
    if (ours.count(name) == 0 && name != "DDPRUN_TERMINAL") env.push_back(entry);
  }
  for (const auto& [name, value] : ours) env.push_back(name + "=" + value);
  if (sets_omp_num_threads(options)) env.push_back("OMP_NUM_THREADS=1");
  const StdoutBuffering buffering = stdout_buffering(options);
  if (!buffering.mode.empty()) {
    // Ours goes first in LD_PRELOAD; a preload the user had stays after it.
    const char* preload = std::getenv("LD_PRELOAD");
    env.erase(std::remove_if(env.begin(), env.end(), [](const std::string& e) { return e.rfind("LD_PRELOAD=", 0) == 0; }),
              env.end());
    env.push_back("LD_PRELOAD=" + buffering.libstdbuf + (preload && *preload ? std::string(":") + preload : ""));
    env.push_back("_STDBUF_O=" + buffering.mode);
    // The rank's isatty(1) is false (a pipe to ddprun), but its "\r" redraws reach a terminal live:
    // tell it, so a program that draws a progress bar only on a terminal can draw it here too.
    if (buffering.mode == "0") env.push_back("DDPRUN_TERMINAL=1");
  }
  return env;
}

RoundResult run_round(const Options& options, const RoundInfo& info, int round, Rendezvous& rendezvous) {
  return Round(options, info, round, rendezvous).run();
}

}  // namespace ddprun
