// MPI datatypes and reduction ops for tensor dtypes.
//
// MPI has no 16-bit floating types. bfloat16 and float16 travel as a committed
// 2-byte contiguous type; their SUM and MAX are user ops that widen each pair
// of operands to float32, combine, and round once back to 16 bits.
#include "comm/mpi_types.h"

#include "fsdp/errors.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <string>

namespace fsdp::detail {
namespace {

MPI_Datatype g_half_type = MPI_DATATYPE_NULL;  // 2 opaque bytes
MPI_Op g_bf16_sum = MPI_OP_NULL, g_bf16_max = MPI_OP_NULL;
MPI_Op g_fp16_sum = MPI_OP_NULL, g_fp16_max = MPI_OP_NULL;

template <typename T, typename Combine>
void combine16(void* in, void* inout, int* len, Combine combine) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = T(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

float add(float x, float y) { return x + y; }
float max_nan(float x, float y) {
  // NaN propagates, as torch.max and NCCL do.
  if (x != x) return x;
  if (y != y) return y;
  return std::max(x, y);
}

void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  combine16<c10::BFloat16>(in, inout, len, add);
}
void bf16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  combine16<c10::BFloat16>(in, inout, len, max_nan);
}
void fp16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  combine16<c10::Half>(in, inout, len, add);
}
void fp16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  combine16<c10::Half>(in, inout, len, max_nan);
}

}  // namespace

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw CommError(std::string(what) + " failed: " + std::string(msg, static_cast<size_t>(len)));
}

void init_mpi_types() {
  check_mpi(MPI_Type_contiguous(2, MPI_BYTE, &g_half_type), "MPI_Type_contiguous");
  check_mpi(MPI_Type_commit(&g_half_type), "MPI_Type_commit");
  check_mpi(MPI_Op_create(bf16_sum, 1, &g_bf16_sum), "MPI_Op_create");
  check_mpi(MPI_Op_create(bf16_max, 1, &g_bf16_max), "MPI_Op_create");
  check_mpi(MPI_Op_create(fp16_sum, 1, &g_fp16_sum), "MPI_Op_create");
  check_mpi(MPI_Op_create(fp16_max, 1, &g_fp16_max), "MPI_Op_create");
}

void free_mpi_types() {
  for (MPI_Op* op : {&g_bf16_sum, &g_bf16_max, &g_fp16_sum, &g_fp16_max}) {
    if (*op != MPI_OP_NULL) MPI_Op_free(op);
  }
  if (g_half_type != MPI_DATATYPE_NULL) MPI_Type_free(&g_half_type);
}

MPI_Datatype mpi_datatype(c10::ScalarType t, const char* argument) {
  switch (t) {
    case c10::kFloat: return MPI_FLOAT;
    case c10::kDouble: return MPI_DOUBLE;
    case c10::kInt: return MPI_INT32_T;
    case c10::kLong: return MPI_INT64_T;
    case c10::kByte: return MPI_UINT8_T;
    case c10::kBFloat16:
    case c10::kHalf: return g_half_type;
    default:
      throw DTypeError(argument, std::string("'") + argument + "' has dtype " + c10::toString(t) +
                                     "; collectives accept float32, float64, bfloat16, float16, "
                                     "int32, int64, uint8");
  }
}

MPI_Op mpi_op(ReduceOp op, c10::ScalarType t) {
  const bool is_max = op == ReduceOp::MAX;
  if (t == c10::kBFloat16) return is_max ? g_bf16_max : g_bf16_sum;
  if (t == c10::kHalf) return is_max ? g_fp16_max : g_fp16_sum;
  return is_max ? MPI_MAX : MPI_SUM;
}

}  // namespace fsdp::detail
