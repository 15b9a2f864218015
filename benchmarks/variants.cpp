#include "variants.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

namespace bench {
namespace {

constexpr int64_t kMiB = 1 << 20;

// PyTorch's default: the first bucket is capped at 1 MiB so the first allreduce starts early.
// A cap of 0 means one bucket per parameter for both engines, so the first cap is 0 there too
// (otherwise the first bucket would still gather parameters up to 1 MiB).
int64_t first_bucket_bytes(double cap_mb) { return cap_mb == 0 ? 0 : kMiB; }

at::Tensor loss(BenchNet& model, const Batch& batch) {
  return torch::nn::functional::cross_entropy(model.forward(batch.x), batch.y);
}

Variant local(std::shared_ptr<BenchNet> model, const Batch& batch) {
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-3));
  Variant v;
  v.step = [=] {
    sgd->zero_grad();
    loss(*model, batch).backward();
    sgd->step();
  };
  v.collectives = [] { return int64_t{0}; };
  return v;
}

// One blocking c10d allreduce per gradient. `with_check`: naive as it was once measured, when
// ddp::all_reduce ran a 7-number fingerprint allgather before every allreduce (two collectives per
// gradient): naive_check.
Variant naive(std::shared_ptr<BenchNet> model, const Batch& batch, const ddp::ProcessGroupPtr& group,
              bool with_check = false) {
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-3));
  const auto params = model->parameters();
  const double world = group->getSize();
  Variant v;
  v.step = [=] {
    sgd->zero_grad();
    loss(*model, batch).backward();
    for (const auto& param : params) {
      if (with_check) {
        std::vector<at::Tensor> fingerprint{torch::tensor({int64_t{1}, int64_t{-1}, int64_t{6}, param.numel(),
                                                           int64_t{-1}, int64_t{-1}, int64_t{0}})};
        std::vector<std::vector<at::Tensor>> gathered(1);
        for (int r = 0; r < group->getSize(); ++r) gathered[0].push_back(torch::empty_like(fingerprint[0]));
        group->allgather(gathered, fingerprint)->wait();
      }
      std::vector<at::Tensor> grad{param.grad()};
      group->allreduce(grad)->wait();
      grad[0].div_(world);
    }
    sgd->step();
  };
  const auto count = static_cast<int64_t>((with_check ? 2 : 1) * params.size());
  v.collectives = [count] { return count; };
  return v;
}

Variant naive_flat(std::shared_ptr<BenchNet> model, const Batch& batch, const ddp::ProcessGroupPtr& group) {
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-3));
  const auto params = model->parameters();
  const double world = group->getSize();
  Variant v;
  v.step = [=] {
    sgd->zero_grad();
    loss(*model, batch).backward();
    std::vector<at::Tensor> grads;
    for (const auto& param : params) grads.push_back(param.grad().reshape({-1}));
    std::vector<at::Tensor> flat{torch::cat(grads)};
    group->allreduce(flat)->wait();
    flat[0].div_(world);
    int64_t offset = 0;
    for (const auto& param : params) {
      param.grad().view({-1}).copy_(flat[0].narrow(0, offset, param.numel()));
      offset += param.numel();
    }
    sgd->step();
  };
  v.collectives = [] { return int64_t{1}; };
  return v;
}

// TORCH_DISTRIBUTED_DEBUG=DETAIL for the construction of one model (DDP reads it then).
struct DetailWhileConstructing {
  explicit DetailWhileConstructing(bool on) : on(on) {
    if (on) setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
  }
  ~DetailWhileConstructing() {
    if (on) unsetenv("TORCH_DISTRIBUTED_DEBUG");
  }
  bool on;
};

// SGD, as every other variant; Adam for ours+adam; Adam sharded over the group for ours+zero_adam
// and, stepped by the comm hook ours() registers, ours+zero_adam_overlap. The three Adam variants
// keep gradients as bucket views: a comm hook (the overlap's) reduces the bucket's own buffer, so
// without views its DDP copies every gradient in and out, which DDP without a hook does not
// (it reduces them where they lie); with views none of the three copies, and their ratios are
// ZeRO's alone.
std::shared_ptr<torch::optim::Optimizer> optimizer_of(const VariantSpec& spec, const std::vector<at::Tensor>& params,
                                                      const ddp::ProcessGroupPtr& group) {
  if (spec.kind == Kind::ours_adam) return std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
  if (spec.kind == Kind::ours_zero_adam || spec.kind == Kind::ours_zero_adam_overlap) {
    return std::make_shared<ddp::ZeroRedundancyOptimizer<torch::optim::Adam>>(
        params,
        ddp::ZeroRedundancyOptimizerOptions()
            .process_group(group)
            .parameters_as_bucket_view(true)
            .overlap_with_ddp(spec.kind == Kind::ours_zero_adam_overlap),
        torch::optim::AdamOptions(1e-3));
  }
  return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-3));
}

