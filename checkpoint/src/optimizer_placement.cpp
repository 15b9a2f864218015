// place_state_with_parameters: after Optimizer::load, each parameter's state moves to the
// parameter's device (optimizer_placement.h).
#include "optimizer_placement.h"

#include "compat.h"
#include "optimizer_state.h"

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

}  // namespace ddp
