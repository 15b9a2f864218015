#pragma once
// The non-template half of DistributedDataParallel: everything that does not depend on the
// wrapped module's type lives here, compiled once in the library.
//
// Thread-safety: see distributed_data_parallel.h.
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <ddp/comm_hooks.h>
#include <ddp/ddp_options.h>
#include <ddp/join.h>
#include <ddp/logging.h>

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

  // ddp::Join (DistributedDataParallel's Joinable methods forward here).
  ProcessGroupPtr join_process_group() const;
  void join_attach(Join* join, size_t index);
  void join_shadow(const JoinStatus& status);
  void join_finish(const JoinStatus& last, int from);

  void register_comm_hook(CommHook hook);
  // The registered hook's state (null without a hook, or for a stateless one).
  Stateful* comm_hook_state() const;

  const DDPOptions& options() const { return options_; }
  const ProcessGroupPtr& process_group() const { return options_.process_group(); }
  ReductionStats stats() const;
  // stats().buckets_rebuilt without the reducer's lock: a comm hook may ask during backward.
  bool buckets_rebuilt() const noexcept;
  DDPLoggingData logging_data() const;

 private:
  static std::string describe(const DDPLoggingData& data);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  DDPOptions options_;
  bool require_sync_ = true;
  Join* join_ = nullptr;  // set while inside Join::run
  size_t join_index_ = 0;
  bool ran_under_join_ = false;  // the last training forward ran inside Join::run
  int64_t last_logged_iteration_ = 0;  // TORCH_DISTRIBUTED_DEBUG=INFO
};

}  // namespace detail
}  // namespace ddp
