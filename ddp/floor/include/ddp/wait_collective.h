#pragma once
// Waiting for a collective: the one place where a failed collective (a dead or stuck peer, which
// Gloo and NCCL report as an error once the group's timeout has passed) becomes an error message,
// so that it reads the same wherever it happens. The library waits on every one of its own
// collectives through it; a communication hook that waits on its collectives should too.
//
// Thread-safety: any thread may wait on any work; the heartbeat (process_group.h) reports this
// process as "in a collective" while at least one thread waits here.
#include <exception>
#include <string>
#include <type_traits>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/process_group.h>

namespace ddp {

// Blocks until `work` is done. On failure throws CollectiveError:
//   "<what> failed: a peer rank may have died, hung past the timeout, or run a different sequence
//    of collectives. Cause: <the backend's message>. Stall check: rank 1 stopped (...)"
// (the stall check takes about 2.5 s and names the ranks that did not come)
// `what` names the collective and who ran it ("DistributedDataParallel: allreduce of gradient
// bucket 2 of 5"); `hint`, when given, replaces the generic list of likely causes.
void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, const char* hint = nullptr);

// Throws the CollectiveError above for `cause`.
[[noreturn]] void throw_collective_error(const std::string& what, const char* hint, const std::exception& cause);

namespace detail {
// While alive, this process's heartbeat says it waits in a collective.
class WaitingInCollective {
 public:
  WaitingInCollective();
  ~WaitingInCollective();
  WaitingInCollective(const WaitingInCollective&) = delete;
  WaitingInCollective& operator=(const WaitingInCollective&) = delete;
};
}  // namespace detail

// The same for the per-iteration path, which must not allocate: `describe()` builds `what` and is
// called only when the collective failed.
template <typename Describe, typename = std::enable_if_t<std::is_invocable_r_v<std::string, Describe>>>
void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, Describe describe, const char* hint = nullptr) {
  try {
    detail::WaitingInCollective waiting;  // what this rank's heartbeat reports to the others
    work->wait();
  } catch (const std::exception& error) {
    throw_collective_error(describe(), hint, error);
  }
}

}  // namespace ddp
