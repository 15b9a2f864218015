#include "ddp/engine/src/fsdp/sharded_unit.h"

#include <cstddef>

#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <ddp/wait_collective.h>

#include "ddp/floor/src/free_collective.h"
#include "ddp/engine/src/observe/timeline.h"
#include "ddp/internal/compat/optimizer_state.h"

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

// A span of this unit's on the TORCHDDP_TIMELINE trace (observe/timeline.h), when there is one.
class UnitSpan {
 public:
  UnitSpan(Timeline::Row row, const char* name, const std::string& unit)
      : timeline_(Timeline::get()), row_(row), name_(name), unit_(unit), start_ns_(timeline_ ? now_ns() : 0) {}
  ~UnitSpan() {
    if (timeline_) timeline_->span(row_, name_, start_ns_, now_ns(), "\"unit\": \"" + unit_ + "\"");
  }
  UnitSpan(const UnitSpan&) = delete;
  UnitSpan& operator=(const UnitSpan&) = delete;

 private:
  Timeline* timeline_;
  Timeline::Row row_;
  const char* name_;
  const std::string& unit_;
  int64_t start_ns_;
};

// visit(at::Tensor&) on each tensor of `optimizer`'s state for `param` (none without either).
template <typename Visit>
void for_each_state_of(torch::optim::Optimizer* optimizer, const at::Tensor& param, Visit&& visit) {
  if (optimizer == nullptr) return;
  auto& states = optimizer->state();
  auto found = states.find(compat::optimizer_state_key(states, param));
  if (found != states.end()) for_each_state_tensor(*found->second, visit);
}

// Parameters smaller than this many elements travel packed, in one collective per unit.
constexpr int64_t kPackedBelow = int64_t{1} << 16;

// A full gradient's rows into their ranks' chunks ({W, chunk} rows of a zeroed buffer): the
// padding after the last rows stays zero.
void copy_into_chunks(const at::Tensor& full, const at::Tensor& chunks) {
  const at::Tensor flat = full.reshape(-1);
  const int64_t chunk = chunks.size(1);
  for (int64_t r = 0; r < chunks.size(0) && r * chunk < flat.numel(); ++r) {
    const int64_t n = std::min(chunk, flat.numel() - r * chunk);
    chunks[r].narrow(0, 0, n).copy_(flat.narrow(0, r * chunk, n));
  }
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
      groups_(std::move(groups)),
      label_(module->name() + (names_.empty() ? std::string() : " (" + names_.front() + ", ...)")) {
  Timeline::open_for_rank(is_initialized() ? get_rank() : groups_.shard->getRank());
  torch::NoGradGuard no_grad;
  // 1. Rank 0's values on every rank: along the replicas first, then inside each shard group.
  for (auto& param : params_) {
    at::Tensor data = param.detach();
    if (groups_.replicate) broadcast(data, 0, groups_.replicate);
    broadcast(data, 0, groups_.shard);
  }
  // 2. The layout, this rank's chunks, and the full parameters' storage (empty until gathered):
  // each parameter padded to W chunks, so that its all-gather lands straight in place.
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& param : params_) shapes.push_back(param.sizes().vec());
  layout_ = ShardLayout(shapes, groups_.shard->getSize(), groups_.shard->getRank(), kPackedBelow);
  const auto options_of_params = params_.empty() ? at::TensorOptions() : params_[0].options();
  flat_shard_ = at::empty({layout_.flat_numel()}, options_of_params);
  full_ = at::empty({layout_.flat_numel() * layout_.world()}, options_of_params.dtype(compute_dtype()));
  for (size_t i = 0; i < params_.size(); ++i) {
    layout_.copy_local_rows(params_[i].detach(), i, flat_shard_);
    shard_views_.push_back(layout_.shard_view(flat_shard_, i));
    full_views_.push_back(full_region(i).narrow(0, 0, params_[i].numel()).view(params_[i].sizes()));
  }
  free_storage(full_);
  // 3. The module's parameters become their shards (the same tensors: optimizers built on them
  // before still hold them). The full values are released here.
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].mutable_grad() = at::Tensor();
    params_[i].set_data(shard_views_[i]);
  }
  waiting_grads_.resize(params_.size());
  counted_grad_bytes_.assign(params_.size(), 0);
}

ShardedUnit::~ShardedUnit() { disarm_backward(); }

