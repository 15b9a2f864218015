#pragma once
// Uneven inputs: ranks that get different numbers of batches (PyTorch's
// torch.distributed.algorithms.Join, Horovod's hvd.join).
//
//   ddp::Join join({model});                      // PyTorch: with Join([model]):
//   join.run([&] {
//     for (auto& batch : *loader) { ...forward, backward, step... }
//   });
//
// Without Join, a rank that still has a batch blocks in its gradient allreduce until the group's
// timeout and then fails ("allreduce of gradient bucket ... failed"). With Join, a rank that ran
// out of batches shadows the others: each iteration it takes part in their collectives with
// contributions that change nothing (zero gradients), until every rank is done; then every rank
// takes the final model from a rank that was still training last (the last joiner).
//
// The algorithm, per iteration:
//   1. active ranks: each joinable's forward runs the join check (one small allreduce: who still
//      has inputs, whether this iteration synchronizes gradients)
//   2. a rank whose loop ended: runs the same check, saying "I am done"; if no rank is active, stop
//   3. while some rank is active: each joinable shadows that iteration's collectives, in order
//   4. once every rank is done: each joinable finishes (DDP: parameters and buffers from the
//      highest rank that was active last)
//
// The check costs a round trip, so active ranks do not wait for it (the default): they launch it
// at the start of an iteration and read it at the start of the next, by when it has long
// completed; an iteration runs under what the previous check said (JoinStatus::active: the ranks
// active one iteration earlier, which includes the rank that just ran out: its buffers are those
// of its last forward, as good a source as any). Only a rank that ran out waits for the check, to
// learn whether it must shadow. Two options need the answer within the iteration itself and make
// active ranks wait for it, as PyTorch always does: throw_on_early_termination (stop before the
// iteration runs) and divide_by_initial_world_size(false) (the divisor is the active count).
//
// Why a call that takes the loop (run) rather than a scope object: the shadowing after the loop
// runs collectives that can fail (a dead peer, throw_on_early_termination); from run() such
// errors reach the caller as exceptions, and the shadowing can be neither forgotten nor skipped.
// A destructor could do neither.
//
// Thread-safety: a Join and its joinables belong to the training thread that runs the loop.
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <ddp/process_group.h>

namespace ddp {

class Join;

// What the join check found out in one iteration; the same on every rank.
struct JoinStatus {
  int64_t iteration = 0;       // iterations checked so far by this Join, this one included
  int world_size = 0;
  std::vector<int> active;     // ranks that still had inputs, ascending (by default as of the
                               // previous iteration's check: see above)
  bool sync = true;            // the active ranks synchronize gradients (no no_sync())
  // The rank others take state from: the highest active rank (rank 0 may have run out).
  int authoritative_rank() const { return active.empty() ? 0 : active.back(); }
};

// Anything whose collectives must be matched on ranks that ran out of inputs. DistributedDataParallel
// is one; JoinableAllReduce below is a small one to copy from.
class Joinable {
 public:
  virtual ~Joinable() = default;

  // The group the join check runs on when this is the first joinable given to Join.
  virtual ProcessGroupPtr join_process_group() const = 0;
  // Join starts (`join` non-null) or stops routing this object's iterations; `index` is its place
  // in Join's list. Call Join::notify(index, ...) at the start of every iteration while attached.
  virtual void join_attach(Join* join, size_t index) = 0;
  // On a rank that ran out of inputs, once per iteration the others still run: run the collectives
  // this object would have run in that iteration, contributing nothing (zeros).
  virtual void join_shadow(const JoinStatus& status) = 0;
  // On every rank, once every rank is done. `last` is the final check; `from` the rank to take
  // state from (a rank that trained in the last iteration any rank trained).
  virtual void join_finish(const JoinStatus& last, int from) = 0;
};

struct JoinOptions {
  // Off: run() just runs the loop (a program can keep one code path for even and uneven inputs).
  TORCH_ARG(bool, enable) = true;
  // Stop every rank, with an error naming the first rank(s) that ran out, as soon as one rank
  // runs out of inputs (instead of shadowing it).
  TORCH_ARG(bool, throw_on_early_termination) = false;
  // DDP: average gradients over the initial world size (joined ranks count as zeros; PyTorch's
  // default) or, when false, over the ranks still active in that iteration. Communication hooks
  // average as they please (the built-ins: over the world size).
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
};

// Thrown on every rank by throw_on_early_termination.
class EarlyTerminationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Join {
 public:
  // Every joinable must outlive run(). The first one's group carries the join check.
  Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options = {});
  Join(std::initializer_list<std::reference_wrapper<Joinable>> joinables, JoinOptions options = {})
      : Join(std::vector<std::reference_wrapper<Joinable>>(joinables), std::move(options)) {}
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Runs `loop` (this rank's training loop over its own inputs), then shadows the other ranks
  // until every rank's loop has ended, then finishes every joinable. Collective: every rank calls
  // it. Rethrows what `loop` throws (after detaching, without shadowing: PyTorch does the same).
  void run(const std::function<void()>& loop);

  // For joinables: the start of one iteration on an active rank. The first joinable's call runs
  // the join check; the others' return its result. `sync`: whether this iteration synchronizes
  // gradients (DDP outside no_sync()). Throws EarlyTerminationError under
  // throw_on_early_termination when a rank has run out.
  const JoinStatus& notify(size_t index, bool sync);

  const JoinOptions& options() const { return options_; }

 private:
  struct Check;  // a launched join check
  // Whether active ranks wait for each iteration's check before running it (see above).
  bool waits_for_check() const;
  std::unique_ptr<Check> launch_check(bool active, bool sync);
  JoinStatus read_check(Check& check) const;
  JoinStatus everyone_active() const;
  [[noreturn]] void throw_early_termination(const JoinStatus& status) const;

  std::vector<std::reference_wrapper<Joinable>> joinables_;
  JoinOptions options_;
  ProcessGroupPtr group_;
  JoinStatus status_;               // what this rank's current iteration runs under
  std::unique_ptr<Check> pending_;  // this rank's check not read yet (when active ranks do not wait)
  int64_t iterations_ = 0;
};

// A tensor the loop all-reduces (sums) once per iteration, e.g. a running loss for a progress
// line, made joinable: on a rank that ran out of inputs, Join all-reduces zeros of the same shape.
//   ddp::JoinableAllReduce running(torch::zeros({2}, torch::kDouble));   // [loss sum, count]
//   ddp::Join join({model, running});      // in the order the loop runs their collectives
//   join.run([&] { for (...) { ...; auto global = running.all_reduce(torch::tensor({loss * n, n})); } });
class JoinableAllReduce : public Joinable {
 public:
  // `like`: the shape and dtype every all_reduce will have (a rank with no input at all must still
  // know what to contribute). `group`: the default group when null.
  explicit JoinableAllReduce(const at::Tensor& like, ProcessGroupPtr group = {});
  // The sum over ranks of `tensor` (not modified), shaped like `like`. Collective, once per
  // iteration; throws std::invalid_argument for another shape or dtype.
  at::Tensor all_reduce(const at::Tensor& tensor);

  ProcessGroupPtr join_process_group() const override;
  void join_attach(Join* join, size_t index) override;
  void join_shadow(const JoinStatus& status) override;
  void join_finish(const JoinStatus&, int) override {}

 private:
  ProcessGroupPtr group_;
  Join* join_ = nullptr;
  size_t index_ = 0;
  at::Tensor zeros_;  // what a rank without inputs contributes
};

}  // namespace ddp
