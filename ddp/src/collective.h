#pragma once
// Waiting for a collective: the one place where a failed collective (a dead or stuck peer, which
// Gloo and NCCL report as an error once the group's timeout has passed) becomes an error message,
// so that it reads the same wherever it happens.
#include <string>
#include <type_traits>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "ddp/process_group.h"
#include "heartbeat.h"

namespace ddp::detail {

// Blocks until `work` is done. On failure throws CollectiveError:
//   "<what> failed: a peer rank may have died, hung past the timeout, or run a different sequence
//    of collectives. Cause: <the backend's message>. Stall check: rank 1 stopped (...)"
// (the stall check, heartbeat.h, takes about 2.5 s and names the ranks that did not come)
// `what` names the collective and who ran it ("DistributedDataParallel: allreduce of gradient
// bucket 2 of 5"); `hint`, when given, replaces the generic list of likely causes.
void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, const char* hint = nullptr);

[[noreturn]] void throw_collective_error(const std::string& what, const char* hint, const std::exception& cause);

// The same for the per-iteration path, which must not allocate: `describe()` builds `what` and is
// called only when the collective failed.
template <typename Describe, typename = std::enable_if_t<std::is_invocable_r_v<std::string, Describe>>>
void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, Describe describe, const char* hint = nullptr) {
  try {
    WaitingInCollective waiting;  // what this rank's heartbeat reports to the others
    work->wait();
  } catch (const std::exception& error) {
    throw_collective_error(describe(), hint, error);
  }
}

}  // namespace ddp::detail
