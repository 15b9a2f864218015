#pragma once
// The one rule for numbers read from environment variables and addresses: the whole string is an
// integer in [lo, hi]; otherwise std::invalid_argument "<prefix><what>='<text>' is not an integer
// (expected a whole number in [lo, hi])" or "<prefix><what>=<text> is out of range [lo, hi]".
#include <stdexcept>
#include <string>

namespace ddp::detail {

inline long parse_int(const std::string& text, const std::string& what, long lo, long hi, const std::string& prefix) {
  size_t used = 0;
  long value = 0;
  try {
    value = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (used == 0 || used != text.size()) {
    throw std::invalid_argument(prefix + what + "='" + text + "' is not an integer (expected a whole number in " +
                                range + ")");
  }
  if (value < lo || value > hi) throw std::invalid_argument(prefix + what + "=" + text + " is out of range " + range);
  return value;
}

}  // namespace ddp::detail
