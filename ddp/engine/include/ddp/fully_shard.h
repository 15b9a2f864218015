#pragma once
// Fully sharded data parallel (ZeRO-3; PyTorch's FSDP2 `fully_shard`): each block's parameters
// live sharded over the ranks, 1/W of every parameter on each, and are gathered only while the
// block computes. Any torch::optim optimizer steps the shards.
//
//   for (auto& block : net->blocks) ddp::fully_shard(block);  // each block: its own unit
//   auto model = ddp::fully_shard(net);                         // the root: everything else
//   torch::optim::Adam optimizer(net->parameters(), 1e-3);      // the shards
//   ...
//   // in Net::forward, each block is called through ddp::sharded_forward:
//   for (auto& block : blocks) x = ddp::sharded_forward(block, x);   // was: x = block->forward(x);
//   ...
//   auto loss = criterion(model.forward(x), y);   // the root's forward: any signature of Net
//   loss.backward();                              // gradients arrive averaged, in the shards
//   optimizer.step();
//
// The change a port makes, and why: LibTorch modules have no forward hooks, so the library cannot
// see a block start or end its forward unless the call goes through it. One line per block call
// (sharded_forward) and the fully_shard calls are all; the block classes are untouched.
//
// One unit (one fully_shard call) goes through, per iteration:
//   1. forward: its shards all-gathered into full parameters (one collective per large parameter,
//      one for the small ones together; the next block's launched first, a prefetch), the block
//      runs, then the full parameters are freed (reshard_after_forward; the root keeps them, as in
//      PyTorch, since backward needs them first);
//   2. backward: when the gradient reaches the block's outputs, gathered again (and the previous
//      block's gather launched); when every parameter's gradient has been accumulated, the full
//      parameters are freed and the full gradients reduce-scattered, launched while backward goes
//      on and averaged into the shards' .grad when the next block's reduction starts;
//   3. at the end of backward, any unit whose parameters got no gradient is reduced too (zeros),
//      so every rank runs the same collectives, and the last reduction completes.
// The prefetches trade memory for overlap: FSDPOptions().forward_prefetch(false)
// .backward_prefetch(ddp::BackwardPrefetch::kNone) keeps one block's full parameters and
// gradients alive at most (memory_stats() counts them), for a model that barely fits.
// The parameters the module registers stay the same tensors throughout (their data is swapped
// between the shard and the full value), so an optimizer built before or after fully_shard works
// and module->parameters() are the shards, except between unshard() and reshard(). .grad is the
// shard's gradient whenever the program has control (zero_grad() between forward and backward
// clears it, as it should).
//
// Semantics as PyTorch's FSDP2: the average over the ranks (W * replicas) of each rank's gradient,
// i.e. DDP's result; gradients accumulate in the shards' .grad across backward passes until
// zero_grad(); set_requires_gradient_sync(false) keeps full gradients local (accumulation) and the
// next synchronized backward reduces their sum.
//
// Memory between steps: every step allocates and frees each block's full parameters and
// gradients again. On CPU, glibc's malloc would give those blocks back to the kernel and fault them
// in afresh the next step (about 4 ms of a 36 ms step on resnet_b32); init_process_group asks it to
// keep them for reuse (process_group.h).
//
// Thread-safety: one training thread drives the model (forward, backward, step); the gathers and
// reductions run inside forward and backward, on the thread running them.
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <ddp/device_mesh.h>
#include <ddp/distributed_data_parallel.h>  // detail::collect_tensors
#include <ddp/process_group.h>
#include <ddp/sharded_state.h>

namespace ddp {

// PyTorch's MixedPrecisionPolicy: compute in param_dtype (the all-gather too, at half the bytes),
// reduce gradients in reduce_dtype; the shards, their gradients and the optimizer stay in the
// parameters' own dtype. Unset dtypes keep the parameters' dtype.
struct MixedPrecisionPolicy {
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype) = c10::nullopt;
  TORCH_ARG(c10::optional<c10::ScalarType>, reduce_dtype) = c10::nullopt;
  // Floating-point tensors passed to sharded_forward/forward are cast to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = true;
};

