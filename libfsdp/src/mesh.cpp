// DeviceMesh: row-major rank layout, per-dimension groups, slicing, flatten.
#include "fsdp/mesh.h"

#include "fsdp/errors.h"
#include "process_group.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace fsdp {

// Immutable description of one (sub-)mesh as seen from this rank.
struct MeshLayout {
  c10::DeviceType device_type = c10::kCPU;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::vector<int> ranks;            // world ranks, row-major over `shape`
  std::vector<int64_t> coordinate;   // this rank's coordinate
  std::vector<ProcessGroupPtr> groups;  // one per dim
};

namespace {

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// Members of the group along `dim` that contains `coord`: every position that
// differs from coord only in `dim`, in order of that dim's index.
std::vector<int> line_through(const MeshLayout& m, const std::vector<int64_t>& coord, int dim) {
  std::vector<int> members;
  members.reserve(static_cast<size_t>(m.shape[dim]));
  std::vector<int64_t> c = coord;
  for (int64_t i = 0; i < m.shape[dim]; ++i) {
    c[dim] = i;
    int64_t linear = 0;
    for (size_t d = 0; d < m.shape.size(); ++d) linear = linear * m.shape[d] + c[d];
    members.push_back(m.ranks[static_cast<size_t>(linear)]);
  }
  return members;
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<const MeshLayout> layout) : layout_(std::move(layout)) {}

c10::DeviceType DeviceMesh::device_type() const { return layout_->device_type; }
int64_t DeviceMesh::size() const { return product(layout_->shape); }
int DeviceMesh::ndim() const { return static_cast<int>(layout_->shape.size()); }
std::vector<int64_t> DeviceMesh::shape() const { return layout_->shape; }
const std::vector<std::string>& DeviceMesh::dim_names() const { return layout_->names; }
std::vector<int> DeviceMesh::world_ranks() const { return layout_->ranks; }
std::vector<int64_t> DeviceMesh::get_coordinate() const { return layout_->coordinate; }

static void check_dim(const DeviceMesh& m, int dim) {
  if (dim < 0 || dim >= m.ndim()) {
    throw MeshError("dim", "DeviceMesh: 'dim' = " + std::to_string(dim) + " is out of range for " +
                               m.to_string() + "; accepted: 0.." + std::to_string(m.ndim() - 1));
  }
}

int64_t DeviceMesh::size(int dim) const {
  check_dim(*this, dim);
  return layout_->shape[static_cast<size_t>(dim)];
}
int64_t DeviceMesh::size(const std::string& dim_name) const { return size(dim_index(dim_name)); }

int DeviceMesh::get_local_rank(int dim) const {
  check_dim(*this, dim);
  return static_cast<int>(layout_->coordinate[static_cast<size_t>(dim)]);
}
int DeviceMesh::get_local_rank(const std::string& dim_name) const {
  return get_local_rank(dim_index(dim_name));
}

int DeviceMesh::get_rank() const {
  int64_t linear = 0;
  for (size_t d = 0; d < layout_->shape.size(); ++d) {
    linear = linear * layout_->shape[d] + layout_->coordinate[d];
  }
  return static_cast<int>(linear);
}

ProcessGroupPtr DeviceMesh::get_group(int dim) const {
  check_dim(*this, dim);
  return layout_->groups[static_cast<size_t>(dim)];
}
ProcessGroupPtr DeviceMesh::get_group(const std::string& dim_name) const {
  return get_group(dim_index(dim_name));
}

int DeviceMesh::dim_index(const std::string& dim_name) const {
  const auto& n = layout_->names;
  auto it = std::find(n.begin(), n.end(), dim_name);
  if (it == n.end()) {
    throw MeshError("dim_name", "DeviceMesh: 'dim_name' = '" + dim_name + "' is not a dim of " +
                                    to_string());
  }
  return static_cast<int>(it - n.begin());
}

DeviceMesh DeviceMesh::operator[](const std::string& dim_name) const {
  return (*this)[std::vector<std::string>{dim_name}];
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& dim_names) const {
  if (dim_names.empty()) {
    throw MeshError("dim_names", "DeviceMesh: 'dim_names' is empty; slicing needs at least one dim name");
  }
  std::vector<int> dims;
  for (const auto& name : dim_names) {
    const int d = dim_index(name);
    if (std::find(dims.begin(), dims.end(), d) != dims.end()) {
      throw MeshError("dim_names", "DeviceMesh: 'dim_names' has '" + name + "' twice");
    }
    if (!dims.empty() && d < dims.back()) {
      throw MeshError("dim_names", "DeviceMesh: 'dim_names' must follow the mesh order of " +
                                       to_string() + "; '" + name + "' comes too late");
    }
    dims.push_back(d);
  }
  auto sub = std::make_shared<MeshLayout>();
  sub->device_type = layout_->device_type;
  for (int d : dims) {
    sub->shape.push_back(layout_->shape[static_cast<size_t>(d)]);
    sub->names.push_back(layout_->names[static_cast<size_t>(d)]);
    sub->coordinate.push_back(layout_->coordinate[static_cast<size_t>(d)]);
    sub->groups.push_back(layout_->groups[static_cast<size_t>(d)]);
  }
  // Enumerate the sub-mesh row-major: vary only the kept dims.
  const int64_t n = product(sub->shape);
  std::vector<int64_t> c = layout_->coordinate;
  for (int64_t linear = 0; linear < n; ++linear) {
    int64_t rest = linear;
    for (size_t k = dims.size(); k-- > 0;) {
      c[static_cast<size_t>(dims[k])] = rest % sub->shape[k];
      rest /= sub->shape[k];
    }
    int64_t parent_linear = 0;
    for (size_t d = 0; d < layout_->shape.size(); ++d) {
      parent_linear = parent_linear * layout_->shape[d] + c[d];
    }
    sub->ranks.push_back(layout_->ranks[static_cast<size_t>(parent_linear)]);
  }
  return DeviceMesh(std::move(sub));
}

DeviceMesh DeviceMesh::flatten(const std::string& dim_name) const {
  std::string name = dim_name;
  if (name.empty()) {
    for (size_t i = 0; i < layout_->names.size(); ++i) name += (i ? "_" : "") + layout_->names[i];
  }
  auto flat = std::make_shared<MeshLayout>();
  flat->device_type = layout_->device_type;
  flat->shape = {size()};
  flat->names = {name};
  flat->ranks = layout_->ranks;
  flat->coordinate = {get_rank()};
  flat->groups = {ndim() == 1 ? layout_->groups[0] : detail::group_for(layout_->ranks)};
  return DeviceMesh(std::move(flat));
}

std::string DeviceMesh::to_string() const {
  std::ostringstream os;
  os << "DeviceMesh(" << c10::DeviceTypeName(layout_->device_type, true) << ", shape=("
     << join(layout_->shape) << "), names=(";
  for (size_t i = 0; i < layout_->names.size(); ++i) os << (i ? ", " : "") << layout_->names[i];
  os << "))";
  return os.str();
}

DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names) {
  int world_size = 0, world_rank = 0;
  MPI_Comm world = detail::library_world();
  detail::check_mpi(MPI_Comm_size(world, &world_size), "MPI_Comm_size");
  detail::check_mpi(MPI_Comm_rank(world, &world_rank), "MPI_Comm_rank");

  if (device_type != c10::kCPU && device_type != c10::kCUDA) {
    throw MeshError("device_type", std::string("init_device_mesh: 'device_type' = ") +
                                       c10::DeviceTypeName(device_type, true) +
                                       "; accepted: cpu, cuda");
  }
  if (shape.empty()) {
    throw MeshError("shape", "init_device_mesh: 'shape' is empty; give at least one dimension");
  }
  for (int64_t s : shape) {
    if (s < 1) {
      throw MeshError("shape", "init_device_mesh: 'shape' = (" + join(shape) +
                                   ") has a dimension < 1; every dimension must be >= 1");
    }
  }
  if (product(shape) != world_size) {
    throw MeshError("shape", "init_device_mesh: 'shape' = (" + join(shape) + ") covers " +
                                 std::to_string(product(shape)) +
                                 " ranks but the world has " + std::to_string(world_size) +
                                 "; the product of the shape must equal the world size");
  }
  std::vector<std::string> names = dim_names;
  if (names.empty()) {
    for (size_t d = 0; d < shape.size(); ++d) names.push_back("dim" + std::to_string(d));
  }
  if (names.size() != shape.size()) {
    throw MeshError("dim_names", "init_device_mesh: 'dim_names' has " +
                                     std::to_string(names.size()) + " names for a " +
                                     std::to_string(shape.size()) + "-D shape");
  }
  std::set<std::string> seen;
  for (const auto& n : names) {
    if (n.empty()) throw MeshError("dim_names", "init_device_mesh: 'dim_names' has an empty name");
    if (!seen.insert(n).second) {
      throw MeshError("dim_names", "init_device_mesh: 'dim_names' has '" + n + "' twice");
    }
  }

  auto layout = std::make_shared<MeshLayout>();
  layout->device_type = device_type;
  layout->shape = shape;
  layout->names = names;
  for (int r = 0; r < world_size; ++r) layout->ranks.push_back(r);
  layout->coordinate.resize(shape.size());
  int64_t rest = world_rank;
  for (size_t d = shape.size(); d-- > 0;) {
    layout->coordinate[d] = rest % shape[d];
    rest /= shape[d];
  }
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    layout->groups.push_back(detail::group_for(line_through(*layout, layout->coordinate, d)));
  }
  return DeviceMesh(std::move(layout));
}

DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names) {
  if (device_type == "cpu") return init_device_mesh(c10::kCPU, shape, dim_names);
  if (device_type == "cuda") return init_device_mesh(c10::kCUDA, shape, dim_names);
  throw MeshError("device_type", "init_device_mesh: 'device_type' = \"" + device_type +
                                     "\"; accepted: \"cpu\", \"cuda\"");
}

ProcessGroupPtr world_group() {
  MPI_Comm world = detail::library_world();
  int size = 0;
  detail::check_mpi(MPI_Comm_size(world, &size), "MPI_Comm_size");
  std::vector<int> all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) all[static_cast<size_t>(r)] = r;
  return detail::find_group(all);
}

}  // namespace fsdp
