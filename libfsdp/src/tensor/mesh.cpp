// DeviceMesh: row-major rank layout, per-dimension groups, slicing, flatten,
// unflatten and concatenate.
#include "fsdp/mesh.h"

#include "fsdp/errors.h"
#include "fsdp/runtime.h"
#include "comm/group_registry.h"
#include "comm/mpi_types.h"

#include <ATen/Context.h>

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
  // The mesh this one was sliced from (null: this mesh is a root), and for
  // each dim its index in that root. Slices of slices point at the root
  // itself, so concatenate() only ever compares roots.
  std::shared_ptr<const MeshLayout> root;
  std::vector<int> root_dims;
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

bool same_mesh(const MeshLayout& a, const MeshLayout& b) {
  return a.device_type == b.device_type && a.shape == b.shape && a.names == b.names &&
         a.ranks == b.ranks;
}

// The sub-mesh of `m` over `dims` (distinct indices of m, in any order) that
// contains this rank. Never communicates: it reuses m's groups.
std::shared_ptr<MeshLayout> slice_layout(const std::shared_ptr<const MeshLayout>& m,
                                         const std::vector<int>& dims) {
  auto sub = std::make_shared<MeshLayout>();
  sub->device_type = m->device_type;
  for (int d : dims) {
    sub->shape.push_back(m->shape[static_cast<size_t>(d)]);
    sub->names.push_back(m->names[static_cast<size_t>(d)]);
    sub->coordinate.push_back(m->coordinate[static_cast<size_t>(d)]);
    sub->groups.push_back(m->groups[static_cast<size_t>(d)]);
  }
  // Enumerate the sub-mesh row-major over its own dim order: vary only the
  // kept dims, the last of `dims` fastest.
  const int64_t n = product(sub->shape);
  std::vector<int64_t> c = m->coordinate;
  for (int64_t linear = 0; linear < n; ++linear) {
    int64_t rest = linear;
    for (size_t k = dims.size(); k-- > 0;) {
      c[static_cast<size_t>(dims[k])] = rest % sub->shape[k];
      rest /= sub->shape[k];
    }
    int64_t parent_linear = 0;
    for (size_t d = 0; d < m->shape.size(); ++d) parent_linear = parent_linear * m->shape[d] + c[d];
    sub->ranks.push_back(m->ranks[static_cast<size_t>(parent_linear)]);
  }
  if (m->root) {
    sub->root = m->root;
    for (int d : dims) sub->root_dims.push_back(m->root_dims[static_cast<size_t>(d)]);
  } else {
    sub->root = m;
    sub->root_dims = dims;
  }
  return sub;
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
  return DeviceMesh(slice_layout(layout_, dims));
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

DeviceMesh DeviceMesh::unflatten(int dim, const std::vector<int64_t>& sizes,
                                 const std::vector<std::string>& names) const {
  check_dim(*this, dim);
  const size_t at = static_cast<size_t>(dim);
  const int64_t old_size = layout_->shape[at];
  if (sizes.empty()) {
    throw MeshError("sizes", "DeviceMesh::unflatten: 'sizes' is empty; accepted: one or more "
                             "sizes >= 1 whose product is " + std::to_string(old_size) +
                             " (the size of dim '" + layout_->names[at] + "')");
  }
  if (std::any_of(sizes.begin(), sizes.end(), [](int64_t s) { return s < 1; }) ||
      product(sizes) != old_size) {
    throw MeshError("sizes", "DeviceMesh::unflatten: 'sizes' = (" + join(sizes) +
                                 ") for dim '" + layout_->names[at] + "' of " + to_string() +
                                 "; accepted: sizes >= 1 whose product is " +
                                 std::to_string(old_size));
  }
  if (names.size() != sizes.size()) {
    throw MeshError("names", "DeviceMesh::unflatten: 'names' has " +
                                 std::to_string(names.size()) + " names for " +
                                 std::to_string(sizes.size()) +
                                 " sizes; accepted: one name per size");
  }
  std::vector<std::string> new_names;
  for (size_t d = 0; d < layout_->names.size(); ++d) {
    if (d == at) {
      new_names.insert(new_names.end(), names.begin(), names.end());
    } else {
      new_names.push_back(layout_->names[d]);
    }
  }
  std::set<std::string> seen;
  for (const auto& n : new_names) {
    if (n.empty()) throw MeshError("names", "DeviceMesh::unflatten: 'names' has an empty name");
    if (!seen.insert(n).second) {
      throw MeshError("names", "DeviceMesh::unflatten: 'names' gives '" + n +
                                   "', which the result of unflattening " + to_string() +
                                   " would have twice; accepted: names unique among the "
                                   "result's dims");
    }
  }

  auto out = std::make_shared<MeshLayout>();
  out->device_type = layout_->device_type;
  out->names = std::move(new_names);
  // Row-major order is unchanged by splitting one dim, so the rank list and
  // every other dim's groups stay as they are.
  out->ranks = layout_->ranks;
  for (size_t d = 0; d < layout_->shape.size(); ++d) {
    if (d == at) {
      out->shape.insert(out->shape.end(), sizes.begin(), sizes.end());
      std::vector<int64_t> sub(sizes.size());
      int64_t rest = layout_->coordinate[d];
      for (size_t k = sizes.size(); k-- > 0;) {
        sub[k] = rest % sizes[k];
        rest /= sizes[k];
      }
      out->coordinate.insert(out->coordinate.end(), sub.begin(), sub.end());
    } else {
      out->shape.push_back(layout_->shape[d]);
      out->coordinate.push_back(layout_->coordinate[d]);
    }
  }
  for (size_t d = 0; d < layout_->shape.size(); ++d) {
    if (d != at) {
      out->groups.push_back(layout_->groups[d]);
    } else if (sizes.size() == 1) {
      // A rename: the one new dim is the old dim.
      out->groups.push_back(layout_->groups[d]);
    } else {
      // Every rank takes this branch the same number of times, in the same
      // order, so the collective group_for calls line up over the world.
      for (size_t k = 0; k < sizes.size(); ++k) {
        out->groups.push_back(
            detail::group_for(line_through(*out, out->coordinate, static_cast<int>(d + k))));
      }
    }
  }
  return DeviceMesh(std::move(out));
}

DeviceMesh DeviceMesh::unflatten(const std::string& dim, const std::vector<int64_t>& sizes,
                                 const std::vector<std::string>& names) const {
  const auto& n = layout_->names;
  auto it = std::find(n.begin(), n.end(), dim);
  if (it == n.end()) {
    throw MeshError("dim", "DeviceMesh::unflatten: 'dim' = '" + dim + "' is not a dim of " +
                               to_string());
  }
  return unflatten(static_cast<int>(it - n.begin()), sizes, names);
}

DeviceMesh DeviceMesh::concatenate(const std::vector<DeviceMesh>& meshes) {
  if (meshes.empty()) {
    throw MeshError("meshes", "DeviceMesh::concatenate: 'meshes' is empty; accepted: one or "
                              "more slices of one mesh");
  }
  auto root_of = [](const DeviceMesh& m) {
    return m.layout_->root ? m.layout_->root : m.layout_;
  };
  auto dims_in_root = [](const DeviceMesh& m) {
    if (m.layout_->root) return m.layout_->root_dims;
    std::vector<int> all(m.layout_->shape.size());
    for (size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int>(d);
    return all;
  };
  const std::shared_ptr<const MeshLayout> root = root_of(meshes[0]);
  const DeviceMesh root_mesh(root);
  std::vector<int> dims;
  for (size_t i = 0; i < meshes.size(); ++i) {
    const std::shared_ptr<const MeshLayout> r = root_of(meshes[i]);
    if (r != root && !same_mesh(*r, *root)) {
      throw MeshError("meshes", "DeviceMesh::concatenate: 'meshes'[" + std::to_string(i) +
                                    "] " + meshes[i].to_string() + " was cut from " +
                                    DeviceMesh(r).to_string() + ", but 'meshes'[0] from " +
                                    root_mesh.to_string() +
                                    "; accepted: slices of one mesh (flatten() and "
                                    "unflatten() results are meshes of their own)");
    }
    for (int d : dims_in_root(meshes[i])) {
      if (std::find(dims.begin(), dims.end(), d) != dims.end()) {
        throw MeshError("meshes", "DeviceMesh::concatenate: 'meshes' holds dim '" +
                                      root->names[static_cast<size_t>(d)] +
                                      "' twice; accepted: each dim of " +
                                      root_mesh.to_string() + " at most once");
      }
      dims.push_back(d);
    }
  }
  return DeviceMesh(slice_layout(root, dims));
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  return layout_ == other.layout_ || same_mesh(*layout_, *other.layout_);
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
  // A CUDA mesh on a machine without CUDA used to be built anyway: its
  // groups ran on MPI and the mesh claimed a device nothing could use.
  if (device_type == c10::kCUDA && (!at::hasCUDA() || at::getNumGPUs() == 0)) {
    throw MeshError("device_type",
                    "init_device_mesh: 'device_type' = cuda, but this process sees no CUDA "
                    "device (LibTorch built without CUDA, or no GPU visible); accepted here: "
                    "cpu");
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

namespace {

// Resolves at most one -1 in `dims`: total / (the product of the others).
// MeshError naming `argument` for a bad size or a product that does not
// divide `total`.
std::vector<int64_t> resolve_sizes(const std::vector<std::pair<std::string, int64_t>>& dims,
                                   int64_t total, const char* argument) {
  std::vector<int64_t> sizes;
  int64_t known = 1;
  int free = -1;
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto& [name, size] = dims[i];
    if (size == -1) {
      if (free >= 0) {
        throw MeshError(argument, std::string("init_node_mesh: '") + argument + "' has two " +
                                      "sizes -1 ('" + dims[static_cast<size_t>(free)].first +
                                      "' and '" + name + "'); at most one dim takes what is left");
      }
      free = static_cast<int>(i);
    } else if (size < 1) {
      throw MeshError(argument, std::string("init_node_mesh: dim '") + name + "' in '" +
                                    argument + "' has size " + std::to_string(size) +
                                    "; accepted: >= 1, or -1 for what is left");
    } else {
      known *= size;
    }
    sizes.push_back(size);
  }
  if (free >= 0) {
    if (total % known != 0) {
      throw MeshError(argument, std::string("init_node_mesh: the sizes of '") + argument +
                                    "' other than '" + dims[static_cast<size_t>(free)].first +
                                    "' multiply to " + std::to_string(known) + ", which does " +
                                    "not divide " + std::to_string(total));
    }
    sizes[static_cast<size_t>(free)] = total / known;
  }
  return sizes;
}

}  // namespace

DeviceMesh init_node_mesh(c10::DeviceType device_type,
                          const std::vector<std::pair<std::string, int64_t>>& within_node,
                          const std::vector<std::pair<std::string, int64_t>>& across_nodes) {
  if (within_node.empty()) {
    throw MeshError("within_node", "init_node_mesh: 'within_node' is empty; give at least one "
                                   "dim that lies inside a node (e.g. {\"shard\", -1})");
  }
  const Runtime& rt = Runtime::get();
  const int world = rt.world_size(), nodes = rt.num_nodes();
  const std::string& first = within_node.front().first;
  // Node k must hold ranks k*R .. k*R+R-1: then a block of consecutive ranks
  // that divides R never straddles two nodes.
  if (world % nodes != 0) {
    throw MeshError("within_node", "init_node_mesh: dim '" + first + "': the " +
                                       std::to_string(nodes) + " nodes hold different numbers " +
                                       "of the " + std::to_string(world) + " ranks; a node mesh "
                                       "needs the same count on every node");
  }
  const int per_node = world / nodes;
  for (int r = 0; r < world; ++r) {
    if (rt.node_of(r) != r / per_node) {
      throw MeshError("within_node", "init_node_mesh: dim '" + first + "' would span nodes: " +
                                         "world rank " + std::to_string(r) + " is on node " +
                                         std::to_string(rt.node_of(r)) + ", not " +
                                         std::to_string(r / per_node) + "; the ranks of a node " +
                                         "must be consecutive world ranks (mpirun --map-by slot, "
                                         "the default; not --map-by node)");
    }
  }
  const std::vector<int64_t> inner = resolve_sizes(within_node, per_node, "within_node");
  // From the innermost dim out: the running product must divide the ranks
  // per node, or the dim where it stops is the one that does not fit.
  int64_t block = 1;
  for (size_t i = inner.size(); i-- > 0;) {
    block *= inner[i];
    if (per_node % block != 0) {
      throw MeshError("within_node", "init_node_mesh: dim '" + within_node[i].first + "' (size " +
                                         std::to_string(inner[i]) + ") does not fit in a node: " +
                                         "the within-node dims from it inward hold " +
                                         std::to_string(block) + " ranks, which does not divide "
                                         "the " + std::to_string(per_node) + " ranks per node");
    }
  }
  const std::vector<int64_t> outer =
      resolve_sizes(across_nodes, world / block, "across_nodes");
  if (product(outer) * block != world) {
    std::string dims;
    for (const auto& d : across_nodes) dims += (dims.empty() ? "'" : ", '") + d.first + "'";
    if (dims.empty()) dims = "(none)";
    throw MeshError("across_nodes", "init_node_mesh: 'across_nodes' dims " + dims +
                                        " of sizes (" + join(outer) +
                                        ") times the within-node ones (" + join(inner) +
                                        ") cover " + std::to_string(product(outer) * block) +
                                        " ranks but the world has " + std::to_string(world));
  }
  std::vector<int64_t> shape = outer;
  std::vector<std::string> names;
  for (const auto& d : across_nodes) names.push_back(d.first);
  for (size_t i = 0; i < within_node.size(); ++i) {
    shape.push_back(inner[i]);
    names.push_back(within_node[i].first);
  }
  return init_device_mesh(device_type, shape, names);
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