// When a block's backward launches the gather of the block whose backward comes next (the
// previous one in forward): PyTorch FSDP1's BackwardPrefetch, whose values these mirror.
enum class BackwardPrefetch {
  // As the block's backward starts (FSDP2's and the default): the gather overlaps the whole of
  // the block's backward, while its full parameters, its gradients, the next block's parameters
  // and the previous block's reduce-scatter buffers are all alive.
  kBackwardPre,
  // Once the block's gradients are computed and its full parameters freed: less overlap, one
  // block's parameters fewer alive at once.
  kBackwardPost,
  // Never; and a block's backward first completes the previous block's reduce-scatter (freeing
  // its buffers). With forward_prefetch(false), at most one block's full parameters and gradients
  // are alive at any time: the least memory, the reductions no longer overlapping compute.
  kNone,
};

struct FSDPOptions {
  // Free the full parameters after the block's forward (gathered again for backward); false keeps
  // them until backward, trading memory for one all-gather per block. (The root always keeps them.)
  TORCH_ARG(bool, reshard_after_forward) = true;
  // The ranks to shard over; null: the default group.
  TORCH_ARG(ProcessGroupPtr, process_group) = {};
  // A 1-D mesh: shard over it. A 2-D mesh {replicate, shard} (HSDP): shard along dimension 1
  // (e.g. inside a host), replicate along dimension 0 (across hosts): gradients are
  // reduce-scattered along 1, then all-reduced along 0. Overrides process_group.
  TORCH_ARG(c10::optional<DeviceMesh>, mesh) = c10::nullopt;
  TORCH_ARG(MixedPrecisionPolicy, mixed_precision) = {};
  // Launch the next block's gather as this one's forward starts (FSDP2 prefetches in forward
  // too); false gathers each block when its forward starts, one block's parameters alive at once.
  TORCH_ARG(bool, forward_prefetch) = true;
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
};

// What a sharded model holds on this rank (FSDPModule::memory_stats): its shards and their
// gradients now, and the most bytes of full parameters, full gradients and reduction buffers
// that were alive at once: one block's parameters and gradients when blocks are sharded with
// reshard_after_forward, forward_prefetch(false) and BackwardPrefetch::kNone; with the default
// prefetching, up to a block's parameters and gradients, the next block's parameters and the
// previous block's reduction buffers.
struct FSDPMemoryStats {
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t peak_unsharded_bytes = 0;
};

namespace detail {

class ShardedUnit;

// The non-template half (fully_shard.cpp).
std::shared_ptr<ShardedUnit> shard_module(const std::shared_ptr<torch::nn::Module>& module, const FSDPOptions& options);
std::shared_ptr<ShardedUnit> unit_of(const torch::nn::Module& module);
void before_forward(ShardedUnit& unit);
at::Tensor cast_forward_input(const ShardedUnit& unit, const at::Tensor& input);
void after_forward(ShardedUnit& unit, const std::vector<at::Tensor>& outputs);
void unshard(ShardedUnit& unit);
void reshard(ShardedUnit& unit);
void set_requires_gradient_sync(ShardedUnit& unit, bool sync);
const FSDPOptions& options_of(const ShardedUnit& unit);
torch::OrderedDict<std::string, at::Tensor> full_state_dict(ShardedUnit& unit);
FSDPMemoryStats memory_stats(const ShardedUnit& unit);
std::shared_ptr<ShardedState> whole_model_state(const std::shared_ptr<ShardedUnit>& unit);

// The module behind a holder, a shared_ptr or a reference.
template <typename M>
auto& sharded_module_of(M& module) {
  if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
    return module;
  } else {
    return *module;  // ModuleHolder<Impl> or std::shared_ptr<Impl>
  }
}

// Tensors in a forward() argument cast as the unit's mixed precision policy says (no unit: as they are).
template <typename T>
decltype(auto) cast_input(const ShardedUnit* unit, T&& value) {
  return map_tensors(std::forward<T>(value),
                     [unit](const at::Tensor& tensor) { return unit ? cast_forward_input(*unit, tensor) : tensor; });
}

}  // namespace detail