Variant ours(std::shared_ptr<BenchNet> model, const Batch& batch, const ddp::ProcessGroupPtr& group,
             const VariantSpec& spec) {
  const double cap_mb = spec.has_buckets() ? spec.bucket_cap_mb : 25;
  auto options = ddp::DDPOptions()
                     .bucket_cap_mb(cap_mb)
                     .first_bucket_cap_mb(static_cast<double>(first_bucket_bytes(cap_mb)) / kMiB)
                     .gradient_as_bucket_view(spec.kind == Kind::ours_view || holds_adam_state(spec))
                     .bucket_cap_mb_auto(spec.kind == Kind::ours_auto);
  std::shared_ptr<ddp::DistributedDataParallel<BenchNet>> wrapped;
  {
    DetailWhileConstructing detail(spec.kind == Kind::ours_detail);
    wrapped = std::make_shared<ddp::DistributedDataParallel<BenchNet>>(model, group, options);
  }
  auto optimizer = optimizer_of(spec, wrapped->parameters(), group);
  switch (spec.kind) {
    case Kind::ours_fp16: wrapped->register_comm_hook(ddp::hooks::fp16_compress()); break;
    case Kind::ours_bf16: wrapped->register_comm_hook(ddp::hooks::bf16_compress()); break;
    case Kind::ours_powersgd1:
    case Kind::ours_powersgd4:
      // From the third step: the bench's two warm-up steps are PowerSGD's plain-allreduce warm-up.
      wrapped->register_comm_hook(ddp::hooks::powersgd(ddp::hooks::PowerSGDOptions()
                                                           .matrix_approximation_rank(spec.kind == Kind::ours_powersgd1 ? 1 : 4)
                                                           .start_powerSGD_iter(2)));
      break;
    case Kind::ours_zero_adam_overlap:
      // shard_buckets: each rank owns 1/W of the state (with whole buckets, mlp_b4's 25 MiB bucket
      // would leave nearly all of it on one rank). The first two steps update nothing (ZeRO's warm-up:
      // before DDP's bucket rebuild, then the pass that records the buckets): ddp_bench's two
      // untimed steps, so every timed step updates. hook_with_zero_step, not its interleaved form:
      // where backward leaves no core idle (two ranks on two cores), a step interleaved with
      // backward only competes with it (mlp_b4 1.15x ZeRO without overlap, against 0.76x).
      wrapped->register_comm_hook(ddp::hooks::hook_with_zero_step(
          ddp::hooks::allreduce(), *wrapped, dynamic_cast<ddp::ZeroRedundancyOptimizerBase&>(*optimizer),
          /*shard_buckets=*/true));
      break;
    default: break;
  }
  Variant v;
  if (spec.kind == Kind::ours_join) {
    v.run_block = [wrapped](const std::function<void()>& block) { ddp::Join({*wrapped}).run(block); };
  }
  if (spec.kind == Kind::ours_auto) {
    v.settled = [wrapped] { return !wrapped->logging_data().autotune_candidates_mb.empty(); };
    v.note = [wrapped] {
      const auto data = wrapped->logging_data();
      std::ostringstream out;
      out << "chose " << data.bucket_cap_bytes / static_cast<double>(kMiB) << " MiB of";
      for (double mb : data.autotune_candidates_mb) out << ' ' << mb;
      return out.str();
    };
  }
  v.step = [=] {
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(wrapped->forward(batch.x), batch.y).backward();
    ddp::TimelineSpan span("optimizer.step");  // TORCHDDP_TIMELINE: beside the hook's ZeRO spans
    optimizer->step();
  };
  v.collectives = [wrapped] { return static_cast<int64_t>(wrapped->reduction_stats().buckets.size()); };
  v.optimizer_state_bytes = [optimizer] { return ddp::optimizer_state_bytes(*optimizer); };
  return v;
}

