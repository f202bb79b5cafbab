// DeviceMesh: an N-D arrangement of the world's ranks with one process group
// per mesh dimension, as in PyTorch.
//
// Ranks are laid out row-major: in a (2, 2) mesh named ("replicate", "shard"),
// world rank r has coordinate (r / 2, r % 2); the "shard" group of rank 0 is
// {0, 1} and its "replicate" group is {0, 2}. Construction and flatten() are
// collective over MPI_COMM_WORLD (every rank calls them in the same order);
// communicators are created once, cached by member list, and freed when the
// Runtime ends. Slicing (operator[]) never communicates.
#pragma once

#include "fsdp/comm.h"

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
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
  DeviceMesh flatten(const std::string& dim_name = "") const;

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
// argument otherwise. Collective over MPI_COMM_WORLD.
DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});
// device_type as a string: "cpu" or "cuda".
DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});

// The group of all world ranks (created when the Runtime starts; this call
// never communicates).
ProcessGroupPtr world_group();

}  // namespace fsdp
