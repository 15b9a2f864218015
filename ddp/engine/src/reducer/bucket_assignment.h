#pragma once
// Which parameters share a gradient bucket. A pure function of sizes, devices and dtypes, so it is
// tested without any device or process group.
#include <cstdint>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace ddp {

struct BucketParam {
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
  int64_t bytes = 0;
};

// Walks `order` (parameter indices, in the order their gradients are expected to be ready) and
// closes a bucket once it holds at least the cap: `first_cap_bytes` for the first bucket of each
// (device, dtype), `cap_bytes` after. A bucket never mixes devices or dtypes. Buckets come back
// sorted by when their first parameter is ready, which is the order they are launched in.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const std::vector<size_t>& order,
                                                int64_t first_cap_bytes, int64_t cap_bytes);

}  // namespace ddp
