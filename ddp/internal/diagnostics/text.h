#pragma once
// The one rule for lists in our messages: the first `limit` items, then how many there are in all,
// so that an error about 4,096 ranks or parameters stays readable.
//   join_limited(ranks, 8, ", ", to_string) -> "1, 2, 3, 4, 5, 6, 7, 8, ... (12 in all)"
#include <cstddef>
#include <string>

namespace ddp::detail {

template <typename Items, typename Format>
std::string join_limited(const Items& items, std::size_t limit, const char* separator, Format format) {
  std::string out;
  std::size_t i = 0;
  for (const auto& item : items) {
    if (i == limit && items.size() > limit + 1) {  // one more is shown rather than summarized
      return out + separator + "... (" + std::to_string(items.size()) + " in all)";
    }
    out += (i++ ? separator : "") + format(item);
  }
  return out;
}

}  // namespace ddp::detail
