#include "fsdp/sharded_unit.h"

#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

namespace ddp::detail {
namespace {

// The full parameters' storage is freed between uses and filled again in place (not replaced):
// autograd may have saved views of it (a Linear's weight.t()), which must see the gathered values
// again in backward, and must not keep the memory alive while the unit is sharded.
void free_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr(at::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
}

void allocate_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (storage->nbytes() >= bytes) return;
  storage->set_data_ptr(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

// The collectives move 16-bit floats as int16: a copy of the bits, which every backend takes
// (LibTorch 1.13's Gloo refuses bfloat16).
at::Tensor as_wire(const at::Tensor& tensor) {
  return tensor.element_size() == 2 ? tensor.view(at::kShort) : tensor;
}

void swap_grad(at::Tensor& param, at::Tensor& waiting) {
  at::Tensor current = param.grad();
  param.mutable_grad() = std::move(waiting);
  waiting = std::move(current);
}

}  // namespace

int ShardGroups::data_parallel_size() const {
  return shard->getSize() * (replicate ? replicate->getSize() : 1);
}

ShardedUnit::ShardedUnit(const std::shared_ptr<torch::nn::Module>& module, std::vector<std::string> names,
                         std::vector<at::Tensor> params, FSDPOptions options, ShardGroups groups)
    : module_(module),
      module_address_(module.get()),
      names_(std::move(names)),
      params_(std::move(params)),
      options_(std::move(options)),
      groups_(std::move(groups)) {
  torch::NoGradGuard no_grad;
  // 1. Rank 0's values on every rank: along the replicas first, then inside each shard group.
  for (auto& param : params_) {
    at::Tensor data = param.detach();
    if (groups_.replicate) broadcast(data, 0, groups_.replicate);
    broadcast(data, 0, groups_.shard);
  }
  // 2. The layout, this rank's chunks, and the full parameters' storage (empty until gathered).
  std::vector<std::vector<int64_t>> shapes;
  int64_t full_numel = 0;
  for (const auto& param : params_) {
    shapes.push_back(param.sizes().vec());
    full_numel += param.numel();
  }
  layout_ = ShardLayout(shapes, groups_.shard->getSize(), groups_.shard->getRank());
  const auto options_of_params = params_.empty() ? at::TensorOptions() : params_[0].options();
  flat_shard_ = at::empty({layout_.flat_numel()}, options_of_params);
  full_ = at::empty({full_numel}, options_of_params.dtype(compute_dtype()));
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    layout_.copy_local_rows(params_[i].detach(), i, flat_shard_);
    shard_views_.push_back(layout_.shard_view(flat_shard_, i));
    full_views_.push_back(full_.narrow(0, offset, params_[i].numel()).view(params_[i].sizes()));
    offset += params_[i].numel();
  }
  free_storage(full_);
  // 3. The module's parameters become their shards (the same tensors: optimizers built on them
  // before still hold them). The full values are released here.
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].mutable_grad() = at::Tensor();
    params_[i].set_data(shard_views_[i]);
  }
  waiting_grads_.resize(params_.size());
}

ShardedUnit::~ShardedUnit() { disarm_backward(); }

c10::ScalarType ShardedUnit::compute_dtype() const {
  if (const auto& dtype = options_.mixed_precision().param_dtype()) return *dtype;
  return params_.empty() ? at::kFloat : params_[0].scalar_type();
}

// ---------------------------------------------------------------------------------------------
// Gathering and freeing
// ---------------------------------------------------------------------------------------------

void ShardedUnit::unshard() {
  if (state_ == State::kUnsharded) return;
  allocate_storage(full_);
  if (layout_.flat_numel() > 0) {
    // One all-gather of every rank's flat chunks (in the compute dtype: half the bytes in bf16),
    // then each parameter's chunks side by side into its full storage.
    at::Tensor send = flat_shard_.to(compute_dtype());
    at::Tensor gathered = at::empty({layout_.flat_numel() * layout_.world()}, send.options());
    at::Tensor wire = as_wire(gathered);
    all_gather_into_tensor(wire, as_wire(send), groups_.shard);
    for (size_t i = 0; i < params_.size(); ++i) full_views_[i].copy_(layout_.full_from_gathered(gathered, i));
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    swap_grad(params_[i], waiting_grads_[i]);
    params_[i].set_data(full_views_[i]);
  }
  state_ = State::kUnsharded;
}

void ShardedUnit::reshard() {
  if (state_ == State::kSharded) return;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    swap_grad(params_[i], waiting_grads_[i]);
    params_[i].set_data(shard_views_[i]);
  }
  free_storage(full_);
  state_ = State::kSharded;
}

