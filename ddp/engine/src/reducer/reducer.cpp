#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/engine/src/reducer/reducer.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <unordered_set>
#include <utility>

#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include "ddp/floor/src/backends.h"
#include <ddp/wait_collective.h>
#include "ddp/engine/src/reducer/bucket_assignment.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/internal/diagnostics/text.h"
#include "ddp/floor/src/desync.h"
#include "ddp/engine/src/reducer/state_sync.h"
#include "ddp/floor/src/start_allreduce.h"

namespace ddp::detail {
namespace {

// Whether replacing `grad` (a parameter's gradient) with another tensor holding the same values
// is invisible: nobody but the parameter holds the tensor or its memory.
bool seen_only_by_its_parameter(const at::Tensor& grad) {
  return !grad.defined() || (grad.use_count() == 1 && grad.storage().use_count() == 1);
}

// `slot` - with every tensor made from it, which share its storage - moves to private memory
// holding its current values; returns a new tensor over the place in the bucket it had.
at::Tensor keep_apart(const at::Tensor& slot) {
  c10::StorageImpl* storage = slot.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  at::DataPtr copy = c10::GetCPUAllocator()->allocate(bytes);
  std::memcpy(copy.get(), storage->data_ptr().get(), bytes);
  at::DataPtr place = storage->set_data_ptr(std::move(copy));
  const c10::Storage fresh(c10::Storage::use_byte_size_t(), bytes, std::move(place), nullptr, false);
  return at::empty({0}, slot.options()).set_(fresh, 0, slot.sizes(), slot.strides());
}

// Why a collective of the training loop fails, most often: the hint of every one of them.
constexpr const char* kLoopCollectiveHint =
    "a peer rank may have died or hung past the timeout, or the ranks ran different numbers of "
    "iterations (uneven inputs: see ddp::Join)";


std::string list_names(const std::vector<std::string>& names, const std::vector<size_t>& which) {
  return join_limited(which, 10, ", ", [&](size_t i) { return names[i]; });
}

// What ranks compare of a hook: its name, and its settings when it has any.
std::string describe_hook(const CommHook& hook) {
  return hook.settings().empty() ? "'" + hook.name() + "'" : "'" + hook.name() + "' (" + hook.settings() + ")";
}

}  // namespace

std::shared_ptr<Reducer> Reducer::create(std::vector<at::Tensor> params, std::vector<std::string> names,
                                         ProcessGroupPtr group, ReducerOptions options) {
  std::shared_ptr<Reducer> reducer(new Reducer(std::move(params), std::move(names), std::move(group), options));
  reducer->register_hooks();
  reducer->verify_buckets_match_across_ranks();
  return reducer;
}

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, ProcessGroupPtr group,
                 ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), group_(std::move(group)), options_(options) {
  divisor_ = group_->getSize();
  check_collectives_ = debug_level_of(group_) == DebugLevel::kDetail;
  ready_.assign(params_.size(), 0);
  globally_unused_.assign(params_.size(), 0);
  ready_order_.reserve(params_.size());
  // Gradients become ready roughly in reverse registration order: the last layer first.
  std::vector<size_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
  build_buckets(order);
}

