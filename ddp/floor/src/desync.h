#pragma once
// Desync detection: before a collective, every rank says which collective it is about to run
// (a fixed-size fingerprint, so the check itself always pairs up), and every rank compares.
// Ranks that disagree - a different collective, another bucket, another size or dtype - get a
// CollectiveError on every rank naming each rank's collective, instead of Gloo pairing mismatched
// buffers (a wrong average, or an abort in its transport thread that no program can catch).
//
// With TORCH_DISTRIBUTED_DEBUG=DETAIL (ddp/internal/diagnostics/debug_level.h), as PyTorch: for the free collectives
// (ddp::all_reduce, broadcast, all_gather, barrier) and DDP's own. Without it nothing is checked
// and nothing is paid; DDP's collectives still never pair with a program's own, because DDP
// reduces over a group of its own (backends.h, split_off).
#include <cstdint>

#include <c10/core/ScalarType.h>

#include <ddp/process_group.h>

namespace ddp::detail {

enum class CollectiveOp : int64_t {
  kAllReduce = 1,
  kBroadcast,
  kAllGather,
  kBarrier,
  kBucketReduction,  // DDP: one gradient bucket (allreduce or communication hook)
  kUsageExchange,    // DDP: which parameters got gradients (find_unused_parameters)
  kBufferBroadcast,  // DDP: buffers from rank 0 before forward
  kBucketOrder,      // DDP: rank 0's gradient order for the one bucket rebuild
  kJoin,             // DDP under ddp::Join: how many ranks still have data
  kReduceScatter,
  kAllGatherIntoTensor,
  kAllToAll,
  kReduce,
  kGather,
  kScatter,
};

struct CollectiveFingerprint {
  CollectiveOp op;
  int64_t index = -1;  // which one of its kind (a bucket's index), -1 when it does not apply
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t numel = 0;
  int64_t root = -1;   // a broadcast's source rank, -1 when it does not apply
  int64_t iteration = -1;  // DDP: synchronized backward passes so far, -1 when it does not apply
  int64_t reduce_op = -1;  // an allreduce's c10d::ReduceOp::RedOpType, -1 when it does not apply
};

// Collective on `group`. Returns when every rank holds the same fingerprint; otherwise throws
// CollectiveError on every rank: "<who>: the ranks are not running the same collective: rank 0
// runs <...>, rank 1 runs <...>". A no-op in a world of one.
void verify_same_collective(const ProcessGroupPtr& group, const CollectiveFingerprint& mine, const char* who);

}  // namespace ddp::detail