// Every block sharded (the MLP's hidden layers, the ResNet's residual blocks), then the root (the
// rest); Adam over the shards. Collectives per step: each block gathers for its forward and again
// for its backward and reduce-scatters once; the root gathers and reduce-scatters once.
Variant fsdp(std::shared_ptr<BenchNet> model, const Batch& batch, const ddp::ProcessGroupPtr& group,
             ddp::FSDPOptions options) {
  options.process_group(group);
  const auto blocks = model->shard_blocks();
  for (auto block : blocks) ddp::fully_shard(block, options);
  auto sharded = std::make_shared<ddp::FSDPModule<BenchNet>>(ddp::fully_shard(model, options));
  auto optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  Variant v;
  v.step = [=] {
    optimizer->zero_grad();
    // TORCHDDP_TIMELINE: the phases beside fully_shard's own spans (DDP's come from its reducer).
    auto loss = [&] {
      ddp::TimelineSpan span("forward");
      return torch::nn::functional::cross_entropy(sharded->forward(batch.x), batch.y);
    }();
    {
      ddp::TimelineSpan span("backward");
      loss.backward();
    }
    ddp::TimelineSpan span("optimizer.step");
    optimizer->step();
  };
  v.collectives = [n = static_cast<int64_t>(blocks.size())] { return 3 * n + 2; };
  v.optimizer_state_bytes = [optimizer] { return ddp::optimizer_state_bytes(*optimizer); };
  v.library_bytes = [sharded] {
    const auto stats = sharded->memory_stats();
    return std::vector<std::pair<std::string, int64_t>>{{"parameter_bytes", stats.parameter_bytes},
                                                        {"gradient_bytes", stats.gradient_bytes},
                                                        {"peak_unsharded_bytes", stats.peak_unsharded_bytes}};
  };
  return v;
}

// c10d::Reducer's constructor by release (checked: reducer.hpp of 1.13, 2.6 and 2.15): 1.13 and 2.6
// take the per-bucket size limits third and default everything after first_bucket_bytes_cap; 2.15
// takes no limits and requires skip_all_reduce_unused_params, use_python_reducer and
// bucket_bytes_cap_list (empty: its own rule when rebuilding, what Python DDP passes by default).
// Chosen by which constructor exists, not by a version number.
template <typename Limits>
std::shared_ptr<c10d::Reducer> make_reducer(const std::vector<at::Tensor>& params,
                                            const std::vector<std::vector<size_t>>& indices, const Limits& limits,
                                            const ddp::ProcessGroupPtr& group, const std::vector<bool>& sparse,
                                            size_t cap, size_t first) {
  using Names = std::unordered_map<size_t, std::string>;
  using Reducer = std::conditional_t<sizeof(Limits) != 0, c10d::Reducer, void>;  // dependent: one branch compiles
  constexpr bool takes_limits =
      std::is_constructible_v<Reducer, std::vector<at::Tensor>, std::vector<std::vector<size_t>>, Limits,
                              ddp::ProcessGroupPtr, std::vector<bool>, int64_t, bool, bool, Names, int64_t>;
  const auto bytes = static_cast<int64_t>(cap), first_bytes = static_cast<int64_t>(first);
  if constexpr (takes_limits) {
    return std::make_shared<Reducer>(params, indices, limits, group, sparse, bytes, /*find_unused_parameters=*/false,
                                     /*gradient_as_bucket_view=*/false, Names{}, first_bytes);
  } else {
    return std::make_shared<Reducer>(params, indices, group, sparse, bytes, /*find_unused_parameters=*/false,
                                     /*gradient_as_bucket_view=*/false, Names{}, first_bytes,
                                     /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                                     /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
  }
}

// Drives c10d::Reducer the way torch/nn/parallel/distributed.py (1.13) does: buckets from
// compute_bucket_assignment_by_size([first cap, cap]) reversed; per step prepare_for_forward,
// rebuild_buckets (once, in observed order), buffer broadcast, forward, prepare_for_backward.
Variant reducer(std::shared_ptr<BenchNet> model, const Batch& batch, const ddp::ProcessGroupPtr& group,
                double cap_mb, bool fp16) {
  const auto cap = static_cast<size_t>(cap_mb * kMiB);
  const auto first = static_cast<size_t>(first_bucket_bytes(cap_mb));
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-3));
  const auto params = model->parameters();
  const std::vector<bool> sparse(params.size(), false);
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(params, {first, cap}, sparse);
  std::reverse(indices.begin(), indices.end());
  std::reverse(limits.begin(), limits.end());
  auto engine = make_reducer(params, indices, limits, group, sparse, cap, first);
  // What Python's model.register_comm_hook(None, default_hooks.fp16_compress_hook) becomes in C++.
  if (fp16) engine->register_builtin_comm_hook(c10d::BuiltinCommHookType::FP16_COMPRESS);
  // Python DDP broadcasts buffers (BatchNorm statistics) from rank 0 before every forward, as ours
  // does with broadcast_buffers at its default; ours skips it in a world of one, so this does too.
  const auto buffers = model->buffers();
  const bool sync_buffers = !buffers.empty() && group->getSize() > 1;
  constexpr size_t kBroadcastBucket = 250 * kMiB;  // Python DDP's broadcast_bucket_size
  Variant v;
  v.step = [=] {
    sgd->zero_grad();
    engine->prepare_for_forward();
    engine->rebuild_buckets();
    if (sync_buffers) c10d::broadcast_coalesced(group, buffers, kBroadcastBucket, 0);
    at::Tensor out = model->forward(batch.x);
    engine->prepare_for_backward({});
    torch::nn::functional::cross_entropy(out, batch.y).backward();
    sgd->step();
  };
  v.collectives = [engine] { return static_cast<int64_t>(engine->get_grad_buckets(false).size()); };
  return v;
}

