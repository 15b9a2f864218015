#include "ddp/internal/diagnostics/debug_level.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ddp::detail {

DebugLevel debug_level() {
  const char* value = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  const std::string text = value ? value : "";
  if (text.empty() || text == "OFF") return DebugLevel::kOff;
  if (text == "INFO") return DebugLevel::kInfo;
  if (text == "DETAIL") return DebugLevel::kDetail;
  throw std::invalid_argument("TORCH_DISTRIBUTED_DEBUG='" + text + "' is not a debug level: use OFF, INFO or DETAIL");
}

void info_log(const std::string& message) {
  std::fprintf(stderr, "[torchddp INFO] %s\n", message.c_str());
}

}  // namespace ddp::detail
