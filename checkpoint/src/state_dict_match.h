#pragma once
// load_state_dict (ddp/state_dict.h) in its two steps, so that a checkpoint load checks every
// model and optimizer before it changes any of them (checkpoint.cpp).
#include <string>
#include <utility>
#include <vector>

#include <ddp/state_dict.h>

namespace ddp {

// Each tensor of `state` beside the module's parameter or buffer it goes into: (destination, source).
using MatchedStateDict = std::vector<std::pair<at::Tensor, at::Tensor>>;

// Makes load_state_dict's checks (throws its CheckpointError listing every mismatch) and changes
// nothing.
MatchedStateDict match_state_dict(torch::nn::Module& module, const StateDict& state, bool strict,
                                  const std::string& source);

// Copies each source into its destination, in place.
void copy_matched(const MatchedStateDict& matched);

}  // namespace ddp
