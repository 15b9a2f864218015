// GradScaler: the per-iteration flow for each optimizer is
//   scale(loss) -> backward -> [unscale_: divide gradients, find inf/NaN, agree across ranks]
//   -> step: skip or step -> update: back off or count a clean step (and maybe grow)
// and the scale changes only in update(), from flags every rank holds alike.
#include <ddp/grad_scaler.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddp {
namespace {

void check_options(const GradScalerOptions& o, const char* who) {
  const std::string prefix = std::string(who) + ": ";
  if (!(o.init_scale() > 0) || !std::isfinite(o.init_scale()) ||
      o.init_scale() > std::numeric_limits<float>::max()) {
    throw std::invalid_argument(prefix + "init_scale must be a positive finite float32 value, got " +
                                std::to_string(o.init_scale()));
  }
  if (!(o.growth_factor() > 1.0) || !std::isfinite(o.growth_factor())) {
    throw std::invalid_argument(prefix + "growth_factor must be > 1.0 (PyTorch: \"The growth factor must be > 1.0.\"), got " +
                                std::to_string(o.growth_factor()));
  }
  if (!(o.backoff_factor() < 1.0) || !(o.backoff_factor() > 0.0)) {
    throw std::invalid_argument(prefix + "backoff_factor must be in (0, 1) (PyTorch: \"The backoff factor must be < 1.0.\"), got " +
                                std::to_string(o.backoff_factor()));
  }
  if (o.growth_interval() < 1) {
    throw std::invalid_argument(prefix + "growth_interval must be >= 1, got " + std::to_string(o.growth_interval()));
  }
}

// A 0-dim entry of a state dict as a double or an int64; throws naming the key.
const at::Tensor& entry(const TensorDict& state, const char* key) {
  const auto found = state.find(key);
  if (found == state.end()) {
    throw std::invalid_argument(std::string("GradScaler::load_state_dict: the state has no \"") + key +
                                "\" (expected scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)");
  }
  if (!found->second.defined() || found->second.numel() != 1) {
    throw std::invalid_argument(std::string("GradScaler::load_state_dict: \"") + key + "\" must hold one number");
  }
  return found->second;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), scale_(static_cast<float>(options_.init_scale())) {
  check_options(options_, "GradScaler");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!is_enabled()) return loss;
  scale_used_ = true;
  // A float32 0-dim factor, so that a bf16/fp16 loss is scaled (and backpropagated) in float32.
  return loss * at::scalar_tensor(scale_, at::TensorOptions().dtype(at::kFloat).device(loss.device()));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return;
  if (!scale_used_) {
    throw std::runtime_error(
        "GradScaler::unscale_: no loss was scaled yet: call scaler.scale(loss).backward() earlier in the iteration");
  }
  OptimizerState& state = per_optimizer_[&optimizer];
  if (state.stage == Stage::kUnscaled) {
    throw std::runtime_error("unscale_() has already been called on this optimizer since the last update()");
  }
  if (state.stage == Stage::kStepped) throw std::runtime_error("unscale_() is being called after step()");
  state.found_inf = unscale_and_check(optimizer);
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) {
    optimizer.step();
    return true;
  }
  if (!scale_used_) {
    throw std::runtime_error(
        "GradScaler::step: no loss was scaled yet: call scaler.scale(loss).backward() earlier in the iteration");
  }
  OptimizerState& state = per_optimizer_[&optimizer];
  if (state.stage == Stage::kStepped) throw std::runtime_error("step() has already been called since the last update()");
  if (state.stage == Stage::kReady) state.found_inf = unscale_and_check(optimizer);
  state.stage = Stage::kStepped;
  // found_inf is already the max over the ranks: every rank takes the same branch.
  if (state.found_inf) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!is_enabled()) return;
  if (per_optimizer_.empty()) {
    throw std::runtime_error(
        "GradScaler::update: No inf checks were recorded prior to update(): call scaler.step(optimizer) (or "
        "unscale_) for each optimizer of this iteration first");
  }
  const bool found_inf = std::any_of(per_optimizer_.begin(), per_optimizer_.end(),
                                     [](const auto& entry) { return entry.second.found_inf; });
  per_optimizer_.clear();  // the next iteration starts fresh for every optimizer
  if (found_inf) {
    // The scale was too large for some gradient: shrink it and start counting clean steps anew.
    scale_ = static_cast<float>(scale_ * options_.backoff_factor());
    growth_tracker_ = 0;
    return;
  }
  if (++growth_tracker_ < options_.growth_interval()) return;
  // growth_interval clean steps in a row: try a larger scale, unless float32 cannot hold it.
  const auto grown = static_cast<float>(scale_ * options_.growth_factor());
  if (std::isfinite(grown)) scale_ = grown;
  growth_tracker_ = 0;
}

