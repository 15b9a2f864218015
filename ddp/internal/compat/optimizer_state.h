#pragma once
// The tensors in a LibTorch optimizer's per-parameter state (Adam's exp_avg, SGD's
// momentum_buffer, ...): OptimizerParamState has no way to list them, so the one list of every
// LibTorch state type's tensor fields lives here (checkpoint: moving state to its parameter's
// device; ZeRO: the same after a load, and counting its bytes).
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace ddp::detail {

// Calls visit(at::Tensor&) on every tensor field of `state` (optional ones, such as
// max_exp_avg_sq without amsgrad, may be undefined). Returns false for a state type other than
// those of SGD, Adam, AdamW, Adagrad, RMSprop and LBFGS (its fields are unknown here).
template <typename Visit>
bool for_each_state_tensor(torch::optim::OptimizerParamState& state, Visit&& visit) {
  using namespace torch::optim;
  if (auto* sgd = dynamic_cast<SGDParamState*>(&state)) {
    visit(sgd->momentum_buffer());
  } else if (auto* adam = dynamic_cast<AdamParamState*>(&state)) {
    visit(adam->exp_avg());
    visit(adam->exp_avg_sq());
    visit(adam->max_exp_avg_sq());
  } else if (auto* adamw = dynamic_cast<AdamWParamState*>(&state)) {  // Adam's fields in another type
    visit(adamw->exp_avg());
    visit(adamw->exp_avg_sq());
    visit(adamw->max_exp_avg_sq());
  } else if (auto* adagrad = dynamic_cast<AdagradParamState*>(&state)) {
    visit(adagrad->sum());
  } else if (auto* rmsprop = dynamic_cast<RMSpropParamState*>(&state)) {
    visit(rmsprop->square_avg());
    visit(rmsprop->momentum_buffer());
    visit(rmsprop->grad_avg());
  } else if (auto* lbfgs = dynamic_cast<LBFGSParamState*>(&state)) {
    visit(lbfgs->d());
    visit(lbfgs->H_diag());
    visit(lbfgs->prev_flat_grad());
    for (auto& tensor : lbfgs->old_dirs()) visit(tensor);
    for (auto& tensor : lbfgs->old_stps()) visit(tensor);
    for (auto& tensor : lbfgs->ro()) visit(tensor);
    if (lbfgs->al()) {
      for (auto& tensor : *lbfgs->al()) visit(tensor);
    }
  } else {
    return false;
  }
  return true;
}

// Moves every tensor of `state` to `device`, dtype unchanged (undefined ones stay so). Another
// optimizer's state type stays where it is.
inline void move_state_tensors(torch::optim::OptimizerParamState& state, const at::Device& device) {
  for_each_state_tensor(state, [&](at::Tensor& tensor) {
    if (tensor.defined()) tensor = tensor.to(device);
  });
}

// An optimizer's per-parameter state and its groups' options, copied deeply (no tensor shared with
// the optimizer, so that what changes it later cannot reach the copy). restore() puts them back
// bitwise, into that optimizer or into another over the same parameters (state keyed alike);
// a fresh optimizer's empty state comes back empty. What a failed checkpoint load undoes.
class OptimizerCopy {
 public:
  explicit OptimizerCopy(torch::optim::Optimizer& optimizer) {
    for (const auto& [key, state] : optimizer.state()) {
      auto copy = state->clone();
      for_each_state_tensor(*copy, [](at::Tensor& tensor) {
        if (tensor.defined()) tensor = tensor.clone();
      });
      states_.emplace_back(key, std::move(copy));
    }
    for (const auto& group : optimizer.param_groups()) options_.push_back(group.options().clone());
  }

  void restore(torch::optim::Optimizer& optimizer) const {
    auto& states = optimizer.state();
    states.clear();
    for (const auto& [key, state] : states_) states[key] = state->clone();
    auto& groups = optimizer.param_groups();
    for (size_t i = 0; i < groups.size() && i < options_.size(); ++i) groups[i].set_options(options_[i]->clone());
  }

 private:
  using Key = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state().begin()->first)>;
  std::vector<std::pair<Key, std::unique_ptr<torch::optim::OptimizerParamState>>> states_;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
};

}  // namespace ddp::detail
