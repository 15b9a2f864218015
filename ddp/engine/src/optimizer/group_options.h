#pragma once
// A LibTorch optimizer archive's parameter-group options. LibTorch's Optimizer::load restores the
// per-parameter state but keeps the options the optimizer was built with; PyTorch's
// load_state_dict takes the saved ones (a learning rate a scheduler set is part of the state).
#include <memory>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

namespace ddp::detail {

// Every saved group's options (lr, momentum, betas, ...), read as what `groups` hold (a clone of
// each group's own options reads the saved values over its fields: any optimizer's options type).
std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved_group_options(
    torch::serialize::InputArchive& archive, const std::vector<torch::optim::OptimizerParamGroup>& groups);

}  // namespace ddp::detail
