// The default group as an n-dimensional mesh (device_mesh.h): row-major coordinates and, per
// dimension, a subgroup of the ranks that differ only along it.
#include <ddp/device_mesh.h>

#include <stdexcept>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/internal/diagnostics/text.h"

namespace ddp {
namespace {

std::string shape_text(const std::vector<int>& shape) {
  return "{" + detail::join_limited(shape, 16, ", ", [](int extent) { return std::to_string(extent); }) + "}";
}

}  // namespace

DeviceMesh init_device_mesh(std::vector<int> shape, std::vector<std::string> names) {
  const ProcessGroupPtr world = default_group();
  const int size = world->getSize();
  int64_t product = 1;
  for (int extent : shape) {
    if (extent < 1) {
      raise<std::invalid_argument>("ddp::init_device_mesh", "shape " + shape_text(shape) + " has an extent below 1");
    }
    product *= extent;
  }
  if (shape.empty() || product != size) {
    raise<std::invalid_argument>("ddp::init_device_mesh", "shape " + shape_text(shape) + " holds " +
                                 std::to_string(product) + " ranks, but the world has " + std::to_string(size));
  }
  if (!names.empty() && names.size() != shape.size()) {
    raise<std::invalid_argument>("ddp::init_device_mesh", std::to_string(names.size()) + " names for " +
                                 std::to_string(shape.size()) + " dimensions; give one name per dimension, or none");
  }
  for (size_t a = 0; a < names.size(); ++a) {
    for (size_t b = 0; b < a; ++b) {
      if (names[a] == names[b]) {
        raise<std::invalid_argument>("ddp::init_device_mesh", "the dimension name '" + names[a] + "' is used twice");
      }
    }
  }
  DeviceMesh mesh;
  mesh.shape_ = std::move(shape);
  mesh.names_ = std::move(names);
  const int dims = static_cast<int>(mesh.shape_.size());
  // Row-major: the last dimension varies fastest. stride[d] = product of the extents after d.
  std::vector<int> stride(static_cast<size_t>(dims), 1);
  for (int d = dims - 2; d >= 0; --d) stride[d] = stride[d + 1] * mesh.shape_[d + 1];
  const int rank = world->getRank();
  for (int d = 0; d < dims; ++d) mesh.coordinate_.push_back(rank / stride[d] % mesh.shape_[d]);
  // Per dimension, every line along it (the ranks whose coordinate there is 0 start one), made by
  // every rank in the same order; this rank keeps the line it lies on.
  for (int d = 0; d < dims; ++d) {
    ProcessGroupPtr mine;
    for (int start = 0; start < size; ++start) {
      if (start / stride[d] % mesh.shape_[d] != 0) continue;
      std::vector<int> line;
      for (int k = 0; k < mesh.shape_[d]; ++k) line.push_back(start + k * stride[d]);
      ProcessGroupPtr group = new_group(NewGroupOptions().parent(world).ranks(line));
      if (group) mine = group;
    }
    mesh.groups_.push_back(mine);
  }
  return mesh;
}

int DeviceMesh::dim_of(const std::string& name) const {
  for (size_t d = 0; d < names_.size(); ++d) {
    if (names_[d] == name) return static_cast<int>(d);
  }
  std::string known;
  for (const auto& each : names_) known += (known.empty() ? "'" : ", '") + each + "'";
  raise<std::invalid_argument>("ddp::DeviceMesh", "no dimension is named '" + name + "'" +
                               (known.empty() ? std::string(" (this mesh's dimensions have no names)")
                                              : " (its dimensions: " + known + ")"));
}

const ProcessGroupPtr& DeviceMesh::group(int dim) const {
  if (dim < 0 || dim >= ndim()) {
    raise<std::invalid_argument>("ddp::DeviceMesh", "dimension " + std::to_string(dim) + " of a " +
                                 std::to_string(ndim()) + "-dimensional mesh");
  }
  return groups_[static_cast<size_t>(dim)];
}
const ProcessGroupPtr& DeviceMesh::group(const std::string& name) const { return group(dim_of(name)); }

int DeviceMesh::size(int dim) const { return group(dim)->getSize(); }
int DeviceMesh::size(const std::string& name) const { return size(dim_of(name)); }

}  // namespace ddp
