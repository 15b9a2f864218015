// place_state_with_parameters: after Optimizer::load, each parameter's state moves to the
// parameter's device (optimizer_placement.h).
#include "checkpoint/src/optimizer_placement.h"

#include <stdexcept>

#include "ddp/internal/compat/versions.h"
#include "ddp/internal/compat/optimizer_state.h"
#include "checkpoint/src/tensor_check.h"

namespace ddp {

void place_state_with_parameters(torch::optim::Optimizer& optimizer) {
  auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      const auto found = states.find(compat::optimizer_state_key(states, param));
      if (found == states.end()) continue;  // never stepped: no state yet
      detail::move_state_tensors(*found->second, param.device());
    }
  }
}

void check_state_fits_parameters(torch::optim::Optimizer& optimizer,
                                 const std::function<std::string(const at::Tensor&)>& name_of) {
  auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) {
      const auto found = states.find(compat::optimizer_state_key(states, param));
      if (found == states.end()) continue;  // never stepped: no state yet
      const bool shaped_like_param = dynamic_cast<torch::optim::LBFGSParamState*>(found->second.get()) == nullptr;
      detail::for_each_state_tensor(*found->second, [&](at::Tensor& tensor) {
        if (!tensor.defined()) return;  // an optional field (Adam's max_exp_avg_sq without amsgrad)
        if (shaped_like_param && !tensor.sizes().equals(param.sizes())) {
          throw std::invalid_argument("its state for the parameter " + name_of(param) + " holds a tensor of shape " +
                                      shape_of(tensor) + ", the parameter's is " + shape_of(param));
        }
        if (const auto value = non_finite(tensor)) {
          throw std::invalid_argument("its state for the parameter " + name_of(param) + " holds " + *value +
                                      " (a run that diverged, or a damaged file)");
        }
      });
    }
  }
}

}  // namespace ddp
