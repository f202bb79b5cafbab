// make_mpi_backend: the MPI transport of a group, for CPU tensors
// (mpi_backend.cpp).
#pragma once

#include "comm/backend.h"

#include <mpi.h>

#include <memory>
#include <string>

namespace fsdp::detail {

class CollectiveCheck;  // comm/collective_check.h

// MPI transport for CPU tensors over `comm` (owned: freed on destruction).
// poll: collectives wait by testing a nonblocking request with short sleeps
// rather than inside a blocking call (which spins on a core).
// check: FSDP_DEBUG=detail's, else null (not owned).
std::unique_ptr<Backend> make_mpi_backend(MPI_Comm comm, std::string group_name, bool poll,
                                          CollectiveCheck* check);

}  // namespace fsdp::detail