// Hooks every parameter's gradient accumulator that does not carry our hook yet. Called again
// after module.to(): set_data() with a new dtype or device replaces the accumulator.
void Reducer::register_hooks() {
  std::weak_ptr<Reducer> weak = weak_from_this();
  grad_accumulators_.resize(params_.size());
  hook_keys_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    if (accumulator == grad_accumulators_[i]) continue;
    if (grad_accumulators_[i]) {
      param_of_accumulator_.erase(grad_accumulators_[i].get());
      grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
    param_of_accumulator_[accumulator.get()] = i;
    hook_keys_[i] = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto reducer = weak.lock()) reducer->on_gradient_ready(i);
          return outputs;
        }));
    grad_accumulators_[i] = std::move(accumulator);
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i) {
    if (grad_accumulators_[i]) grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Set-up: bucket storage
// ---------------------------------------------------------------------------------------------

void Reducer::build_buckets(const std::vector<size_t>& order, Builders builders) {
  const auto layout = assign_buckets(bucket_params(), order, options_.first_bucket_bytes, options_.bucket_bytes);

  at::NoGradGuard no_grad;
  // Free the old buckets before allocating the new ones, so a rebuild never holds two sets (a
  // bucket-view gradient keeps its old storage alive until it is copied in below). The hook's
  // view of them goes first: it points at their buffers.
  if (hook_runner_) hook_runner_->set_buckets({});
  buckets_.clear();
  std::vector<Bucket> buckets(layout.size());
  std::vector<std::vector<at::Tensor>> members(layout.size());
  for (size_t b = 0; b < layout.size(); ++b) {
    buckets[b].params = layout[b];
    for (size_t p : layout[b]) members[b].push_back(params_[p]);
  }
  std::vector<std::unique_ptr<GradientBuffer>> buffers;
  try {
    // A hook averages over the whole group, as PyTorch's do (set_divisor leaves its buckets alone).
    buffers = make_gradient_buffers(group_, members,
                                    {hook_runner_ != nullptr, builders == Builders::kEveryRank,
                                     options_.gradient_as_bucket_view, hook_runner_ ? group_->getSize() : divisor_});
  } catch (const std::exception& error) {  // a peer died or hung while the buckets went into shared memory
    throw_collective_error(options_.owner + ": putting the gradient buckets in shared memory", kLoopCollectiveHint,
                           error);
  }
  place_.assign(params_.size(), BucketPlace{});
  for (size_t b = 0; b < layout.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.buffer = std::move(buffers[b]);
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      place_[bucket.params[k]] = BucketPlace{b, k};
      // A gradient the user already holds moves into the bucket, so nothing is lost (as it would
      // after the next reduction, write_back_gradients).
      at::Tensor& grad = params_[bucket.params[k]].mutable_grad();
      at::Tensor& slot = bucket.buffer->slot(k);
      if (grad.defined() && (options_.gradient_as_bucket_view ||
                             (adopts_slots(*bucket.buffer) && seen_only_by_its_parameter(grad)))) {
        slot.copy_(grad);
        grad = slot;
      }
    }
  }
  buckets_ = std::move(buckets);
  bucket_order_ = order;
  if (hook_runner_) hook_runner_->set_buckets(hook_buckets());
  std::vector<int64_t> bytes;
  for (const auto& bucket : buckets_) bytes.push_back(bucket.buffer->flat().nbytes());
  if (first_bucket_bytes_.empty()) first_bucket_bytes_ = bytes;
  recorder_.set_buckets(std::move(bytes));
  used_host_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  const auto device = collective_device(group_);
  used_device_ = device.is_cpu() ? used_host_ : used_host_.to(device);
}

// Whether a bucket's slot may become its parameter's gradient instead of being copied back
// (write_back_gradients): in memory every rank's reduction writes (GradientBuffer::shared), where
// the copy would be a pass for nothing. Not with a hook, whose views of the slots stay the bucket's.
bool Reducer::adopts_slots(const GradientBuffer& buffer) const { return buffer.shared() && !hook_runner_; }

// What a communication hook sees of each bucket: views of the reducer's own storage.
std::vector<GradBucket> Reducer::hook_buckets() const {
  std::vector<GradBucket> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    std::vector<at::Tensor> params;
    std::vector<int64_t> offsets;
    int64_t offset = 0;
    for (size_t p : bucket.params) {
      params.push_back(params_[p]);
      offsets.push_back(offset);
      offset += params_[p].numel();
    }
    out.push_back(GradBucket(b, buckets_.size(), bucket.buffer->flat(), bucket.buffer->slots(), std::move(params),
                             std::move(offsets), group_, bucket.params));
    // hooks::allreduce() averages the bucket's own storage as the floor built it to be averaged.
    out.back().own_average_ = [buffer = bucket.buffer.get()] { return buffer->start_average(); };
    out.back().own_buffer_ = bucket.buffer->flat();
  }
  return out;
}

