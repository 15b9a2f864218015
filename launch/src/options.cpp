#include "options.h"

#include <sstream>

#include <sched.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <regex>
#include <algorithm>

#include "number.h"
#include "process.h"

namespace ddprun {

int count_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

int count_gpus() {
  // Device nodes exist wherever the NVIDIA driver is loaded; nvidia-smi covers containers that
  // expose GPUs differently.
  int nodes = 0;
  std::error_code error;
  const std::regex device("nvidia[0-9]+");
  for (const auto& entry : std::filesystem::directory_iterator("/dev", error)) {
    if (std::regex_match(entry.path().filename().string(), device)) ++nodes;
  }
  if (nodes > 0) return nodes;
  if (find_program("nvidia-smi").empty()) return 0;
  FILE* pipe = popen("nvidia-smi -L 2>/dev/null", "r");
  if (pipe == nullptr) return 0;
  int listed = 0;
  char line[512];
  while (fgets(line, sizeof(line), pipe) != nullptr) {
    if (std::string(line).rfind("GPU ", 0) == 0) ++listed;
  }
  pclose(pipe);
  return listed;
}

namespace {

constexpr double kMaxSeconds = 86400;

int parse_nproc(const std::string& text) {
  if (text == "cpu") return count_cpus();
  if (text == "gpu") {
    const int gpus = count_gpus();
    if (gpus == 0) {
      throw UsageError("--nproc-per-node gpu: no NVIDIA GPU found (no /dev/nvidia<N>, no GPU in 'nvidia-smi -L')");
    }
    return gpus;
  }
  const auto value = parse_number(text, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  if (!value) throw UsageError("--nproc-per-node must be a number, 'cpu' or 'gpu' (got '" + text + "')");
  if (*value < 1) throw UsageError("--nproc-per-node must be at least 1 (got " + text + ")");
  if (*value > kMaxRanksPerNode) {
    throw UsageError("--nproc-per-node " + text + " is more than " + std::to_string(kMaxRanksPerNode) +
                     " ranks on one node (each is a process with its own pipes): use more nodes");
  }
  return static_cast<int>(*value);
}

}  // namespace

bool parse_options(int argc, char** argv, Options& options) {
  CLI::App app{
      "ddprun: start one process per rank of a torchddp job (the C++ counterpart of torchrun).\n"
      "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,\n"
      "MASTER_ADDR, MASTER_PORT and DDPRUN_RESTART_COUNT, so ddp::init_process_group() with env://\n"
      "just works.",
      "ddprun"};
  app.footer(
      "The program and its arguments follow the options (or a `--`):\n"
      "  ddprun --nproc-per-node 4 --standalone -- ./train --epochs 3\n"
      "  ddprun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 ./train\n"
      "  ddprun -H host1:2,host2:2 ./train     (node k on the k-th host, started over ssh)\n"
      "Exit codes: 0 success, 1 a rank or the rendezvous failed, 2 bad input (nothing started),\n"
      "128+N stopped by signal N. See launch/README.md.");
  std::string nproc = "1";
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "ranks on this node: a number, 'cpu' or 'gpu'")
      ->capture_default_str();
  app.add_option("--nnodes", options.nnodes, "number of nodes (hosts) in the job")->capture_default_str();
  app.add_option("--node-rank,--node_rank", options.node_rank, "this node's index, 0..nnodes-1")
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", options.master_addr, "address of node 0")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", options.master_port,
                 "port on node 0: the ranks' store (1 node) or the launchers' rendezvous store (>1 node)")
      ->capture_default_str();
  app.add_flag("--standalone", options.standalone, "single node on 127.0.0.1 with a free port picked by ddprun");
  app.add_option("--max-restarts,--max_restarts", options.max_restarts,
                 "restart the whole group this many times after a failure")
      ->capture_default_str();
  app.add_option("--monitor-interval,--monitor_interval", options.monitor_interval_s,
                 "seconds between checks for failures on other nodes")
      ->capture_default_str();
  app.add_option("--timeout,--rdzv-timeout", options.rdzv_timeout_s,
                 "seconds node launchers wait for each other at rendezvous")
      ->capture_default_str();
  app.add_option("--grace-period", options.grace_period_s,
                 "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", options.log_dir, "write each rank's output to DIR/rank_<RANK>.log");
  app.add_flag("--tee,!--no-tee", options.tee, "copy rank output to the console (default on; --no-tee needs --log-dir)");
  app.add_flag("--prefix,!--no-prefix", options.prefix, "prefix console lines with [rank N] (default on)");
  app.add_flag("--keep-output-buffering", options.keep_output_buffering,
               "leave the ranks' stdout buffered as the C library does on a pipe (4 KiB blocks); by default "
               "ddprun preloads coreutils' libstdbuf so it is unbuffered when ddprun's stdout is a terminal "
               "(\\r progress redraws show live), line-buffered otherwise");
  std::string filter;
  app.add_option("--local-ranks-filter,--local_ranks_filter", filter,
                 "show only these local ranks on the console, e.g. 0 or 0,3 (all ranks still go to --log-dir)");
  std::string host_list, hostfile;
  app.add_option("-H,--hosts", host_list,
                 "run on several hosts from one command: host1:2,host2:2 (host:ranks); the other hosts' "
                 "launchers are started over ssh, node k on the k-th host");
  app.add_option("--hostfile", hostfile, "like -H, from a file of lines 'host slots=N'");
  app.add_option("-x", options.forward_env,
                 "with -H: also send this environment variable to the other hosts (NAME or NAME=VALUE; repeat -x)")
      ->allow_extra_args(false);
  app.add_option("--ssh", options.ssh_command, "with -H: the ssh command, split at spaces (e.g. 'ssh -F cluster.conf')")
      ->capture_default_str();
  app.add_option("--rdzv-token-file", options.rdzv_token_file,
                 "several nodes: a file (mode 0600) holding the job's rendezvous token, the same on every node "
                 "(or DDPRUN_RDZV_TOKEN); node 0 makes one when none is given");
  app.add_flag("--rdzv-listen-all", options.rdzv_listen_all,
               "several nodes: node 0's store listens on every interface, not only --master-addr's");
  app.add_flag("--rdzv-token-stdin", options.rdzv_token_stdin,
               "read the rendezvous token from stdin's first line (what -H gives each node launcher)");
  app.add_flag("--stop-when-stdin-closes", options.stop_when_stdin_closes,
               "stop as on SIGHUP when stdin reaches EOF (what -H gives each node launcher)");
  app.set_version_flag("--version", "ddprun " DDPRUN_VERSION);
  // Everything from the first positional argument on is the program's command line, so
  // `ddprun --nproc-per-node 2 train --lr 0.1` works without `--`.
  app.prefix_command();

