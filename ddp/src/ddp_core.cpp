#include "ddp/ddp_core.h"

#include <stdexcept>
#include <unordered_set>

#include <ATen/core/grad_mode.h>

#include "backends.h"
#include "reducer.h"
#include "state_sync.h"

namespace ddp::detail {

struct DDPCore::Impl {
  torch::nn::Module* module = nullptr;
  ProcessGroupPtr group;           // what DDP's collectives run on (see the constructor)
  std::vector<at::Tensor> params;  // those that require grad, deduplicated, registration order
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;
  std::shared_ptr<Reducer> reducer;
  std::unique_ptr<TensorBroadcaster> buffer_broadcaster;
};

DDPCore::DDPCore(torch::nn::Module& module, DDPOptions options)
    : impl_(std::make_unique<Impl>()), options_(std::move(options)) {
  if (!options_.process_group()) options_.process_group(ddp::default_group());
  // DDP's own collectives go over a group of their own (same ranks, own connections), so that none
  // of them can ever pair with a collective the program runs on the group it passed in: uneven
  // loops become an error instead of silently averaging the wrong tensors. A group this library did
  // not make (built with c10d directly) cannot be split: then DDP shares it.
  impl_->group = split_off(options_.process_group(), "ddp");
  if (!impl_->group) impl_->group = options_.process_group();
  const ProcessGroupPtr& group = impl_->group;
  if (options_.bucket_cap_mb() < 0 || options_.first_bucket_cap_mb() < 0) {
    throw std::invalid_argument("DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be >= 0, got " +
                                std::to_string(options_.bucket_cap_mb()) + " and " +
                                std::to_string(options_.first_bucket_cap_mb()));
  }
  impl_->module = &module;

  // Shared parameters appear once; parameters that do not require grad are never reduced.
  std::unordered_set<const void*> seen;
  std::vector<at::Tensor> all_state;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& param = item.value();
    if (!seen.insert(param.unsafeGetTensorImpl()).second) continue;
    all_state.push_back(param);
    if (param.is_sparse()) {
      throw std::invalid_argument("DistributedDataParallel: parameter '" + item.key() +
                                  "' is sparse; only dense parameters are supported");
    }
    if (!param.requires_grad()) continue;
    impl_->params.push_back(param);
    impl_->names.push_back(item.key());
  }
  if (impl_->params.empty()) {
    throw std::invalid_argument("DistributedDataParallel: the module has no parameter that requires a "
                                "gradient, so there is nothing to synchronize (wrapping it is not needed)");
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) impl_->buffers.push_back(item.value());
  }

  verify_same_parameters(impl_->params, impl_->names, group);
  // Every rank starts from rank 0's parameters and buffers.
  std::vector<at::Tensor> state = all_state;
  state.insert(state.end(), impl_->buffers.begin(), impl_->buffers.end());
  TensorBroadcaster(state, group).broadcast_from(0);
  if (options_.broadcast_buffers() && !impl_->buffers.empty() && group->getSize() > 1) {
    impl_->buffer_broadcaster = std::make_unique<TensorBroadcaster>(impl_->buffers, group);
  }

  ReducerOptions reducer_options;
  reducer_options.first_bucket_bytes = static_cast<int64_t>(options_.first_bucket_cap_mb() * 1024 * 1024);
  reducer_options.bucket_bytes = static_cast<int64_t>(options_.bucket_cap_mb() * 1024 * 1024);
  reducer_options.find_unused_parameters = options_.find_unused_parameters();
  reducer_options.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  reducer_options.static_graph = options_.static_graph();
  impl_->reducer = Reducer::create(impl_->params, impl_->names, group, reducer_options);
}

DDPCore::~DDPCore() = default;

void DDPCore::before_forward() {
  impl_->reducer->prepare_for_forward();
  if (impl_->buffer_broadcaster) impl_->buffer_broadcaster->broadcast_from(0);
}

bool DDPCore::wants_outputs() const { return impl_->reducer->wants_outputs(); }

void DDPCore::after_forward(const std::vector<at::Tensor>& outputs) {
  // Like PyTorch: a forward without grad mode (evaluation) does not touch the reducer.
  if (!at::GradMode::is_enabled()) return;
  impl_->reducer->prepare_for_backward(require_sync_, outputs);
}

void DDPCore::module_moved() {
  impl_->reducer->reallocate_buckets();
  if (impl_->buffer_broadcaster) {
    impl_->buffer_broadcaster = std::make_unique<TensorBroadcaster>(impl_->buffers, impl_->group);
  }
}

void DDPCore::register_comm_hook(CommHook hook) { impl_->reducer->register_comm_hook(std::move(hook)); }

Stateful* DDPCore::comm_hook_state() const {
  const CommHook* hook = impl_->reducer->comm_hook();
  return hook ? hook->state().get() : nullptr;
}

ReductionStats DDPCore::stats() const {
  const ReducerStats raw = impl_->reducer->stats();
  ReductionStats stats;
  stats.collectives_launched = raw.collectives_launched;
  stats.iterations_reduced = raw.iterations_reduced;
  stats.buckets_rebuilt = raw.buckets_rebuilt;
  for (const auto& bucket : raw.buckets) {
    std::vector<std::string> names;
    for (size_t p : bucket) names.push_back(impl_->names[p]);
    stats.buckets.push_back(std::move(names));
  }
  return stats;
}

}  // namespace ddp::detail
