#include "coordinator.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "options.h"
#include "output.h"
#include "process.h"
#include "secret.h"
#include "signals.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

// Variables the ranks need on every host even without -x: they tune or debug the program.
const char* const kForwardedPrefixes[] = {"OMP_NUM_THREADS=", "TORCHDDP_", "TORCH_", "GLOO_", "NCCL_"};

// Never prompt (a password prompt would hang the job), bound the connect, notice a dead host.
// The user's --ssh words come first, and ssh keeps the first value it gets for an option.
const char* const kSshOptions[] = {"-o", "BatchMode=yes",         "-o", "ConnectTimeout=10",
                                   "-o", "StrictHostKeyChecking=accept-new",
                                   "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"};

constexpr int kSshFailed = 255;     // ssh's own exit code: could not connect, or lost the connection
constexpr int kCannotExecute = 126;  // the remote shell's codes for a program it cannot run...
constexpr int kNotFound = 127;       // ...or cannot find

struct Node {
  Host host;
  bool here = false;  // this machine: started directly, not over ssh
  Child child;
  std::unique_ptr<RankOutput> output;
  std::string start_error;  // why it could not even be started

  // The exit codes that say the node launcher never ran there, so ssh's or the shell's message is
  // the news.
  bool never_ran() const {
    const int code = child.status.signal == 0 ? child.status.code : -1;
    return !here && (code == kSshFailed || code == kCannotExecute || code == kNotFound);
  }
};

std::string text(double seconds) {
  char buffer[64];
  return std::string(buffer, std::to_chars(buffer, buffer + sizeof(buffer), seconds).ptr);
}