c10::ScalarType ShardedUnit::compute_dtype() const {
  if (const auto& dtype = options_.mixed_precision().param_dtype()) return *dtype;
  return params_.empty() ? at::kFloat : params_[0].scalar_type();
}

// ---------------------------------------------------------------------------------------------
// Gathering and freeing
// ---------------------------------------------------------------------------------------------

// Parameter i's W chunks side by side in the full storage: its all-gather's output, whose
// first rows are the parameter.
at::Tensor ShardedUnit::full_region(size_t i) const {
  const ShardSlot& slot = layout_.slots()[i];
  return full_.narrow(0, slot.offset * layout_.world(), slot.padded_numel() * layout_.world());
}

void ShardedUnit::allocate_full() {
  if (full_allocated_) return;
  allocate_storage(full_);
  tree_->count_unsharded(full_.nbytes());
  full_allocated_ = true;
}

void ShardedUnit::free_full() {
  if (!full_allocated_) return;
  free_storage(full_);
  tree_->count_unsharded(-static_cast<int64_t>(full_.nbytes()));
  full_allocated_ = false;
}

// One all-gather per parameter, of its chunk into its place in the full storage, and one for the
// packed small ones together (in the compute dtype: half the bytes in bf16); launched now, waited
// for by unshard().
void ShardedUnit::start_gather() {
  if (state_ != State::kSharded || gather_ || layout_.flat_numel() == 0) return;
  allocate_full();
  InFlight gather;
  at::Tensor send = flat_shard_.to(compute_dtype());  // alive until waited for
  verify_if_detail(groups_.shard, fingerprint(CollectiveOp::kAllGatherIntoTensor, send), "ddp::fully_shard");
  if (layout_.packed_numel() > 0) {
    at::Tensor input = as_wire(send.narrow(0, 0, layout_.packed_numel()));
    gather.outputs.push_back(at::empty({layout_.packed_numel() * layout_.world()}, send.options()));
    at::Tensor output = as_wire(gather.outputs.back());
    gather.works.push_back(groups_.shard->_allgather_base(output, input));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardSlot& slot = layout_.slots()[i];
    if (slot.packed || slot.padded_numel() == 0) continue;
    at::Tensor input = as_wire(send.narrow(0, slot.offset, slot.padded_numel()));
    at::Tensor output = as_wire(full_region(i));
    gather.works.push_back(groups_.shard->_allgather_base(output, input));
  }
  gather.inputs.push_back(std::move(send));
  gather_ = std::move(gather);
}

void ShardedUnit::wait_gather() {
  if (!gather_) return;
  UnitSpan span(Timeline::kCommunication, "fsdp all-gather (waited for)", label_);
  InFlight gather = std::move(*gather_);
  gather_.reset();
  for (const auto& work : gather.works) wait_collective(work, "ddp::fully_shard: the all-gather of a block's parameters");
  if (layout_.packed_numel() == 0) return;
  // The packed ones from their ranks' prefixes into their places.
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardSlot& slot = layout_.slots()[i];
    if (!slot.packed) continue;
    full_region(i).view({layout_.world(), slot.padded_numel()}).copy_(layout_.packed_chunks(gather.outputs.front(), i));
  }
}

void ShardedUnit::unshard() {
  if (state_ != State::kSharded) return;
  start_gather();
  allocate_full();  // a unit with nothing to gather
  wait_gather();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
  state_ = State::kUnsharded;
}

void ShardedUnit::reshard() {
  if (state_ != State::kUnsharded) return;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(shard_views_[i]);
  free_full();
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
  tree_->forward_started(shared_from_this());
  unshard();
  if (options_.forward_prefetch()) {
    if (auto next = tree_->next_in_forward(this)) next->start_gather();  // while this block computes
  }
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
  if (backward_ != Backward::kExpecting || full_grads_) return;
  // No prefetch: the previous block's reduction buffers go before this block's gradients come.
  if (options_.backward_prefetch() == BackwardPrefetch::kNone) tree_->complete_reduction();
  unshard();
  // From here until the reduction, .grad is the full gradient autograd accumulates into (after
  // set_requires_gradient_sync(false): the sum so far); the shard's waits.
  for (size_t i = 0; i < params_.size(); ++i) swap_grad(params_[i], waiting_grads_[i]);
  full_grads_ = true;
  tree_->backward_started();
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre) prefetch_for_backward();
}

