// DistributedOptimizer's non-template half (ddp/distributed_optimizer.h): the optimizer's
// parameters handed to DDP's reducer in its optimizer mode, and Horovod's two broadcasts.
#include <ddp/distributed_optimizer.h>

#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include <ATen/core/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/numbers/check_number.h"
#include "ddp/engine/src/optimizer/group_options.h"
#include "ddp/engine/src/reducer/reducer.h"
#include "ddp/engine/src/reducer/state_sync.h"

namespace ddp {
namespace detail {

struct GradientAverager::Impl {
  DistributedOptimizerOptions options;
  std::shared_ptr<Reducer> reducer;
};

GradientAverager::GradientAverager(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                   DistributedOptimizerOptions options)
    : impl_(std::make_unique<Impl>()) {
  // Bad options are refused before any collective, so every rank fails alike and at once.
  if (options.backward_passes_per_step() < 1) {
    throw std::invalid_argument("DistributedOptimizer: backward_passes_per_step is " +
                                std::to_string(options.backward_passes_per_step()) +
                                "; it counts the backward passes per step() and must be at least 1");
  }
  for (const auto& [name, value] : {std::pair<const char*, double>{"bucket_cap_mb", options.bucket_cap_mb()},
                                    {"first_bucket_cap_mb", options.first_bucket_cap_mb()}}) {
    require_finite("DistributedOptimizer", name, value, 0, 1e12, " (MiB)");
  }
  if (!options.process_group()) options.process_group(ddp::default_group());
  // Its own group, as DDP's: none of its collectives can pair with one of the program's.
  ProcessGroupPtr group = split_off(options.process_group(), "optimizer");
  if (!group) {
    throw std::invalid_argument("DistributedOptimizer: the process group was built with c10d directly, so the "
                                "optimizer cannot give its collectives a group of their own. Make the group with "
                                "ddp::init_process_group (the default group) or ddp::new_group.");
  }
  // Every parameter that takes a gradient, once, in the optimizer's order; named by its place.
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::unordered_set<const void*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& group_params = groups[g].params();
    for (size_t i = 0; i < group_params.size(); ++i) {
      const at::Tensor& param = group_params[i];
      if (!param.requires_grad() || !seen.insert(param.unsafeGetTensorImpl()).second) continue;
      if (param.is_sparse()) {
        throw std::invalid_argument("DistributedOptimizer: parameter " + std::to_string(i) + " of group " +
                                    std::to_string(g) + " is sparse; only dense parameters are supported");
      }
      params.push_back(param);
      names.push_back("group " + std::to_string(g) + " parameter " + std::to_string(i));
    }
  }
  if (params.empty()) {
    throw std::invalid_argument("DistributedOptimizer: the optimizer has no parameter that requires a gradient, so "
                                "there is nothing to average");
  }
  verify_same_parameters(params, names, group, "DistributedOptimizer");

  ReducerOptions reducer_options;
  reducer_options.first_bucket_bytes = static_cast<int64_t>(options.first_bucket_cap_mb() * 1024 * 1024);
  reducer_options.bucket_bytes = static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024);
  reducer_options.find_unused_parameters = false;
  reducer_options.gradient_as_bucket_view = false;
  reducer_options.static_graph = false;
  reducer_options.bucket_cap_auto = false;
  reducer_options.trigger = PassTrigger::kFirstGradient;
  reducer_options.passes_per_step = options.backward_passes_per_step();
  reducer_options.owner = "DistributedOptimizer";
  impl_->reducer = Reducer::create(std::move(params), std::move(names), std::move(group), reducer_options);
  impl_->options = std::move(options);
}

GradientAverager::~GradientAverager() = default;

void GradientAverager::before_step() { impl_->reducer->check_passes_before_step(); }

// What DDP does before the next forward: the one bucket rebuild in observed gradient order.
void GradientAverager::after_step() { impl_->reducer->prepare_for_forward(); }

void GradientAverager::register_comm_hook(CommHook hook) { impl_->reducer->register_comm_hook(std::move(hook)); }

ReductionStats GradientAverager::stats() const { return impl_->reducer->reduction_stats(); }

const DistributedOptimizerOptions& GradientAverager::options() const { return impl_->options; }

}  // namespace detail

void broadcast_parameters(torch::nn::Module& module, int root, const ProcessGroupPtr& group) {
  std::vector<at::Tensor> state;
  std::vector<std::string> names;
  std::unordered_set<const void*> seen;
  auto take = [&](const torch::OrderedDict<std::string, at::Tensor>& tensors) {
    for (const auto& item : tensors) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // a shared parameter: once
      state.push_back(item.value());
      names.push_back(item.key());
    }
  };
  take(module.named_parameters(/*recurse=*/true));
  take(module.named_buffers(/*recurse=*/true));
  const ProcessGroupPtr& pg = group ? group : default_group();
  detail::verify_same_parameters(state, names, pg, "ddp::broadcast_parameters");
  if (state.empty()) return;
  at::NoGradGuard no_grad;  // writing into leaves that require grad
  detail::TensorBroadcaster(state, pg).broadcast_from(root);
}

void broadcast_optimizer_state(torch::optim::Optimizer& optimizer, int root, const ProcessGroupPtr& group) {
  // The optimizer's own archive (its state and every group's options), as bytes from the root.
  std::string bytes;
  const ProcessGroupPtr& pg = group ? group : default_group();
  if (pg->getRank() == root) {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream out;
    archive.save_to(out);
    bytes = out.str();
  }
  broadcast_bytes(bytes, root, pg);
  if (pg->getRank() != root) {
    std::istringstream in(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    optimizer.load(archive);
    // The groups' options too (learning rate, betas, ...), which LibTorch's load leaves as built.
    auto options = detail::saved_group_options(archive, optimizer.param_groups());
    for (size_t g = 0; g < options.size(); ++g) optimizer.param_groups()[g].set_options(std::move(options[g]));
  }
}

}  // namespace ddp
