// DeviceMesh: an N-D arrangement of the world's ranks with one process group
// per mesh dimension, as in PyTorch.
//
// Ranks are laid out row-major: in a (2, 2) mesh named ("replicate", "shard"),
// world rank r has coordinate (r / 2, r % 2); the "shard" group of rank 0 is
// {0, 1} and its "replicate" group is {0, 2}. Construction, flatten() and
// unflatten() are collective over MPI_COMM_WORLD (every rank calls them in
// the same order); communicators are created once, cached by member list,
// and freed when the Runtime ends. Slicing (operator[]) and concatenate()
// never communicate.
//
// Views: unflatten() and flatten() build new meshes over the same ranks (as
// torchtitan builds its dense and sparse meshes from one world mesh); each is
// a root of its own. A slice remembers the root it was cut from, so that
// slices of one root can be put back together with concatenate().
#pragma once

#include "fsdp/comm.h"

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

struct MeshLayout;

class DeviceMesh {
 public:
  // The mesh's device type (kCPU or kCUDA).
  c10::DeviceType device_type() const;
  // Total ranks, and ranks along one dimension (by index or name).
  int64_t size() const;
  int64_t size(int dim) const;
  int64_t size(const std::string& dim_name) const;
  int ndim() const;
  std::vector<int64_t> shape() const;
  const std::vector<std::string>& dim_names() const;
  // World ranks of this mesh, row-major.
  std::vector<int> world_ranks() const;

  // This rank's coordinate in the mesh.
  std::vector<int64_t> get_coordinate() const;
  // This rank's index along one dimension.
  int get_local_rank(int dim) const;
  int get_local_rank(const std::string& dim_name) const;
  // This rank's rank in the flattened mesh (0 .. size()-1).
  int get_rank() const;

  // Process group of the ranks that share every coordinate but `dim`'s.
  ProcessGroupPtr get_group(int dim) const;
  ProcessGroupPtr get_group(const std::string& dim_name) const;

  // Sub-mesh over the named dimensions (in mesh order) that contains this rank.
  DeviceMesh operator[](const std::string& dim_name) const;
  DeviceMesh operator[](const std::vector<std::string>& dim_names) const;
  // So that mesh[{"replicate", "shard"}] is not read as a std::string.
  DeviceMesh operator[](std::initializer_list<std::string> dim_names) const {
    return (*this)[std::vector<std::string>(dim_names)];
  }

  // A 1-D mesh over the same ranks; its dim name defaults to the dim names
  // joined with "_". Collective over the world (creates a communicator once).
  // The result is a new root (concatenate() does not mix it with slices of
  // this mesh).
  DeviceMesh flatten(const std::string& dim_name = "") const;

  // A mesh over the same ranks in which `dim` is replaced by len(sizes) dims
  // named `names`, laid out row-major: init_device_mesh({8}).unflatten(0,
  // {2, 2, 2}, n) has the ranks, coordinates and groups of
  // init_device_mesh({2, 2, 2}, n). The other dims keep their groups; the new
  // dims' groups are created (or found in the cache) with one collective
  // each, so this is collective over MPI_COMM_WORLD like init_device_mesh:
  // every world rank calls it, in the same order, on its own copy (or its
  // own slice) of the same mesh. The result is a new root.
  // Throws MeshError naming 'dim' (out of range / unknown name), 'sizes'
  // (empty, an entry < 1, or product != size(dim)) or 'names' (count !=
  // sizes.size(), an empty name, or a name not unique in the result).
  DeviceMesh unflatten(int dim, const std::vector<int64_t>& sizes,
                       const std::vector<std::string>& names) const;
  DeviceMesh unflatten(const std::string& dim, const std::vector<int64_t>& sizes,
                       const std::vector<std::string>& names) const;

  // The root that every mesh in `meshes` was sliced from (operator[]), cut
  // down to the union of their dims, in the given order: the dims of
  // meshes[0] in its order, then those of meshes[1], ... (so
  // concatenate({m["dp"], m["tp"]}) == m[{"dp", "tp"}] for a (dp, tp) mesh,
  // and the reverse order gives the transposed view). A root counts as a
  // slice of itself; roots are compared with operator==. Never communicates:
  // every group already exists. Throws MeshError naming 'meshes' when it is
  // empty, when the meshes come from different roots, or when a dim occurs
  // twice.
  static DeviceMesh concatenate(const std::vector<DeviceMesh>& meshes);

  // Same device type, shape, dim names and world ranks (hence the same
  // groups). Where a mesh was cut from does not matter.
  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }

  // Index of a dim name; throws MeshError naming `dim_name` if unknown.
  int dim_index(const std::string& dim_name) const;

  std::string to_string() const;

 private:
  friend DeviceMesh init_device_mesh(c10::DeviceType, const std::vector<int64_t>&,
                                     const std::vector<std::string>&);
  explicit DeviceMesh(std::shared_ptr<const MeshLayout> layout);
  std::shared_ptr<const MeshLayout> layout_;
};

// Builds a mesh over all world ranks. shape: 1-3 dims (more are accepted),
// each >= 1, product == world size. dim_names: empty (names "dim0", "dim1",
// ...) or one unique non-empty name per dim. Throws MeshError naming the
// argument otherwise; device_type cuda where this process sees no CUDA
// device (a CPU build, or no GPU visible) is a MeshError naming
// "device_type" too. Collective over MPI_COMM_WORLD.
DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});
// device_type as a string: "cpu" or "cuda".
DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});

// A mesh laid out on the nodes (Runtime::num_nodes): the dims of
// `across_nodes` (outermost first) step from node to node, the dims of
// `within_node` (innermost last) stay inside one node, so a within-node dim's
// groups never leave a node and can use its shared memory. Each entry is
// (dim name, size); one size per list may be -1: what is left (within: the
// ranks per node over the other within dims; across: the world over
// everything else). The mesh is init_device_mesh(device_type, across sizes
// then within sizes, the names in that order).
//
//   HSDP, shard inside a node, replicate across:
//     init_node_mesh(kCPU, {{"shard", -1}}, {{"replicate", -1}})
//   (dp, tp) with tp inside a node (tp 2, dp whatever is left):
//     init_node_mesh(kCPU, {{"tp", 2}}, {{"dp", -1}})
//
// Needs every node to hold the same number of ranks R, as consecutive world
// ranks (node k: ranks k*R .. k*R+R-1; mpirun's default by-slot mapping).
// Throws MeshError naming 'within_node' -- its message names the dim -- when
// that is not so (the first within-node dim's groups would span nodes), when
// the within-node sizes do not divide R (the dim that stops fitting), or for
// an entry < 1 other than -1, more than one -1, or an empty list; naming
// 'across_nodes' when the sizes do not cover the world (or two -1); the
// name and device errors of init_device_mesh otherwise. Collective over
// MPI_COMM_WORLD like init_device_mesh.
DeviceMesh init_node_mesh(c10::DeviceType device_type,
                          const std::vector<std::pair<std::string, int64_t>>& within_node,
                          const std::vector<std::pair<std::string, int64_t>>& across_nodes = {});

// The group of all world ranks (created when the Runtime starts; this call
// never communicates).
ProcessGroupPtr world_group();

}  // namespace fsdp