void Reducer::register_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (hook_runner_) {
    fail("a communication hook ('" + hook_runner_->hook().name() + "') is already registered; register_comm_hook "
         "can be called only once (to combine hooks, wrap one in the other, e.g. hooks::fp16_compress_wrapper).");
  }
  if (options_.bucket_cap_auto && hook.state()) {
    fail("the communication hook '" + hook.name() + "' keeps state per bucket, and bucket_cap_mb_auto changes the "
         "buckets during the first iterations: use a fixed bucket_cap_mb with it.");
  }
  if (training_forwards_ > 0) {
    fail("register_comm_hook must be called before training starts (before the first forward() with "
         "gradients enabled); the buckets of the iterations so far were reduced without it.");
  }
  hook_runner_ = std::make_unique<HookRunner>(std::move(hook), timeout_of(group_));
  // The buckets keep their storage; from now on the hook reduces them, averaging over the group.
  for (Bucket& bucket : buckets_) bucket.buffer->hand_to_hook(group_->getSize());
  hook_runner_->set_buckets(hook_buckets());
  hook_runner_->set_on_done([this](size_t b) { recorder_.reduced(b); });
  if (check_collectives_) {
    // On the hook thread, right before the hook issues the bucket's collectives.
    hook_runner_->set_before_each([this](size_t b) {
      check_collective(CollectiveOp::kBucketReduction, static_cast<int64_t>(b), buckets_[b].buffer->flat());
    });
  }
}

const CommHook* Reducer::comm_hook() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hook_runner_ ? &hook_runner_->hook() : nullptr;
}

void Reducer::reallocate_buckets() {
  std::lock_guard<std::mutex> lock(mutex_);
  build_buckets(bucket_order_, Builders::kThisRankAlone);  // private until the next rebuild, if any
  register_hooks();
}

// Buckets are rebuilt once, in the order gradients really arrived in the first iteration, so each
// bucket fills up as early as possible. Rank 0's order is used everywhere: buckets must match.
void Reducer::rebuild_buckets_in_observed_order() {
  std::vector<int64_t> local(ready_order_.begin(), ready_order_.end());
  at::Tensor order = at::tensor(local, at::kLong).to(collective_device(group_));
  check_collective(CollectiveOp::kBucketOrder, -1, order, 0);
  std::vector<at::Tensor> tensors{order};
  wait_collective(group_->broadcast(tensors), options_.owner + ": broadcast of rank 0's gradient order (the one bucket rebuild)",
                  kLoopCollectiveHint);
  order = order.cpu();
  const int64_t* broadcast_order = order.data_ptr<int64_t>();
  const std::vector<size_t> agreed(broadcast_order, broadcast_order + params_.size());
  build_buckets(agreed);
  rebuilt_ = true;
  ready_order_ = {};
  for (const auto& bucket : buckets_) rebuilt_bucket_bytes_.push_back(bucket.buffer->flat().nbytes());
  verify_buckets_match_across_ranks();
}

void Reducer::verify_buckets_match_across_ranks() const {
  std::vector<std::pair<int64_t, c10::ScalarType>> layout;
  for (const auto& bucket : buckets_) layout.emplace_back(bucket.buffer->flat().numel(), bucket.buffer->flat().scalar_type());
  verify_same_buckets(layout, group_);
}

void Reducer::check_collective(CollectiveOp op, int64_t index, const at::Tensor& tensor, int64_t root) const {
  if (!check_collectives_) return;
  verify_same_collective(group_,
                         {op, index, tensor.scalar_type(), tensor.numel(), root,
                          iterations_reduced_},
                         (options_.owner + " (TORCH_DISTRIBUTED_DEBUG=DETAIL)").c_str());
}

void Reducer::set_divisor(int divisor) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (divisor == divisor_) return;
  divisor_ = divisor;
  if (hook_runner_) return;  // hooks average as they please
  for (auto& bucket : buckets_) bucket.buffer->set_divisor(divisor_);
}

