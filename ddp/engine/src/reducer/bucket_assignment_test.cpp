// Bucket assignment, device-free: devices are just names here, so the multi-device (model
// parallel) rules are tested on a CPU-only machine.
#include <gtest/gtest.h>

#include "ddp/engine/src/reducer/bucket_assignment.h"

namespace {

using ddp::BucketParam;
using Buckets = std::vector<std::vector<size_t>>;

BucketParam p(const char* device, c10::ScalarType dtype, int64_t bytes) {
  return BucketParam{c10::Device(device), dtype, bytes};
}

std::vector<size_t> reversed(size_t n) {
  std::vector<size_t> order;
  for (size_t i = n; i-- > 0;) order.push_back(i);
  return order;
}

TEST(BucketAssignment, FirstBucketSmallThenCap) {
  std::vector<BucketParam> params(6, p("cpu", c10::kFloat, 400));
  // first cap 500: closes after 2 params (800 >= 500); then cap 1000: 3 params (1200 >= 1000).
  EXPECT_EQ(ddp::assign_buckets(params, reversed(6), 500, 1000), (Buckets{{5, 4}, {3, 2, 1}, {0}}));
}

TEST(BucketAssignment, ZeroCapGivesOneBucketPerParameter) {
  std::vector<BucketParam> params(3, p("cpu", c10::kFloat, 4));
  EXPECT_EQ(ddp::assign_buckets(params, reversed(3), 0, 0), (Buckets{{2}, {1}, {0}}));
}

TEST(BucketAssignment, HugeCapGivesOneBucket) {
  std::vector<BucketParam> params(4, p("cpu", c10::kFloat, 4));
  EXPECT_EQ(ddp::assign_buckets(params, reversed(4), 1 << 30, 1 << 30), (Buckets{{3, 2, 1, 0}}));
}

TEST(BucketAssignment, NeverMixesDevicesOrDtypes) {
  // The tutorial's model-parallel case: net1 on one device, net2 on another, plus a double param.
  std::vector<BucketParam> params = {p("cuda:0", c10::kFloat, 8), p("cuda:0", c10::kFloat, 8),
                                     p("cuda:1", c10::kFloat, 8), p("cuda:1", c10::kFloat, 8),
                                     p("cpu", c10::kDouble, 8),   p("cuda:1", c10::kHalf, 8)};
  const auto buckets = ddp::assign_buckets(params, reversed(6), 1 << 20, 1 << 20);
  for (const auto& bucket : buckets) {
    for (size_t member : bucket) {
      EXPECT_EQ(params[member].device, params[bucket.front()].device);
      EXPECT_EQ(params[member].dtype, params[bucket.front()].dtype);
    }
  }
  // Order follows readiness of each bucket's first member: 5 (half), 4 (double), {3,2}, {1,0}.
  EXPECT_EQ(buckets, (Buckets{{5}, {4}, {3, 2}, {1, 0}}));
}

TEST(BucketAssignment, EachDeviceHasItsOwnSmallFirstBucket) {
  std::vector<BucketParam> params = {p("cuda:0", c10::kFloat, 600), p("cuda:0", c10::kFloat, 600),
                                     p("cuda:1", c10::kFloat, 600), p("cuda:1", c10::kFloat, 600)};
  // first cap 500 closes at once on each device, then cap 2000 keeps the rest together.
  EXPECT_EQ(ddp::assign_buckets(params, reversed(4), 500, 2000), (Buckets{{3}, {2}, {1}, {0}}));
  EXPECT_EQ(ddp::assign_buckets(params, reversed(4), 1200, 2000), (Buckets{{3, 2}, {1, 0}}));
}

TEST(BucketAssignment, FollowsTheGivenOrder) {
  std::vector<BucketParam> params(4, p("cpu", c10::kFloat, 4));
  EXPECT_EQ(ddp::assign_buckets(params, {1, 3, 0, 2}, 8, 8), (Buckets{{1, 3}, {0, 2}}));
}

TEST(BucketAssignment, RejectsBadIndex) {
  std::vector<BucketParam> params(2, p("cpu", c10::kFloat, 4));
  EXPECT_THROW(ddp::assign_buckets(params, {0, 5}, 8, 8), std::out_of_range);
}

}  // namespace
