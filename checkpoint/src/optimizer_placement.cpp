// place_state_with_parameters: after Optimizer::load, each parameter's state moves to the
// parameter's device (optimizer_placement.h).
#include "optimizer_placement.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "compat.h"

namespace ddp {
namespace {

// Optional state (max_exp_avg_sq without amsgrad, ...) is an undefined tensor: it stays so.
void move_to(at::Tensor& tensor, const at::Device& device) {
  if (tensor.defined()) tensor = tensor.to(device);
}

// Adam and AdamW: the same fields in two unrelated types.
template <typename AdamFamilyState>
void move_adam_state(AdamFamilyState& state, const at::Device& device) {
  move_to(state.exp_avg(), device);
  move_to(state.exp_avg_sq(), device);
  move_to(state.max_exp_avg_sq(), device);
}

// One branch per LibTorch state type (torch/optim/*.h); every tensor field of each.
void move_state(torch::optim::OptimizerParamState& state, const at::Device& device) {
  using namespace torch::optim;
  if (auto* sgd = dynamic_cast<SGDParamState*>(&state)) {
    move_to(sgd->momentum_buffer(), device);
  } else if (auto* adam = dynamic_cast<AdamParamState*>(&state)) {
    move_adam_state(*adam, device);
  } else if (auto* adamw = dynamic_cast<AdamWParamState*>(&state)) {
    move_adam_state(*adamw, device);
  } else if (auto* adagrad = dynamic_cast<AdagradParamState*>(&state)) {
    move_to(adagrad->sum(), device);
  } else if (auto* rmsprop = dynamic_cast<RMSpropParamState*>(&state)) {
    move_to(rmsprop->square_avg(), device);
    move_to(rmsprop->momentum_buffer(), device);
    move_to(rmsprop->grad_avg(), device);
  } else if (auto* lbfgs = dynamic_cast<LBFGSParamState*>(&state)) {
    move_to(lbfgs->d(), device);
    move_to(lbfgs->H_diag(), device);
    move_to(lbfgs->prev_flat_grad(), device);
    for (auto& tensor : lbfgs->old_dirs()) move_to(tensor, device);
    for (auto& tensor : lbfgs->old_stps()) move_to(tensor, device);
    for (auto& tensor : lbfgs->ro()) move_to(tensor, device);
    if (lbfgs->al()) {
      for (auto& tensor : *lbfgs->al()) move_to(tensor, device);
    }
  }
  // Another optimizer's state type: its fields are unknown here, so it stays as loaded.
}

}  // namespace

void place_state_with_parameters(torch::optim::Optimizer& optimizer) {
  auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      const auto found = states.find(compat::optimizer_state_key(states, param));
      if (found == states.end()) continue;  // never stepped: no state yet
      move_state(*found->second, param.device());
    }
  }
}

}  // namespace ddp
