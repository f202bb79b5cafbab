// Shared fixture of the CPU-algorithm suites (test_cpu_collectives.cpp,
// test_two_level_collectives.cpp): every rank's input exchanged with a raw
// MPI_Allgather on a private duplicate of MPI_COMM_WORLD (never through
// libfsdp), the reference folds computed with plain ATen ops, and the error
// bound of a sum against the exact one.
#pragma once

#include "spmd.h"

#include <fsdp/comm.h>

#include <ATen/ATen.h>

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace cpu_coll {

using fsdp::CpuAlgorithm;
using fsdp::ProcessGroupPtr;
using fsdp::ReduceOp;

// The reference's own communicator: its messages can never match the
// library's. One per executable, set by ReferenceComm.
inline MPI_Comm g_ref_comm = MPI_COMM_NULL;

// Each suite registers it (or a fixture derived from it) with
// BOOST_TEST_GLOBAL_FIXTURE.
struct ReferenceComm {
  ReferenceComm() { MPI_Comm_dup(MPI_COMM_WORLD, &g_ref_comm); }
  ~ReferenceComm() { MPI_Comm_free(&g_ref_comm); }
  ReferenceComm(const ReferenceComm&) = delete;
  ReferenceComm& operator=(const ReferenceComm&) = delete;
};

// Restores the start-up settings after each case.
struct KeepSettings {
  fsdp::CpuCollectives saved = fsdp::cpu_collectives();
  ~KeepSettings() { fsdp::set_cpu_collectives(saved); }
};

inline void use(CpuAlgorithm a) { fsdp::set_cpu_collectives({a, 0, 0, 0, 0}); }

// Every world rank's `mine` (same numel everywhere), [world, numel], raw bytes.
inline at::Tensor gather_world(const at::Tensor& mine) {
  const int n = spmd::world_size();
  at::Tensor all = at::empty({n, mine.numel()}, mine.options());
  const int bytes = static_cast<int>(mine.nbytes());
  MPI_Allgather(mine.data_ptr(), bytes, MPI_BYTE, all.data_ptr(), bytes, MPI_BYTE, g_ref_comm);
  return all;
}

// The group's members' rows of gather_world, in group-rank order.
inline at::Tensor group_rows(const at::Tensor& world_rows, const ProcessGroupPtr& g) {
  std::vector<int64_t> idx(g->world_ranks().begin(), g->world_ranks().end());
  return world_rows.index_select(0, at::tensor(idx, at::kLong));
}

// Distinct, sign-mixed values per rank and element; integers stay small.
inline at::Tensor input(c10::ScalarType t, int64_t numel, int salt) {
  at::Tensor base = at::arange(numel, at::kDouble);
  at::Tensor v = at::sin(base * 0.37 + (spmd::rank() + 1) * 1.3 + salt) * 4.0 +
                 0.01 * (spmd::rank() + 1);
  if (!at::isFloatingType(t)) v = at::round(v * 10);
  return v.to(t).contiguous();
}

// The type the algorithms accumulate in: float32 for 16-bit types.
inline c10::ScalarType acc_of(c10::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf ? at::kFloat : t;
}

inline at::Tensor combine(const at::Tensor& acc, const at::Tensor& x, ReduceOp op) {
  return op == ReduceOp::MAX ? at::maximum(acc, x) : acc + x;
}

// rows [n, m] -> the left fold over `order` of rows in the accumulation
// type (divided by n there for AVG), rounded once to rows' dtype.
inline at::Tensor fold(const at::Tensor& rows, const std::vector<int64_t>& order, ReduceOp op) {
  at::Tensor acc = rows[order[0]].to(acc_of(rows.scalar_type()));
  for (size_t k = 1; k < order.size(); ++k) {
    acc = combine(acc, rows[order[k]].to(acc.scalar_type()), op);
  }
  if (op == ReduceOp::AVG) acc = acc / static_cast<double>(order.size());
  return acc.to(rows.scalar_type());
}

// fold over ranks 0..n-1 (pairwise's and shm's order).
inline at::Tensor flat_fold(const at::Tensor& rows, ReduceOp op) {
  std::vector<int64_t> order;
  for (int64_t k = 0; k < rows.size(0); ++k) order.push_back(k);
  return fold(rows, order, op);
}

// Worst |got - want| over the allowed error: <= 1 passes. The bound for
// sums: half an ulp of the 16-bit result (rounded once) plus (n+1) ulps of
// the accumulation type's error on sum |x|; exact for integers and max.
inline double error_ratio(const at::Tensor& got, const at::Tensor& rows, ReduceOp op) {
  const at::Tensor d = rows.to(at::kDouble);
  const int64_t n = rows.size(0);
  at::Tensor want = op == ReduceOp::MAX ? std::get<0>(d.max(0)) : d.sum(0);
  if (op == ReduceOp::AVG) want = want / static_cast<double>(n);
  const at::Tensor err = (got.to(at::kDouble) - want).abs();
  const auto t = rows.scalar_type();
  if (!at::isFloatingType(t) || op == ReduceOp::MAX) {
    return err.max().item<double>() == 0 ? 0.0 : 1e30;
  }
  const double acc_eps = acc_of(t) == at::kDouble ? 0x1p-52 : 0x1p-23;
  at::Tensor bound = d.abs().sum(0) * (acc_eps * static_cast<double>(n + 1));
  if (op == ReduceOp::AVG) bound = bound / static_cast<double>(n);
  if (acc_of(t) != t) {
    const double half_ulp = t == at::kBFloat16 ? 0x1p-8 : 0x1p-11;
    bound = bound + want.abs() * half_ulp;
  }
  bound = bound + 1e-300;
  return (err / bound).max().item<double>();
}

inline const std::vector<c10::ScalarType> kAllTypes{at::kFloat, at::kDouble, at::kBFloat16,
                                                    at::kHalf,  at::kInt,    at::kLong};
// Elements per rank's block: 1, odd, and past the 256 KiB per-peer chunk
// for every dtype (2-byte: 131072 elements per chunk).
inline const std::vector<int64_t> kBlocks{1, 7, 1000, 140001};

}  // namespace cpu_coll