// The same step with the model unwrapped: the optimizer's own hooks average the gradients, through
// the same engine and caps as ours.
Variant ours_optimizer(std::shared_ptr<BenchNet> model, const Batch& batch, const ddp::ProcessGroupPtr& group,
                       const VariantSpec& spec) {
  const double cap_mb = spec.has_buckets() ? spec.bucket_cap_mb : 25;
  ddp::broadcast_parameters(*model, 0, group);
  auto optimizer = std::make_shared<ddp::DistributedOptimizer<torch::optim::SGD>>(
      ddp::DistributedOptimizerOptions()
          .process_group(group)
          .bucket_cap_mb(cap_mb)
          .first_bucket_cap_mb(static_cast<double>(first_bucket_bytes(cap_mb)) / kMiB),
      model->parameters(), torch::optim::SGDOptions(1e-3));
  Variant v;
  v.step = [=] {
    optimizer->zero_grad();
    loss(*model, batch).backward();
    optimizer->step();
  };
  v.collectives = [optimizer] { return static_cast<int64_t>(optimizer->reduction_stats().buckets.size()); };
  return v;
}

}  // namespace

std::string VariantSpec::kind_name() const {
  switch (kind) {
    case Kind::local: return "local";
    case Kind::naive: return "naive";
    case Kind::naive_flat: return "naive_flat";
    case Kind::naive_check: return "naive_check";
    case Kind::reducer: return "reducer";
    case Kind::ours: return "ours";
    case Kind::ours_gloo: return "ours_gloo";
    case Kind::ours_view: return "ours_view";
    case Kind::ours_join: return "ours_join";
    case Kind::ours_detail: return "ours_detail";
    case Kind::ours_auto: return "ours_auto";
    case Kind::ours_optimizer: return "ours_optimizer";
    case Kind::ours_fp16: return "ours+fp16";
    case Kind::ours_bf16: return "ours+bf16";
    case Kind::ours_powersgd1: return "ours+powersgd1";
    case Kind::ours_powersgd4: return "ours+powersgd4";
    case Kind::reducer_fp16: return "reducer+fp16";
    case Kind::ours_syncbn: return "ours_syncbn";
    case Kind::ours_adam: return "ours+adam";
    case Kind::ours_zero_adam: return "ours+zero_adam";
    case Kind::ours_zero_adam_overlap: return "ours+zero_adam_overlap";
    case Kind::fsdp_adam: return "fsdp_adam";
    case Kind::fsdp_adam_prefetch: return "fsdp_adam+prefetch";
  }
  return "?";
}

std::string VariantSpec::id() const {
  if (!has_buckets()) return kind_name();
  std::ostringstream out;
  out << kind_name() << '@' << bucket_cap_mb;
  return out.str();
}

VariantSpec parse_variant(const std::string& id) {
  const auto at = id.find('@');
  const std::string name = id.substr(0, at);
  VariantSpec spec;
  if (at != std::string::npos) spec.bucket_cap_mb = std::stod(id.substr(at + 1));
  for (Kind kind : {Kind::local, Kind::naive, Kind::naive_flat, Kind::naive_check, Kind::reducer, Kind::ours,
                    Kind::ours_gloo, Kind::ours_view,
                    Kind::ours_join, Kind::ours_detail, Kind::ours_auto, Kind::ours_optimizer, Kind::ours_fp16, Kind::ours_bf16,
                    Kind::ours_powersgd1, Kind::ours_powersgd4, Kind::reducer_fp16,
                    Kind::ours_syncbn, Kind::ours_adam, Kind::ours_zero_adam, Kind::ours_zero_adam_overlap,
                    Kind::fsdp_adam, Kind::fsdp_adam_prefetch}) {
    spec.kind = kind;
    if (spec.kind_name() == name) return spec;
  }
  throw std::invalid_argument("unknown variant '" + id + "'");
}

