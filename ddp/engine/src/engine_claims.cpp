#include "ddp/engine/src/engine_claims.h"

#include <mutex>
#include <unordered_map>

namespace ddp::detail {
namespace {

struct Claims {
  std::mutex mutex;
  std::unordered_map<const void*, int> ddp;  // a parameter's TensorImpl: live wrappers over it
};

Claims& claims() {
  static Claims instance;
  return instance;
}

}  // namespace

void claim_for_ddp(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(claims().mutex);
  for (const auto& param : params) ++claims().ddp[param.unsafeGetTensorImpl()];
}

void release_from_ddp(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(claims().mutex);
  for (const auto& param : params) {
    auto found = claims().ddp.find(param.unsafeGetTensorImpl());
    if (found != claims().ddp.end() && --found->second == 0) claims().ddp.erase(found);
  }
}

const char* engine_wrapping(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(claims().mutex);
  return claims().ddp.count(param.unsafeGetTensorImpl()) ? "DistributedDataParallel" : nullptr;
}

}  // namespace ddp::detail
