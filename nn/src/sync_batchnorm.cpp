// SyncBatchNorm's forward and backward (the steps numbered as in sync_batchnorm.h), and
// convert_sync_batchnorm.
#include <ddp/sync_batchnorm.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <vector>

#include <torch/autograd.h>
#include <torch/nn/functional/batchnorm.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <ddp/wait_collective.h>

namespace ddp {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Header of the gathered statistics: [dim, channels, count], then mean (C), var (C).
constexpr int64_t kHeader = 3;

std::string who(int64_t num_features) {
  return "ddp::SyncBatchNorm(num_features=" + std::to_string(num_features) + ")";
}

// The shape that broadcasts a per-channel vector over the input.
std::vector<int64_t> channel_shape(const Tensor& input) {
  std::vector<int64_t> shape(input.dim(), 1);
  shape[1] = input.size(1);
  return shape;
}

// Half and bfloat16 inputs are normalized in float (as ATen's batch norm does).
c10::ScalarType compute_type(const Tensor& input) {
  const auto type = input.scalar_type();
  return type == at::kHalf || type == at::kBFloat16 ? at::kFloat : type;
}

// Every rank's gathered row of step 2 (float64, on the CPU): [dim, channels, count], mean (C), var (C).
struct GatheredRows {
  const double* data;
  int64_t world, width;
  double at(int64_t rank, int64_t i) const { return data[rank * width + i]; }
};

// Every rank's input must be (N, C, ...) with 2 to 5 dimensions: each rank sees all headers, so
// all fail together with the same message.
void check_inputs_fit(const GatheredRows& rows, int64_t num_features) {
  const auto dim = [&](int64_t r) { return static_cast<int64_t>(rows.at(r, 0)); };
  const auto channels = [&](int64_t r) { return static_cast<int64_t>(rows.at(r, 1)); };
  bool fit = true;
  for (int64_t r = 0; r < rows.world; ++r) fit = fit && dim(r) >= 2 && dim(r) <= 5 && channels(r) == num_features;
  if (fit) return;
  std::ostringstream message;
  message << who(num_features) << ": every rank's input must be (N, " << num_features
          << ", ...) with 2 to 5 dimensions, but";
  for (int64_t r = 0; r < rows.world; ++r) {
    message << (r ? "," : "") << " rank " << r << " has a " << dim(r) << "-D input";
    if (dim(r) >= 2) message << " of " << channels(r) << " channels";
  }
  message << ". Give every rank inputs of the channels the layer was built with";
  throw std::invalid_argument(message.str());
}

// Step 3: the global batch's count, and its mean and biased variance per channel (float64, CPU),
// each rank weighted by its count. Plain loops over 2C + 3 numbers per rank: a dozen tensor
// operations on vectors this short cost more in dispatch than in arithmetic.
struct GlobalStatistics {
  double count = 0;
  Tensor mean, var;
};
GlobalStatistics combine(const GatheredRows& rows, int64_t C) {
  GlobalStatistics out;
  for (int64_t r = 0; r < rows.world; ++r) out.count += rows.at(r, 2);
  out.mean = torch::zeros({C}, torch::kDouble);
  out.var = torch::zeros({C}, torch::kDouble);
  if (out.count <= 0) return out;
  double* mean = out.mean.data_ptr<double>();
  double* var = out.var.data_ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0;
    for (int64_t r = 0; r < rows.world; ++r) sum += rows.at(r, kHeader + c) * rows.at(r, 2);
    mean[c] = sum / out.count;
    double spread = 0;
    for (int64_t r = 0; r < rows.world; ++r) {
      const double d = rows.at(r, kHeader + c) - mean[c];
      spread += (rows.at(r, kHeader + C + c) + d * d) * rows.at(r, 2);
    }
    var[c] = spread / out.count;
  }
  return out;
}

// What the autograd function needs besides the tensors it differentiates.
struct SyncState {
  ProcessGroupPtr group;
  Tensor running_mean, running_var;  // undefined without track_running_stats
  double momentum = 0;               // the factor this step (PyTorch's exponential_average_factor)
  double eps = 0;
  int64_t num_features = 0;
};

