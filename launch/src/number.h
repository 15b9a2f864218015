#pragma once
// The one checked parser of ddprun's numbers: command-line counts and what the store holds.
#include <charconv>
#include <optional>
#include <string_view>
#include <system_error>

namespace ddprun {

// The whole of `text` as a decimal integer in [low, high]; nullopt for anything else ("", "1x",
// "+1", " 1", "99999999999999999999", out of range).
inline std::optional<long long> parse_number(std::string_view text, long long low, long long high) {
  long long value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end || value < low || value > high) return std::nullopt;
  return value;
}

}  // namespace ddprun
