// is_main_process() and the per-rank seed (per_rank.h).
#include <ddp/per_rank.h>

#include <torch/utils.h>

#include <ddp/process_group.h>

namespace ddp {

bool is_main_process() { return !is_initialized() || get_rank() == 0; }

uint64_t manual_seed(uint64_t seed) {
  const uint64_t rank = is_initialized() ? static_cast<uint64_t>(get_rank()) : 0;
  torch::manual_seed(seed + rank);
  return seed + rank;
}

}  // namespace ddp
