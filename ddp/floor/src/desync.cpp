#include "ddp/floor/src/desync.h"

#include <sstream>
#include <vector>

#include <ATen/ATen.h>

#include <ddp/wait_collective.h>

#include "ddp/internal/diagnostics/text.h"

namespace ddp::detail {
namespace {

constexpr int64_t kFields = 7;

const char* name_of(int64_t op) {
  switch (static_cast<CollectiveOp>(op)) {
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kBarrier: return "barrier";
    case CollectiveOp::kBucketReduction: return "DDP gradient bucket reduction";
    case CollectiveOp::kUsageExchange: return "DDP unused-parameter exchange";
    case CollectiveOp::kBufferBroadcast: return "DDP buffer broadcast";
    case CollectiveOp::kBucketOrder: return "DDP bucket-order broadcast";
    case CollectiveOp::kJoin: return "DDP join check";
    case CollectiveOp::kReduceScatter: return "reduce_scatter_tensor";
    case CollectiveOp::kAllGatherIntoTensor: return "all_gather_into_tensor";
    case CollectiveOp::kAllToAll: return "all_to_all_single";
    case CollectiveOp::kReduce: return "reduce";
    case CollectiveOp::kGather: return "gather";
    case CollectiveOp::kScatter: return "scatter";
  }
  return "an unknown collective";
}

const char* reduce_op_name(int64_t op) {
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    default: return "another reduce op";
  }
}

std::string describe(const int64_t* f) {
  std::ostringstream out;
  out << name_of(f[0]);
  if (f[1] >= 0) out << " #" << f[1];
  if (f[2] != static_cast<int64_t>(c10::ScalarType::Undefined)) {
    out << " of " << f[3] << " " << c10::toString(static_cast<c10::ScalarType>(f[2])) << " elements";
  }
  if (f[4] >= 0) out << " from rank " << f[4];
  if (f[5] >= 0) out << " in iteration " << f[5];
  if (f[6] >= 0) out << " with " << reduce_op_name(f[6]);
  return out.str();
}

}  // namespace

void verify_same_collective(const ProcessGroupPtr& group, const CollectiveFingerprint& mine, const char* who) {
  const int world = group->getSize();
  if (world == 1) return;
  at::Tensor own = at::tensor({static_cast<int64_t>(mine.op), mine.index, static_cast<int64_t>(mine.dtype), mine.numel,
                               mine.root, mine.iteration, mine.reduce_op},
                              at::kLong);
  std::vector<at::Tensor> input{own.to(collective_device(group))};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world; ++r) output[0].push_back(at::empty_like(input[0]));
  wait_collective(group->allgather(output, input), [who] { return std::string(who) + ": the check that every rank "
                                                                   "runs the same collective"; });
  std::vector<int64_t> all(world * kFields);
  for (int r = 0; r < world; ++r) {
    const at::Tensor theirs = output[0][r].cpu();
    std::copy(theirs.data_ptr<int64_t>(), theirs.data_ptr<int64_t>() + kFields, all.begin() + r * kFields);
  }
  bool same = true;
  for (int r = 1; r < world && same; ++r) same = std::equal(all.begin(), all.begin() + kFields, all.begin() + r * kFields);
  if (same) return;
  std::ostringstream message;
  message << who << ": the ranks are not running the same collective (they would pair up mismatched data): ";
  std::vector<int> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r] = r;
  message << join_limited(ranks, 8, ", ", [&](int r) {
    return "rank " + std::to_string(r) + " runs " + describe(all.data() + r * kFields);
  });
  message << ". Every rank must run the same collectives in the same order (uneven inputs: see ddp::Join)";
  throw CollectiveError(message.str());
}

}  // namespace ddp::detail
