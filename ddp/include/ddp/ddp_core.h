#pragma once
// The non-template half of DistributedDataParallel: everything that does not depend on the
// wrapped module's type lives here, compiled once in the library.
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <ddp/comm_hooks.h>
#include <ddp/ddp_options.h>

namespace ddp {

// What the reducer did so far; for tests, benchmarks and curious users.
struct ReductionStats {
  int64_t collectives_launched = 0;             // gradient-bucket allreduces
  int64_t iterations_reduced = 0;               // synchronized backward passes completed
  bool buckets_rebuilt = false;                 // the one rebuild in observed gradient order
  std::vector<std::vector<std::string>> buckets;  // parameter names per bucket, in launch order
};

namespace detail {

class DDPCore {
 public:
  DDPCore(torch::nn::Module& module, DDPOptions options);
  ~DDPCore();
  DDPCore(const DDPCore&) = delete;
  DDPCore& operator=(const DDPCore&) = delete;

  // Before forward: errors of the previous iteration, the one bucket rebuild, buffer broadcast.
  void before_forward();
  // Whether after_forward needs the outputs (to find unused parameters).
  bool wants_outputs() const;
  // After forward: arms the reducer for the coming backward (when grad mode is on).
  void after_forward(const std::vector<at::Tensor>& outputs);

  bool require_sync() const { return require_sync_; }
  void set_require_sync(bool sync) { require_sync_ = sync; }
  // The parameters moved (module.to(...)): re-allocate buckets and broadcast buffers.
  void module_moved();

  void register_comm_hook(CommHook hook);
  // The registered hook's state (null without a hook, or for a stateless one).
  Stateful* comm_hook_state() const;

  const DDPOptions& options() const { return options_; }
  const ProcessGroupPtr& process_group() const { return options_.process_group(); }
  ReductionStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  DDPOptions options_;
  bool require_sync_ = true;
};

}  // namespace detail
}  // namespace ddp
