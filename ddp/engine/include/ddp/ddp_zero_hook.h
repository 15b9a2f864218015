#pragma once
// ZeroRedundancyOptimizer overlapped with DDP's backward (PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook): once a gradient bucket is averaged,
// the rank that owns the bucket steps its parameters and broadcasts them while backward goes on.
//
//   ddp::DistributedDataParallel model(net);
//   ddp::ZeroRedundancyOptimizer<torch::optim::Adam> opt(model.parameters(),
//       ddp::ZeroRedundancyOptimizerOptions().overlap_with_ddp(true), torch::optim::AdamOptions(1e-3));
//   model.register_comm_hook(ddp::hooks::hook_with_zero_step(ddp::hooks::allreduce(), model, opt));
//   for (...) {
//     opt.zero_grad();
//     loss(model.forward(x)).backward();   // averages, steps and broadcasts: the update is done here
//     opt.step();                          // does nothing (may stay, as in PyTorch)
//   }
//
// Per bucket b of a backward pass, on DDP's hook thread, in bucket order:
//   1. the wrapped hook (`hook`, usually hooks::allreduce()) averages the bucket
//   2. the owner of bucket b (rank b % W) steps the bucket's parameters with that average
//      (hook_with_zero_step_interleaved: right away; hook_with_zero_step: once the last bucket is
//      averaged, all owned buckets in order, so the steps compete neither with backward's
//      computation nor with the last bucket's allreduce)
//   3. every rank takes part in the broadcast of bucket b's parameters from the owner
//   4. at the last bucket, every broadcast is waited on: backward returns with every rank's
//      parameters updated, as after DDP + the plain optimizer's step()
//
// Warm-up (PyTorch's rule): DDP's bucket-to-rank assignment needs DDP's final buckets, which exist
// from the one bucket rebuild on (before the second synchronized iteration's forward). Until then
// the hook only averages: the first synchronized iteration updates NOTHING (the parameters keep
// their values; param.grad() holds the averaged gradients as usual; step() does nothing). From the
// second synchronized iteration on, every backward updates, and the result equals DDP with the
// plain optimizer from then on (bitwise with hooks::allreduce(): the same averages, and each
// parameter's update is elementwise). PyTorch needs one more warm-up iteration (two, or three with
// static_graph) because its hook learns the buckets by watching a whole pass after the rebuild;
// ours assigns each bucket as it first comes by, so only the iteration before the rebuild is lost.
// A loop ported from PyTorch with two dummy warm-up inputs therefore updates on the second of them.
//
// Balance: by default a bucket is owned whole, so a rank's shard is the sum of its buckets and
// depends on the bucket caps: a model smaller than bucket_cap_mb is one bucket (plus the small first
// one), and then rank 0 holds nearly all the optimizer state. shard_buckets=true is PyTorch's remedy,
// with a rule of ours that keeps its promise on every layout: the buckets' parameters, in bucket
// order, are cut into one contiguous run per rank, each within total/W plus one parameter (a run
// crossing a bucket's end is a piece per bucket, each broadcast on its own). It needs every bucket's
// size first, so the first pass after the rebuild only records them and updates nothing either: two
// warm-up iterations then, as in PyTorch (without static_graph).
//
// Why this cannot hang on Gloo (PyTorch refuses every backend but NCCL/HCCL, pytorch#62300): a
// collective-based process group pairs the k-th collective of one rank with the k-th of every other,
// so all ranks must issue them in the same order. PyTorch launches the broadcasts from future
// callbacks, which run on whichever thread completes the allreduce, while the autograd thread
// launches the next buckets' allreduces on the same group: the interleaving of the two streams
// depends on timing and can differ between ranks. Here every collective of a backward pass -- each
// bucket's allreduce, then its broadcast -- is issued by one thread, DDP's hook thread, which calls
// the hook of bucket b+1 only once bucket b's hook has returned and its future is done; the training
// thread is inside backward meanwhile and issues nothing. So every rank issues the same collectives
// in the same order, on Gloo, over shared memory (gloo+shm) and on NCCL alike. (DDP's allreduces
// even run on a group of their own, split off the one given, so they cannot pair with a broadcast.)
//
// Rules, each checked (std::invalid_argument when the hook is made, naming the problem):
//  - `zero` was constructed with overlap_with_ddp(true) (and one parameter group);
//  - its group has the same size and this rank's place in it as the model's;
//  - the model does not use bucket_cap_mb_auto (its buckets change after the rebuild);
//  - one hook per optimizer.
// In a backward pass, a bucket parameter that is not one of `zero`'s fails that backward, naming it.
// With find_unused_parameters, a parameter no rank used is stepped with a zero gradient (PyTorch's
// overlap does the same: its functional optimizer is given the bucket's gradient), where the plain
// optimizer would skip it.
//
// Lifetimes: the hook holds the optimizer by reference; keep `zero` alive while `ddp` trains (a
// backward after `zero` is gone fails naming it). `ddp` owns the hook.
#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/zero_redundancy_optimizer.h>

namespace ddp {
namespace detail {
CommHook zero_step_hook(CommHook hook, const DDPCore& ddp, ZeroRedundancyOptimizerBase& zero, bool interleaved,
                        bool shard_buckets);
}  // namespace detail

namespace hooks {

// PyTorch's hook_with_zero_step: `hook` averages each bucket; the owners step their buckets once
// the last bucket is averaged (communication-bound models). `shard_buckets`: split buckets between
// ranks for balance (above). Throws std::invalid_argument (above).
template <typename ModuleType>
CommHook hook_with_zero_step(CommHook hook, DistributedDataParallel<ModuleType>& ddp, ZeroRedundancyOptimizerBase& zero,
                             bool shard_buckets = false) {
  return detail::zero_step_hook(std::move(hook), ddp.core(), zero, /*interleaved=*/false, shard_buckets);
}

// PyTorch's hook_with_zero_step_interleaved: each bucket's owner steps it as soon as it is averaged,
// while backward computes the next buckets (compute-bound models).
template <typename ModuleType>
CommHook hook_with_zero_step_interleaved(CommHook hook, DistributedDataParallel<ModuleType>& ddp,
                                         ZeroRedundancyOptimizerBase& zero, bool shard_buckets = false) {
  return detail::zero_step_hook(std::move(hook), ddp.core(), zero, /*interleaved=*/true, shard_buckets);
}

}  // namespace hooks
}  // namespace ddp
