// Argument checks shared by the tensor-parallel files.
#include "tp/check.h"

#include "fsdp/errors.h"

#include <string>

namespace fsdp::tp::detail {

void check_tp(const char* fn, const DeviceMesh& tp) {
  if (tp.ndim() != 1) {
    throw MeshError("tp", std::string(fn) + ": 'tp' is " + tp.to_string() +
                              "; accepted: a 1-D mesh (slice a multi-dim mesh, e.g. mesh[\"tp\"])");
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