// ---------------------------------------------------------------------------------------------
// Around forward
// ---------------------------------------------------------------------------------------------

// What went wrong in the last pass (finalize_pass records it), raised once.
void Reducer::raise_pending_error() {
  if (error_.empty()) return;
  std::string error = std::move(error_);
  error_.clear();
  throw std::runtime_error(error);
}

void Reducer::check_passes_before_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  const int passes = std::exchange(passes_since_step_, 0);
  if (state_ != State::kIdle) {
    discard_iteration();
    fail("step() was called while a backward pass was still running or did not finish (it raised an "
         "error, or the loss did not reach every parameter); gradients were not synchronized.");
  }
  raise_pending_error();
  if (passes % options_.passes_per_step != 0) {
    fail("step() after " + std::to_string(passes) + " backward pass(es), but backward_passes_per_step is " +
         std::to_string(options_.passes_per_step) + ": the last " + std::to_string(passes % options_.passes_per_step) +
         " were only accumulated on this rank, not averaged across ranks. Call step() after every " +
         std::to_string(options_.passes_per_step) + " backward passes.");
  }
}

void Reducer::prepare_for_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::kReducing) {
    discard_iteration();
    fail("the previous backward pass did not finish (it raised an error, or the loss did not reach "
         "every bucket); gradients of that iteration were not synchronized.");
  }
  raise_pending_error();
  if (!rebuilt_ && iterations_reduced_ > 0 && ready_order_.size() == params_.size()) {
    rebuild_buckets_in_observed_order();
  }
  if (options_.bucket_cap_auto && rebuilt_) autotune_step();
}

// bucket_cap_mb_auto (autotune.h): from the first iteration after the rebuild, one step of the
// autotuner's schedule per iteration.
void Reducer::autotune_step() {
  if (!autotuner_) {
    autotuner_ = std::make_unique<BucketAutotuner>(
        distinct_layout_caps(bucket_params(), bucket_order_, options_.first_bucket_bytes));
  }
  if (autotuner_->done()) return;
  switch (autotuner_->at_iteration_start(now_ns())) {
    case BucketAutotuner::Action::kKeep:
      return;
    case BucketAutotuner::Action::kSwitch:  // the next candidate, from this iteration on
      options_.bucket_bytes = autotuner_->next_cap();
      build_buckets(bucket_order_);
      return;
    case BucketAutotuner::Action::kAgree: {
      // The slowest rank's time of each candidate decides, the same on every rank.
      at::Tensor times = at::tensor(autotuner_->median_times(), at::kLong).to(collective_device(group_));
      check_collective(CollectiveOp::kAllReduce, -1, times);
      wait_collective(start_allreduce_max(group_, times),
                      options_.owner + ": bucket_cap_mb_auto's agreement on the step times", kLoopCollectiveHint);
      times = times.cpu();
      autotuner_->choose(std::vector<int64_t>(times.data_ptr<int64_t>(), times.data_ptr<int64_t>() + times.numel()));
      options_.bucket_bytes = autotuner_->chosen_cap();
      build_buckets(bucket_order_);
      verify_buckets_match_across_ranks();
      if (group_->getRank() == 0 && debug_level_of(group_) != DebugLevel::kOff) info_log(describe_choice(*autotuner_));
      return;
    }
  }
}

// What bucket assignment needs of each parameter.
std::vector<BucketParam> Reducer::bucket_params() const {
  std::vector<BucketParam> sizes;
  for (const auto& param : params_) {
    sizes.push_back({param.device(), param.scalar_type(), static_cast<int64_t>(param.numel() * param.element_size())});
  }
  return sizes;
}

bool Reducer::wants_outputs() const {
  return options_.find_unused_parameters || (options_.static_graph && !graph_learnt_);
}

void Reducer::prepare_for_backward(bool sync, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++training_forwards_;
  if (!sync) {
    state_ = State::kAccumulating;
    return;
  }
  arm_pass();
  state_ = State::kExpecting;
  if (track_usage_) unused_ = find_unused(outputs);
}