class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight, const Tensor& bias,
                        const SyncState& s) {
    const int64_t C = s.num_features;
    const bool fits = input.dim() >= 2 && input.dim() <= 5 && input.size(1) == C;
    const auto acc = compute_type(input);
    const auto wire = torch::TensorOptions().dtype(at::kDouble).device(input.device());
    // 1. This rank's per-channel statistics (zeros and a count of 0 for an empty batch).
    const int64_t count = fits ? input.numel() / C : 0;
    Tensor local_mean, local_var;
    if (count > 0) {
      // BatchNorm's own statistics kernel, in its training form with eps 0 (so its invstd is
      // 1/sqrt(var)): on the CPU several times faster than var_mean over (N, H, W); the normalized
      // output it also makes is dropped. ATen gives a channel of variance 0 an invstd of 0.
      const auto stats = at::native_batch_norm(input.to(acc), {}, {}, {}, {}, /*training=*/true, /*momentum=*/0.0,
                                               /*eps=*/0.0);
      const Tensor invstd = std::get<2>(stats).to(at::kDouble);
      local_mean = std::get<1>(stats).to(at::kDouble);
      local_var = invstd.pow(-2).masked_fill_(invstd == 0, 0.0);
    } else {
      local_mean = local_var = torch::zeros({C}, wire);
    }
    const Tensor header = torch::tensor({static_cast<double>(input.dim()),
                                         static_cast<double>(input.dim() >= 2 ? input.size(1) : 0),
                                         static_cast<double>(count)}, wire);
    // 2. One allgather of [header, mean, var] from every rank, into the rows of one tensor.
    const int64_t world = s.group->getSize();
    std::vector<Tensor> mine{torch::cat({header, local_mean, local_var}).to(collective_device(s.group))};
    const Tensor rows = torch::empty({world, mine[0].numel()}, mine[0].options());
    std::vector<std::vector<Tensor>> all(1);
    for (int64_t r = 0; r < world; ++r) all[0].push_back(rows[r]);
    wait_collective(s.group->allgather(all, mine),
                            [&] { return who(C) + ": allgather of the batch statistics in forward"; });
    const Tensor gathered = rows.cpu();
    const GatheredRows view{gathered.data_ptr<double>(), world, gathered.size(1)};
    check_inputs_fit(view, C);
    // 3. Global count, mean and biased variance, each rank weighted by its count.
    const auto [total, global_mean, global_var] = combine(view, C);
    if (total <= 1) {
      throw std::invalid_argument(who(C) + ": expected more than 1 value per channel when training, got " +
                                  std::to_string(static_cast<int64_t>(total)) + " in the global batch of every rank");
    }
    // 4. Running statistics from the global batch, with the unbiased variance.
    if (s.running_mean.defined()) {
      torch::NoGradGuard no_grad;
      s.running_mean.mul_(1 - s.momentum).add_(global_mean.to(s.running_mean.options()), s.momentum);
      s.running_var.mul_(1 - s.momentum).add_((global_var * (total / (total - 1))).to(s.running_var.options()),
                                              s.momentum);
    }
    // 5. Normalize with the global statistics: BatchNorm's own kernel in its inference form (given
    //    mean and variance) does it in one fused pass.
    const auto on_input = torch::TensorOptions().dtype(acc).device(input.device());
    const Tensor mean = global_mean.to(on_input), var = global_var.to(on_input);
    const Tensor w = weight.defined() ? weight.to(acc) : Tensor(), b = bias.defined() ? bias.to(acc) : Tensor();
    const Tensor y = input.numel() == 0 ? input.to(acc)
                                        : at::batch_norm(input.to(acc), w, b, mean, var, /*training=*/false,
                                                         /*momentum=*/0.0, s.eps, /*cudnn_enabled=*/true);
    ctx->save_for_backward({input, weight, mean, var});
    ctx->saved_data["count"] = total;
    ctx->saved_data["eps"] = s.eps;
    ctx->saved_data["group"] = c10::IValue::make_capsule(s.group);
    return y.to(input.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &input = saved[0], &weight = saved[1], &mean = saved[2], &var = saved[3];
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto acc = compute_type(input);
    const Tensor x = input.to(acc), dy = grad_outputs[0].to(acc);
    const Tensor w = weight.defined() ? weight.to(acc) : Tensor();
    // 6. This rank's per-channel sums, from BatchNorm's own backward in its inference form, which
    //    returns in fused passes: g = dy * invstd * weight, sum(dy * (x - mean) * invstd), sum(dy).
    //    The parameters' gradients come from this rank's sums alone.
    //    An empty batch (LibTorch's CPU kernel divides by its size) contributes zeros.
    Tensor g = torch::empty_like(x), dy_xhat = torch::zeros_like(mean), sum_dy = torch::zeros_like(mean);
    if (x.numel() > 0) {
      std::tie(g, dy_xhat, sum_dy) = at::native_batch_norm_backward(
          dy, x, w, mean, var, /*save_mean=*/{}, /*save_invstd=*/{}, /*train=*/false, eps,
          {ctx->needs_input_grad(0), true, true});
    }
    const Tensor invstd = (var + eps).rsqrt();
    const Tensor sum_dy_xmu = dy_xhat / invstd;
    Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(1)) grad_weight = dy_xhat.to(weight.scalar_type());
    if (ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.scalar_type());
    if (ctx->needs_input_grad(0)) {
      // 7. One allreduce of both sums: the input gradient needs every rank's.
      auto group = c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(ctx->saved_data["group"].toCapsule());
      const int64_t C = input.size(1);
      std::vector<Tensor> sums{torch::cat({sum_dy, sum_dy_xmu}).to(at::kDouble).to(collective_device(group))};
      wait_collective(group->allreduce(sums),
                              [&] { return who(C) + ": allreduce of the gradient sums in backward"; });
      const double total = ctx->saved_data["count"].toDouble();
      const Tensor means = (sums[0] / total).to(torch::TensorOptions().dtype(acc).device(input.device()));
      const Tensor mean_dy = means.narrow(0, 0, C), mean_dy_xmu = means.narrow(0, C, C);
      // 8. The input gradient, dx = (dy - mean_dy - (x - mean) * invstd^2 * mean_dy_xmu) * invstd * weight,
      //    is g plus a per-channel affine function of x: dx = g - a * x - b with
      //    a = invstd^3 * weight * mean_dy_xmu and b = invstd * weight * (mean_dy - mean * invstd^2 * mean_dy_xmu).
      const Tensor scale = w.defined() ? invstd * w : invstd;
      const Tensor a = scale * invstd.pow(2) * mean_dy_xmu;
      const Tensor b = scale * (mean_dy - mean * invstd.pow(2) * mean_dy_xmu);
      const auto shape = channel_shape(input);
      grad_input = g.sub_(b.view(shape)).addcmul_(x, a.view(shape), -1).to(input.scalar_type());
    }
    return {grad_input, grad_weight, grad_bias, Tensor()};
  }
};

}  // namespace