// The gather of the unit whose backward comes next, launched now to overlap what runs before it.
void ShardedUnit::prefetch_for_backward() {
  if (auto previous = tree_->previous_in_forward(this)) previous->start_gather();
}

void ShardedUnit::on_gradient_ready(size_t i) {
  if (backward_ != Backward::kExpecting || ready_[i]) return;
  ready_[i] = true;
  count_full_grad(i);
  if (--pending_ > 0) return;
  reduce_gradients();
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPost) prefetch_for_backward();
}

// One reduce-scatter per parameter, launched; complete_reduction() averages the result into the
// shards' gradients. Without sync the full gradients are kept for the next backward instead.
void ShardedUnit::reduce_gradients() {
  disarm_backward();
  backward_ = Backward::kReduced;
  if (requires_sync_ && layout_.flat_numel() > 0) {
    tree_->reduction_started(shared_from_this());  // the previous one's buffers freed first
    shard_grads_back();  // the full gradients now wait: they are read from there
    reshard();           // the full parameters are not needed to reduce: freed before any buffer
    launch_reduction();
  }
  shard_grads_back();  // without sync: the full gradients wait for the next backward
  reshard();
}

// In an order that holds little more than the full gradients at any time: first the inputs (a
// full gradient whose rows split evenly is already its W chunks side by side, rank r's rows
// r*c..: it is reduced where it lies; others are copied, padded, and let go), then the outputs
// (1/W of the inputs), then the launches. Each buffer is counted as unsharded when allocated;
// a gradient reduced where it lies keeps its count, as the input.
void ShardedUnit::launch_reduction() {
  const auto reduce_dtype = options_.mixed_precision().reduce_dtype().value_or(flat_shard_.scalar_type());
  const auto reduce_options = flat_shard_.options().dtype(reduce_dtype);
  UnitSpan span(Timeline::kBucketFill, "fsdp reduce-scatter launched", label_);
  verify_if_detail(groups_.shard,
                   fingerprint(CollectiveOp::kReduceScatter, flat_shard_, -1, static_cast<int64_t>(c10d::ReduceOp::SUM)),
                   "ddp::fully_shard");
  InFlight reduction;
  auto hold = [&](int64_t bytes) {
    tree_->count_unsharded(bytes);
    reduction.bytes += bytes;
  };
  const int world = layout_.world();
  at::Tensor packed_input;
  if (layout_.packed_numel() > 0) {
    packed_input = at::zeros({layout_.packed_numel() * world}, reduce_options);
    hold(packed_input.nbytes());
  }
  std::vector<std::pair<size_t, at::Tensor>> inputs;  // the parameters reduced one by one
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;
    const ShardSlot& slot = layout_.slots()[i];
    int64_t grad_bytes = std::exchange(counted_grad_bytes_[i], 0);
    at::Tensor full = std::exchange(waiting_grads_[i], at::Tensor());
    if (full.defined() && (full.scalar_type() != reduce_dtype || !full.is_contiguous())) {
      at::Tensor converted = full.to(reduce_dtype).contiguous();
      tree_->count_unsharded(static_cast<int64_t>(converted.nbytes()) - grad_bytes);  // the original goes
      grad_bytes = static_cast<int64_t>(converted.nbytes());
      full = std::move(converted);
    }
    at::Tensor input;  // the W chunks side by side, padded
    if (slot.packed) {
      if (full.defined()) copy_into_chunks(full, layout_.packed_chunks(packed_input, i));
    } else if (full.defined() && slot.rows == slot.chunk_rows * world) {
      input = full.view(-1);
      reduction.bytes += std::exchange(grad_bytes, 0);  // the gradient is the input: its count moves
    } else {
      input = at::zeros({slot.padded_numel() * world}, reduce_options);
      hold(input.nbytes());
      if (full.defined()) copy_into_chunks(full, input.view({world, slot.padded_numel()}));
    }
    full = at::Tensor();
    tree_->count_unsharded(-grad_bytes);
    if (input.defined()) inputs.emplace_back(i, std::move(input));
  }
  for (auto& [i, input] : inputs) {
    at::Tensor output = at::empty({layout_.slots()[i].padded_numel()}, reduce_options);
    hold(output.nbytes());
    reduction.works.push_back(groups_.shard->_reduce_scatter_base(output, input));
    reduction.views.emplace_back(i, output);
    reduction.inputs.push_back(std::move(input));
    reduction.outputs.push_back(std::move(output));
  }
  if (packed_input.defined()) {
    at::Tensor packed_output = at::empty({layout_.packed_numel()}, reduce_options);
    hold(packed_output.nbytes());
    for (size_t i = 0; i < params_.size(); ++i) {
      const ShardSlot& slot = layout_.slots()[i];
      if (slot.packed && params_[i].requires_grad()) {
        reduction.views.emplace_back(i, packed_output.narrow(0, slot.offset, slot.padded_numel()));
      }
    }
    reduction.works.push_back(groups_.shard->_reduce_scatter_base(packed_output, packed_input));
    reduction.inputs.push_back(std::move(packed_input));
    reduction.outputs.push_back(std::move(packed_output));
  }
  reduction_ = std::move(reduction);
}

