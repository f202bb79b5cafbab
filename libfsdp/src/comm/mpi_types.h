// MPI helpers: error checks, and the MPI datatypes and reduction ops of
// tensor dtypes (mpi_types.cpp).
#pragma once

#include "fsdp/reduce_op.h"

#include <mpi.h>

#include <c10/core/ScalarType.h>

namespace fsdp::detail {

// Throws CommError with the MPI error string if rc != MPI_SUCCESS.
void check_mpi(int rc, const char* what);
// MPI datatype for a tensor dtype; DTypeError naming `argument` if unsupported.
MPI_Datatype mpi_datatype(c10::ScalarType t, const char* argument);
// MPI op for a reduction on a dtype (AVG maps to SUM; the caller divides).
MPI_Op mpi_op(ReduceOp op, c10::ScalarType t);
// Creates/frees the custom 16-bit datatypes and ops (Runtime start/end).
void init_mpi_types();
void free_mpi_types();

}  // namespace fsdp::detail
