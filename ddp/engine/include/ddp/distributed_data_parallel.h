#pragma once
// ddp::DistributedDataParallel: wraps a torch::nn::Module so that every backward() averages the
// gradients of all ranks, bucket by bucket, while backward is still running.
//
//   auto net = std::make_shared<Net>();
//   ddp::DistributedDataParallel model(net, pg, ddp::DDPOptions().bucket_cap_mb(25));
//   auto loss = criterion(model.forward(x), y);   // any forward signature of Net
//   loss.backward();                              // gradients arrive averaged
//   { auto guard = model.no_sync(); ... }         // accumulate locally, sync on the next backward
//
// Unlike PyTorch, named_parameters() carries no "module." prefix: a state dict saved from the
// wrapper loads into the bare module and the other way round.
//
// Thread-safety: one training thread drives a wrapper (forward, backward, no_sync, step of its
// optimizer); the wrapper reduces on its own communication thread (comm hooks run there) and on
// the backend's threads, and hands results back at the end of backward. Wrappers over different
// groups may train on different threads; two wrappers must not share one model.
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <ddp/ddp_core.h>
#include <ddp/ddp_options.h>
#include <ddp/powersgd.h>  // the built-in hooks come with the wrapper

namespace ddp {
namespace detail {

// Tensors inside whatever forward() returned, for the unused-parameter search.
inline void collect_tensors(const at::Tensor& tensor, std::vector<at::Tensor>& out) { out.push_back(tensor); }
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}  // holds no tensor we can see
template <typename T>
void collect_tensors(const std::vector<T>& items, std::vector<at::Tensor>& out) {
  for (const auto& item : items) collect_tensors(item, out);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& pair, std::vector<at::Tensor>& out) {
  collect_tensors(pair.first, out);
  collect_tensors(pair.second, out);
}
template <typename... T>
void collect_tensors(const std::tuple<T...>& tuple, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... items) { (collect_tensors(items, out), ...); }, tuple);
}
template <typename K, typename V>
void collect_tensors(const std::map<K, V>& items, std::vector<at::Tensor>& out) {
  for (const auto& item : items) collect_tensors(item.second, out);
}
template <typename K, typename V>
void collect_tensors(const std::unordered_map<K, V>& items, std::vector<at::Tensor>& out) {
  for (const auto& item : items) collect_tensors(item.second, out);
}

// A forward() argument with `change` (at::Tensor -> at::Tensor) applied to its tensors (alone or in
// a vector); everything else passes through untouched. DDP moves arguments to the module's device
// with it, fully_shard casts them to its compute dtype.
template <typename T, typename Change>
decltype(auto) map_tensors(T&& value, const Change& change) {
  using Plain = std::decay_t<T>;
  if constexpr (std::is_same_v<Plain, at::Tensor>) {
    return at::Tensor(change(value));
  } else if constexpr (std::is_same_v<Plain, std::vector<at::Tensor>>) {
    Plain changed;
    for (const auto& tensor : value) changed.push_back(change(tensor));
    return changed;
  } else {
    return std::forward<T>(value);
  }
}

// Tensors in a forward() argument moved to `device` (none: as they are).
template <typename T>
decltype(auto) to_device(T&& value, const c10::optional<c10::Device>& device) {
  return map_tensors(std::forward<T>(value),
                     [&](const at::Tensor& tensor) { return device ? tensor.to(*device) : tensor; });
}

}  // namespace detail

// Suspends gradient synchronization while alive (see DistributedDataParallel::no_sync).
class NoSyncGuard {
 public:
  explicit NoSyncGuard(detail::DDPCore& core) : core_(&core), previous_(core.require_sync()) {
    core_->set_require_sync(false);
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept : core_(std::exchange(other.core_, nullptr)), previous_(other.previous_) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (core_) core_->set_require_sync(previous_);
  }

 private:
  detail::DDPCore* core_;
  bool previous_;
};

template <typename ModuleType>
class DistributedDataParallel : public Joinable {
 public:
  // Construction is collective: every rank must construct, with the same model.
  DistributedDataParallel(std::shared_ptr<ModuleType> module, ProcessGroupPtr group, DDPOptions options = {})
      : module_(std::move(module)) {
    if (!module_) throw std::invalid_argument("DistributedDataParallel: the module is null");
    if (group) options.process_group(std::move(group));
    place_on_device(options);
    core_ = std::make_unique<detail::DDPCore>(*module_, std::move(options));
  }
  explicit DistributedDataParallel(std::shared_ptr<ModuleType> module, DDPOptions options = {})
      : DistributedDataParallel(std::move(module), ProcessGroupPtr(), std::move(options)) {}
  DistributedDataParallel(torch::nn::ModuleHolder<ModuleType> holder, ProcessGroupPtr group, DDPOptions options = {})
      : DistributedDataParallel(holder.ptr(), std::move(group), std::move(options)) {}
  explicit DistributedDataParallel(torch::nn::ModuleHolder<ModuleType> holder, DDPOptions options = {})
      : DistributedDataParallel(holder.ptr(), ProcessGroupPtr(), std::move(options)) {}
  // A module held by reference (`Net net; ddp::DistributedDataParallel model(net);`): the wrapper
  // does not own it, so `net` must outlive the wrapper; module() then hands out a shared_ptr that
  // does not own it either. (Templates only so that class template argument deduction takes the
  // guide below, which admits modules alone, and a ModuleHolder lvalue still deduces its Impl.)
  template <typename M, std::enable_if_t<std::is_same_v<M, ModuleType>, int> = 0>
  DistributedDataParallel(M& module, ProcessGroupPtr group, DDPOptions options = {})
      : DistributedDataParallel(std::shared_ptr<ModuleType>(std::shared_ptr<ModuleType>(), &module), std::move(group),
                                std::move(options)) {}
  template <typename M, std::enable_if_t<std::is_same_v<M, ModuleType>, int> = 0>
  explicit DistributedDataParallel(M& module, DDPOptions options = {})
      : DistributedDataParallel(module, ProcessGroupPtr(), std::move(options)) {}

