#pragma once
// A gradient bucket: one flat tensor that several parameters' gradients are copied into (or live
// in, with gradient_as_bucket_view), reduced by one collective.
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace ddp::detail {

struct Bucket {
  std::vector<size_t> params;           // reducer-wide parameter indices, in bucket order
  at::Tensor flat;                      // contiguous storage of all members
  std::vector<at::Tensor> views;        // views[k]: params[k]'s slot, shaped like the parameter
  std::vector<at::Tensor> collective;   // {flat}: the argument list reused by every launch
  at::Tensor scale;                     // 1/world_size, 0-dim, bucket dtype and device
  // Reduced where the gradients lie (shared memory, OwnedGroup::start_scaled_sum) instead of in
  // `flat`: a gradient usable as it is never enters the bucket, and the average is taken in the
  // reduction's own pass. Only without a comm hook (hooks are given `flat`).
  bool in_place = false;
  std::vector<at::Tensor> pieces;       // in_place: this launch's list, reused (no allocation per step)
  size_t pending = 0;                   // members not ready yet in this iteration
  c10::intrusive_ptr<c10d::Work> work;  // the in-flight allreduce, if launched
};

// Where a parameter's gradient lives: which bucket, and which of its views (its slot).
struct BucketPlace {
  size_t bucket = 0;
  size_t index = 0;
};

}  // namespace ddp::detail
