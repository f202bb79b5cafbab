// Internal: argument checks shared by the tensor-parallel files.
#pragma once

#include "fsdp/mesh.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdp::tp::detail {

// MeshError naming "tp" unless `tp` is 1-D, or when its group spans nodes
// and $FSDP_TP_ACROSS_NODES is not "1" (the message names the dim); `fn`
// prefixes the message.
void check_tp(const char* fn, const DeviceMesh& tp);

// `dim` of `x` made non-negative; ArgumentError naming "dim" if out of range.
int64_t wrap_dim(const char* fn, const at::Tensor& x, int64_t dim);

}  // namespace fsdp::tp::detail
