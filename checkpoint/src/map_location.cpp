// MapLocation: a device-string rule, kept pure so it is testable without a GPU.
#include <ddp/map_location.h>

#include <stdexcept>
#include <utility>

namespace ddp {
namespace {

// Normalized spelling ("cuda" stays "cuda", "cuda:1" stays "cuda:1"); throws on a non-device.
std::string checked_device(const std::string& device, const char* role) {
  try {
    return c10::Device(device).str();
  } catch (const std::exception&) {
    throw std::invalid_argument(std::string("map_location: ") + role + " '" + device +
                                "' is not a device (expected e.g. \"cpu\", \"cuda\", \"cuda:1\")");
  }
}

}  // namespace

MapLocation::MapLocation(const char* device) : MapLocation(std::string(device)) {}

MapLocation::MapLocation(const std::string& device) {
  const std::string target = checked_device(device, "target device");
  rule_ = [target](const std::string&) { return target; };
}

MapLocation::MapLocation(c10::Device device) : MapLocation(device.str()) {}

MapLocation MapLocation::remap(const std::map<std::string, std::string>& renames) {
  std::map<std::string, std::string> checked;
  for (const auto& [from, to] : renames) {
    checked[checked_device(from, "source device")] = checked_device(to, "target device");
  }
  MapLocation location;
  location.rule_ = [checked = std::move(checked)](const std::string& saved) {
    auto it = checked.find(saved);
    return it == checked.end() ? saved : it->second;
  };
  return location;
}

MapLocation MapLocation::function(Function rule) {
  MapLocation location;
  location.rule_ = std::move(rule);
  return location;
}

MapLocation MapLocation::cuda_for_local_rank(int local_rank) {
  return remap({{"cuda:0", "cuda:" + std::to_string(local_rank)}});
}

std::string MapLocation::operator()(const std::string& saved_device) const {
  if (!rule_) return saved_device;
  // A user rule may return anything: check it here so a typo fails with its own name.
  return checked_device(rule_(saved_device), "mapped device");
}

c10::Device MapLocation::device_for(const std::string& saved_device) const {
  const c10::Device device((*this)(saved_device));
  // A meta tensor has sizes but no data: LibTorch would place a checkpoint's tensors there, then
  // fail copying them into the model (a crafted file can name "meta" as a tensor's device).
  if (device.is_meta()) {
    throw std::invalid_argument("map_location: the meta device holds no data, so a checkpoint cannot be loaded onto "
                                "it (map it to a device that does, e.g. ddp::MapLocation(\"cpu\"))");
  }
  return device;
}

}  // namespace ddp