SyncBatchNormOptions SyncBatchNormOptions::from(const torch::nn::BatchNormOptions& options) {
  return SyncBatchNormOptions(options.num_features())
      .eps(options.eps())
      .momentum(options.momentum())
      .affine(options.affine())
      .track_running_stats(options.track_running_stats());
}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_) : options(std::move(options_)) { reset(); }

void SyncBatchNormImpl::register_state(Tensor weight_, Tensor bias_, Tensor running_mean_, Tensor running_var_,
                                       Tensor num_batches_tracked_) {
  weight = register_parameter("weight", weight_, weight_.defined() && weight_.requires_grad());
  bias = register_parameter("bias", bias_, bias_.defined() && bias_.requires_grad());
  running_mean = register_buffer("running_mean", running_mean_);
  running_var = register_buffer("running_var", running_var_);
  num_batches_tracked = register_buffer("num_batches_tracked", num_batches_tracked_);
}

void SyncBatchNormImpl::reset() {
  const int64_t C = options.num_features();
  if (C <= 0) throw std::invalid_argument("ddp::SyncBatchNorm: num_features must be positive, got " + std::to_string(C));
  const bool stats = options.track_running_stats();
  register_state(options.affine() ? torch::ones({C}).requires_grad_() : Tensor(),
                 options.affine() ? torch::zeros({C}).requires_grad_() : Tensor(),
                 stats ? torch::zeros({C}) : Tensor(), stats ? torch::ones({C}) : Tensor(),
                 stats ? torch::tensor(0, torch::kLong) : Tensor());
  agreed_group_ = nullptr;
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

ProcessGroupPtr SyncBatchNormImpl::sync_group() const {
  if (!is_training()) return {};
  ProcessGroupPtr group = options.process_group();
  if (!group && is_initialized()) group = default_group();
  return group && group->getSize() > 1 ? group : ProcessGroupPtr();
}

void SyncBatchNormImpl::agree_on_num_features(const ProcessGroupPtr& group) {
  std::vector<Tensor> mine{torch::tensor({options.num_features()}, torch::kLong).to(collective_device(group))};
  std::vector<std::vector<Tensor>> all(1);
  for (int r = 0; r < group->getSize(); ++r) all[0].push_back(torch::empty_like(mine[0]));
  wait_collective(group->allgather(all, mine),
                          [&] { return who(options.num_features()) + ": the check that every rank has the same num_features"; });
  bool same = true;
  for (const auto& theirs : all[0]) same = same && theirs.item<int64_t>() == options.num_features();
  if (!same) {
    std::ostringstream message;
    message << who(options.num_features())
            << ": the ranks' layers disagree on num_features (the channel count):";
    for (size_t r = 0; r < all[0].size(); ++r) message << (r ? "," : "") << " rank " << r << " has " << all[0][r].item<int64_t>();
    message << ". Every rank must build the same model";
    throw std::invalid_argument(message.str());
  }
  agreed_group_ = group.get();
}

Tensor SyncBatchNormImpl::forward(const Tensor& input) {
  // BatchNorm's momentum rule: momentum, or the cumulative average (1 / batches so far) when unset.
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked += 1;
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();
  }
  const ProcessGroupPtr group = sync_group();
  if (!group) {
    if (input.dim() < 2 || input.dim() > 5) {
      throw std::invalid_argument(who(options.num_features()) + ": expected a 2-D to 5-D input (N, C, ...), got " +
                                  std::to_string(input.dim()) + "-D");
    }
    return torch::nn::functional::detail::batch_norm(input, running_mean, running_var, weight, bias,
                                                     is_training() || !options.track_running_stats(), factor,
                                                     options.eps());
  }
  if (agreed_group_ != group.get()) agree_on_num_features(group);
  SyncState state{group, running_mean, running_var, factor, options.eps(), options.num_features()};
  return SyncBatchNormFunction::apply(input, weight, bias, state);
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum()) stream << *options.momentum();
  else stream << "None";
  stream << ", affine=" << std::boolalpha << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