double hook_cap(const std::vector<double>& caps) {
  return std::find(caps.begin(), caps.end(), 25.0) != caps.end() || caps.empty() ? 25.0
                                                                                 : *std::max_element(caps.begin(), caps.end());
}

std::vector<VariantSpec> all_variants(const std::vector<double>& caps, const std::vector<double>& view_caps,
                                      bool features, bool hooks, bool batchnorm) {
  std::vector<VariantSpec> specs{{Kind::local}, {Kind::naive}, {Kind::naive_flat}, {Kind::naive_check}};
  for (double cap : caps) {
    specs.push_back({Kind::reducer, cap});
    specs.push_back({Kind::ours, cap});
  }
  specs.push_back({Kind::ours_gloo, hook_cap(caps)});
  for (double cap : view_caps) specs.push_back({Kind::ours_view, cap});
  if (features && !view_caps.empty()) {
    specs.push_back({Kind::ours_join, view_caps.front()});
    specs.push_back({Kind::ours_detail, view_caps.front()});
  }
  if (features) specs.push_back({Kind::ours_auto});
  if (features) specs.push_back({Kind::ours_optimizer, hook_cap(caps)});
  if (features) {
    specs.push_back({Kind::ours_adam, hook_cap(caps)});
    specs.push_back({Kind::ours_zero_adam, hook_cap(caps)});
    specs.push_back({Kind::ours_zero_adam_overlap, hook_cap(caps)});
    specs.push_back({Kind::fsdp_adam});
    specs.push_back({Kind::fsdp_adam_prefetch});
  }
  if (features && batchnorm && !view_caps.empty()) specs.push_back({Kind::ours_syncbn, view_caps.front()});
  if (hooks) {
    for (Kind kind : {Kind::reducer_fp16, Kind::ours_fp16, Kind::ours_bf16, Kind::ours_powersgd1, Kind::ours_powersgd4}) {
      specs.push_back({kind, hook_cap(caps)});
    }
  }
  return specs;
}

bool uses_sync_batchnorm(const VariantSpec& spec) { return spec.kind == Kind::ours_syncbn; }

bool holds_adam_state(const VariantSpec& spec) {
  return spec.kind == Kind::ours_adam || spec.kind == Kind::ours_zero_adam || spec.kind == Kind::ours_zero_adam_overlap ||
         spec.kind == Kind::fsdp_adam || spec.kind == Kind::fsdp_adam_prefetch;
}

Variant make_variant(const VariantSpec& spec, std::shared_ptr<BenchNet> model, const Batch& batch,
                     const Groups& groups) {
  Variant v;
  const ddp::ProcessGroupPtr& group = groups.ours;
  switch (spec.kind) {
    case Kind::local: v = local(model, batch); break;
    case Kind::naive: v = naive(model, batch, groups.gloo); break;
    case Kind::naive_flat: v = naive_flat(model, batch, groups.gloo); break;
    case Kind::naive_check: v = naive(model, batch, groups.gloo, /*with_check=*/true); break;
    case Kind::reducer:
    case Kind::reducer_fp16:
      v = reducer(model, batch, groups.gloo, spec.bucket_cap_mb, spec.kind == Kind::reducer_fp16);
      break;
    case Kind::ours_gloo: v = ours(model, batch, groups.gloo, spec); break;
    case Kind::ours_optimizer: v = ours_optimizer(model, batch, group, spec); break;
    case Kind::ours:
    case Kind::ours_view:
    case Kind::ours_join:
    case Kind::ours_detail:
    case Kind::ours_auto:
    case Kind::ours_fp16:
    case Kind::ours_bf16:
    case Kind::ours_powersgd1:
    case Kind::ours_powersgd4:
    case Kind::ours_syncbn:
    case Kind::ours_adam:
    case Kind::ours_zero_adam:
    case Kind::ours_zero_adam_overlap: v = ours(model, batch, group, spec); break;
    case Kind::fsdp_adam:
      v = fsdp(model, batch, group,
               ddp::FSDPOptions().forward_prefetch(false).backward_prefetch(ddp::BackwardPrefetch::kNone));
      break;
    case Kind::fsdp_adam_prefetch: v = fsdp(model, batch, group, ddp::FSDPOptions()); break;
  }
  v.spec = spec;
  return v;
}

}  // namespace bench
