// Internal: the elementwise reductions of libfsdp's own CPU collective
// algorithms (cpu_algorithms.h), on raw buffers of one dtype.
//
// 16-bit types (bfloat16, float16) accumulate in float32 and are rounded once
// at the end; every other type accumulates in itself. The accumulator type of
// a dtype is acc_type(dtype). Loops run on the calling thread only (never on
// LibTorch's intra-op pool: the comm thread must not take the compute cores)
// and are compiled with -O3 so they vectorise.
// The rule: docs/architecture.md#reduction-order.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace fsdp::detail::cpu {

enum class Combine { Sum, Max };  // Max propagates NaN, as torch.max does

// float32 for bfloat16/float16, else t itself.
c10::ScalarType acc_type(c10::ScalarType t);

// out[i] = ((xs[0][i] op xs[1][i]) op xs[2][i]) ... op xs[nx-1][i], divided
// by `divisor` (AVG; 1 otherwise), in the accumulation type, rounded once
// into out (dtype t). nx >= 1. out may be xs[0] or xs[1], not a later one.
// scratch: n floats, used for 16-bit types only.
void fold(c10::ScalarType t, Combine c, void* out, const void* const* xs, int nx, int64_t n,
          double divisor, float* scratch);

// acc[i] = acc[i] op x[i]; acc in acc_type(t), x in t.
void accumulate(c10::ScalarType t, Combine c, void* acc, const void* x, int64_t n);

// acc (acc_type(t)) <- x (t), and out (t) <- acc / divisor, rounding once.
// Plain copies when acc_type(t) == t and divisor == 1.
void widen(c10::ScalarType t, void* acc, const void* x, int64_t n);
void narrow(c10::ScalarType t, void* out, const void* acc, int64_t n, double divisor);

}  // namespace fsdp::detail::cpu
