#include <ddp/metrics.h>

#include <stdexcept>
#include <string>

#include <torch/torch.h>

namespace ddp {
namespace {

// A 32-bit FNV-1a hash of the names: exact as a double, so its sum over W ranks is exactly
// W * hash when (and, barring a collision, only when) every rank holds the same names.
double names_hash(const std::map<std::string, Metrics::Value>& values) {
  uint32_t hash = 2166136261u;
  for (const auto& entry : values) {
    for (char c : entry.first + '\0') {
      hash ^= static_cast<uint8_t>(c);
      hash *= 16777619u;
    }
  }
  return static_cast<double>(hash);
}

}  // namespace

void Metrics::add(const std::string& name, double sum, double count) {
  Value& value = values_[name];
  value.sum += sum;
  value.count += count;
}

const Metrics::Value& Metrics::at(const std::string& name) const {
  auto found = values_.find(name);
  if (found == values_.end()) throw std::out_of_range("Metrics: no metric named '" + name + "' was added");
  return found->second;
}

Metrics Metrics::all_reduce(const ProcessGroupPtr& group) const {
  // Packed as [names hash, sum_0, count_0, sum_1, count_1, ...] so one collective does it all.
  auto packed = torch::empty({static_cast<int64_t>(1 + 2 * values_.size())}, torch::kFloat64);
  auto* data = packed.data_ptr<double>();
  data[0] = names_hash(values_);
  size_t i = 1;
  for (const auto& entry : values_) {
    data[i++] = entry.second.sum;
    data[i++] = entry.second.count;
  }
  const ProcessGroupPtr& pg = group ? group : default_group();
  at::Tensor on_device = packed.to(collective_device(pg));
  ddp::all_reduce(on_device, c10d::ReduceOp::SUM, pg);
  packed = on_device.cpu();
  data = packed.data_ptr<double>();

  const int world = get_world_size(pg);
  if (data[0] != world * names_hash(values_)) {
    std::string names;
    for (const auto& entry : values_) names += (names.empty() ? "" : ", ") + entry.first;
    throw std::runtime_error("Metrics::all_reduce: the ranks hold different metric names (rank " +
                             std::to_string(get_rank(pg)) + " has [" + names +
                             "]); add the same names on every rank before reducing");
  }
  Metrics global;
  i = 1;
  for (const auto& entry : values_) {
    global.values_[entry.first] = Value{data[i], data[i + 1]};
    i += 2;
  }
  return global;
}

}  // namespace ddp