// The full gradients count as unsharded from the moment autograd has accumulated them (after
// set_requires_gradient_sync(false): the sum so far, counted once) until they are reduced.
void ShardedUnit::count_full_grad(size_t i) {
  const at::Tensor& grad = params_[i].grad();
  if (!full_grads_ || !grad.defined()) return;
  const int64_t bytes = static_cast<int64_t>(grad.nbytes());
  tree_->count_unsharded(bytes - counted_grad_bytes_[i]);
  counted_grad_bytes_[i] = bytes;
}

at::Tensor& ShardedUnit::shard_grad_slot(size_t i) {
  return full_grads_ ? waiting_grads_[i] : params_[i].mutable_grad();
}

// .grad is the shard's gradient again; the full gradients, if any are left, wait.
void ShardedUnit::shard_grads_back() {
  if (!full_grads_) return;
  for (size_t i = 0; i < params_.size(); ++i) swap_grad(params_[i], waiting_grads_[i]);
  full_grads_ = false;
}

void ShardedUnit::complete_reduction() {
  if (!reduction_) return;
  InFlight reduction = std::move(*reduction_);
  reduction_.reset();
  UnitSpan span(Timeline::kCommunication, "fsdp reduce-scatter (waited for)", label_);
  for (const auto& work : reduction.works) {
    wait_collective(work, "ddp::fully_shard: the reduce-scatter of a block's gradients");
  }
  // The sum over every rank (across the replicas too, for HSDP), averaged.
  for (auto& output : reduction.outputs) {
    if (groups_.replicate) all_reduce(output, c10d::ReduceOp::SUM, groups_.replicate);
    output.div_(groups_.data_parallel_size());
  }
  for (const auto& [i, output] : reduction.views) {
    // This rank's rows as a tensor of its own (not a view: optimizers detach_() gradients in place).
    at::Tensor shard_grad = at::empty({0}, output.options());
    shard_grad.set_(output.storage(), output.storage_offset(), layout_.slots()[i].local_shape(), {});
    if (shard_grad.scalar_type() != flat_shard_.scalar_type()) shard_grad = shard_grad.to(flat_shard_.scalar_type());
    at::Tensor& slot_grad = shard_grad_slot(i);  // accumulated until zero_grad, as .grad always is
    if (slot_grad.defined()) {
      slot_grad.add_(shard_grad);
    } else {
      slot_grad = shard_grad;
    }
  }
  tree_->count_unsharded(-reduction.bytes);
}

void ShardedUnit::finish_backward() {
  if (backward_ == Backward::kExpecting) reduce_gradients();  // parameters that got no gradient
  backward_ = Backward::kIdle;
  reshard();
}

// A prefetched gather nobody unsharded with (the order changed): its values would be stale
// after the optimizer's step, so it is waited for (every rank launched it) and dropped.
void ShardedUnit::drop_unused_gather() {
  if (!gather_) return;
  wait_gather();
  if (state_ == State::kSharded) free_full();
}

// ---------------------------------------------------------------------------------------------
// Whole, for a checkpoint
// ---------------------------------------------------------------------------------------------

// Parameter i's shard-shaped `local` (a shard, or the optimizer's state of it) from every rank,
// side by side: the whole tensor, on every rank.
at::Tensor ShardedUnit::gather_rows(const at::Tensor& local, size_t i) const {
  const ShardSlot& slot = layout_.slots()[i];
  at::Tensor padded = at::zeros({slot.padded_numel()}, local.options());
  if (local.numel() > 0) padded.narrow(0, 0, local.numel()).copy_(local.reshape(-1));
  at::Tensor gathered = at::empty({slot.padded_numel() * layout_.world()}, local.options());
  at::Tensor wire = as_wire(gathered);
  all_gather_into_tensor(wire, as_wire(padded), groups_.shard);
  return gathered.narrow(0, 0, slot.rows * slot.row_numel).view(slot.shape).clone();
}