// --- convert_sync_batchnorm -------------------------------------------------------------------

struct SyncBatchNormConverter {
  // A SyncBatchNorm that takes over `bn`'s tensors, options and mode; null if `module` is not a
  // BatchNorm1d/2d/3d.
  static std::shared_ptr<SyncBatchNormImpl> from(const torch::nn::Module& module, const ProcessGroupPtr& group) {
    if (auto* bn = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module)) return take_over(*bn, group);
    if (auto* bn = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module)) return take_over(*bn, group);
    if (auto* bn = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module)) return take_over(*bn, group);
    return nullptr;
  }

 private:
  template <typename BatchNorm>
  static std::shared_ptr<SyncBatchNormImpl> take_over(const BatchNorm& bn, const ProcessGroupPtr& group) {
    // Not make_shared: the public constructor registers fresh tensors under the same names.
    std::shared_ptr<SyncBatchNormImpl> sync(
        new SyncBatchNormImpl(SyncBatchNormOptions::from(bn.options).process_group(group), SyncBatchNormImpl::Empty{}));
    sync->register_state(bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked);
    sync->train(bn.is_training());
    return sync;
  }
};

namespace {

bool is_batchnorm(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module);
}

// Sequential, ModuleList and ModuleDict keep their own list of modules besides the children.
bool is_container(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&module) ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&module) ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&module);
}