  // An explicit `--` ends ddprun's options even if the program's name starts with '-'.
  std::vector<std::string> own{argv + 1, argv + argc};
  std::vector<std::string> command;
  bool explicit_separator = false;
  for (size_t i = 0; i < own.size(); ++i) {
    if (own[i] == "--") {
      command.assign(own.begin() + static_cast<long>(i) + 1, own.end());
      own.resize(i);
      explicit_separator = true;
      break;
    }
  }
  std::reverse(own.begin(), own.end());  // CLI11 parses a reversed vector
  try {
    app.parse(own);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  } catch (const CLI::CallForVersion&) {
    std::cout << "ddprun " DDPRUN_VERSION "\n";
    return false;
  } catch (const CLI::ParseError& error) {
    throw UsageError(error.what());
  }
  const auto remaining = app.remaining();
  if (!remaining.empty()) {
    if (explicit_separator) {
      throw UsageError("unexpected argument '" + remaining.front() + "' before '--'");
    }
    if (remaining.front().size() > 1 && remaining.front()[0] == '-') {
      throw UsageError("unknown option '" + remaining.front() + "'");
    }
    command = remaining;
  }

  options.nproc_per_node = parse_nproc(nproc);
  if (!host_list.empty() || !hostfile.empty()) {
    if (!host_list.empty() && !hostfile.empty()) throw UsageError("give the hosts with -H or with --hostfile, not both");
    for (const char* own : {"--nnodes", "--node-rank", "--nproc-per-node", "--standalone"}) {
      if (app.count(own) > 0) {
        throw UsageError(std::string(own) + " cannot be used with -H/--hostfile: the host list gives the nodes and "
                         "each host's ranks (host:slots)");
      }
    }
    options.hosts = host_list.empty() ? read_hostfile(hostfile) : parse_host_list(host_list);
    options.nnodes = static_cast<int>(options.hosts.size());
    if (app.count("--master-addr") == 0) options.master_addr = options.hosts.front().name;
    const bool all_here = std::all_of(options.hosts.begin(), options.hosts.end(),
                                      [](const Host& host) { return is_this_host(host.name); });
    if (!all_here && is_loopback(options.master_addr)) {
      throw UsageError("node 0 ('" + options.master_addr + "') hosts the rendezvous, but that is a loopback address "
                       "the other hosts cannot reach: name the first host by an address they can reach, or give "
                       "--master-addr");
    }
    for (const auto& entry : options.forward_env) {
      const std::string name = entry.substr(0, entry.find('='));
      if (name.empty() || name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_") !=
                              std::string::npos) {
        throw UsageError("-x '" + entry + "': expected NAME or NAME=VALUE");
      }
      if (entry.find('=') == std::string::npos && std::getenv(name.c_str()) == nullptr) {
        throw UsageError("-x " + name + ": " + name + " is not set here; set it, or give -x " + name + "=VALUE");
      }
    }
  } else if (!options.forward_env.empty() || app.count("--ssh") > 0) {
    throw UsageError("-x and --ssh only apply with -H/--hostfile (hosts started over ssh)");
  }
  if (options.nnodes < 1) throw UsageError("--nnodes must be at least 1 (got " + std::to_string(options.nnodes) + ")");
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) + " is out of range for --nnodes " +
                     std::to_string(options.nnodes) + " (valid: 0.." + std::to_string(options.nnodes - 1) + ")");
  }
  if (options.master_port < 1 || options.master_port > 65535) {
    throw UsageError("--master-port " + std::to_string(options.master_port) + " is out of range [1, 65535]");
  }
  if (options.standalone && options.nnodes != 1) {
    throw UsageError("--standalone is for a single node, but --nnodes is " + std::to_string(options.nnodes));
  }
  if (options.max_restarts < 0) throw UsageError("--max-restarts must be >= 0");
  // Durations in seconds: finite and within a day (nan, inf or 1e308 would act as 0 or overflow).
  auto check_seconds = [](const char* name, double value, bool zero_ok) {
    // Below a millisecond a duration would act as 0: every wait is counted in milliseconds.
    if (!std::isfinite(value) || value < 0 || (!zero_ok && value == 0) || (value > 0 && value < 0.001) ||
        value > kMaxSeconds) {
      std::ostringstream text;
      text << name << " " << value << " is not a duration in seconds: use a number " << (zero_ok ? ">= 0" : "> 0")
           << " and at most " << kMaxSeconds << " (a day); one that is not 0 at least 0.001 (a millisecond)";
      throw UsageError(text.str());
    }
  };
  check_seconds("--monitor-interval", options.monitor_interval_s, false);
  check_seconds("--timeout", options.rdzv_timeout_s, false);
  check_seconds("--grace-period", options.grace_period_s, true);
  if (!filter.empty()) {
    // With -H every host gets the filter: it must fit the host with the fewest ranks.
    int ranks_per_node = options.nproc_per_node;
    if (!options.hosts.empty()) {
      ranks_per_node = std::min_element(options.hosts.begin(), options.hosts.end(), [](const Host& a, const Host& b) {
                         return a.slots < b.slots;
                       })->slots;
    }
    std::stringstream items(filter);
    for (std::string item; std::getline(items, item, ',');) {
      const auto local = parse_number(item, 0, ranks_per_node - 1);
      if (!local) {
        throw UsageError("--local-ranks-filter: '" + item + "' is not a local rank (valid: 0.." +
                         std::to_string(ranks_per_node - 1) + ", comma-separated)");
      }
      options.console_ranks.push_back(static_cast<int>(*local));
    }
  }
  if (!options.tee && options.log_dir.empty()) {
    throw UsageError("--no-tee without --log-dir would throw every rank's output away");
  }
  if (command.empty()) throw UsageError("no program given: ddprun [options] [--] program [args...]");
  options.command = command;
  options.program_path = find_program(command.front());
  if (options.program_path.empty()) {
    throw UsageError("program '" + command.front() + "' not found" +
                     (command.front().find('/') == std::string::npos ? " in PATH" : "") + " or not executable");
  }
  return true;
}

}  // namespace ddprun