void GradScaler::update(double new_scale) {
  if (!is_enabled()) return;
  if (!(new_scale > 0) || !std::isfinite(static_cast<float>(new_scale))) {
    throw std::invalid_argument("GradScaler::update: new_scale must be a positive finite float32 value, got " +
                                std::to_string(new_scale));
  }
  scale_ = static_cast<float>(new_scale);
  per_optimizer_.clear();
}

double GradScaler::get_scale() const { return is_enabled() ? static_cast<double>(scale_) : 1.0; }

bool GradScaler::unscale_and_check(torch::optim::Optimizer& optimizer) {
  // Multiplying by the float32 reciprocal is exact for the power-of-two scales the defaults give.
  const auto inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  std::vector<at::Tensor> all_finite;  // one 0-dim bool per device: read once, not once per gradient
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      if (!param.grad().defined()) continue;
      at::Tensor& grad = param.mutable_grad();
      if (grad.scalar_type() == at::kHalf) {
        throw std::invalid_argument(
            "GradScaler::unscale_: Attempting to unscale FP16 gradients: keep the parameters in float32 (autocast "
            "runs the forward in reduced precision while parameters and gradients stay float32)");
      }
      if (grad.is_sparse()) grad = grad.coalesce();  // then each value appears once
      at::Tensor values = grad.is_sparse() ? grad._values() : grad;
      // Unscale even when not finite: a skipped step leaves these gradients unused either way.
      values.mul_(inv_scale);
      at::Tensor finite = at::isfinite(values).all();
      auto same_device = std::find_if(all_finite.begin(), all_finite.end(),
                                      [&](const at::Tensor& t) { return t.device() == finite.device(); });
      if (same_device == all_finite.end()) {
        all_finite.push_back(finite);
      } else {
        same_device->logical_and_(finite);
      }
    }
  }
  bool found_inf_here = false;
  for (const auto& finite : all_finite) found_inf_here = found_inf_here || !finite.item<bool>();
  return any_rank(found_inf_here);
}

bool GradScaler::any_rank(bool found_inf_here) const {
  ProcessGroupPtr group = options_.group();
  if (!group && is_initialized()) group = default_group();
  if (!group || group->getSize() == 1) return found_inf_here;
  // MAX of a 0/1 flag: 1 when any rank found inf/NaN. Waits with the group's timeout.
  at::Tensor flag = at::full({1}, found_inf_here ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(collective_device(group)));
  try {
    all_reduce(flag, c10d::ReduceOp::MAX, group);
  } catch (const CollectiveError& error) {
    throw CollectiveError(
        std::string("GradScaler: agreeing on inf/NaN gradients across ranks failed; every rank must call "
                    "unscale_/step for the same optimizers in the same order each iteration. ") +
        error.what());
  }
  return flag.item<float>() > 0;
}

TensorDict GradScaler::state_dict() const {
  if (!is_enabled()) return {};
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  return {{"scale", at::scalar_tensor(static_cast<double>(scale_), f64)},
          {"growth_factor", at::scalar_tensor(options_.growth_factor(), f64)},
          {"backoff_factor", at::scalar_tensor(options_.backoff_factor(), f64)},
          {"growth_interval", at::scalar_tensor(options_.growth_interval(), i64)},
          {"_growth_tracker", at::scalar_tensor(growth_tracker_, i64)}};
}

void GradScaler::load_state_dict(const TensorDict& state) {
  if (!is_enabled()) return;
  if (state.empty()) {
    throw std::invalid_argument(
        "GradScaler::load_state_dict: The source state dict is empty, possibly because it was saved from a "
        "disabled instance of GradScaler");
  }
  GradScalerOptions loaded = options_;
  loaded.init_scale(entry(state, "scale").item<double>());
  loaded.growth_factor(entry(state, "growth_factor").item<double>());
  loaded.backoff_factor(entry(state, "backoff_factor").item<double>());
  loaded.growth_interval(entry(state, "growth_interval").item<int64_t>());
  const auto tracker = entry(state, "_growth_tracker").item<int64_t>();
  check_options(loaded, "GradScaler::load_state_dict");
  if (tracker < 0 || tracker >= loaded.growth_interval()) {
    throw std::invalid_argument("GradScaler::load_state_dict: \"_growth_tracker\" must be in [0, growth_interval), got " +
                                std::to_string(tracker));
  }
  options_ = loaded;
  scale_ = static_cast<float>(loaded.init_scale());
  growth_tracker_ = tracker;
}

}  // namespace ddp
