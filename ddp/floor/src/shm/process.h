#pragma once
// What this machine says about another process, by pid: whether it exited, is stopped, or lives.
// The shared-memory collectives (communicator.h) and the stall check (heartbeat.h) name a peer
// that does not come by this one rule. A pid means the same process only between processes of
// one pid namespace on one boot of one machine (same_pid_space()), and only while the process's
// start time is the one recorded when it was seen first (a pid is reused once its process is gone).
#include <cstdint>
#include <string>

namespace ddp::detail::shm {

struct ProcessInfo {
  bool exists = false;
  char state = '?';              // /proc/<pid>/stat's state: R, S, D, T (stopped), t (traced), Z, X
  std::uint64_t start_time = 0;  // clock ticks since boot, the same in every pid namespace; 0: unknown
};

ProcessInfo read_process(int pid);

// Gone, a zombie, or its pid reused by another process (another start time than `start_time`).
bool exited(const ProcessInfo& now, std::uint64_t start_time);
// Stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger.
bool stopped(const ProcessInfo& now);

// "<boot id> <pid namespace>": two processes that print the same see each other's pids.
std::string pid_space();

// The CPUs this process may run on (its affinity; the machine's count where that is unknown).
// Fewer than the ranks of a group on the host means the rank one waits for may need one's core.
int cpus_available();

}  // namespace ddp::detail::shm
