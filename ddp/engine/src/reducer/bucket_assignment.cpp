#include "ddp/engine/src/reducer/bucket_assignment.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const std::vector<size_t>& order,
                                                int64_t first_cap_bytes, int64_t cap_bytes) {
  struct OpenBucket {
    std::vector<size_t> members;
    int64_t bytes = 0;
    int64_t cap = 0;
  };
  using Key = std::pair<std::string, c10::ScalarType>;  // (device, dtype)
  std::map<Key, OpenBucket> open;
  std::vector<std::vector<size_t>> buckets;

  for (size_t index : order) {
    if (index >= params.size()) throw std::out_of_range("assign_buckets: parameter index out of range");
    const BucketParam& param = params[index];
    auto [it, inserted] = open.try_emplace(Key{param.device.str(), param.dtype});
    OpenBucket& bucket = it->second;
    if (inserted) bucket.cap = first_cap_bytes;
    bucket.members.push_back(index);
    bucket.bytes += param.bytes;
    if (bucket.bytes >= bucket.cap) {
      buckets.push_back(std::move(bucket.members));
      bucket = OpenBucket{{}, 0, cap_bytes};
    }
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.members.empty()) buckets.push_back(std::move(bucket.members));
  }

  // Launch order = readiness order of each bucket's first member.
  std::vector<size_t> position(params.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::sort(buckets.begin(), buckets.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return buckets;
}

}  // namespace ddp
