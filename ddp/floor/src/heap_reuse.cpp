// glibc's malloc asked to keep freed blocks for reuse (heap_reuse.h).
#include "ddp/floor/src/heap_reuse.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace ddp::detail {
namespace {

constexpr int kMmapThresholdBytes = 32 << 20;
constexpr int kTrimThresholdBytes = 64 << 20;

bool set(const char* variable) {
  const char* value = std::getenv(variable);
  return value != nullptr && *value != '\0';
}

// The user's own choice, which wins.
bool user_chose() {
  if (const char* tuning = std::getenv("TORCHDDP_MALLOC_TUNING"); tuning != nullptr && std::strcmp(tuning, "0") == 0) {
    return true;
  }
  if (const char* tunables = std::getenv("GLIBC_TUNABLES"); tunables != nullptr && std::strstr(tunables, "glibc.malloc.")) {
    return true;
  }
  return set("MALLOC_MMAP_THRESHOLD_") || set("MALLOC_TRIM_THRESHOLD_");
}

bool ask_glibc() {
#if defined(__GLIBC__)
  if (user_chose()) return false;
  // mallopt returns 1 on success. The mmap threshold first: setting either fixes both (glibc's
  // sliding rule stops), so both are set.
  return mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes) == 1;
#else
  return false;
#endif
}

}  // namespace

bool keep_freed_memory_for_reuse() {
  static const bool asked = ask_glibc();
  return asked;
}

}  // namespace ddp::detail
