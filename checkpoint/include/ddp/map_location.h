#pragma once
// map_location: where a tensor saved on one device is placed when a checkpoint is read, so a
// checkpoint written on one device layout loads on another (torch.load's map_location).
//
// Thread-safety: a plain value.
#include <functional>
#include <map>
#include <string>

#include <c10/core/Device.h>

namespace ddp {

class MapLocation {
 public:
  using Function = std::function<std::string(const std::string& saved_device)>;

  // Keeps every tensor on the device it was saved from.
  MapLocation() = default;
  // Everything onto one device: MapLocation("cpu"), MapLocation(torch::Device(torch::kCUDA, 1)).
  MapLocation(const char* device);         // NOLINT(google-explicit-constructor): reads like torch.load
  MapLocation(const std::string& device);  // NOLINT(google-explicit-constructor)
  MapLocation(c10::Device device);         // NOLINT(google-explicit-constructor)

  static MapLocation to(const std::string& device) { return MapLocation(device); }
  // Renames listed devices ({"cuda:0", "cuda:1"}); devices not listed stay where they were saved.
  static MapLocation remap(const std::map<std::string, std::string>& renames);
  // Any rule: gets the saved device ("cuda:0", "cpu") and returns where to put it.
  static MapLocation function(Function rule);
  // The usual DDP case: what rank 0 saved on cuda:0 goes to this process's cuda:<local_rank>.
  static MapLocation cuda_for_local_rank(int local_rank);

  // Pure: maps a device string to a device string, valid even without a GPU.
  // Throws std::invalid_argument naming a string that is not a device.
  std::string operator()(const std::string& saved_device) const;
  // Where a tensor saved on `saved_device` is placed. Throws c10::Error for a string that is not
  // a device, std::invalid_argument for the meta device (it holds no data to load into a model).
  c10::Device device_for(const std::string& saved_device) const;

 private:
  Function rule_;  // empty: identity
};

}  // namespace ddp
