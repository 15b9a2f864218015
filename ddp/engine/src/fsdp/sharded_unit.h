#pragma once
// One fully_shard call's parameters: their shards, the gather before the block computes, and the
// reduce-scatter of their gradients when the block's backward is done (fully_shard.h says when
// each step runs). The registry of units, the tree a root's backward finishes, and the checks on
// what fully_shard is given live in fully_shard.cpp.
//
// Thread-safety: the training thread drives a unit; the gradient hooks run on the thread running
// backward (which the training thread waits on), so nothing runs concurrently.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/optim/optimizer.h>

#include <ddp/fully_shard.h>

#include "ddp/internal/compat/versions.h"
#include "ddp/engine/src/fsdp/shard_layout.h"

namespace ddp::detail {

class ShardTree;

// The groups a unit's collectives run on.
struct ShardGroups {
  ProcessGroupPtr shard;      // the parameters are cut over these ranks
  ProcessGroupPtr replicate;  // null, or HSDP's other dimension: the shards are copies across it
  int data_parallel_size() const;
};

class ShardedUnit : public std::enable_shared_from_this<ShardedUnit> {
 public:
  // Takes `params` (named `names` in `module`) as they are on rank 0 and keeps this rank's shard.
  ShardedUnit(const std::shared_ptr<torch::nn::Module>& module, std::vector<std::string> names,
              std::vector<at::Tensor> params, FSDPOptions options, ShardGroups groups);
  ShardedUnit(const ShardedUnit&) = delete;
  ShardedUnit& operator=(const ShardedUnit&) = delete;
  ~ShardedUnit();

  // The steps of an iteration (fully_shard.h, "One unit ... goes through").
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);
  void before_backward();
  void finish_backward();  // the end of backward: reduces what the hooks did not
  void drop_unused_gather();

  // Full parameters in the module, or the shards (a no-op when already so). start_gather()
  // launches the all-gather unshard() would wait for (a prefetch).
  void start_gather();
  void unshard();
  void reshard();
  // Waits for this unit's launched reduce-scatter and adds the result to the shards' gradients.
  void complete_reduction();
  // For a checkpoint (sharded_state.h): the parameters whole in their own dtype, with the
  // optimizer's state of them; then the shards again, of the whole values or as they were.
  void gather_whole(torch::optim::Optimizer* optimizer);
  void shard_again(torch::optim::Optimizer* optimizer, bool take_whole);

  at::Tensor cast_input(const at::Tensor& input) const;
  void set_requires_gradient_sync(bool sync) { requires_sync_ = sync; }

  bool owns(const at::Tensor& param) const;
  // Which of this unit's parameters `param` is (params_.size() when none).
  size_t index_of(const at::Tensor& param) const;
  const ShardLayout& layout() const { return layout_; }
  bool is_of(const torch::nn::Module& module) const;
  bool module_alive() const { return !module_.expired(); }
  std::shared_ptr<torch::nn::Module> module() const { return module_.lock(); }
  const std::vector<std::string>& names() const { return names_; }
  const FSDPOptions& options() const { return options_; }
  const ShardGroups& groups() const { return groups_; }
  std::shared_ptr<ShardTree> tree() const { return tree_; }
  int64_t shard_bytes() const { return flat_shard_.nbytes(); }
  int64_t shard_grad_bytes() const;
  void set_tree(std::shared_ptr<ShardTree> tree) { tree_ = std::move(tree); }

 private:
  // kWhole: full values in the parameters' own dtype for a checkpoint (kUnsharded's are in the
  // compute dtype, in full_).
  enum class State { kSharded, kUnsharded, kWhole };
  enum class Backward { kIdle, kExpecting, kReduced };

  void prefetch_for_backward();
  void arm_backward();
  void disarm_backward();
  void on_gradient_ready(size_t i);
  void reduce_gradients();
  void launch_reduction();
  void count_full_grad(size_t i);
  at::Tensor& shard_grad_slot(size_t i);
  void shard_grads_back();
  at::Tensor gather_rows(const at::Tensor& local, size_t i) const;
  at::Tensor full_region(size_t i) const;
  void allocate_full();
  void free_full();
  void wait_gather();
  at::Tensor local_rows_of(const at::Tensor& whole, size_t i) const;
  bool keeps_after_forward() const;
  c10::ScalarType compute_dtype() const;

