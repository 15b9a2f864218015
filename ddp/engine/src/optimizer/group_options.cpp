// A LibTorch optimizer archive's parameter-group options (group_options.h).
#include "ddp/engine/src/optimizer/group_options.h"

#include <string>

namespace ddp::detail {

std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved_group_options(
    torch::serialize::InputArchive& archive, const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  torch::serialize::InputArchive saved_groups;
  archive.read("param_groups", saved_groups);
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive group, saved;
    saved_groups.read("param_groups/" + std::to_string(g), group);
    group.read("options", saved);
    options.push_back(groups[g].options().clone());
    options.back()->serialize(saved);
  }
  return options;
}

}  // namespace ddp::detail
