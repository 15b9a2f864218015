// ddprun: starts one process per rank with torchrun's environment, supervises them, and restarts
// or stops the whole group together. See launch/README.md.
//
// Exit codes: 0 success; 1 a rank failed (after the allowed restarts) or the rendezvous failed;
// 2 bad input (nothing was started); 128+N stopped by signal N.
#include <cstdlib>
#include <iostream>

#include "coordinator.h"
#include "options.h"
#include "rendezvous.h"
#include "secret.h"
#include "signals.h"
#include "supervisor.h"

namespace {

bool stop_requested() { return ddprun::stop_signal() != 0; }

void report(const ddprun::RoundResult& result) {
  std::cerr << "ddprun: " << result.reason << "\n";
  if (!result.tail.empty()) {
    std::cerr << "ddprun: last " << result.tail.size() << " line(s) of its output"
              << (result.log_path.empty() ? "" : " (full log: " + result.log_path + ")") << ":\n";
    for (const auto& line : result.tail) std::cerr << "  | " << line << "\n";
  }
}

int run(ddprun::Options& options) {
  // Handlers first: a node launcher of `ddprun -H` may be told to stop while still connecting.
  ddprun::install_signal_handlers();
  // The token first: a node launcher of `ddprun -H` reads it from stdin before watching stdin close.
  const std::string token = options.nnodes > 1 ? ddprun::job_token(options) : "";
  if (options.stop_when_stdin_closes) ddprun::hang_up_when_stdin_closes("node " + std::to_string(options.node_rank));
  auto rendezvous = ddprun::make_rendezvous(options, token);
  if (ddprun::sets_omp_num_threads(options)) {
    std::cerr << "ddprun: setting OMP_NUM_THREADS=1 for each rank to avoid oversubscribing the CPUs; "
                 "set it yourself to tune\n";
  }
  if (const auto buffering = ddprun::stdout_buffering(options); !buffering.note.empty()) {
    std::cerr << "ddprun: " << buffering.note << "\n";
  }
  for (int round = 0;; ++round) {
    ddprun::RoundInfo info;
    try {
      info = rendezvous->join(round, stop_requested);
    } catch (const ddprun::RendezvousError& error) {
      std::cerr << "ddprun: rendezvous failed: " << error.what() << "\n";
      rendezvous->leave();
      return stop_requested() ? 128 + ddprun::stop_signal() : 1;
    }
    auto result = ddprun::run_round(options, info, round, *rendezvous);
    if (result.outcome == ddprun::RoundResult::kSucceeded) {
      auto peer = rendezvous->finish(round, stop_requested);
      if (!peer) {
        rendezvous->leave();
        return 0;
      }
      if (stop_requested()) {
        std::cerr << "ddprun: received signal " << ddprun::stop_signal()
                  << " while waiting for the other nodes; this node's ranks had finished\n";
        rendezvous->leave();
        return 128 + ddprun::stop_signal();
      }
      result.outcome = ddprun::RoundResult::kPeerFailed;
      result.reason = *peer;
    }
    if (result.outcome == ddprun::RoundResult::kInterrupted) {
      std::cerr << "ddprun: " << result.reason << "; stopped all ranks\n";
      rendezvous->leave();
      return 128 + result.signal;
    }
    if (result.outcome == ddprun::RoundResult::kPeerFailed) result.reason = "another node failed: " + result.reason;
    report(result);
    if (result.outcome == ddprun::RoundResult::kCouldNotStart) {
      // Like a usage error (exit 2): the command itself cannot run, so restarting cannot help.
      std::cerr << "ddprun: stopped all ranks; the program could not be started\n";
      rendezvous->leave();
      return 2;
    }
    if (round >= options.max_restarts) {
      std::cerr << "ddprun: stopped all ranks; job failed"
                << (options.max_restarts > 0 ? " after " + std::to_string(round) + " restart(s)" : "") << "\n";
      rendezvous->leave();
      return 1;
    }
    std::cerr << "ddprun: restarting all ranks (restart " << round + 1 << " of " << options.max_restarts << ")\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  ddprun::Options options;
  try {
    if (!ddprun::parse_options(argc, argv, options)) return 0;
    return options.hosts.empty() ? run(options) : ddprun::run_on_hosts(options);
  } catch (const ddprun::UsageError& error) {
    std::cerr << "ddprun: error: " << error.what() << "\nRun 'ddprun --help' for usage.\n";
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "ddprun: error: " << error.what() << "\n";
    return 1;
  }
}
