#pragma once
// Which rank stalled a collective. A collective that times out only knows that some peer did not
// come; the stall check (Horovod's has one) names it. Every rank of the default group runs a
// heartbeat thread that writes "<beat> <waiting>" under torchddp/heartbeat/<rank> in the group's
// store once a second: <beat> counts up while the process runs (a frozen, stopped or dead process
// stops counting, all its threads with it), <waiting> says whether it is inside a collective, and
// "<pid> <start time> <pid space>" which process it is (shm/process.h). When a collective fails,
// the rank that waited reads every heartbeat twice, 2.5 s apart, and names the ranks that stopped
// beating - as "exited" or "stopped" where their pid means their process here too (one host, one
// pid namespace) - and the ones that run but are in no collective.
#include <atomic>
#include <chrono>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddp::detail {


// Starts this process's heartbeat for the default group (replacing a previous one). `connect`
// opens the store client the heartbeat writes through, with a short timeout of its own, so a store
// that stopped answering cannot hold a failing collective longer than a few seconds.
void start_heartbeat(std::function<c10::intrusive_ptr<c10d::Store>()> connect, int rank, int world_size);
void stop_heartbeat();

// "Stall check: rank 1 stopped (...)", "rank 2 exited (...)"; empty when no heartbeat runs.
// Blocks about 2.5 s.
std::string stall_report();

}  // namespace ddp::detail
