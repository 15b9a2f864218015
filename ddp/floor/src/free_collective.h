#pragma once
// What every free collective (collectives.cpp, more_collectives.cpp) does first: find its group
// and, under TORCH_DISTRIBUTED_DEBUG=DETAIL, check that every rank runs the same collective
// (desync.h): a mismatch is then a CollectiveError on every rank instead of mismatched buffers
// paired inside the backend. Otherwise a free collective is exactly its collective, as in PyTorch.
#include <ddp/process_group.h>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/floor/src/desync.h"

namespace ddp::detail {

inline ProcessGroupPtr resolve(const ProcessGroupPtr& group) { return group ? group : default_group(); }

inline CollectiveFingerprint fingerprint(CollectiveOp op, const at::Tensor& tensor, int root = -1,
                                         int64_t reduce_op = -1) {
  return {op, -1, tensor.scalar_type(), tensor.numel(), root, -1, reduce_op};
}

inline void verify_if_detail(const ProcessGroupPtr& group, const CollectiveFingerprint& mine, const char* who) {
  if (debug_level_of(group) == DebugLevel::kDetail) verify_same_collective(group, mine, who);
}

}  // namespace ddp::detail