std::string shell_quote(const std::string& word) {
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// The node launcher of node `k`: what a user would run on that host by hand.
std::vector<std::string> node_command(const Options& options, const std::string& ddprun, int k) {
  std::vector<std::string> args{ddprun,
                                "--nnodes", std::to_string(options.nnodes),
                                "--node-rank", std::to_string(k),
                                "--nproc-per-node", std::to_string(options.hosts[k].slots),
                                "--master-addr", options.master_addr,
                                "--master-port", std::to_string(options.master_port),
                                "--max-restarts", std::to_string(options.max_restarts),
                                "--monitor-interval", text(options.monitor_interval_s),
                                "--timeout", text(options.rdzv_timeout_s),
                                "--grace-period", text(options.grace_period_s),
                                "--stop-when-stdin-closes", "--rdzv-token-stdin"};
  if (!options.log_dir.empty()) args.insert(args.end(), {"--log-dir", options.log_dir});
  if (!options.tee) args.push_back("--no-tee");
  if (!options.prefix) args.push_back("--no-prefix");
  if (options.keep_output_buffering) args.push_back("--keep-output-buffering");
  if (!options.console_ranks.empty()) {
    std::string list;
    for (int local : options.console_ranks) list += (list.empty() ? "" : ",") + std::to_string(local);
    args.insert(args.end(), {"--local-ranks-filter", list});
  }
  args.push_back("--");
  // A program found through our PATH may not be on the ssh session's PATH: give where we found it.
  const auto& program = options.command.front();
  args.push_back(program.find('/') == std::string::npos ? options.program_path : program);
  args.insert(args.end(), options.command.begin() + 1, options.command.end());
  return args;
}

// What the ranks on another host need from our environment: kForwardedPrefixes and each -x.
std::vector<std::string> forwarded_environment(const Options& options) {
  std::vector<std::string> env;
  for (const auto& entry : current_environment()) {
    for (const char* prefix : kForwardedPrefixes) {
      if (entry.rfind(prefix, 0) == 0) env.push_back(entry);
    }
  }
  for (const auto& entry : options.forward_env) {  // later entries win in `env`
    env.push_back(entry.find('=') != std::string::npos ? entry : entry + "=" + std::getenv(entry.c_str()));
  }
  return env;
}

// Ours with the forwarded variables in place of our values (the -x NAME=VALUE ones differ).
std::vector<std::string> local_environment(const Options& options) {
  const auto forwarded = forwarded_environment(options);
  std::vector<std::string> env;
  for (const auto& entry : current_environment()) {
    const std::string name = entry.substr(0, entry.find('=') + 1);
    if (std::none_of(forwarded.begin(), forwarded.end(), [&](const std::string& f) { return f.rfind(name, 0) == 0; })) {
      env.push_back(entry);
    }
  }
  env.insert(env.end(), forwarded.begin(), forwarded.end());
  return env;
}

// ssh runs the node launcher in our working directory with the forwarded variables.
std::vector<std::string> ssh_command(const Options& options, const Host& host, const std::vector<std::string>& node) {
  char cwd[4096];
  if (getcwd(cwd, sizeof(cwd)) == nullptr) throw std::runtime_error("cannot read the working directory");
  std::string remote = "cd " + shell_quote(cwd) + " && exec env";
  for (const auto& entry : forwarded_environment(options)) remote += " " + shell_quote(entry);
  for (const auto& arg : node) remote += " " + shell_quote(arg);

  std::vector<std::string> words;
  std::istringstream split(options.ssh_command);
  for (std::string word; split >> word;) words.push_back(word);
  words.insert(words.end(), std::begin(kSshOptions), std::end(kSshOptions));
  words.push_back(host.name);
  words.push_back(remote);
  return words;
}

// One line on why a node failed, for the report.
std::string why_failed(const Options& options, const Node& node, const std::string& ddprun) {
  const int code = node.child.status.code;
  if (!node.start_error.empty()) return node.start_error;
  if (node.never_ran() && code == kSshFailed) {
    return "ssh exited with code 255: it could not connect to " + node.host.name +
           " or lost the connection (ssh's message is quoted below; passwordless ssh must work: try `" +
           options.ssh_command + " -o BatchMode=yes " + node.host.name + " true`)";
  }
  if (node.never_ran()) {
    return "the remote shell could not run " + ddprun + " (exit code " + std::to_string(code) +
           "): ddprun must be at the same path on every host";
  }
  return "its launcher " + node.child.status.describe();
}

class Coordinator {
 public:
  explicit Coordinator(const Options& options)
      : options_(options), ddprun_(own_executable()), token_(job_token(options)) {}

  int run() {
    // 1. Know which hosts need ssh before starting anything, so a missing ssh starts nothing.
    for (const auto& host : options_.hosts) nodes_.push_back(Node{host, is_this_host(host.name), {}, nullptr, ""});
    std::string ssh;
    std::istringstream first_word(options_.ssh_command);
    first_word >> ssh;
    const std::string ssh_path = find_program(ssh);
    for (const auto& node : nodes_) {
      if (!node.here && ssh_path.empty()) {
        throw UsageError("host " + node.host.name + " needs ssh, but '" + ssh +
                         "' is not found or not executable (Debian: openssh-client; or set --ssh)");
      }
    }

    // 2. Start node k on host k; a node that cannot even start fails the job like one that fails later.
    install_signal_handlers();
    for (size_t k = 0; k < nodes_.size(); ++k) {
      Node& node = nodes_[k];
      node.output = std::make_unique<RankOutput>(static_cast<int>(k), 0, OutputSettings{true, false, ""});
      const auto command = node_command(options_, ddprun_, static_cast<int>(k));
      try {
        node.child = node.here ? spawn(ddprun_, command, local_environment(options_), StdinMode::kPipe)
                               : spawn(ssh_path, ssh_command(options_, node.host, command), current_environment(),
                                       StdinMode::kPipe);
      } catch (const std::exception& error) {
        node.start_error = error.what();
        failed_ = static_cast<int>(k);
        break;
      }
      // The token goes through the pipe, never a command line another user could read in ps.
      const std::string line = token_ + "\n";
      (void)!write(node.child.stdin_fd, line.data(), line.size());
    }

    // 3. Relay output until every node launcher exited. A signal stops them all at once, and so
    //    does a node launcher that never ran (ssh failed). After a node launcher failed, the others
    //    normally learn it through the rendezvous and stop by themselves, reporting the real cause;
    //    those that do not are stopped once that had time to happen.
    if (failed_ >= 0) stop_at(Clock::now());
    while (any_running()) {
      relay(std::chrono::milliseconds(100));
      for (size_t k = 0; k < nodes_.size(); ++k) {
        if (reap_if_exited(nodes_[k].child) && !nodes_[k].child.status.ok() && failed_ < 0 && signal_ == 0) {
          failed_ = static_cast<int>(k);
          const bool told_the_others = !nodes_[k].never_ran();  // through the rendezvous
          stop_at(Clock::now() + (told_the_others ? seconds(options_.monitor_interval_s + options_.grace_period_s + 1)
                                                  : Clock::duration::zero()));
        }
      }
      if (stop_signal() != 0 && signal_ == 0) {
        signal_ = stop_signal();
        stop_at(Clock::now());
      }
      if (Clock::now() >= stop_at_) stop_all();
      if (Clock::now() >= kill_at_) {
        for (auto& node : nodes_) signal_group(node.child, SIGKILL);
      }
    }
    for (auto& node : nodes_) {
      if (node.output) drain(node.child.stdout_fd, node.child.stderr_fd, *node.output, std::chrono::milliseconds(200));
      if (node.child.stdin_fd >= 0) close(node.child.stdin_fd);
    }

    // 4. Report: which host failed and why, in one place after all the relayed output.
    if (signal_ != 0 && failed_ < 0) {
      std::cerr << "ddprun: received signal " << signal_ << "; stopped the job on every host\n";
      return 128 + signal_;
    }
    if (failed_ < 0) return 0;
    const Node& node = nodes_[failed_];
    std::cerr << "ddprun: host " << node.host.name << " (node " << failed_ << ") failed: "
              << why_failed(options_, node, ddprun_) << "\n";
    if (node.never_ran()) {
      for (const auto& line : node.output->tail()) std::cerr << "  | " << line << "\n";
    }
    std::cerr << "ddprun: stopped the job on every host\n";
    return signal_ != 0 ? 128 + signal_ : 1;
  }

 private:
  bool any_running() const {
    for (const auto& node : nodes_) {
      if (node.child.running) return true;
    }
    return false;
  }

  static Clock::duration seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }

  void stop_at(Clock::time_point when) { stop_at_ = std::min(stop_at_, when); }

  // Closes every node launcher's stdin: each stops its ranks and exits (see coordinator.h); those
  // still running after twice the grace period (+10 s) are killed.
  void stop_all() {
    if (kill_at_ == Clock::time_point::max()) kill_at_ = Clock::now() + seconds(2 * options_.grace_period_s + 10);
    for (auto& node : nodes_) {
      if (node.child.stdin_fd >= 0) close(node.child.stdin_fd);
      node.child.stdin_fd = -1;
    }
  }

  // Sleeps until output, a signal (SIGCHLD included) or the timeout; passes the lines on.
  void relay(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds{{wake_fd(), POLLIN, 0}};
    for (auto& node : nodes_) {
      fds.push_back({node.child.stdout_fd, POLLIN, 0});  // poll ignores fd -1
      fds.push_back({node.child.stderr_fd, POLLIN, 0});
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) <= 0) return;
    if (fds[0].revents != 0) drain_wakeups();
    for (size_t k = 0; k < nodes_.size(); ++k) {
      if (fds[1 + 2 * k].revents != 0) pump(nodes_[k].child.stdout_fd, 1, *nodes_[k].output);
      if (fds[2 + 2 * k].revents != 0) pump(nodes_[k].child.stderr_fd, 2, *nodes_[k].output);
    }
  }

  const Options& options_;
  const std::string ddprun_;
  const std::string token_;  // the job's rendezvous token, handed to each node launcher
  std::vector<Node> nodes_;
  int failed_ = -1;  // the first node whose launcher failed
  int signal_ = 0;   // the stop signal we received
  Clock::time_point stop_at_ = Clock::time_point::max();  // when to close the node launchers' stdin
  Clock::time_point kill_at_ = Clock::time_point::max();  // when to kill those still running
};

}  // namespace

int run_on_hosts(const Options& options) { return Coordinator(options).run(); }

}  // namespace ddprun
