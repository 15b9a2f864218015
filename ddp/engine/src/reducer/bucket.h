#pragma once
// A gradient bucket: several parameters' gradients reduced by one collective. Its storage and how
// it is reduced are the floor's (gradient_buffers.h); the reducer keeps which parameters it holds
// and this pass's progress.
#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "ddp/floor/src/gradient_buffers.h"

namespace ddp::detail {

struct Bucket {
  std::vector<size_t> params;              // reducer-wide parameter indices, in bucket order
  std::unique_ptr<GradientBuffer> buffer;  // member k is params[k]
  size_t pending = 0;                      // members not ready yet in this iteration
  c10::intrusive_ptr<c10d::Work> work;     // the in-flight average, if launched
};

// Where a parameter's gradient lives: which bucket, and which of its members.
struct BucketPlace {
  size_t bucket = 0;
  size_t index = 0;
};

}  // namespace ddp::detail