// Resets the per-pass state for a synchronized backward pass.
void Reducer::arm_pass() {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& bucket : buckets_) bucket.pending = bucket.params.size();
  next_bucket_ = 0;
  if (hook_runner_) hook_runner_->begin_pass();
  if (iterations_reduced_ == 0) ready_order_.clear();
  track_usage_ = wants_outputs();
  if (track_usage_) {
    used_host_.zero_();
    unused_.clear();
  } else if (!options_.static_graph) {
    unused_.clear();
  }  // static_graph after its first iteration: unused_ still holds what that iteration found
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::kReducing) fail("shadow_backward() during a backward pass (this is a bug in ddp::Join)");
  arm_pass();
  state_ = State::kReducing;
  recorder_.skip();
  // Zeros for every parameter, in bucket order: every bucket completes and goes out in order.
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t p : buckets_[b].params) mark_ready(p, /*used=*/false);
  }
  finalize_pass();
}

// Parameters whose gradient accumulator cannot be reached from the outputs get no gradient in
// this backward: they count as ready at once, so their buckets do not wait forever.
std::vector<size_t> Reducer::find_unused(const std::vector<at::Tensor>& outputs) const {
  std::vector<char> reached(params_.size(), 0);
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  auto visit = [&](const torch::autograd::Node* node) {
    if (node != nullptr && seen.insert(node).second) stack.push_back(node);
  };
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    visit(output.grad_fn() ? output.grad_fn().get() : torch::autograd::impl::try_get_grad_accumulator(output).get());
  }
  while (!stack.empty()) {
    const torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (auto it = param_of_accumulator_.find(node); it != param_of_accumulator_.end()) reached[it->second] = 1;
    for (const auto& edge : node->next_edges()) visit(edge.function.get());
  }
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!reached[i]) unused.push_back(i);
  }
  return unused;
}

// ---------------------------------------------------------------------------------------------
// During backward: the hot path
// ---------------------------------------------------------------------------------------------

void Reducer::on_gradient_ready(size_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  switch (state_) {
    case State::kAccumulating:
      return;  // no_sync(): AccumulateGrad already summed into param.grad()
    case State::kIdle:
      if (options_.trigger == PassTrigger::kFirstGradient) {
        begin_pass_on_first_gradient();
        if (state_ == State::kAccumulating) return;
        break;
      }
      fail("a gradient arrived for parameter '" + names_[param] +
           "' but no forward() ran since the last reduction: backward() was called twice after one "
           "forward(), or the module was run directly instead of through the wrapper. Call forward() "
           "through DistributedDataParallel before each backward(); to accumulate gradients over "
           "several backward passes, use no_sync().");
    case State::kExpecting:
    case State::kReducing:
      break;
  }
  if (state_ == State::kExpecting) {
    // First gradient of this backward: finalize() runs when the engine has finished.
    state_ = State::kReducing;
    std::weak_ptr<Reducer> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto reducer = weak.lock()) reducer->finalize();
    });
    for (size_t unused : unused_) mark_ready(unused, /*used=*/false);
  }
  mark_ready(param, /*used=*/true);
}

// No forward announced this pass (ddp::DistributedOptimizer): every passes_per_step-th one is
// reduced like DDP's; the others accumulate locally (DDP's no_sync) until the engine finishes.
void Reducer::begin_pass_on_first_gradient() {
  ++training_forwards_;
  if (++passes_since_step_ % options_.passes_per_step != 0) {
    state_ = State::kAccumulating;
    std::weak_ptr<Reducer> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto reducer = weak.lock()) {
        std::lock_guard<std::mutex> lock(reducer->mutex_);
        reducer->state_ = State::kIdle;
      }
    });
    return;
  }
  arm_pass();
  state_ = State::kExpecting;
}

