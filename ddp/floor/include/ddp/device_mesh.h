#pragma once
// torch.distributed.device_mesh: the default group's ranks laid out as an n-dimensional array in
// row-major order (as PyTorch's init_device_mesh), with one group per dimension for this rank: the
// ranks that share every other coordinate. The layout of hybrid parallelism: a 2-D mesh
// {"replicate", "shard"} gives data-parallel replicas across one dimension and shards along the other.
//
//   ddp::DeviceMesh mesh = ddp::init_device_mesh({2, 2}, {"replicate", "shard"});  // world of 4
//   mesh.coordinate();        // rank 3: {1, 1}
//   mesh.group("shard");      // rank 3: the group of ranks {2, 3}
//   mesh.group("replicate");  // rank 3: the group of ranks {1, 3}
//
// Thread-safety: a mesh is a value; its groups are process groups (process_group.h).
#include <string>
#include <vector>

#include <ddp/process_group.h>

namespace ddp {

class DeviceMesh {
 public:
  // This rank's group along a dimension, by name or index.
  const ProcessGroupPtr& group(const std::string& name) const;
  const ProcessGroupPtr& group(int dim) const;
  // The extent of a dimension.
  int size(const std::string& name) const;
  int size(int dim) const;
  // This rank's index along each dimension.
  const std::vector<int>& coordinate() const { return coordinate_; }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& dim_names() const { return names_; }
  int ndim() const { return static_cast<int>(shape_.size()); }

 private:
  friend DeviceMesh init_device_mesh(std::vector<int> shape, std::vector<std::string> names);
  int dim_of(const std::string& name) const;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coordinate_;
  std::vector<ProcessGroupPtr> groups_;
};

// Collective over the default group, whose size must be the product of `shape`. `names` (one per
// dimension, each once) may be empty: then dimensions are reached by index only.
DeviceMesh init_device_mesh(std::vector<int> shape, std::vector<std::string> names = {});

}  // namespace ddp