at::Tensor ShardedUnit::cast_input(const at::Tensor& input) const {
  const auto& policy = options_.mixed_precision();
  if (!policy.param_dtype() || !policy.cast_forward_inputs() || !input.defined() || !input.is_floating_point()) {
    return input;
  }
  return input.to(*policy.param_dtype());
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

void ShardedUnit::before_forward() {
  unshard();
  bool trains = false;
  for (const auto& param : params_) trains = trains || param.requires_grad();
  if (torch::GradMode::is_enabled() && trains) arm_backward();
}

// The root keeps its full parameters for the backward that comes first to it; so does every unit
// with reshard_after_forward(false). With no backward coming, nothing is kept.
bool ShardedUnit::keeps_after_forward() const {
  return backward_ == Backward::kExpecting && (tree_->is_root(this) || !options_.reshard_after_forward());
}

void ShardedUnit::after_forward(const std::vector<at::Tensor>& outputs) {
  if (!keeps_after_forward()) reshard();
  if (backward_ != Backward::kExpecting) return;
  // The gradient reaching any output is the moment this block's backward begins.
  std::weak_ptr<ShardedUnit> weak = weak_from_this();
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    at::Tensor(output).register_hook([weak](const at::Tensor&) {
      if (auto unit = weak.lock()) unit->before_backward();
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

void ShardedUnit::arm_backward() {
  disarm_backward();
  std::weak_ptr<ShardedUnit> weak = weak_from_this();
  ready_.assign(params_.size(), false);
  pending_ = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto unit = weak.lock()) unit->on_gradient_ready(i);
          return outputs;
        })));
    accumulators_.push_back(std::move(accumulator));
    ++pending_;
  }
  backward_ = Backward::kExpecting;
}

void ShardedUnit::disarm_backward() {
  for (size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(hook_keys_[k]);
  accumulators_.clear();
  hook_keys_.clear();
}

void ShardedUnit::before_backward() {
  if (backward_ != Backward::kExpecting) return;
  unshard();
  tree_->backward_started();
}

void ShardedUnit::on_gradient_ready(size_t i) {
  if (backward_ != Backward::kExpecting || ready_[i]) return;
  ready_[i] = true;
  if (--pending_ == 0) reduce_gradients();
}

// Every full gradient of the unit cut into the ranks' chunks, summed chunk by chunk across the
// group (one reduce-scatter; across the replicas too, for HSDP), averaged, and added to the
// shards' gradients. Without sync the full gradients are kept for the next backward to add to.
void ShardedUnit::reduce_gradients() {
  disarm_backward();
  backward_ = Backward::kReduced;
  if (requires_sync_ && layout_.flat_numel() > 0) {
    const auto reduce_dtype = options_.mixed_precision().reduce_dtype().value_or(flat_shard_.scalar_type());
    at::Tensor input = at::zeros({layout_.flat_numel() * layout_.world()}, flat_shard_.options().dtype(reduce_dtype));
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& full = params_[i].grad();
      if (full.defined()) layout_.place_in_segments(full.to(reduce_dtype), i, input);
    }
    input.div_(groups_.data_parallel_size());
    at::Tensor output = at::empty({layout_.flat_numel()}, input.options());
    reduce_scatter_tensor(output, input, c10d::ReduceOp::SUM, groups_.shard);
    if (groups_.replicate) all_reduce(output, c10d::ReduceOp::SUM, groups_.replicate);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad()) continue;
      // A tensor of its own, not a view of `output`: optimizers detach_() gradients in place.
      at::Tensor shard_grad = layout_.shard_view(output, i).to(flat_shard_.scalar_type(), false, /*copy=*/true);
      at::Tensor& waiting = waiting_grads_[i];  // the shard's gradient, accumulated until zero_grad
      if (waiting.defined()) {
        waiting.add_(shard_grad);
      } else {
        waiting = shard_grad;
      }
      params_[i].mutable_grad() = at::Tensor();  // the full gradient is reduced: freed
    }
  }
  reshard();
}

void ShardedUnit::finish_backward() {
  if (backward_ == Backward::kExpecting) reduce_gradients();  // parameters that got no gradient
  backward_ = Backward::kIdle;
  reshard();
}

bool ShardedUnit::owns(const at::Tensor& param) const {
  for (const auto& mine : params_) {
    if (mine.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return true;
  }
  return false;
}

bool ShardedUnit::is_of(const torch::nn::Module& module) const {
  return module_address_ == &module && !module_.expired();
}

// ---------------------------------------------------------------------------------------------
// The tree
// ---------------------------------------------------------------------------------------------

void ShardTree::backward_started() {
  if (finish_queued_) return;
  finish_queued_ = true;
  std::weak_ptr<ShardTree> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto tree = weak.lock()) tree->finish();
  });
}

// In order of sharding (the blocks before their root), so that every rank reduces in one order.
void ShardTree::finish() {
  finish_queued_ = false;
  for (const auto& weak : units_) {
    if (auto unit = weak.lock()) unit->finish_backward();
  }
}

}  // namespace ddp::detail