// Hands one gradient to its bucket (gradient_buffers.h: copied into its slot, or reduced where it
// lies); launches every bucket that became complete.
void Reducer::mark_ready(size_t param, bool used) {
  if (ready_[param]) {
    fail("parameter '" + names_[param] + "' received a second gradient in one backward pass "
         "(a reentrant backward or activation checkpointing re-ran it); this is not supported.");
  }
  ready_[param] = 1;
  if (!rebuilt_ && iterations_reduced_ == 0) ready_order_.push_back(param);  // for the rebuild

  Bucket& bucket = buckets_[place_[param].bucket];
  const size_t k = place_[param].index;
  at::Tensor& slot = bucket.buffer->slot(k);
  recorder_.gradient_into(place_[param].bucket);
  at::NoGradGuard no_grad;
  // A shared bucket's slot becomes the gradient when nobody else can see it (write_back_gradients),
  // but every rank's reduction writes into every slot. So the gradient keeps its values - moved to
  // private memory, as in PyTorch - when it gets none in this pass (an unused parameter's); and so
  // does an earlier gradient the user still holds (or a tensor made from it) after the optimizer
  // reset the parameter's gradient to undefined.
  if (adopts_slots(*bucket.buffer) && !options_.gradient_as_bucket_view) {
    const bool is_gradient = params_[param].grad().is_same(slot);
    if (is_gradient ? !used : slot.use_count() > 1 || slot.storage().use_count() > 1) slot = keep_apart(slot);
  }
  if (!used) {
    slot.zero_();
    bucket.buffer->take(k, slot);
  } else {
    at::Tensor& grad = params_[param].mutable_grad();
    if (grad.is_sparse()) {
      fail("parameter '" + names_[param] + "' produced a sparse gradient; DistributedDataParallel "
           "reduces dense gradients only (e.g. construct torch::nn::Embedding with sparse(false)).");
    }
    if (options_.gradient_as_bucket_view && !grad.is_same(slot)) {
      slot.copy_(grad);  // first iteration, or the optimizer reset grads to undefined
      grad = slot;
    }
    bucket.buffer->take(k, grad);
    if (track_usage_) used_host_.data_ptr<int32_t>()[param] = 1;
  }
  if (--bucket.pending == 0) launch_ready_buckets();
}

// Buckets go out strictly in order, so every rank issues the same collectives in the same order.
// CUDA: the copy into the bucket ran on the stream the gradient was computed on (the hook runs
// there); the process group orders its own stream after the current one when it launches, and
// Work::wait() in finalize() orders the current stream after the collective, so neither the copy
// nor the optimizer step that follows can race with the allreduce.
void Reducer::launch_ready_buckets() {
  if (!hooks_compared_ && next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    // Before the first reduction of the run, which every rank reaches (a shadowing rank too):
    // hooks are registered rank by rank, so this is the first point where they can be compared.
    hooks_compared_ = true;
    verify_same_comm_hook(hook_runner_ ? describe_hook(hook_runner_->hook()) : "", group_);
  }
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_];
    if (hook_runner_) {
      hook_runner_->submit(next_bucket_);  // checked on the hook thread under DETAIL
    } else {
      check_collective(CollectiveOp::kBucketReduction, static_cast<int64_t>(next_bucket_), bucket.buffer->flat());
      c10::OptionalDeviceGuard guard(bucket.buffer->flat().device());
      try {
        bucket.work = bucket.buffer->start_average();
      } catch (const std::exception& error) {  // a backend may fail at launch already (a closed peer)
        throw_collective_error(describe_bucket(next_bucket_), kLoopCollectiveHint, error);
      }
      if (recorder_.recording()) {
        std::weak_ptr<Reducer> weak = weak_from_this();
        bucket.work->getFuture()->addCallback([weak, b = next_bucket_](c10::ivalue::Future&) {
          if (auto reducer = weak.lock()) reducer->recorder_.reduced(b);
        });
      }
    }
    recorder_.launched(next_bucket_);
    ++collectives_launched_;
    ++next_bucket_;
  }
  if (next_bucket_ == buckets_.size()) recorder_.all_ready();
}

// ---------------------------------------------------------------------------------------------
// End of backward
// ---------------------------------------------------------------------------------------------

void Reducer::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::kReducing) return;
  finalize_pass();
}

