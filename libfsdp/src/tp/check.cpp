// Argument checks shared by the tensor-parallel files.
#include "tp/check.h"

#include "fsdp/errors.h"

#include <cstdlib>
#include <string>

namespace fsdp::tp::detail {

void check_tp(const char* fn, const DeviceMesh& tp) {
  if (tp.ndim() != 1) {
    throw MeshError("tp", std::string(fn) + ": 'tp' is " + tp.to_string() +
                              "; accepted: a 1-D mesh (slice a multi-dim mesh, e.g. mesh[\"tp\"])");
  }
  // TP's collectives sit on the critical path of every layer, forward and
  // backward: across a node's link they cost far more than inside a node, so
  // a tp group that spans nodes is refused unless asked for.
  const ProcessGroupPtr group = tp.get_group(0);
  if (group->num_nodes() > 1) {
    const char* opt_out = std::getenv("FSDP_TP_ACROSS_NODES");
    if (opt_out == nullptr || std::string(opt_out) != "1") {
      throw MeshError("tp", std::string(fn) + ": tp dim '" + tp.dim_names()[0] + "' (group " +
                                group->name() + ") spans " + std::to_string(group->num_nodes()) +
                                " nodes; put tp inside a node (fsdp::init_node_mesh(..., "
                                "{{\"" + tp.dim_names()[0] + "\", n}}, ...)) or set "
                                "FSDP_TP_ACROSS_NODES=1 to allow it");
    }
  }
}

int64_t wrap_dim(const char* fn, const at::Tensor& x, int64_t dim) {
  const int64_t nd = x.dim();
  if (dim < -nd || dim >= nd) {
    throw ArgumentError("dim", std::string(fn) + ": 'dim' = " + std::to_string(dim) +
                                   " for a tensor with " + std::to_string(nd) +
                                   " dims; accepted: " + std::to_string(-nd) + " <= dim < " +
                                   std::to_string(nd));
  }
  return dim < 0 ? dim + nd : dim;
}

}  // namespace fsdp::tp::detail
