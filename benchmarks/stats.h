#pragma once
// Order statistics for step times.
#include <algorithm>
#include <cmath>
#include <vector>

namespace bench {

// Linear interpolation between the closest ranks; q in [0, 1].
inline double quantile(std::vector<double> values, double q) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  const double position = q * static_cast<double>(values.size() - 1);
  const auto below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, values.size() - 1);
  return values[below] + (position - static_cast<double>(below)) * (values[above] - values[below]);
}

inline double median(const std::vector<double>& values) { return quantile(values, 0.5); }

}  // namespace bench