void Reducer::finalize_pass() {
  if (track_usage_) {
    // Reachable parameters can still get no gradient (an output the loss ignores).
    for (size_t p = 0; p < params_.size(); ++p) {
      if (!ready_[p]) mark_ready(p, /*used=*/false);
    }
  }
  if (next_bucket_ < buckets_.size()) {
    std::vector<size_t> missing;
    for (size_t p = 0; p < params_.size(); ++p) {
      if (!ready_[p]) missing.push_back(p);
    }
    error_ = options_.owner + ": the previous backward finished without gradients for " +
             std::to_string(missing.size()) + " parameter(s): " + list_names(names_, missing) +
             ". Their buckets were never reduced, so gradients are not synchronized across ranks. " +
             (options_.trigger == PassTrigger::kForward
                  ? "If forward() does not use every parameter, construct with "
                    "DDPOptions().find_unused_parameters(true); if it does, make sure the loss depends on "
                    "every output of forward()."
                  : "DistributedOptimizer averages every parameter it was given in every synchronized pass: "
                    "give it only parameters the loss depends on, and make sure the loss depends on them.");
    discard_iteration();
    return;
  }

  struct DiscardOnError {
    Reducer* reducer;
    bool armed = true;
    ~DiscardOnError() { if (armed) reducer->discard_iteration(); }
  } guard{this};
  // The usage exchange is a collective as well, so it must come after the bucket reductions on
  // every rank. Without a hook they all went out from this thread already: launch it now and let
  // it overlap the waits. A hook may still be issuing collectives on its thread: wait first.
  c10::intrusive_ptr<c10d::Work> usage_work;
  if (track_usage_ && !hook_runner_) usage_work = launch_usage_exchange();
  recorder_.wait_begin();
  wait_for_buckets();
  if (track_usage_ && hook_runner_) usage_work = launch_usage_exchange();
  if (usage_work) read_usage_exchange(usage_work);
  write_back_gradients();
  guard.armed = false;
  ++iterations_reduced_;
  state_ = State::kIdle;
  recorder_.end();
}

// Every rank's "I produced a gradient for it" flags, reduced with MAX: a parameter stays without a
// gradient only when no rank used it.
c10::intrusive_ptr<c10d::Work> Reducer::launch_usage_exchange() {
  check_collective(CollectiveOp::kUsageExchange, -1, used_device_);
  if (!used_device_.is_same(used_host_)) used_device_.copy_(used_host_);
  return start_allreduce_max(group_, used_device_);
}

void Reducer::read_usage_exchange(const c10::intrusive_ptr<c10d::Work>& work) {
  wait_collective(
      work, [this] { return options_.owner + ": the exchange of which parameters got gradients"; },
      kLoopCollectiveHint);
  if (!used_device_.is_same(used_host_)) used_host_.copy_(used_device_);
  const int32_t* used = used_host_.data_ptr<int32_t>();
  bool changed = false;
  for (size_t p = 0; p < params_.size(); ++p) {
    changed = changed || globally_unused_[p] != (used[p] == 0);
    globally_unused_[p] = used[p] == 0;
  }
  if (options_.static_graph) graph_learnt_ = true;
  if (changed && group_->getRank() == 0 && debug_level_of(group_) != DebugLevel::kOff) {
    std::vector<size_t> unused;
    for (size_t p = 0; p < params_.size(); ++p) {
      if (globally_unused_[p]) unused.push_back(p);
    }
    info_log("DDP iteration " + std::to_string(iterations_reduced_) + ": " + std::to_string(unused.size()) +
             " parameter(s) got no gradient on any rank" + (unused.empty() ? "" : ": " + list_names(names_, unused)));
  }
}

// Waits for every bucket's reduction; the averages are then in the buckets.
void Reducer::wait_for_buckets() {
  if (hook_runner_) {
    const std::vector<at::Tensor>& averages = hook_runner_->wait_all();  // throws naming the bucket
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const at::Tensor& flat = buckets_[b].buffer->flat();
      if (!averages[b].is_same(flat)) flat.copy_(averages[b]);
    }
    return;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) wait_for_bucket(b);
}

