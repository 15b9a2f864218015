#pragma once
// Command-line options of ddprun and their validation. Everything that can be checked before a
// process is started is checked here, so bad input never leaves a half-started job behind.
#include <stdexcept>
#include <string>
#include <vector>

#include "hosts.h"

namespace ddprun {

// Bad input: ddprun prints the message and exits 2 without starting anything.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int kMaxRanksPerNode = 1024;  // --nproc-per-node, -H slots and the counts in the store

struct Options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval_s = 0.1;  // how often the peer-failure key is polled (multi-node)
  double rdzv_timeout_s = 300;      // how long node launchers wait for each other
  double grace_period_s = 5;        // SIGTERM -> SIGKILL delay when stopping ranks
  std::string log_dir;              // one file per rank when set
  bool tee = true;                  // copy rank output to the console
  bool prefix = true;               // "[rank N] " before each console line
  std::vector<int> console_ranks;   // --local-ranks-filter: local ranks shown on the console (empty: all)
  bool keep_output_buffering = false;  // leave the ranks' stdout buffering alone (supervisor.h)
  std::vector<std::string> command;  // program and its arguments, as given
  std::string program_path;          // command[0] resolved through PATH

  // -H / --hostfile: this ddprun is the coordinator and starts one node launcher per host
  // (coordinator.h); node ranks follow the list, master_addr defaults to the first host.
  std::vector<Host> hosts;
  std::vector<std::string> forward_env;  // -x NAME or NAME=VALUE: also sent to the other hosts
  std::string ssh_command = "ssh";        // --ssh: how to reach a host, split at spaces
  bool stop_when_stdin_closes = false;    // a node launcher the coordinator started (signals.h)

  // Multi-node: the job's rendezvous token (secret.h) and where node 0's store listens.
  std::string rdzv_token_file;
  bool rdzv_token_stdin = false;  // a node launcher the coordinator started: the token's first line on stdin
  bool rdzv_listen_all = false;   // every interface, not only --master-addr's
};

// Parses argv. Returns false when the caller should exit 0 at once (--help, --version).
// Throws UsageError for anything invalid.
bool parse_options(int argc, char** argv, Options& options);

// "gpu" support: how many NVIDIA devices this host has, without linking CUDA (0 if none).
int count_gpus();
// CPUs this process may run on.
int count_cpus();

}  // namespace ddprun
