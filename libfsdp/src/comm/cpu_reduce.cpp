#include "comm/cpu_reduce.h"

#include "fsdp/errors.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <string>

namespace fsdp::detail::cpu {
namespace {

template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<c10::BFloat16> {
  using type = float;
};
template <>
struct Acc<c10::Half> {
  using type = float;
};

template <typename A>
inline A apply(Combine c, A a, A b) {
  if (c == Combine::Sum) return a + b;
  if constexpr (std::is_floating_point_v<A>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return a < b ? b : a;
}

// The loops below take the combine as a template argument so each is one
// branch-free loop the compiler vectorises.
template <Combine C, typename A, typename X>
void accumulate_loop(A* acc, const X* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = apply<A>(C, acc[i], static_cast<A>(x[i]));
}

// out[i] = acc[i] / divisor, rounded to T; divisor is 1 for integers.
template <typename T, typename A>
void narrow_loop(T* out, const A* acc, int64_t n, double divisor) {
  if (divisor == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(acc[i]);
  } else {
    const A d = static_cast<A>(divisor);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(acc[i] / d);
  }
}

template <Combine C, typename T>
void fold_typed(T* out, const void* const* xs, int nx, int64_t n, double divisor,
                float* scratch) {
  using A = typename Acc<T>::type;
  const T* x0 = static_cast<const T*>(xs[0]);
  if constexpr (std::is_same_v<A, T>) {
    if (nx == 1) {
      if (out != x0) std::memmove(out, x0, static_cast<size_t>(n) * sizeof(T));
    } else {
      const T* x1 = static_cast<const T*>(xs[1]);
      for (int64_t i = 0; i < n; ++i) out[i] = apply<T>(C, x0[i], x1[i]);
      for (int k = 2; k < nx; ++k) accumulate_loop<C>(out, static_cast<const T*>(xs[k]), n);
    }
    if (divisor != 1) narrow_loop(out, out, n, divisor);
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(x0[i]);
    for (int k = 1; k < nx; ++k) accumulate_loop<C>(scratch, static_cast<const T*>(xs[k]), n);
    narrow_loop(out, scratch, n, divisor);
  }
}

template <typename F>
void dispatch(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::kFloat: f(float{}); return;
    case c10::kDouble: f(double{}); return;
    case c10::kBFloat16: f(c10::BFloat16{}); return;
    case c10::kHalf: f(c10::Half{}); return;
    case c10::kInt: f(int32_t{}); return;
    case c10::kLong: f(int64_t{}); return;
    default:
      throw DTypeError("tensor", std::string("CPU collective reduction: dtype ") +
                                     c10::toString(t) + " is not supported");
  }
}

}  // namespace

c10::ScalarType acc_type(c10::ScalarType t) {
  return t == c10::kBFloat16 || t == c10::kHalf ? c10::kFloat : t;
}

void fold(c10::ScalarType t, Combine c, void* out, const void* const* xs, int nx, int64_t n,
          double divisor, float* scratch) {
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    if (c == Combine::Sum) {
      fold_typed<Combine::Sum>(static_cast<T*>(out), xs, nx, n, divisor, scratch);
    } else {
      fold_typed<Combine::Max>(static_cast<T*>(out), xs, nx, n, divisor, scratch);
    }
  });
}

void accumulate(c10::ScalarType t, Combine c, void* acc, const void* x, int64_t n) {
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    if (c == Combine::Sum) {
      accumulate_loop<Combine::Sum>(static_cast<A*>(acc), static_cast<const T*>(x), n);
    } else {
      accumulate_loop<Combine::Max>(static_cast<A*>(acc), static_cast<const T*>(x), n);
    }
  });
}

void widen(c10::ScalarType t, void* acc, const void* x, int64_t n) {
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    A* a = static_cast<A*>(acc);
    const T* v = static_cast<const T*>(x);
    for (int64_t i = 0; i < n; ++i) a[i] = static_cast<A>(v[i]);
  });
}

void narrow(c10::ScalarType t, void* out, const void* acc, int64_t n, double divisor) {
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    narrow_loop(static_cast<T*>(out), static_cast<const A*>(acc), n, divisor);
  });
}

}  // namespace fsdp::detail::cpu