void Reducer::fail(const std::string& message) const { raise<std::runtime_error>(options_.owner.c_str(), message); }

std::string Reducer::describe_bucket(size_t b) const {
  return options_.owner + ": allreduce of gradient bucket " + std::to_string(b) + " of " +
         std::to_string(buckets_.size());
}

void Reducer::wait_for_bucket(size_t b) {
  Bucket& bucket = buckets_[b];
  wait_collective(bucket.work, [&] { return describe_bucket(b); }, kLoopCollectiveHint);
  bucket.work.reset();
}

void Reducer::write_back_gradients() {
  at::NoGradGuard no_grad;
  for (size_t p = 0; p < params_.size(); ++p) {
    if (globally_unused_[p]) continue;  // like a single process: no gradient, no update
    GradientBuffer& buffer = *buckets_[place_[p].bucket].buffer;
    const size_t k = place_[p].index;
    if (buffer.reduced_in_place(k)) continue;  // the average is in the gradient already
    const at::Tensor& slot = buffer.slot(k);
    at::Tensor& grad = params_[p].mutable_grad();
    // In a shared bucket the slot becomes the gradient when that cannot be seen: later iterations
    // then accumulate in the bucket, and nothing is copied in or back.
    if (options_.gradient_as_bucket_view ||
        (adopts_slots(buffer) && (grad.is_same(slot) || seen_only_by_its_parameter(grad)))) {
      if (!grad.is_same(slot)) grad = slot;
    } else if (grad.defined()) {
      grad.copy_(slot);
    } else {
      grad = slot.clone();  // unused here, used on another rank
    }
  }
}

// Leaves no collective of this rank half-done and returns to idle.
void Reducer::discard_iteration() {
  if (hook_runner_) hook_runner_->abandon();
  for (size_t b = 0; b < next_bucket_; ++b) {
    if (!buckets_[b].work) continue;
    try {
      buckets_[b].work->wait();
    } catch (const std::exception&) {
      // The iteration is being abandoned; its error is reported by the caller.
    }
    buckets_[b].work.reset();
  }
  state_ = State::kIdle;
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ReducerStats stats;
  stats.collectives_launched = collectives_launched_;
  stats.iterations_reduced = iterations_reduced_;
  stats.buckets_rebuilt = rebuilt_.load();
  for (const auto& bucket : buckets_) stats.buckets.push_back(bucket.params);
  stats.first_bucket_bytes = first_bucket_bytes_;
  stats.rebuilt_bucket_bytes = rebuilt_bucket_bytes_;
  stats.bucket_bytes = options_.bucket_bytes;
  if (autotuner_ && autotuner_->done()) {
    stats.autotune_candidates = autotuner_->candidates();
    stats.autotune_times = autotuner_->agreed_times();
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    if (globally_unused_[p]) stats.unused_parameter_bytes += params_[p].numel() * params_[p].element_size();
  }
  return stats;
}

ReductionStats Reducer::reduction_stats() const {
  const ReducerStats raw = stats();
  ReductionStats out;
  out.collectives_launched = raw.collectives_launched;
  out.iterations_reduced = raw.iterations_reduced;
  out.buckets_rebuilt = raw.buckets_rebuilt;
  for (const auto& bucket : raw.buckets) {
    std::vector<std::string> names;
    for (size_t p : bucket) names.push_back(names_[p]);
    out.buckets.push_back(std::move(names));
  }
  return out;
}

int64_t Reducer::iterations_reduced() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return iterations_reduced_;
}

void Reducer::begin_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  recorder_.begin(iterations_reduced_);
}

void Reducer::forward_done() {
  std::lock_guard<std::mutex> lock(mutex_);
  recorder_.forward_done();
}

RuntimeAverages Reducer::runtime_averages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recorder_.averages();
}

void Reducer::set_timeline(Timeline* timeline) {
  std::lock_guard<std::mutex> lock(mutex_);
  recorder_.set_timeline(timeline);
}

}  // namespace ddp::detail