  // Runs the wrapped module's forward with the same arguments. Before it: buffers from rank 0
  // (broadcast_buffers); after it: the reducer is armed for the coming backward.
  template <typename... Args>
  auto forward(Args&&... args) {
    core_->before_forward();
    const auto& options = core_->options();
    c10::optional<c10::Device> input_device;
    if (!options.device_ids().empty()) input_device = options.device_ids().front();
    auto output = module_->forward(detail::to_device(std::forward<Args>(args), input_device)...);
    std::vector<at::Tensor> tensors;
    if (core_->wants_outputs()) detail::collect_tensors(output, tensors);
    core_->after_forward(tensors);
    c10::optional<c10::Device> output_device = options.output_device();
    if (!output_device) output_device = input_device;
    if (output_device) return decltype(output)(detail::to_device(std::move(output), output_device));
    return output;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Inside the returned guard's scope, backward passes accumulate gradients locally with no
  // communication; the first backward after it reduces the accumulated sum.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*core_); }

  // Replaces how each gradient bucket is reduced (ddp/comm_hooks.h states the hook's contract):
  //   model.register_comm_hook(ddp::hooks::fp16_compress());
  // Once per wrapper, before training starts (before the first forward with gradients enabled);
  // otherwise throws std::runtime_error saying which rule was broken.
  void register_comm_hook(CommHook hook) { core_->register_comm_hook(std::move(hook)); }
  // The registered hook's state (PowerSGD's matrices, ...), or null. save_checkpoint and
  // load_checkpoint, given this wrapper, carry it under the name "comm_hook".
  Stateful* comm_hook_state() const { return core_->comm_hook_state(); }

  std::shared_ptr<ModuleType> module() const { return module_; }
  ModuleType* operator->() const { return module_.get(); }

  std::vector<at::Tensor> parameters(bool recurse = true) const { return module_->parameters(recurse); }
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const {
    return module_->named_parameters(recurse);
  }
  std::vector<at::Tensor> buffers(bool recurse = true) const { return module_->buffers(recurse); }
  torch::OrderedDict<std::string, at::Tensor> named_buffers(bool recurse = true) const {
    return module_->named_buffers(recurse);
  }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }
  bool is_training() const { return module_->is_training(); }
  // Moves the module; bucket storage follows the parameters.
  void to(c10::Device device, bool non_blocking = false) {
    module_->to(device, non_blocking);
    core_->module_moved();
  }
  void to(c10::ScalarType dtype, bool non_blocking = false) {
    module_->to(dtype, non_blocking);
    core_->module_moved();
  }
  void zero_grad() { module_->zero_grad(); }

  // ddp::Join: a rank that ran out of inputs shadows this model's collectives (join.h).
  ProcessGroupPtr join_process_group() const override { return core_->join_process_group(); }
  void join_attach(Join* join, size_t index) override { core_->join_attach(join, index); }
  void join_shadow(const JoinStatus& status) override { core_->join_shadow(status); }
  void join_finish(const JoinStatus& last, int from) override { core_->join_finish(last, from); }

  const DDPOptions& options() const { return core_->options(); }
  const ProcessGroupPtr& process_group() const { return core_->process_group(); }
  ReductionStats reduction_stats() const { return core_->stats(); }
  // PyTorch's DDPLoggingData fields that apply here: options, buckets, and averaged timings of
  // sampled iterations (ddp/logging.h).
  DDPLoggingData logging_data() const { return core_->logging_data(); }
  // The non-template half, for the library's own hooks (ddp::hooks::hook_with_zero_step).
  const detail::DDPCore& core() const { return *core_; }

 private:
  // device_ids names where a single-device module lives: put it there before broadcasting.
  void place_on_device(const DDPOptions& options) {
    if (options.device_ids().size() > 1) {
      throw std::invalid_argument("DistributedDataParallel: device_ids takes at most one device (one "
                                  "device per process); leave it empty for a module spread over devices");
    }
    if (!options.device_ids().empty()) module_->to(options.device_ids().front());
  }

  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<detail::DDPCore> core_;
};

template <typename M, typename... Rest>
DistributedDataParallel(std::shared_ptr<M>, Rest&&...) -> DistributedDataParallel<M>;
template <typename M, typename... Rest>
DistributedDataParallel(torch::nn::ModuleHolder<M>, Rest&&...) -> DistributedDataParallel<M>;
template <typename M, typename... Rest, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>, int> = 0>
DistributedDataParallel(M&, Rest&&...) -> DistributedDataParallel<M>;

}  // namespace ddp
