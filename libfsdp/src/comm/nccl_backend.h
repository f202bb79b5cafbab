// make_nccl_backend: the NCCL transport of a group, for CUDA tensors
// (nccl_backend.cpp). Defined only when built with FSDP_WITH_NCCL.
#pragma once

#include "comm/backend.h"

#include <mpi.h>

#include <c10/core/Device.h>

#include <memory>
#include <string>

namespace fsdp::detail {

class CollectiveCheck;  // comm/collective_check.h

// NCCL transport for CUDA tensors on `device`, bootstrapped over `bootstrap`
// (not owned). eager: the group's communicator is created now, which is
// collective over the group (ProcessGroupImpl's constructor, itself
// collective, passes true when the Runtime's device is CUDA: c10d's eager
// init); else by the first collective. A pair's communicator (send/recv in a
// group of more than 2) comes with that pair's first send/recv.
std::unique_ptr<Backend> make_nccl_backend(MPI_Comm bootstrap, c10::Device device,
                                           std::string group_name, CollectiveCheck* check,
                                           bool eager);

}  // namespace fsdp::detail
