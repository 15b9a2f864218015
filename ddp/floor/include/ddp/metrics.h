#pragma once
// Global training figures from per-rank ones: each rank adds (sum, count) pairs, then one
// all_reduce of a packed double tensor gives every rank the totals and means over all ranks.
//
//   ddp::Metrics metrics;
//   metrics.add("loss", loss.item<double>() * batch_size, batch_size);  // mean loss, weighted
//   metrics.add("correct", correct, batch_size);                        // accuracy = correct / n
//   auto global = metrics.all_reduce();      // the default group, or all_reduce(group)
//   if (ddp::get_rank() == 0) std::cout << global.mean("loss") << " " << global.mean("correct");
//
// Thread-safety: a Metrics object belongs to one thread; all_reduce() is a collective on its group.
#include <map>
#include <string>

#include <ddp/process_group.h>

namespace ddp {

class Metrics {
 public:
  struct Value {
    double sum = 0;
    double count = 0;
    // sum / count; 0 when nothing was counted.
    double mean() const { return count == 0 ? 0 : sum / count; }
  };

  // Adds `sum` over `count` items to metric `name` (created on first use).
  void add(const std::string& name, double sum, double count = 1);
  // Throws std::out_of_range naming the metric when it was never added.
  const Value& at(const std::string& name) const;
  double sum(const std::string& name) const { return at(name).sum; }
  double count(const std::string& name) const { return at(name).count; }
  double mean(const std::string& name) const { return at(name).mean(); }
  const std::map<std::string, Value>& values() const { return values_; }
  void clear() { values_.clear(); }

  // Sums of every metric over the ranks of `group` (the default group when null), returned on
  // every rank. Collective: every rank must call it with the same metric names; different names
  // throw std::runtime_error.
  Metrics all_reduce(const ProcessGroupPtr& group = {}) const;

 private:
  std::map<std::string, Value> values_;  // ordered: every rank packs the names in the same order
};

}  // namespace ddp
