#pragma once
// One attempt ("round") of the job on this node: start every local rank, relay their output,
// and watch them. The first rank that fails (or a failure on another node, or a stop signal)
// stops all the others: SIGTERM to each rank's process group, SIGKILL after the grace period.
#include <deque>
#include <string>
#include <vector>

#include "options.h"
#include "rendezvous.h"

namespace ddprun {

struct RoundResult {
  // kCouldNotStart: the program could not be executed at all (exec failed): no restart helps.
  enum Outcome { kSucceeded, kRankFailed, kCouldNotStart, kPeerFailed, kInterrupted } outcome = kSucceeded;
  std::string reason;             // one line: what failed
  std::deque<std::string> tail;   // last output lines of the failed rank
  std::string log_path;           // its log file, when --log-dir is set
  int signal = 0;                 // for kInterrupted
};

RoundResult run_round(const Options& options, const RoundInfo& info, int round, Rendezvous& rendezvous);

// Whether ddprun sets OMP_NUM_THREADS=1 for the ranks: with more than one rank per node and the
// variable unset (several ranks each using every core oversubscribe the machine; torchrun does
// the same). The one place this is decided.
bool sets_omp_num_threads(const Options& options);

// How the ranks' stdout is buffered: coreutils' libstdbuf preloaded with _STDBUF_O=`mode` ("0"
// unbuffered when ddprun's stdout is a terminal, "L" line-buffered otherwise), or, with `mode`
// empty, the C library's default (block-buffered on a pipe). The one place this is decided; why in
// supervisor.cpp. `note`, when not empty, is what ddprun says once about it (libstdbuf missing).
struct StdoutBuffering {
  std::string mode;
  std::string libstdbuf;  // the library's path when `mode` is set
  std::string note;
};
StdoutBuffering stdout_buffering(const Options& options);

// The environment each rank starts with: ours plus torchrun's variables.
std::vector<std::string> rank_environment(const Options& options, const RoundInfo& info, int local_rank, int round);

}  // namespace ddprun
