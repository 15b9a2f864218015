#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace ddp::fuzz {
struct Outcomes {
  int loaded_checkpoint = 0;  // load_checkpoint succeeded
  int loaded_state_dict = 0;  // load_state_dict succeeded
  int refused = 0;            // either refused with a CheckpointError
  std::string last_error;
};
extern Outcomes outcomes;

// Writes a seed input: the archive of a real checkpoint (small model, Adam, a GradScaler).
void write_seed(const std::string& path);
}  // namespace ddp::fuzz
