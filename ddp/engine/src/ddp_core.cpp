#include <ddp/ddp_core.h>

#include <stdexcept>
#include <unordered_set>

#include <ATen/core/grad_mode.h>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/numbers/check_number.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/engine/src/engine_claims.h"
#include "ddp/engine/src/reducer/reducer.h"
#include "ddp/engine/src/reducer/state_sync.h"

namespace ddp::detail {

struct DDPCore::Impl {
  torch::nn::Module* module = nullptr;
  ProcessGroupPtr group;           // what DDP's collectives run on (see the constructor)
  std::vector<at::Tensor> params;  // those that require grad, deduplicated, registration order
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> state;   // every parameter (trainable or not), then every buffer
  std::shared_ptr<Reducer> reducer;
  std::unique_ptr<TensorBroadcaster> buffer_broadcaster;
};

DDPCore::DDPCore(torch::nn::Module& module, DDPOptions options)
    : impl_(std::make_unique<Impl>()), options_(std::move(options)) {
  // Bad caps are refused before any collective, so every rank fails alike and at once. The cap's
  // byte count must fit in 64 bits; 1e12 MiB leaves room and is above any model.
  for (const auto& [name, value] : {std::pair<const char*, double>{"bucket_cap_mb", options_.bucket_cap_mb()},
                                    {"first_bucket_cap_mb", options_.first_bucket_cap_mb()}}) {
    detail::require_finite("DistributedDataParallel", name, value, 0, 1e12,
                           " (MiB; a cap above the model's size already puts every gradient in one bucket)");
  }
  if (!options_.process_group()) options_.process_group(ddp::default_group());
  // DDP's own collectives go over a group of their own (same ranks, own connections), so that none
  // of them can ever pair with a collective the program runs on the group it passed in: uneven
  // loops become an error instead of silently averaging the wrong tensors. A group built with c10d
  // directly cannot be split (c10d does not tell its store): sharing it let a program's allreduce
  // of a bucket's size stand in for the bucket on one rank, so it is refused.
  impl_->group = split_off(options_.process_group(), "ddp");
  if (!impl_->group) {
    throw std::invalid_argument(
        "DistributedDataParallel: the process group was built with c10d directly, so DDP cannot give its "
        "collectives a group of their own, and sharing it lets one of the program's collectives pair with a "
        "gradient bucket's and average the wrong tensors without an error. Make the group with "
        "ddp::init_process_group (the default group) or ddp::new_group.");
  }
  const ProcessGroupPtr& group = impl_->group;
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
    if (is_fully_sharded(param)) {
      throw std::invalid_argument("DistributedDataParallel: parameter '" + item.key() +
                                  "' is sharded by ddp::fully_shard; a module is trained by DistributedDataParallel "
                                  "or by fully_shard, not both (fully_shard averages gradients already)");
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
  impl_->state = all_state;
  impl_->state.insert(impl_->state.end(), impl_->buffers.begin(), impl_->buffers.end());
  TensorBroadcaster(impl_->state, group).broadcast_from(0);
  if (options_.broadcast_buffers() && !impl_->buffers.empty() && group->getSize() > 1) {
    impl_->buffer_broadcaster = std::make_unique<TensorBroadcaster>(impl_->buffers, group);
  }

  ReducerOptions reducer_options;
  reducer_options.first_bucket_bytes = static_cast<int64_t>(options_.first_bucket_cap_mb() * 1024 * 1024);
  reducer_options.bucket_bytes = static_cast<int64_t>(options_.bucket_cap_mb() * 1024 * 1024);
  reducer_options.find_unused_parameters = options_.find_unused_parameters();
  reducer_options.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  reducer_options.static_graph = options_.static_graph();
  reducer_options.bucket_cap_auto = options_.bucket_cap_mb_auto();
  impl_->reducer = Reducer::create(impl_->params, impl_->names, group, reducer_options);
  impl_->reducer->set_timeline(Timeline::open_for_rank(group->getRank()));
  if (group->getRank() == 0 && debug_level_of(group) != DebugLevel::kOff) info_log(describe(logging_data()));
  claim_for_ddp(impl_->params);
}

// One line for TORCH_DISTRIBUTED_DEBUG=INFO.
std::string DDPCore::describe(const DDPLoggingData& data) {
  std::string sizes;
  const auto& bytes = data.has_rebuilt_buckets ? data.rebuilt_bucket_sizes : data.bucket_sizes;
  for (size_t b = 0; b < bytes.size(); ++b) sizes += (b ? ", " : "") + std::to_string(bytes[b]);
  std::string line = "DDP on " + std::to_string(data.world_size) + " rank(s) (" + data.backend_name + "): " +
                     std::to_string(data.num_parameter_tensors) + " parameters, " +
                     std::to_string(data.total_parameter_size_bytes) + " bytes, " + std::to_string(bytes.size()) +
                     " bucket(s) of [" + sizes + "] bytes (cap " + std::to_string(data.bucket_cap_bytes) + ")";
  if (!data.comm_hook.empty()) line += ", comm hook " + data.comm_hook;
  if (data.sampled_iterations > 0) {
    line += "; iteration " + std::to_string(data.iteration) + ", averages of " +
            std::to_string(data.sampled_iterations) + " sampled: forward " +
            std::to_string(data.avg_forward_compute_time / 1000) + " us, backward compute " +
            std::to_string(data.avg_backward_compute_time / 1000) + " us, communication " +
            std::to_string(data.avg_backward_comm_time / 1000) + " us, overlapped " +
            std::to_string(data.avg_backward_compute_comm_overlap_time / 1000) + " us";
  }
  return line;
}

namespace {
// What gradients are averaged over in an iteration under ddp::Join: the world, or with
// divide_by_initial_world_size(false) the ranks still training.
int divisor_under_join(const Join& join, const JoinStatus& status, int world) {
  return join.options().divide_by_initial_world_size() ? world : static_cast<int>(status.active.size());
}
}  // namespace

DDPCore::~DDPCore() { release_from_ddp(impl_->params); }

void DDPCore::before_forward() {
  int source = 0;                       // buffers come from rank 0 ...
  int divisor = impl_->group->getSize();  // ... and gradients are averaged over every rank,
  if (join_ != nullptr) {
    // ... unless, under ddp::Join, some ranks ran out of inputs: then buffers come from a rank that
    // still trains, and gradients may be averaged over the active ranks only.
    const bool sync = require_sync_ && at::GradMode::is_enabled();
    const JoinStatus& status = join_->notify(join_index_, sync);
    source = status.authoritative_rank();
    divisor = divisor_under_join(*join_, status, divisor);
  }
  ran_under_join_ = join_ != nullptr;
  impl_->reducer->set_divisor(divisor);
  impl_->reducer->prepare_for_forward();
  if (impl_->buffer_broadcaster) impl_->buffer_broadcaster->broadcast_from(source);
  // INFO: the averages every 100 iterations, from rank 0.
  const int64_t iteration = impl_->reducer->iterations_reduced();
  if (iteration > 0 && iteration % 100 == 0 && iteration != last_logged_iteration_ &&
      impl_->group->getRank() == 0 && debug_level_of(impl_->group) != DebugLevel::kOff) {
    last_logged_iteration_ = iteration;
    info_log(describe(logging_data()));
  }
  impl_->reducer->begin_iteration();
}

bool DDPCore::wants_outputs() const { return impl_->reducer->wants_outputs(); }

void DDPCore::after_forward(const std::vector<at::Tensor>& outputs) {
  // Like PyTorch: a forward without grad mode (evaluation) does not touch the reducer.
  if (!at::GradMode::is_enabled()) return;
  impl_->reducer->forward_done();
  impl_->reducer->prepare_for_backward(require_sync_, outputs);
}

void DDPCore::module_moved() {
  impl_->reducer->reallocate_buckets();
  if (impl_->buffer_broadcaster) {
    impl_->buffer_broadcaster = std::make_unique<TensorBroadcaster>(impl_->buffers, impl_->group);
  }
}

ProcessGroupPtr DDPCore::join_process_group() const { return impl_->group; }

void DDPCore::join_attach(Join* join, size_t index) {
  join_ = join;
  join_index_ = index;
}

// One iteration of the other ranks, on a rank that ran out of inputs: the same collectives as
// before_forward and backward, in the same order, contributing nothing.
void DDPCore::join_shadow(const JoinStatus& status) {
  // The active ranks' divisor: where buckets are reduced in place, the scale is part of the
  // collective (the zeros this rank contributes are the same either way).
  impl_->reducer->set_divisor(divisor_under_join(*join_, status, impl_->group->getSize()));
  impl_->reducer->prepare_for_forward();  // the one bucket rebuild, in the iteration the others do it
  if (impl_->buffer_broadcaster) impl_->buffer_broadcaster->broadcast_from(status.authoritative_rank());
  if (status.sync) impl_->reducer->shadow_backward();
}

// Every rank takes the final parameters and buffers of a rank that trained until the end: ranks
// that joined early skipped their optimizer steps while shadowing.
void DDPCore::join_finish(const JoinStatus&, int from) {
  TensorBroadcaster(impl_->state, impl_->group).broadcast_from(from);
}

void DDPCore::register_comm_hook(CommHook hook) { impl_->reducer->register_comm_hook(std::move(hook)); }

Stateful* DDPCore::comm_hook_state() const {
  const CommHook* hook = impl_->reducer->comm_hook();
  return hook ? hook->state().get() : nullptr;
}

DDPLoggingData DDPCore::logging_data() const {
  DDPLoggingData data;
  const ProcessGroupPtr& group = impl_->group;
  data.world_size = group->getSize();
  data.rank = group->getRank();
  data.backend_name = transport_of(group);  // "gloo+shm" when shared memory serves DDP's group
  data.module_name = impl_->module->name();
  data.num_parameter_tensors = static_cast<int64_t>(impl_->params.size());
  for (const auto& p : impl_->params) data.total_parameter_size_bytes += p.numel() * p.element_size();
  data.first_bucket_cap_bytes = static_cast<int64_t>(options_.first_bucket_cap_mb() * 1024 * 1024);
  data.find_unused_parameters = options_.find_unused_parameters();
  data.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  data.static_graph = options_.static_graph();
  data.broadcast_buffers = options_.broadcast_buffers();
  const CommHook* hook = impl_->reducer->comm_hook();
  data.comm_hook = hook ? hook->name() : "";
  data.join_uneven_inputs = ran_under_join_;
  const ReducerStats stats = impl_->reducer->stats();
  data.bucket_cap_bytes = stats.bucket_bytes;
  data.bucket_cap_mb_auto = options_.bucket_cap_mb_auto();
  for (int64_t cap : stats.autotune_candidates) data.autotune_candidates_mb.push_back(cap / (1024.0 * 1024.0));
  data.autotune_step_times = stats.autotune_times;
  data.bucket_sizes = stats.first_bucket_bytes;
  data.has_rebuilt_buckets = stats.buckets_rebuilt;
  data.rebuilt_bucket_sizes = stats.rebuilt_bucket_bytes;
  data.iteration = stats.iterations_reduced;
  data.unused_parameter_size = stats.unused_parameter_bytes;
  const RuntimeAverages averages = impl_->reducer->runtime_averages();
  data.avg_forward_compute_time = averages.forward;
  data.avg_backward_compute_time = averages.backward_compute;
  data.avg_backward_comm_time = averages.backward_comm;
  data.avg_backward_compute_comm_overlap_time = averages.overlap;
  data.sampled_iterations = averages.samples;
  return data;
}

bool DDPCore::buckets_rebuilt() const noexcept { return impl_->reducer->buckets_rebuilt(); }

ReductionStats DDPCore::stats() const { return impl_->reducer->reduction_stats(); }

}  // namespace ddp::detail
