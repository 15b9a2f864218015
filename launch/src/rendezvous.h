#pragma once
// How the launchers of one job agree on the world before each attempt ("round"), and how they
// tell each other about a failure. One node: nothing to agree on. Several nodes: a small
// key-value store (store.h) hosted by node 0's launcher on --master-port, open only to launchers
// that know the job's token (secret.h), with keys namespaced by round:
//   r<k>/nproc/<node>  each node's rank count     r<k>/port    the ranks' MASTER_PORT (node 0 picks)
//   r<k>/failed        why the round failed         r<k>/done    nodes whose ranks all succeeded
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace ddprun {

struct Options;

struct RoundInfo {
  int world_size = 0;
  int rank_offset = 0;  // global rank of this node's local rank 0
  std::string master_addr;
  int master_port = 0;  // what the ranks get as MASTER_PORT
  // What the ranks get as TORCHDDP_RUN_ID: the same on every node of this job and in each of its
  // restart rounds, different for any other job, so ranks of two jobs that meet at one store
  // refuse each other (process_group.cpp) and a restart resumes its own checkpoints.
  std::string run_id;
};

// The rendezvous could not complete (a node missing, the master unreachable).
struct RendezvousError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Blocks until every node joined round `round` (or throws after the timeout, naming who is
  // missing). `stop_requested` is polled so Ctrl-C interrupts the wait.
  virtual RoundInfo join(int round, bool (*stop_requested)()) = 0;
  // Tells the other nodes this round failed.
  virtual void report_failure(int round, const std::string& why) = 0;
  // Non-blocking: why another node failed this round, if it did.
  virtual std::optional<std::string> peer_failure(int round) = 0;
  // This node's ranks all succeeded: waits until every node's did (returns nullopt) or one
  // failed (returns why).
  virtual std::optional<std::string> finish(int round, bool (*stop_requested)()) = 0;
  // Last call before ddprun exits; node 0 keeps the store up until the others are done with it.
  virtual void leave() {}
};

// Throws UsageError when node 0 cannot host the store on --master-port (port in use). `token` is
// the job's rendezvous token (secret.h: job_token), unused with one node.
std::unique_ptr<Rendezvous> make_rendezvous(const Options& options, const std::string& token);

}  // namespace ddprun
