#include "ddp/engine/src/zero/shard_tensors.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ddp/wait_collective.h>

namespace ddp::detail {

at::Tensor flatten_as_views(std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  int64_t numel = 0;
  for (const auto& param : params) numel += param.numel();
  at::Tensor flat = at::empty({numel}, params.front().options().requires_grad(false));
  int64_t offset = 0;
  for (auto& param : params) {
    at::Tensor view = flat.narrow(0, offset, param.numel()).view(param.sizes());
    view.copy_(param.detach());
    param.set_data(view);
    offset += param.numel();
  }
  return flat;
}

void BroadcastBatch::launch(const ProcessGroupPtr& group, const at::Tensor& tensor, int root,
                            std::function<std::string()> what) {
  Launched item{tensor, tensor.is_contiguous() ? tensor : tensor.contiguous(), std::move(what), {}};
  std::vector<at::Tensor> tensors{item.sent};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  item.work = group->broadcast(tensors, options);
  launched_.push_back(std::move(item));
}

void BroadcastBatch::wait_all() {
  std::vector<Launched> launched = std::move(launched_);
  launched_.clear();
  at::NoGradGuard no_grad;
  for (auto& item : launched) {
    wait_collective(item.work, item.what);
    if (!item.sent.is_same(item.target)) item.target.copy_(item.sent);
  }
}

}  // namespace ddp::detail
