#pragma once
// Optimizer state follows its parameter, as torch.optim.Optimizer.load_state_dict does.
#include <functional>
#include <string>

#include <torch/optim/optimizer.h>

namespace ddp {

// Moves each parameter's state tensors (Adam's exp_avg, SGD's momentum_buffer, ...) to that
// parameter's device, dtype unchanged. LibTorch's Optimizer::load reads the whole state onto one
// device; a model split over devices (model parallel) would then step with state on the wrong
// one. Knows the state of LibTorch's optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS: its
// one state, kept with its first parameter, goes to that parameter's device); another optimizer's
// state stays where it was loaded.
void place_state_with_parameters(torch::optim::Optimizer& optimizer);

// Refuses a loaded state LibTorch would only meet at the next step(), or train on to NaN: a state
// tensor shaped unlike its parameter (for LibTorch's optimizers but LBFGS, whose state is flat
// over all parameters), or one holding NaN or an infinity. Throws std::invalid_argument naming the
// parameter as `name_of` calls it.
void check_state_fits_parameters(torch::optim::Optimizer& optimizer,
                                 const std::function<std::string(const at::Tensor&)>& name_of);

}  // namespace ddp
