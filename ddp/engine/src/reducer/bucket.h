#pragma once
// A gradient bucket: one flat tensor that several parameters' gradients are copied into (or live
// in, with gradient_as_bucket_view), reduced by one collective.
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace ddp::detail {

// How a bucket is reduced; chosen when it is built, the same on every rank.
enum class Reduction {
  kFlat,     // `flat` through the group's allreduce: gradients copied in (pre-divided), or a comm hook's
  // Shared memory, without a comm hook (the average taken in the reduction's own pass):
  kInPlace,  // each gradient where it lies, or in its slot when it cannot be used as it is
  kShared,   // `flat` lives in memory every rank maps, the gradients in it (gradient_as_bucket_view):
             // each rank reduces its slice of every rank's bucket and writes it into all of them
};

struct Bucket {
  std::vector<size_t> params;           // reducer-wide parameter indices, in bucket order
  at::Tensor flat;                      // contiguous storage of all members
  std::vector<at::Tensor> views;        // views[k]: params[k]'s slot, shaped like the parameter
  std::vector<at::Tensor> collective;   // {flat}: the argument list reused by every launch
  at::Tensor scale;                     // 1/world_size, 0-dim, bucket dtype and device
  Reduction reduction = Reduction::kFlat;
  std::vector<at::Tensor> pieces;       // kInPlace: this launch's list, reused (no allocation per step)
  size_t pending = 0;                   // members not ready yet in this iteration
  c10::intrusive_ptr<c10d::Work> work;  // the in-flight allreduce, if launched
};

// Where a parameter's gradient lives: which bucket, and which of its views (its slot).
struct BucketPlace {
  size_t bucket = 0;
  size_t index = 0;
};

}  // namespace ddp::detail
