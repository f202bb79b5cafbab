// Shared pieces of the test_collectives feature files
// (test_collectives_{ops,async,batch_p2p}.cpp).
//
// The reference never goes through libfsdp: each member of a group sends its
// input to every other member over a private duplicate of MPI_COMM_WORLD
// (ReferenceComm, a global fixture registered once, in
// test_collectives_ops.cpp), and the expected result is computed locally in
// double. Every call is also checked against the collective counters
// (exactly one more (op, group) record with this rank's payload bytes).
#pragma once
#include "spmd.h"

#include "comm/process_group.h"  // ProcessGroupImpl: groups no other test has used

#include <fsdp/comm.h>
#include <fsdp/errors.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <mpi.h>

#include <chrono>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

namespace collectives_ref {
// The reference's own communicator, so its messages can never match (or be
// matched by) the library's, which live on communicators of their own. One
// for the executable (an inline variable), set by ReferenceComm.
inline MPI_Comm g_ref_comm = MPI_COMM_NULL;
}  // namespace collectives_ref

namespace {

using fsdp::ProcessGroup;
using fsdp::ProcessGroupPtr;
using fsdp::ReduceOp;
using fsdp::WorkPtr;

// ---- reference exchange ----------------------------------------------------

using collectives_ref::g_ref_comm;
constexpr int kRefTag = 11;

struct ReferenceComm {
  ReferenceComm() { MPI_Comm_dup(MPI_COMM_WORLD, &g_ref_comm); }
  ~ReferenceComm() { MPI_Comm_free(&g_ref_comm); }
};

// Every member's `mine`, flattened, on the CPU, in group-rank order. Sends are
// non-blocking because blocking sends to every peer before any receive
// deadlock once a message exceeds MPI's eager limit.
inline std::vector<at::Tensor> exchange(const ProcessGroup& g, const at::Tensor& mine) {
  const at::Tensor local = mine.cpu().contiguous().reshape({-1});
  const int nbytes = static_cast<int>(local.numel() * local.element_size());
  const std::vector<int>& members = g.world_ranks();
  std::vector<at::Tensor> all(members.size());
  std::vector<MPI_Request> sends;
  sends.reserve(members.size());
  for (size_t p = 0; p < members.size(); ++p) {
    if (static_cast<int>(p) == g.rank()) continue;
    sends.emplace_back();
    MPI_Isend(local.data_ptr(), nbytes, MPI_BYTE, members[p], kRefTag, g_ref_comm,
              &sends.back());
  }
  for (size_t p = 0; p < members.size(); ++p) {
    if (static_cast<int>(p) == g.rank()) {
      all[p] = local.clone();  // a snapshot: in-place collectives overwrite `mine`
      continue;
    }
    // Members' inputs may differ in size (all_to_all), so ask MPI for it.
    MPI_Status status;
    MPI_Probe(members[p], kRefTag, g_ref_comm, &status);
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    all[p] = at::empty({count / static_cast<int64_t>(local.element_size())}, local.options());
    MPI_Recv(all[p].data_ptr(), count, MPI_BYTE, members[p], kRefTag, g_ref_comm,
             MPI_STATUS_IGNORE);
  }
  MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
  return all;
}

// ---- inputs and expected values --------------------------------------------

const std::vector<at::ScalarType> kDtypes = {at::kFloat,    at::kDouble, at::kBFloat16,
                                             at::kHalf,     at::kInt,    at::kLong};
// Odd sizes (4099 is prime: no block boundary lines up by luck) and empty.
const std::vector<int64_t> kSizes = {7, 4099, 0};

inline bool is_16bit(at::ScalarType dt) { return dt == at::kBFloat16 || dt == at::kHalf; }

inline std::vector<ReduceOp> ops_for(at::ScalarType dt) {
  if (at::isFloatingType(dt)) return {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX};
  return {ReduceOp::SUM, ReduceOp::MAX};
}

// Deterministic input, distinct per member `who` and per `salt`.
// Integer and float32/64 inputs hold integers (scaled by 1/4 for floats) in
// [-30, 30], so any sum over at most 4 ranks is exact in any order and the
// check can demand equality. 16-bit inputs have magnitudes in [1, 41] with
// full significands, so their sums need rounding (what the 16-bit ops must
// get right), while a float32 sum of up to 4 of them is still exact and AVG's
// division by 2 or 4 stays clear of subnormals.
inline at::Tensor make_input(at::ScalarType dt, int64_t numel, int who, int salt) {
  const at::Tensor i = at::arange(numel, at::kLong);
  if (is_16bit(dt)) {
    const at::Tensor x = i.to(at::kDouble) * 0.37 + (who * 1.1 + salt * 0.7);
    const at::Tensor sign = at::where((i + who + salt) % 3 == 0, -1.0, 1.0);
    return ((1 + 40 * at::sin(x).abs()) * sign).to(dt);
  }
  const at::Tensor k = (i * 7 + who * 13 + salt * 5) % 61 - 30;
  if (at::isFloatingType(dt)) return (k.to(at::kDouble) * 0.25).to(dt);
  return k.to(dt);
}

// What a correct implementation may return: |got - value| <= tol, elementwise.
struct Expected {
  at::Tensor value;  // double
  at::Tensor tol;    // double
};

inline Expected exact(const at::Tensor& t) {
  // On the host, where mismatch() compares: the data may be on the device.
  const at::Tensor v = t.reshape({-1}).to(at::kCPU, at::kDouble);
  return {v, at::zeros_like(v)};
}

// Unit roundoff of a 16-bit type: half the gap between 1 and the next value.
inline double unit_roundoff(at::ScalarType dt) { return dt == at::kBFloat16 ? 0x1p-8 : 0x1p-11; }

// Elementwise reduction of equally sized flat inputs, one per member.
inline Expected reference_reduce(const std::vector<at::Tensor>& inputs, ReduceOp op,
                          at::ScalarType dt) {
  const int n = static_cast<int>(inputs.size());
  const at::Tensor stacked = at::stack(inputs).to(at::kDouble);
  if (op == ReduceOp::MAX) return exact(std::get<0>(stacked.max(0)));
  const at::Tensor sum = stacked.sum(0);
  Expected e{sum, at::zeros_like(sum)};
  if (is_16bit(dt)) {
    if (n <= 2) {
      // One float32 addition (exact for these inputs) rounded once to 16 bits:
      // the documented semantics make the result the correctly rounded sum.
      e.value = sum.to(at::kFloat).to(dt).to(at::kDouble);
    } else {
      // With more ranks MPI chooses the order in which partial sums are
      // combined, and each combination is rounded to 16 bits. Each rounding
      // is off by at most u * |partial sum| <= u * sum|x_i|, so n - 1 of them
      // bound the error by (n - 1) * u * sum|x_i| -- a few ulps of the sum.
      e.tol = (n - 1) * unit_roundoff(dt) * stacked.abs().sum(0);
    }
  }
  if (op == ReduceOp::AVG) {
    // Dividing by 2 or 4 is exact in every floating type here.
    e.value = e.value / n;
    e.tol = e.tol / n;
  }
  return e;
}

// Empty when `got` (any shape) holds `want`'s values within tolerance and has
// dtype `dt`; otherwise describes the first mismatch.
inline std::string mismatch(const at::Tensor& got, at::ScalarType dt, const Expected& want) {
  std::ostringstream os;
  if (got.scalar_type() != dt) {
    os << "dtype " << got.scalar_type() << ", expected " << dt;
    return os.str();
  }
  const at::Tensor g = got.cpu().reshape({-1}).to(at::kDouble);
  if (g.numel() != want.value.numel()) {
    os << g.numel() << " elements, expected " << want.value.numel();
    return os.str();
  }
  // Written as !(err <= tol) so that a NaN counts as a mismatch.
  const at::Tensor bad = at::logical_not((g - want.value).abs() <= want.tol);
  if (!bad.any().item<bool>()) return "";
  const int64_t i = bad.nonzero()[0][0].item<int64_t>();
  os.precision(17);
  os << bad.sum().item<int64_t>() << " of " << g.numel() << " elements wrong; first at " << i
     << ": got " << g[i].item<double>() << ", expected " << want.value[i].item<double>()
     << " (tolerance " << want.tol[i].item<double>() << ")";
  return os.str();
}

#define CHECK_MATCH(got, dt, want)                          \
  do {                                                      \
    const std::string why_ = mismatch((got), (dt), (want)); \
    BOOST_CHECK_MESSAGE(why_.empty(), #got ": " << why_);   \
  } while (0)

// ---- groups, counters, work handles ----------------------------------------

struct TestGroup {
  std::string label;
  ProcessGroupPtr group;
};

inline std::vector<TestGroup> test_groups() {
  const c10::DeviceType type = spmd::device().type();
  const int n = spmd::world_size();
  std::vector<TestGroup> out;
  auto with_name = [](const std::string& label, ProcessGroupPtr g) {
    return TestGroup{label + " " + g->name(), std::move(g)};
  };
  const auto world = fsdp::init_device_mesh(type, {n});
  out.push_back(with_name("mesh {" + std::to_string(n) + "} dim 0", world.get_group(0)));
  if (n == 4) {
    const auto hsdp = fsdp::init_device_mesh(type, {2, 2}, {"replicate", "shard"});
    out.push_back(with_name("mesh {2,2} 'replicate'", hsdp.get_group("replicate")));
    out.push_back(with_name("mesh {2,2} 'shard'", hsdp.get_group("shard")));
    const auto mesh3 = fsdp::init_device_mesh(type, {2, 1, 2});
    for (int d = 0; d < 3; ++d) {
      out.push_back(with_name("mesh {2,1,2} dim " + std::to_string(d), mesh3.get_group(d)));
    }
  }
  return out;
}

inline int64_t count_of(const fsdp::CollectiveCounters& c, const std::string& op,
                 const std::string& group) {
  const auto it = c.count.find({op, group});
  return it == c.count.end() ? 0 : it->second;
}

inline int64_t bytes_of(const fsdp::CollectiveCounters& c, const std::string& op,
                 const std::string& group) {
  const auto it = c.bytes.find({op, group});
  return it == c.bytes.end() ? 0 : it->second;
}

inline int64_t all_counts(const fsdp::CollectiveCounters& c) {
  int64_t n = 0;
  for (const auto& entry : c.count) n += entry.second;
  return n;
}

inline int64_t payload(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Runs `call`, one collective on `g`, and checks that the counters recorded
// exactly it: one more (op, group) call carrying `bytes`, nothing else.
inline WorkPtr counted(const std::string& op, const ProcessGroup& g, int64_t bytes,
                const std::function<WorkPtr()>& call) {
  const fsdp::CollectiveCounters before = fsdp::collective_counters();
  WorkPtr work = call();
  const fsdp::CollectiveCounters after = fsdp::collective_counters();
  BOOST_CHECK_MESSAGE(count_of(after, op, g.name()) == count_of(before, op, g.name()) + 1,
                      "counter (" << op << ", " << g.name() << ") went from "
                                  << count_of(before, op, g.name()) << " to "
                                  << count_of(after, op, g.name()));
  BOOST_CHECK_MESSAGE(all_counts(after) == all_counts(before) + 1,
                      op << " changed the total count by "
                         << all_counts(after) - all_counts(before));
  BOOST_CHECK_MESSAGE(
      bytes_of(after, op, g.name()) == bytes_of(before, op, g.name()) + bytes,
      op << " added " << bytes_of(after, op, g.name()) - bytes_of(before, op, g.name())
         << " payload bytes, expected " << bytes);
  return work;
}

// What a returned Work guarantees depends on the device of the tensors, the
// suite's device (comm.h's Work):
//  - CPU (MPI): a synchronous call hands back a completed Work; an async one
//    is complete once wait() returns.
//  - CUDA (NCCL): neither blocks the host. A synchronous call and wait() make
//    the caller's current stream wait for the collective (later work on it
//    sees the result); is_completed() turns true once the GPU has run the
//    collective, which holds after a device synchronize.
// Either way wait() may be called again.
inline void finish(const WorkPtr& work, bool async_op) {
  BOOST_CHECK_MESSAGE(work != nullptr, "the collective returned no Work");
  if (!work) return;
  const c10::Device device = spmd::device();
  if (device.is_cuda()) {
    work->wait();
    torch::cuda::synchronize(device.index());
    BOOST_CHECK_MESSAGE(work->is_completed(),
                        "is_completed() is false after wait() and a device synchronize");
  } else {
    if (!async_op) BOOST_CHECK_MESSAGE(work->is_completed(), "a synchronous call returned early");
    work->wait();
    BOOST_CHECK_MESSAGE(work->is_completed(), "is_completed() is false after wait()");
  }
  work->wait();
}

inline std::string context(const TestGroup& tg, at::ScalarType dt, const std::string& rest,
                    bool async_op) {
  std::ostringstream os;
  os << "group " << tg.label << " (group rank " << tg.group->rank() << "), dtype " << dt
     << ", " << rest << (async_op ? ", async" : ", sync");
  return os.str();
}

inline std::string sized(int64_t numel) { return "numel " + std::to_string(numel); }

inline std::string op_sized(ReduceOp op, int64_t numel) {
  return "op " + fsdp::to_string(op) + ", " + sized(numel);
}

// A value outside every input's range, so untouched output is caught.
inline at::Tensor filled(at::IntArrayRef shape, at::ScalarType dt) {
  return at::full(shape, 999, at::TensorOptions(dt).device(spmd::device()));
}

}  // namespace
