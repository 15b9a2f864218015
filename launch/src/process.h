#pragma once
// Starting and stopping one rank's process, implemented by process_posix.cpp.
//
// ddprun is a Linux program. Its Linux/glibc-only calls, and where they are:
//   process_posix.cpp  pipe2, prctl(PR_SET_PDEATHSIG) (a rank dies with ddprun), sigabbrev_np (glibc 2.32+)
//   signals.cpp        pipe2 (the self-pipe that wakes the supervisor on a signal)
//   store.cpp          pipe2, accept4 (close-on-exec without a race against a spawning thread)
//   options.cpp        sched_getaffinity (--nproc-per-node cpu counts the CPUs this process may use)
// A port to macOS would replace these four files' calls (pipe + fcntl, kqueue's NOTE_EXIT for the
// parent-death signal, strsignal); Windows would need process_win32.cpp with Job Objects and a
// Winsock store. The library itself (ddp/, data/, checkpoint/) uses none of them; on Windows,
// start the ranks by hand with file:// (launch/README.md).
#include <string>
#include <vector>

namespace ddprun {

struct ExitStatus {
  int code = 0;    // exit code when signal == 0
  int signal = 0;  // the signal that killed it, 0 if it exited
  bool ok() const { return signal == 0 && code == 0; }
  std::string describe() const;  // "exited with code 3" / "was killed by signal 9 (SIGKILL)"
};

struct Child {
  int pid = -1;
  int stdout_fd = -1;  // read ends of the child's stdout/stderr; -1 once closed
  int stderr_fd = -1;
  int stdin_fd = -1;   // write end of its stdin (StdinMode::kPipe), -1 otherwise; closing it is EOF
  bool running = false;
  ExitStatus status;
};

// A rank reads /dev/null; a node launcher started by `ddprun -H` reads a pipe whose closing tells
// it to stop (its EOF travels through ssh).
enum class StdinMode { kNull, kPipe };

// Starts `path` with argv `args` and exactly the environment `env` ("NAME=value" entries). The
// child leads its own process group (a terminal's Ctrl-C reaches only ddprun, which forwards it)
// and is killed by the kernel if ddprun dies without cleaning up. Throws on failure.
Child spawn(const std::string& path, const std::vector<std::string>& args, const std::vector<std::string>& env,
            StdinMode stdin_mode = StdinMode::kNull);

// Sends `signal` to the child's whole process group (it and anything it started).
void signal_group(const Child& child, int signal);

// Non-blocking: when the child has exited, kills what is left of its process group, reaps it,
// fills child.status and returns true.
bool reap_if_exited(Child& child);

// The absolute path `name` runs as (PATH lookup unless it contains '/'); empty if not runnable.
std::string find_program(const std::string& name);

// The absolute path of the running ddprun executable (what `ddprun -H` runs on every host).
std::string own_executable();

// Our own environment as "NAME=value" entries.
std::vector<std::string> current_environment();

// A listening TCP socket on every address of this host at `port`: dual-stack IPv6 first (IPv4
// and IPv6 peers both reach it), plain IPv4 where IPv6 is off; SO_REUSEADDR as c10d's TCPStore
// server sets it. Returns -1 with errno set when neither works. The one bind for the launcher's
// store and for port_is_free.
int listen_any(int port, int backlog);
// The same on the addresses `address` resolves to (every address when it is empty).
int listen_at(const std::string& address, int port, int backlog);
// True when a TCP port can be listened on by this host right now.
bool port_is_free(int port);
// A port that was free a moment ago (the kernel's pick).
int pick_free_port();

}  // namespace ddprun
