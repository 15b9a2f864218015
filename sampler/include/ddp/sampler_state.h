#pragma once
// Where a DistributedSampler stands: enough to resume mid-epoch without repeating or skipping.
// Its own header so that checkpoint/ can save it without depending on the sampler.
//
// Thread-safety: a plain value.
#include <cstdint>

namespace ddp {

struct SamplerState {
  int64_t epoch = 0;     // the epoch set with set_epoch()
  int64_t consumed = 0;  // indices this rank already yielded in that epoch
  bool operator==(const SamplerState& other) const {
    return epoch == other.epoch && consumed == other.consumed;
  }
};

}  // namespace ddp
