#pragma once
// Process helpers for programs that start copies of themselves: the multi-process tests
// (tests/support/multiprocess.h) and ddp_bench. POSIX only, no LibTorch, no GoogleTest.
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

namespace ddp::procutil {

// A TCP port on 127.0.0.1 the kernel just handed out, closed again before returning: free when the
// caller binds it, unless another process took it in between (rare). Throws std::runtime_error
// with the reason when the kernel gives none.
int free_port();

struct SpawnOptions {
  std::map<std::string, std::string> env;  // added to this process's environment (replacing a same name)
  std::string log;                         // the child's stdout and stderr go to this file; empty: inherited
  bool own_process_group = false;          // setpgid(0, 0): kill(-pid, ...) also reaches its children
};

// Starts this executable again (/proc/self/exe) with `argv` (argv[0] first) and returns its pid.
// Fork, then exec at once: the child runs nothing of this process (no thread pool, no torch
// state), and its environment is built before the fork, so the child does not allocate.
// Throws std::runtime_error when fork fails; a failed exec ends the child with exit code 127.
pid_t spawn_self(const std::vector<std::string>& argv, const SpawnOptions& options = {});

}  // namespace ddp::procutil