// This rank's rows of parameter i's whole-shaped `whole`, as a tensor of its own.
at::Tensor ShardedUnit::local_rows_of(const at::Tensor& whole, size_t i) const {
  const ShardSlot& slot = layout_.slots()[i];
  return whole.reshape({slot.rows, slot.row_numel})
      .narrow(0, layout_.rank() * slot.chunk_rows, slot.local_rows)
      .reshape(slot.local_shape())
      .clone();
}

void ShardedUnit::gather_whole(torch::optim::Optimizer* optimizer) {
  reshard();
  torch::NoGradGuard no_grad;
  shard_state_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    for_each_state_of(optimizer, params_[i], [&](at::Tensor& tensor) {
      if (!tensor.defined() || tensor.sizes() != shard_views_[i].sizes()) return;
      shard_state_.push_back(tensor);
      tensor = gather_rows(tensor, i);
    });
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].set_data(gather_rows(shard_views_[i], i));
  }
  state_ = State::kWhole;
}

void ShardedUnit::shard_again(torch::optim::Optimizer* optimizer, bool take_whole) {
  if (state_ != State::kWhole) return;
  torch::NoGradGuard no_grad;
  size_t next_saved = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    for_each_state_of(optimizer, params_[i], [&](at::Tensor& tensor) {
      if (!tensor.defined() || tensor.sizes() != params_[i].sizes()) return;
      if (take_whole) {
        tensor = local_rows_of(tensor.to(params_[i].device()), i);
      } else if (next_saved < shard_state_.size()) {
        tensor = shard_state_[next_saved++];
      }
    });
  }
  shard_state_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (take_whole) layout_.copy_local_rows(params_[i].detach(), i, flat_shard_);
    params_[i].set_data(shard_views_[i]);
  }
  state_ = State::kSharded;
}

int64_t ShardedUnit::shard_grad_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = full_grads_ ? waiting_grads_[i] : params_[i].grad();
    if (grad.defined()) bytes += grad.nbytes();
  }
  return bytes;
}

bool ShardedUnit::owns(const at::Tensor& param) const { return index_of(param) < params_.size(); }

size_t ShardedUnit::index_of(const at::Tensor& param) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return i;
  }
  return params_.size();
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

// In order of sharding (the blocks before their root), so that every rank reduces in one order;
// then the last reduction in flight completes.
void ShardTree::finish() {
  finish_queued_ = false;
  for (const auto& weak : units_) {
    if (auto unit = weak.lock()) unit->finish_backward();
  }
  complete_reduction();
  for (const auto& weak : units_) {
    if (auto unit = weak.lock()) unit->drop_unused_gather();
  }
}

void ShardTree::forward_started(const std::shared_ptr<ShardedUnit>& unit) {
  if (is_root(unit.get())) last_forward_order_ = std::exchange(forward_order_, {});
  forward_order_.push_back(unit);
}

namespace {
std::shared_ptr<ShardedUnit> after(const std::vector<std::weak_ptr<ShardedUnit>>& order, const ShardedUnit* unit,
                                   std::ptrdiff_t step) {
  for (size_t k = 0; k < order.size(); ++k) {
    if (order[k].lock().get() != unit) continue;
    const auto at = static_cast<std::ptrdiff_t>(k) + step;
    if (at < 0 || at >= static_cast<std::ptrdiff_t>(order.size())) return nullptr;
    return order[static_cast<size_t>(at)].lock();
  }
  return nullptr;
}
}  // namespace

std::shared_ptr<ShardedUnit> ShardTree::next_in_forward(const ShardedUnit* unit) const {
  return after(last_forward_order_, unit, +1);
}

std::shared_ptr<ShardedUnit> ShardTree::previous_in_forward(const ShardedUnit* unit) const {
  return after(forward_order_, unit, -1);
}

void ShardTree::reduction_started(const std::shared_ptr<ShardedUnit>& unit) {
  complete_reduction();
  reducing_ = unit;
}

void ShardTree::complete_reduction() {
  if (auto last = reducing_.lock()) last->complete_reduction();
  reducing_.reset();
}

}  // namespace ddp::detail