  std::weak_ptr<torch::nn::Module> module_;
  const torch::nn::Module* module_address_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;  // the module's own tensors: their data is what we swap
  FSDPOptions options_;
  ShardGroups groups_;
  std::string label_;  // for the timeline: the module's class and first parameter
  ShardLayout layout_;
  at::Tensor flat_shard_;  // this rank's padded chunks; params_ view it when sharded
  std::vector<at::Tensor> shard_views_;
  at::Tensor full_;  // every full parameter padded to W chunks, one after the other (storage
                     // freed while sharded)
  std::vector<at::Tensor> full_views_;
  bool full_allocated_ = false;
  // Launched collectives (one per parameter, one for the packed ones) and their buffers, alive
  // until waited for.
  struct InFlight {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> inputs, outputs;
    std::vector<std::pair<size_t, at::Tensor>> views;  // a reduction's parameter: its chunk of an output
    int64_t bytes = 0;                                  // a reduction's buffers, counted while alive
  };
  c10::optional<InFlight> gather_;
  c10::optional<InFlight> reduction_;
  std::vector<at::Tensor> shard_state_;  // the optimizer's shard tensors while kWhole, in visit order
  // Whenever the program has control, each parameter's .grad is its shard's gradient (what the
  // optimizer steps and zero_grad() clears), and a full gradient kept for accumulation waits here.
  // In backward, from the gradient reaching the unit's outputs to the reduction (full_grads_),
  // the other way round: .grad is the full gradient autograd accumulates into.
  std::vector<at::Tensor> waiting_grads_;
  std::vector<int64_t> counted_grad_bytes_;  // each full gradient's bytes in the tree's count
  bool full_grads_ = false;
  State state_ = State::kSharded;
  Backward backward_ = Backward::kIdle;
  bool requires_sync_ = true;
  std::shared_ptr<ShardTree> tree_;
  // The gradient accumulators hooked for the coming backward, and how many have fired.
  std::vector<compat::GradAccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<bool> ready_;
  size_t pending_ = 0;
};

// The units that finish one backward together: a root and the units sharded inside it (or a unit
// alone). The first unit whose backward starts asks the autograd engine to call finish() at the
// end of that backward.
class ShardTree : public std::enable_shared_from_this<ShardTree> {
 public:
  explicit ShardTree(std::weak_ptr<ShardedUnit> root) : root_(std::move(root)) {}
  void add(std::weak_ptr<ShardedUnit> unit) { units_.push_back(std::move(unit)); }
  bool is_root(const ShardedUnit* unit) const { return root_.lock().get() == unit; }
  const std::vector<std::weak_ptr<ShardedUnit>>& units() const { return units_; }
  void backward_started();
  // The order the units ran their forward in this iteration: each prefetches its neighbour's
  // gather (the next one in forward, the previous one in backward).
  void forward_started(const std::shared_ptr<ShardedUnit>& unit);
  std::shared_ptr<ShardedUnit> next_in_forward(const ShardedUnit* unit) const;      // by the last iteration
  std::shared_ptr<ShardedUnit> previous_in_forward(const ShardedUnit* unit) const;  // in this one
  // At most one reduce-scatter in flight: the previous one completes when the next is launched,
  // so the reduction buffers of one block at a time are alive, not the whole model's.
  void reduction_started(const std::shared_ptr<ShardedUnit>& unit);
  // The reduce-scatter in flight, if any, waited for and its buffers freed.
  void complete_reduction();

  // The bytes of full parameters, full gradients and reduction buffers alive now, and the most
  // alive at once since construction (what sharding leaves unsharded at its peak).
  void count_unsharded(int64_t delta) {
    unsharded_bytes_ += delta;
    peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, unsharded_bytes_);
  }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }

 private:
  void finish();
  std::weak_ptr<ShardedUnit> root_;
  std::vector<std::weak_ptr<ShardedUnit>> units_;
  std::vector<std::weak_ptr<ShardedUnit>> forward_order_, last_forward_order_;
  std::weak_ptr<ShardedUnit> reducing_;
  bool finish_queued_ = false;
  int64_t unsharded_bytes_ = 0;
  int64_t peak_unsharded_bytes_ = 0;
};

}  // namespace ddp::detail