// Calls block->forward(args...) as fully sharded data parallel needs: the block's parameters are
// gathered first and freed after (reshard_after_forward), and its backward is arranged. The one
// change a port makes at each call of a sharded block; a block that is not sharded is just called.
template <typename M, typename... Args>
auto sharded_forward(M& block, Args&&... args) {
  auto& module = detail::sharded_module_of(block);
  std::shared_ptr<detail::ShardedUnit> unit = detail::unit_of(module);
  if (unit) detail::before_forward(*unit);
  auto output = module.forward(detail::cast_input(unit.get(), std::forward<Args>(args))...);
  if (unit) {
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(output, tensors);
    detail::after_forward(*unit, tensors);
  }
  return output;
}

// What fully_shard returns: the sharded module, called like DDP's wrapper.
template <typename ModuleType>
class FSDPModule {
 public:
  FSDPModule(std::shared_ptr<ModuleType> module, std::shared_ptr<detail::ShardedUnit> unit)
      : module_(std::move(module)), unit_(std::move(unit)), whole_(detail::whole_model_state(unit_)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    return sharded_forward(*module_, std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The full parameters in the module until reshard() (to read, evaluate or save them whole);
  // this unit only, not the blocks sharded inside it. Collective over the unit's group.
  void unshard() { detail::unshard(*unit_); }
  void reshard() { detail::reshard(*unit_); }
  // false: backward passes keep full gradients locally (accumulation, DDP's no_sync); the next
  // backward with true reduces their sum. This unit and every unit sharded inside it.
  void set_requires_gradient_sync(bool sync) { detail::set_requires_gradient_sync(*unit_, sync); }
  // Every parameter and buffer of the module, full, as copies (the blocks' too): what the module
  // would hold unsharded, in named_parameters() then named_buffers() order. Collective.
  torch::OrderedDict<std::string, at::Tensor> full_state_dict() { return detail::full_state_dict(*unit_); }
  // This unit's and the units' sharded inside it (the root's: the whole model's).
  FSDPMemoryStats memory_stats() const { return detail::memory_stats(*unit_); }

  std::shared_ptr<ModuleType> module() const { return module_; }
  ModuleType* operator->() const { return module_.get(); }
  std::vector<at::Tensor> parameters(bool recurse = true) const { return module_->parameters(recurse); }
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const {
    return module_->named_parameters(recurse);
  }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }
  void zero_grad() { module_->zero_grad(); }
  const FSDPOptions& options() const { return detail::options_of(*unit_); }
  // How ddp::save_checkpoint / load_checkpoint see the whole model (sharded_state.h): give them
  // this FSDPModule (the root's) and they write and read what an unsharded model would.
  ShardedState* sharded_state() const { return whole_.get(); }

 private:
  std::shared_ptr<ModuleType> module_;
  std::shared_ptr<detail::ShardedUnit> unit_;
  std::shared_ptr<ShardedState> whole_;
};

// Shards `module`'s parameters that no earlier fully_shard call took (call it on the blocks first,
// then on their parent: bottom-up, as PyTorch). Collective over the group: every rank calls it in
// the same order with the same model; rank 0's parameter values are the starting point on every
// rank. The module must be held by a shared_ptr (std::make_shared, a TORCH_MODULE holder).
template <typename M>
auto fully_shard(M& module, const FSDPOptions& options = {}) {
  auto& impl = detail::sharded_module_of(module);
  using Impl = std::remove_reference_t<decltype(impl)>;
  std::shared_ptr<Impl> owner;
  try {
    owner = std::dynamic_pointer_cast<Impl>(impl.shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    throw std::invalid_argument("ddp::fully_shard: the module is not held by a std::shared_ptr; create it with "
                                "std::make_shared (or a TORCH_MODULE holder), as its blocks are");
  }
  auto unit = detail::shard_module(owner, options);
  return FSDPModule<Impl>(std::move(owner), std::move(unit));
}

// The blocks given after the options sharded first, each a unit of its own, then `module`: one
// line for a model whose blocks are separate members.
//   auto model = ddp::fully_shard(net, {}, net->conv2, net->fc1);
template <typename M, typename Block, typename... Blocks>
auto fully_shard(M& module, const FSDPOptions& options, Block& block, Blocks&... blocks) {
  fully_shard(block, options);
  (fully_shard(blocks, options), ...);
  return fully_shard(module, options);
}

}  // namespace ddp
