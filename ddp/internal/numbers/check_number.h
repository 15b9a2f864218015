#pragma once
// The one rule for real-valued options: a finite number in [lo, hi]. A check written as
// "refuse when value < lo" lets NaN through (every comparison with NaN is false), and an infinity
// or 1e308 overflows whatever the value sizes, so both are refused here, by name:
//   "<who>: <name> must be a finite number in [lo, hi]<why>, got <value>"
//   "<who>: <name> must be a finite number >= lo<why>, got <value>"      (hi infinite: no bound)
// <why> says what the value does, so the user can pick a good one.
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "ddp/internal/diagnostics/error_text.h"

namespace ddp::detail {

// As a user writes a number: 1e+308, nan, inf, 0.25 (std::to_string prints 1e308 with 309 digits).
inline std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

inline void require_finite(const char* who, const std::string& name, double value, double lo, double hi,
                           const std::string& why) {
  if (std::isfinite(value) && value >= lo && value <= hi) return;
  const std::string range = std::isinf(hi) ? " >= " + number_text(lo)
                                            : " in [" + number_text(lo) + ", " + number_text(hi) + "]";
  raise<std::invalid_argument>(who, name + " must be a finite number" + range + why + ", got " + number_text(value));
}

}  // namespace ddp::detail