// One place a BatchNorm sits in the tree.
struct Found {
  torch::nn::Module* parent;
  std::string name;  // among the parent's children
  std::string path;  // from the root, as in named_parameters()
  std::shared_ptr<torch::nn::Module> batchnorm;
};

void collect(torch::nn::Module& parent, const std::string& prefix, std::vector<Found>& found,
             std::vector<const torch::nn::Module*>& visited) {
  if (std::find(visited.begin(), visited.end(), &parent) != visited.end()) return;
  visited.push_back(&parent);
  for (const auto& child : parent.named_children()) {
    const std::string path = prefix.empty() ? child.key() : prefix + "." + child.key();
    if (is_batchnorm(*child.value())) {
      found.push_back({&parent, child.key(), path, child.value()});
    } else {
      collect(*child.value(), path, found, visited);
    }
  }
}

// Points the parent's own list (if it has one) and its children at `sync` instead of `old`.
void replace(const Found& at, const std::shared_ptr<SyncBatchNormImpl>& sync) {
  if (auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(at.parent)) {
    for (auto& entry : *sequential) {
      if (entry.ptr() == at.batchnorm) entry = torch::nn::AnyModule(sync);
    }
  } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(at.parent)) {
    for (auto& entry : *list) {
      if (entry == at.batchnorm) entry = sync;
    }
  } else if (auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(at.parent)) {
    for (auto& entry : *dict) {
      if (entry.value() == at.batchnorm) entry.value() = sync;
    }
  }
  at.parent->replace_module(at.name, sync);
}

}  // namespace

void convert_sync_batchnorm_in_place(torch::nn::Module& module, const ProcessGroupPtr& group) {
  if (is_batchnorm(module)) {
    throw std::invalid_argument("ddp::convert_sync_batchnorm: the module is itself a BatchNorm, which cannot be "
                                "replaced in place: build a ddp::SyncBatchNorm instead (same parameter names)");
  }
  std::vector<Found> found;
  std::vector<const torch::nn::Module*> visited;
  collect(module, "", found, visited);
  // Who holds each BatchNorm: its parents' children lists, a container's own list, and `found`.
  // Anything more (a member field, another handle) would keep running the plain BatchNorm.
  std::vector<std::string> held_elsewhere;
  for (const auto& at : found) {
    long expected = 0;
    for (const auto& other : found) {
      if (other.batchnorm == at.batchnorm) expected += 2 + (is_container(*other.parent) ? 1 : 0);
    }
    if (at.batchnorm.use_count() > expected) held_elsewhere.push_back("'" + at.path + "'");
  }
  if (!held_elsewhere.empty()) {
    std::ostringstream message;
    message << "ddp::convert_sync_batchnorm: cannot replace the BatchNorm at ";
    for (size_t i = 0; i < held_elsewhere.size(); ++i) message << (i ? ", " : "") << held_elsewhere[i];
    message << ": besides its parent's list of children something else holds it, most likely a member field of "
               "its module (such as `torch::nn::BatchNorm2d bn`), which would go on running the plain BatchNorm. "
               "Declare that field as ddp::SyncBatchNorm (the same parameter names: checkpoints still load) or hold "
               "the BatchNorm in a torch::nn::Sequential, and drop other handles to it before converting. Nothing "
               "was changed";
    throw std::invalid_argument(message.str());
  }
  // A BatchNorm registered in several places becomes one SyncBatchNorm registered in all of them.
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, std::shared_ptr<SyncBatchNormImpl>>> converted;
  for (const auto& at : found) {
    std::shared_ptr<SyncBatchNormImpl> sync;
    for (const auto& [old, made] : converted) {
      if (old == at.batchnorm) sync = made;
    }
    if (!sync) {
      sync = SyncBatchNormConverter::from(*at.batchnorm, group);
      converted.emplace_back(at.batchnorm, sync);
    }
    replace(at, sync);
  }
}

}  // namespace ddp
