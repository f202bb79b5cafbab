// L0: every collective x dtype x op against a naive reference built from MPI
// point-to-point messages.
//
// The reference never goes through libfsdp: each member of a group sends its
// input to every other member over a private duplicate of MPI_COMM_WORLD, and
// the expected result is computed locally in double. Every call is also
// checked against the collective counters (exactly one more (op, group)
// record with this rank's payload bytes).
//
// Groups: the world (mesh {n}); at 4 ranks also both dims of a {2,2}
// ("replicate", "shard") mesh and every dim of a 3-D {2,1,2} mesh, whose
// middle dim is a one-rank group.
//
// batch_isend_irecv: rings whose ranks all list sends first (4 MiB, past
// the eager limit), send + receive with one peer, Works in the order of
// the ops, labels in describe_pending_collectives(), typed errors naming
// ops[i] that issue and count nothing.
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

namespace {

using fsdp::ProcessGroup;
using fsdp::ProcessGroupPtr;
using fsdp::ReduceOp;
using fsdp::WorkPtr;

// ---- reference exchange ----------------------------------------------------

// The reference's own communicator, so its messages can never match (or be
// matched by) the library's, which live on communicators of their own.
MPI_Comm g_ref_comm = MPI_COMM_NULL;
constexpr int kRefTag = 11;

struct ReferenceComm {
  ReferenceComm() { MPI_Comm_dup(MPI_COMM_WORLD, &g_ref_comm); }
  ~ReferenceComm() { MPI_Comm_free(&g_ref_comm); }
};
BOOST_TEST_GLOBAL_FIXTURE(ReferenceComm);

// Every member's `mine`, flattened, on the CPU, in group-rank order. Sends are
// non-blocking because blocking sends to every peer before any receive
// deadlock once a message exceeds MPI's eager limit.
std::vector<at::Tensor> exchange(const ProcessGroup& g, const at::Tensor& mine) {
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

bool is_16bit(at::ScalarType dt) { return dt == at::kBFloat16 || dt == at::kHalf; }

std::vector<ReduceOp> ops_for(at::ScalarType dt) {
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
at::Tensor make_input(at::ScalarType dt, int64_t numel, int who, int salt) {
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

Expected exact(const at::Tensor& t) {
  // On the host, where mismatch() compares: the data may be on the device.
  const at::Tensor v = t.reshape({-1}).to(at::kCPU, at::kDouble);
  return {v, at::zeros_like(v)};
}

// Unit roundoff of a 16-bit type: half the gap between 1 and the next value.
double unit_roundoff(at::ScalarType dt) { return dt == at::kBFloat16 ? 0x1p-8 : 0x1p-11; }

// Elementwise reduction of equally sized flat inputs, one per member.
Expected reference_reduce(const std::vector<at::Tensor>& inputs, ReduceOp op,
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
std::string mismatch(const at::Tensor& got, at::ScalarType dt, const Expected& want) {
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

std::vector<TestGroup> test_groups() {
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

int64_t count_of(const fsdp::CollectiveCounters& c, const std::string& op,
                 const std::string& group) {
  const auto it = c.count.find({op, group});
  return it == c.count.end() ? 0 : it->second;
}

int64_t bytes_of(const fsdp::CollectiveCounters& c, const std::string& op,
                 const std::string& group) {
  const auto it = c.bytes.find({op, group});
  return it == c.bytes.end() ? 0 : it->second;
}

int64_t all_counts(const fsdp::CollectiveCounters& c) {
  int64_t n = 0;
  for (const auto& entry : c.count) n += entry.second;
  return n;
}

int64_t payload(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Runs `call`, one collective on `g`, and checks that the counters recorded
// exactly it: one more (op, group) call carrying `bytes`, nothing else.
WorkPtr counted(const std::string& op, const ProcessGroup& g, int64_t bytes,
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
void finish(const WorkPtr& work, bool async_op) {
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

std::string context(const TestGroup& tg, at::ScalarType dt, const std::string& rest,
                    bool async_op) {
  std::ostringstream os;
  os << "group " << tg.label << " (group rank " << tg.group->rank() << "), dtype " << dt
     << ", " << rest << (async_op ? ", async" : ", sync");
  return os.str();
}

std::string sized(int64_t numel) { return "numel " + std::to_string(numel); }

std::string op_sized(ReduceOp op, int64_t numel) {
  return "op " + fsdp::to_string(op) + ", " + sized(numel);
}

// A value outside every input's range, so untouched output is caught.
at::Tensor filled(at::IntArrayRef shape, at::ScalarType dt) {
  return at::full(shape, 999, at::TensorOptions(dt).device(spmd::device()));
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_all_gather_into_tensor) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (int64_t numel : kSizes) {
        for (bool async_op : {false, true}) {
          BOOST_TEST_CONTEXT(context(tg, dt, sized(numel), async_op)) {
            const at::Tensor input = make_input(dt, numel, g.rank(), 0).to(spmd::device());
            const std::vector<at::Tensor> all = exchange(g, input);
            at::Tensor output = filled({g.size() * numel}, dt);
            finish(counted("all_gather", g, payload(input),
                           [&] { return g.all_gather_into_tensor(output, input, async_op); }),
                   async_op);
            CHECK_MATCH(output, dt, exact(at::cat(all)));
            CHECK_MATCH(input, dt, exact(all[static_cast<size_t>(g.rank())]));
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_reduce_scatter_tensor) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (ReduceOp op : ops_for(dt)) {
        for (int64_t numel : kSizes) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, op_sized(op, numel), async_op)) {
              const at::Tensor input =
                  make_input(dt, g.size() * numel, g.rank(), 1).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, input);
              at::Tensor output = filled({numel}, dt);
              finish(counted("reduce_scatter", g, payload(input),
                             [&] {
                               return g.reduce_scatter_tensor(output, input, op, async_op);
                             }),
                     async_op);
              const Expected full = reference_reduce(all, op, dt);
              const int64_t begin = g.rank() * numel;
              CHECK_MATCH(output, dt,
                          (Expected{full.value.narrow(0, begin, numel),
                                    full.tol.narrow(0, begin, numel)}));
            }
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_all_reduce) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (ReduceOp op : ops_for(dt)) {
        for (int64_t numel : kSizes) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, op_sized(op, numel), async_op)) {
              at::Tensor tensor = make_input(dt, numel, g.rank(), 2).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, tensor);
              finish(counted("all_reduce", g, payload(tensor),
                             [&] { return g.all_reduce(tensor, op, async_op); }),
                     async_op);
              CHECK_MATCH(tensor, dt, reference_reduce(all, op, dt));
            }
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_broadcast_from_every_root) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    for (at::ScalarType dt : kDtypes) {
      for (int64_t numel : kSizes) {
        for (int root = 0; root < g.size(); ++root) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, sized(numel) + ", root " + std::to_string(root),
                                       async_op)) {
              at::Tensor tensor = make_input(dt, numel, g.rank(), 3 + root).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, tensor);
              finish(counted("broadcast", g, payload(tensor),
                             [&] { return g.broadcast(tensor, root, async_op); }),
                     async_op);
              CHECK_MATCH(tensor, dt, exact(all[static_cast<size_t>(root)]));
            }
          }
        }
      }
    }
  }
}

namespace {

constexpr int64_t kRowWidth = 5;

// all_to_all_single on `g` where member i sends rows[i][j] rows to member j,
// checked against the members' inputs.
void check_all_to_all(const TestGroup& tg, at::ScalarType dt, bool async_op,
                      const std::vector<std::vector<int64_t>>& rows, bool pass_splits) {
  ProcessGroup& g = *tg.group;
  const auto me = static_cast<size_t>(g.rank());
  const size_t n = rows.size();
  std::vector<int64_t> in_splits, out_splits;
  int64_t in_rows = 0, out_rows = 0;
  for (size_t j = 0; j < n; ++j) {
    in_splits.push_back(rows[me][j]);
    out_splits.push_back(rows[j][me]);
    in_rows += rows[me][j];
    out_rows += rows[j][me];
  }
  const at::Tensor input =
      make_input(dt, in_rows * kRowWidth, g.rank(), 4).reshape({in_rows, kRowWidth}).to(
          spmd::device());
  const std::vector<at::Tensor> all = exchange(g, input);
  at::Tensor output = filled({out_rows, kRowWidth}, dt);
  const std::vector<int64_t> no_splits;
  finish(counted("all_to_all", g, payload(input),
                 [&] {
                   return g.all_to_all_single(output, input, pass_splits ? out_splits : no_splits,
                                              pass_splits ? in_splits : no_splits, async_op);
                 }),
         async_op);
  // Block j of the output is the block that member j addressed to this rank.
  std::vector<at::Tensor> blocks;
  for (size_t j = 0; j < n; ++j) {
    int64_t offset = 0;
    for (size_t k = 0; k < me; ++k) offset += rows[j][k];
    blocks.push_back(all[j].reshape({-1, kRowWidth}).narrow(0, offset, rows[j][me]));
  }
  CHECK_MATCH(output, dt, exact(at::cat(blocks)));
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_all_to_all_single_equal_split) {
  for (const TestGroup& tg : test_groups()) {
    const auto n = static_cast<size_t>(tg.group->size());
    const std::vector<std::vector<int64_t>> rows(n, std::vector<int64_t>(n, 3));
    for (at::ScalarType dt : kDtypes) {
      for (bool async_op : {false, true}) {
        BOOST_TEST_CONTEXT(context(tg, dt, "3 rows to each rank, no split sizes", async_op)) {
          check_all_to_all(tg, dt, async_op, rows, false);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_all_to_all_single_uneven_split) {
  for (const TestGroup& tg : test_groups()) {
    const auto n = static_cast<size_t>(tg.group->size());
    // 0, 1 or 2 rows from i to j: zero-row blocks in both directions, and
    // ranks that send and receive different totals.
    std::vector<std::vector<int64_t>> uneven(n, std::vector<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) uneven[i][j] = static_cast<int64_t>((i + 2 * j + 1) % 3);
    }
    const std::vector<std::vector<int64_t>> empty(n, std::vector<int64_t>(n, 0));
    for (at::ScalarType dt : kDtypes) {
      for (bool async_op : {false, true}) {
        BOOST_TEST_CONTEXT(context(tg, dt, "(i + 2j + 1) % 3 rows from i to j", async_op)) {
          check_all_to_all(tg, dt, async_op, uneven, true);
        }
        BOOST_TEST_CONTEXT(context(tg, dt, "zero rows everywhere", async_op)) {
          check_all_to_all(tg, dt, async_op, empty, true);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_send_recv_ring) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;  // a one-rank group has no peer to talk to
    const int next = (g.rank() + 1) % g.size();
    const int prev = (g.rank() + g.size() - 1) % g.size();
    for (at::ScalarType dt : kDtypes) {
      for (int64_t numel : {int64_t{7}, int64_t{4099}}) {
        for (int tag : {0, 32767}) {
          for (bool async_op : {false, true}) {
            BOOST_TEST_CONTEXT(context(tg, dt, sized(numel) + ", tag " + std::to_string(tag),
                                       async_op)) {
              const at::Tensor sent = make_input(dt, numel, g.rank(), 5).to(spmd::device());
              const std::vector<at::Tensor> all = exchange(g, sent);
              at::Tensor received = filled({numel}, dt);
              auto do_send = [&] {
                return counted("send", g, payload(sent),
                               [&] { return g.send(sent, next, tag, async_op); });
              };
              auto do_recv = [&] {
                return counted("recv", g, payload(received),
                               [&] { return g.recv(received, prev, tag, async_op); });
              };
              // A group runs its operations one at a time in issue order, so
              // a rank whose receive comes first cannot send until it is
              // matched: even ranks send first, odd ranks receive first.
              WorkPtr first, second;
              if (g.rank() % 2 == 0) {
                first = do_send();
                second = do_recv();
              } else {
                first = do_recv();
                second = do_send();
              }
              finish(first, async_op);
              finish(second, async_op);
              CHECK_MATCH(received, dt, exact(all[static_cast<size_t>(prev)]));
              CHECK_MATCH(sent, dt, exact(all[static_cast<size_t>(g.rank())]));
            }
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_barrier) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kDelay = std::chrono::milliseconds(400);
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << ")") {
      // Line every rank up on the reference communicator, then hold group
      // rank 0 back: no member may leave the barrier before it entered. Half
      // the delay is margin for ranks that leave the line-up late.
      MPI_Barrier(g_ref_comm);
      const auto start = Clock::now();
      if (g.rank() == 0) std::this_thread::sleep_for(kDelay);
      counted("barrier", g, 0, [&] {
        g.barrier();
        return WorkPtr();
      });
      const auto waited = Clock::now() - start;
      if (g.rank() != 0) {
        BOOST_CHECK_MESSAGE(waited >= kDelay / 2,
                            "left the barrier after "
                                << std::chrono::duration<double>(waited).count()
                                << " s although group rank 0 entered it after "
                                << std::chrono::duration<double>(kDelay).count() << " s");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_async_ops_in_flight_complete_in_issue_order) {
  constexpr int64_t kNumel = 4099;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    const int root = g.size() - 1;
    for (at::ScalarType dt : kDtypes) {
      BOOST_TEST_CONTEXT(context(tg, dt, "five ops in flight", true)) {
        const at::Tensor a = make_input(dt, kNumel, g.rank(), 6).to(spmd::device());
        const at::Tensor b = make_input(dt, kNumel, g.rank(), 7).to(spmd::device());
        const at::Tensor c = make_input(dt, g.size() * kNumel, g.rank(), 8).to(spmd::device());
        const std::vector<at::Tensor> all_a = exchange(g, a);
        const std::vector<at::Tensor> all_b = exchange(g, b);
        const std::vector<at::Tensor> all_c = exchange(g, c);

        // The first two touch the same tensor, so only issue order gives
        // n * a[root]; the reverse would give root's sum of a.
        at::Tensor chained = a.clone();
        at::Tensor gathered = filled({g.size() * kNumel}, dt);
        at::Tensor maxed = b.clone();
        at::Tensor scattered = filled({kNumel}, dt);
        std::vector<WorkPtr> works;
        works.push_back(counted("broadcast", g, payload(chained),
                                [&] { return g.broadcast(chained, root, true); }));
        works.push_back(counted("all_reduce", g, payload(chained),
                                [&] { return g.all_reduce(chained, ReduceOp::SUM, true); }));
        works.push_back(counted("all_gather", g, payload(b), [&] {
          return g.all_gather_into_tensor(gathered, b, true);
        }));
        works.push_back(counted("all_reduce", g, payload(maxed),
                                [&] { return g.all_reduce(maxed, ReduceOp::MAX, true); }));
        works.push_back(counted("reduce_scatter", g, payload(c), [&] {
          return g.reduce_scatter_tensor(scattered, c, ReduceOp::SUM, true);
        }));

        // Poll newest first: once an op is seen complete, every op issued
        // before it must already be complete (on CUDA is_completed() polls
        // the GPU, so the loop ends once the device has run them all).
        bool ordered = true;
        for (bool last_done = false; !last_done;) {
          last_done = works.back()->is_completed();
          bool later_done = false;
          for (auto it = works.rbegin(); it != works.rend(); ++it) {
            const bool done = (*it)->is_completed();
            if (later_done && !done) ordered = false;
            later_done = later_done || done;
          }
          std::this_thread::yield();
        }
        BOOST_CHECK_MESSAGE(ordered, "an op completed before one issued earlier");
        for (const WorkPtr& w : works) finish(w, true);

        const std::vector<at::Tensor> copies(static_cast<size_t>(g.size()),
                                             all_a[static_cast<size_t>(root)]);
        CHECK_MATCH(chained, dt, reference_reduce(copies, ReduceOp::SUM, dt));
        CHECK_MATCH(gathered, dt, exact(at::cat(all_b)));
        CHECK_MATCH(maxed, dt, reference_reduce(all_b, ReduceOp::MAX, dt));
        const Expected full = reference_reduce(all_c, ReduceOp::SUM, dt);
        const int64_t begin = g.rank() * kNumel;
        CHECK_MATCH(scattered, dt,
                    (Expected{full.value.narrow(0, begin, kNumel),
                              full.tol.narrow(0, begin, kNumel)}));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(test_async_work_is_not_completed_until_every_rank_joins) {
  constexpr int kGoTag = 12;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;  // a one-rank group waits for nobody
    BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << ")") {
      const int n = g.size();
      const std::vector<int>& members = g.world_ranks();
      at::Tensor t =
          at::full({4099}, g.rank() + 1, at::TensorOptions(at::kFloat).device(spmd::device()));
      auto issue = [&] {
        return counted("all_reduce", g, payload(t),
                       [&] { return g.all_reduce(t, ReduceOp::SUM, true); });
      };
      // Group rank 0 joins only after every other member has looked at its
      // Work, so none of those can be complete when looked at (on CUDA too:
      // a member's NCCL kernel cannot finish before rank 0 launched its own).
      WorkPtr work;
      if (g.rank() == 0) {
        for (int p = 1; p < n; ++p) {
          MPI_Recv(nullptr, 0, MPI_BYTE, members[static_cast<size_t>(p)], kGoTag, g_ref_comm,
                   MPI_STATUS_IGNORE);
        }
        work = issue();
      } else {
        work = issue();
        BOOST_CHECK_MESSAGE(!work->is_completed(),
                            "is_completed() is true before group rank 0 joined");
        MPI_Send(nullptr, 0, MPI_BYTE, members[0], kGoTag, g_ref_comm);
      }
      finish(work, true);
      CHECK_MATCH(t, at::kFloat, exact(at::full({4099}, n * (n + 1) / 2, at::kDouble)));
    }
  }
}

// A group's transport is set up when the group is built (collective, in
// the same order on every rank), never inside its first collective (c10d's
// eager init). Set up lazily, ranks that issue their first collectives on two
// new groups in opposite orders wait for each other forever, each blocked in
// the set-up of a different group. CPU tensors check the MPI backend's
// communicators; a gpu entry (CUDA tensors) checks NCCL's ncclCommInitRank.
BOOST_AUTO_TEST_CASE(test_first_collectives_of_new_groups_in_opposite_orders) {
  const int n = spmd::world_size();
  const int me = spmd::rank();
  std::vector<int> members(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) members[static_cast<size_t>(r)] = r;
  auto make_group = [&](const std::string& name) {
    MPI_Comm comm = MPI_COMM_NULL;
    BOOST_REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &comm) == MPI_SUCCESS);
    return std::make_shared<fsdp::detail::ProcessGroupImpl>(comm, members, name);
  };
  auto a = make_group("new group A");
  auto b = make_group("new group B");
  const auto options = at::TensorOptions(at::kFloat).device(spmd::device());
  at::Tensor ta = at::full({4099}, me + 1, options);
  at::Tensor tb = at::full({4099}, 10 * (me + 1), options);
  // Even ranks start with A, odd ones with B; both are issued before either
  // is waited for, as prefetching issues them.
  WorkPtr wa, wb;
  if (me % 2 == 0) {
    wa = a->all_reduce(ta, ReduceOp::SUM, /*async_op=*/true);
    wb = b->all_reduce(tb, ReduceOp::SUM, /*async_op=*/true);
  } else {
    wb = b->all_reduce(tb, ReduceOp::SUM, /*async_op=*/true);
    wa = a->all_reduce(ta, ReduceOp::SUM, /*async_op=*/true);
  }
  finish(wa, true);
  finish(wb, true);
  const double sum = n * (n + 1) / 2.0;
  CHECK_MATCH(ta, at::kFloat, exact(at::full({4099}, sum, at::kDouble)));
  CHECK_MATCH(tb, at::kFloat, exact(at::full({4099}, 10 * sum, at::kDouble)));
  a->shutdown();
  b->shutdown();
}

BOOST_AUTO_TEST_CASE(test_collective_counters_count_each_call_and_reset) {
  const std::vector<TestGroup> groups = test_groups();
  const c10::TensorOptions options = at::TensorOptions(at::kFloat).device(spmd::device());
  auto check_empty = [](const char* when) {
    const fsdp::CollectiveCounters c = fsdp::collective_counters();
    BOOST_CHECK_MESSAGE(c.count.empty() && c.bytes.empty() && c.sequence.empty(),
                        "counters not empty " << when << ": " << all_counts(c) << " calls, "
                                              << c.sequence.size() << " records");
  };

  fsdp::reset_collective_counters();
  check_empty("after reset");

  // One call of each kind per group, remembered in issue order.
  std::vector<std::pair<std::string, std::string>> issued;
  std::vector<int64_t> issued_bytes;
  for (const TestGroup& tg : groups) {
    ProcessGroup& g = *tg.group;
    BOOST_TEST_CONTEXT("group " << tg.label) {
      const int n = g.size();
      auto note = [&](const std::string& op, int64_t bytes) {
        issued.emplace_back(op, g.name());
        issued_bytes.push_back(bytes);
      };
      at::Tensor x = at::ones({6}, options);
      at::Tensor big = at::ones({6 * n}, options);
      at::Tensor small = at::ones({6}, options);
      counted("all_gather", g, 24, [&] { return g.all_gather_into_tensor(big, x); });
      note("all_gather", 24);
      counted("reduce_scatter", g, 24 * n,
              [&] { return g.reduce_scatter_tensor(small, big, ReduceOp::AVG); });
      note("reduce_scatter", 24 * n);
      counted("all_reduce", g, 24, [&] { return g.all_reduce(x, ReduceOp::MAX, true); })->wait();
      note("all_reduce", 24);
      counted("broadcast", g, 24, [&] { return g.broadcast(x, 0); });
      note("broadcast", 24);
      at::Tensor rows = at::ones({n, 2}, options);
      at::Tensor rows_out = at::empty({n, 2}, options);
      counted("all_to_all", g, 8 * n, [&] { return g.all_to_all_single(rows_out, rows); });
      note("all_to_all", 8 * n);
      if (n > 1) {
        // Pairs (0,1), (2,3): the group sizes here are 2 or 4.
        const int peer = g.rank() ^ 1;
        if (g.rank() % 2 == 0) {
          counted("send", g, 24, [&] { return g.send(x, peer); });
          counted("recv", g, 24, [&] { return g.recv(x, peer); });
          note("send", 24);
          note("recv", 24);
        } else {
          counted("recv", g, 24, [&] { return g.recv(x, peer); });
          counted("send", g, 24, [&] { return g.send(x, peer); });
          note("recv", 24);
          note("send", 24);
        }
      }
      counted("barrier", g, 0, [&] {
        g.barrier();
        return WorkPtr();
      });
      note("barrier", 0);
    }
  }

  const fsdp::CollectiveCounters c = fsdp::collective_counters();
  std::map<std::pair<std::string, std::string>, int64_t> expected_count;
  for (const auto& key : issued) ++expected_count[key];
  BOOST_CHECK(c.count == expected_count);
  BOOST_CHECK_EQUAL(c.sequence.size(), issued.size());
  for (size_t i = 0; i < std::min(c.sequence.size(), issued.size()); ++i) {
    const fsdp::CollectiveRecord& r = c.sequence[i];
    BOOST_CHECK_MESSAGE(r.op == issued[i].first && r.group == issued[i].second &&
                            r.bytes == issued_bytes[i],
                        "record " << i << " is (" << r.op << ", " << r.group << ", " << r.bytes
                                  << "), issued (" << issued[i].first << ", "
                                  << issued[i].second << ", " << issued_bytes[i] << ")");
  }
  const std::string world = groups.front().group->name();
  BOOST_CHECK_EQUAL(c.total("barrier"), static_cast<int64_t>(groups.size()));
  const int64_t world_barriers = expected_count[{"barrier", world}];
  BOOST_CHECK_EQUAL(c.total("barrier", world), world_barriers);

  fsdp::reset_collective_counters();
  check_empty("after the second reset");
  ProcessGroup& g = *groups.front().group;
  at::Tensor x = at::ones({3}, options);
  counted("all_reduce", g, 12, [&] { return g.all_reduce(x); });
  BOOST_CHECK_EQUAL(fsdp::collective_counters().count.size(), 1u);
  BOOST_CHECK_EQUAL(count_of(fsdp::collective_counters(), "all_reduce", g.name()), 1);
}

// Both ranks of each pair send first: a queued blocking send would deadlock
// past MPI's eager limit, so point-to-point must start at once. An MPI
// property, so CPU tensors on every entry (with NCCL, whose sends and
// receives are queued in order on one stream, such an exchange needs
// batch_isend_irecv); wait() on MPI Works blocks until they are complete.
BOOST_AUTO_TEST_CASE(test_send_recv_exchange_both_send_first,
                     *spmd::needs_even_world_size("to pair the ranks up")) {
  auto group = fsdp::world_group();
  const int me = group->rank();
  const int peer = me ^ 1;
  const int64_t n = 1 << 20;  // 4 MiB of float32, far past the eager limit
  auto out = at::full({n}, static_cast<float>(me + 1), at::kFloat);
  auto in = at::zeros({n}, at::kFloat);
  auto send = group->send(out, peer, 7, /*async_op=*/true);
  auto recv = group->recv(in, peer, 7, /*async_op=*/true);
  send->wait();
  recv->wait();
  BOOST_TEST(send->is_completed());
  BOOST_TEST(recv->is_completed());
  BOOST_TEST(at::equal(in, at::full({n}, static_cast<float>(peer + 1), at::kFloat)));
}

// ---- batch_isend_irecv -------------------------------------------------------

namespace {

using fsdp::P2POp;

P2POp p2p(P2POp::Kind kind, at::Tensor t, int peer, int tag, std::string label = "") {
  P2POp op;
  op.kind = kind;
  op.tensor = std::move(t);
  op.peer = peer;
  op.tag = tag;
  op.label = std::move(label);
  return op;
}

// Issues `ops` on `g` and checks the counters: one "send" per Send op and
// one "recv" per Recv op on g, with their payload bytes, nothing else.
std::vector<WorkPtr> counted_batch(ProcessGroup& g, const std::vector<P2POp>& ops) {
  int64_t sends = 0, recvs = 0, send_bytes = 0, recv_bytes = 0;
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::Send;
    (send ? sends : recvs) += 1;
    (send ? send_bytes : recv_bytes) += payload(op.tensor);
  }
  const fsdp::CollectiveCounters before = fsdp::collective_counters();
  std::vector<WorkPtr> works = g.batch_isend_irecv(ops);
  const fsdp::CollectiveCounters after = fsdp::collective_counters();
  const std::string& n = g.name();
  BOOST_CHECK_EQUAL(count_of(after, "send", n) - count_of(before, "send", n), sends);
  BOOST_CHECK_EQUAL(count_of(after, "recv", n) - count_of(before, "recv", n), recvs);
  BOOST_CHECK_EQUAL(bytes_of(after, "send", n) - bytes_of(before, "send", n), send_bytes);
  BOOST_CHECK_EQUAL(bytes_of(after, "recv", n) - bytes_of(before, "recv", n), recv_bytes);
  BOOST_CHECK_EQUAL(all_counts(after) - all_counts(before), sends + recvs);
  BOOST_CHECK_EQUAL(works.size(), ops.size());
  return works;
}

constexpr int64_t kBigNumel = int64_t{1} << 20;  // 4 MiB of float32: past any eager limit

}  // namespace

// Every rank lists its sends before its receives -- blocking sends in that
// order deadlock past the eager limit -- on a ring in both directions (to
// the next rank, float32, tag 1; to the previous one, bfloat16, tag 2;
// at 2 ranks both peers are the same rank). The batch completes, each
// receive holds its sender's data and the sent tensors are untouched.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_ring_sends_listed_first) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;
    const int next = (g.rank() + 1) % g.size();
    const int prev = (g.rank() + g.size() - 1) % g.size();
    BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << ")") {
      const at::Tensor to_next = make_input(at::kFloat, kBigNumel, g.rank(), 9).to(spmd::device());
      const at::Tensor to_prev =
          make_input(at::kBFloat16, kBigNumel / 2 + 3, g.rank(), 10).to(spmd::device());
      const std::vector<at::Tensor> all_next = exchange(g, to_next);
      const std::vector<at::Tensor> all_prev = exchange(g, to_prev);
      at::Tensor from_prev = filled({kBigNumel}, at::kFloat);
      at::Tensor from_next = filled({kBigNumel / 2 + 3}, at::kBFloat16);
      const std::vector<WorkPtr> works = counted_batch(
          g, {p2p(P2POp::Kind::Send, to_next, next, 1), p2p(P2POp::Kind::Send, to_prev, prev, 2),
              p2p(P2POp::Kind::Recv, from_prev, prev, 1),
              p2p(P2POp::Kind::Recv, from_next, next, 2)});
      for (const WorkPtr& w : works) finish(w, true);
      CHECK_MATCH(from_prev, at::kFloat, exact(all_next[static_cast<size_t>(prev)]));
      CHECK_MATCH(from_next, at::kBFloat16, exact(all_prev[static_cast<size_t>(next)]));
      CHECK_MATCH(to_next, at::kFloat, exact(all_next[static_cast<size_t>(g.rank())]));
      CHECK_MATCH(to_prev, at::kBFloat16, exact(all_prev[static_cast<size_t>(g.rank())]));
    }
  }
}

// 1F1B's fused exchange: a send and a receive with the same peer in one
// batch, listed send-first on even ranks and receive-first on odd ones,
// three times in a row (three microbatches).
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_send_and_recv_with_one_peer) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() % 2 != 0) continue;  // pairs (0,1), (2,3)
    const int peer = g.rank() ^ 1;
    for (int mb = 0; mb < 3; ++mb) {
      BOOST_TEST_CONTEXT("group " << tg.label << " (group rank " << g.rank() << "), round " << mb) {
        const at::Tensor out = make_input(at::kFloat, kBigNumel, g.rank(), 20 + mb).to(spmd::device());
        const std::vector<at::Tensor> all = exchange(g, out);
        at::Tensor in = filled({kBigNumel}, at::kFloat);
        const P2POp send = p2p(P2POp::Kind::Send, out, peer, mb);
        const P2POp recv = p2p(P2POp::Kind::Recv, in, peer, mb);
        const bool send_first = g.rank() % 2 == 0;
        const std::vector<WorkPtr> works =
            counted_batch(g, send_first ? std::vector<P2POp>{send, recv} : std::vector<P2POp>{recv, send});
        for (const WorkPtr& w : works) finish(w, true);
        CHECK_MATCH(in, at::kFloat, exact(all[static_cast<size_t>(peer)]));
        CHECK_MATCH(out, at::kFloat, exact(all[static_cast<size_t>(g.rank())]));
      }
    }
  }
}

// The Works come back in the order of the ops, not the order they are
// posted in (receives first): rank 0 lists [send to 1, receive from 1];
// rank 1 receives, says so, and sends only when told. Until then rank 0's
// works[0] (its send) completes and works[1] (its receive) cannot.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_works_in_the_order_given,
                     *spmd::needs_device(c10::kCPU, "NCCL completes a batch together: its ops "
                                                    "share one Work")) {
  constexpr int kSignalTag = 13;
  auto g = fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size()}).get_group(0);
  const int me = g->rank();
  const at::Tensor big = make_input(at::kFloat, kBigNumel, 0, 30);
  const at::Tensor small = make_input(at::kFloat, 17, 1, 31);
  if (me == 0) {
    at::Tensor in = filled({17}, at::kFloat);
    const std::vector<WorkPtr> works = counted_batch(
        *g, {p2p(P2POp::Kind::Send, big, 1, 3), p2p(P2POp::Kind::Recv, in, 1, 4)});
    BOOST_TEST_REQUIRE(works.size() == 2u);
    MPI_Recv(nullptr, 0, MPI_BYTE, g->world_ranks()[1], kSignalTag, g_ref_comm,
             MPI_STATUS_IGNORE);  // rank 1 has received `big`
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!works[0]->is_completed() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    BOOST_TEST(works[0]->is_completed(), "works[0] (the send) did not complete");
    BOOST_TEST(!works[1]->is_completed(), "works[1] (the receive) completed before its send");
    MPI_Send(nullptr, 0, MPI_BYTE, g->world_ranks()[1], kSignalTag, g_ref_comm);  // go
    for (const WorkPtr& w : works) finish(w, true);
    CHECK_MATCH(in, at::kFloat, exact(small));
  } else if (me == 1) {
    at::Tensor in = filled({kBigNumel}, at::kFloat);
    for (const WorkPtr& w : counted_batch(*g, {p2p(P2POp::Kind::Recv, in, 0, 3)})) finish(w, true);
    CHECK_MATCH(in, at::kFloat, exact(big));
    MPI_Send(nullptr, 0, MPI_BYTE, g->world_ranks()[0], kSignalTag, g_ref_comm);
    MPI_Recv(nullptr, 0, MPI_BYTE, g->world_ranks()[0], kSignalTag, g_ref_comm,
             MPI_STATUS_IGNORE);
    for (const WorkPtr& w : counted_batch(*g, {p2p(P2POp::Kind::Send, small, 0, 4)})) {
      finish(w, true);
    }
  }
}

// While a labelled receive waits for a sender that has not posted yet,
// describe_pending_collectives() shows its label; once it completed, not.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_label_while_pending) {
  const std::string label = "pp stage 1 -> 0 gradient of microbatch 3 (label test)";
  auto g = fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size()}).get_group(0);
  const at::Tensor data = make_input(at::kFloat, 33, 1, 32).to(spmd::device());
  at::Tensor in = filled({33}, at::kFloat);
  // A first exchange between ranks 0 and 1 sets up whatever the pair needs
  // (NCCL: its communicator), so the receive below only waits for data.
  if (g->rank() < 2) {
    at::Tensor warm_in = filled({2}, at::kFloat);
    const at::Tensor warm_out = at::ones({2}, warm_in.options());
    const int other = 1 - g->rank();
    for (const WorkPtr& w : counted_batch(*g, {p2p(P2POp::Kind::Send, warm_out, other, 6),
                                               p2p(P2POp::Kind::Recv, warm_in, other, 6)})) {
      finish(w, true);
    }
  }
  std::vector<WorkPtr> works;
  if (g->rank() == 0) {
    works = counted_batch(*g, {p2p(P2POp::Kind::Recv, in, 1, 5, label)});
    const std::string pending = fsdp::describe_pending_collectives();
    BOOST_TEST(pending.find(label) != std::string::npos, "pending: " << pending);
    BOOST_TEST(pending.find("recv") != std::string::npos, "pending: " << pending);
  }
  MPI_Barrier(g_ref_comm);  // rank 1 sends only now
  if (g->rank() == 1) {
    works = counted_batch(*g, {p2p(P2POp::Kind::Send, data, 0, 5, "the sender's label")});
  }
  for (const WorkPtr& w : works) finish(w, true);
  if (g->rank() == 0) {
    CHECK_MATCH(in, at::kFloat, exact(data));
    const std::string pending = fsdp::describe_pending_collectives();
    BOOST_TEST(pending.find(label) == std::string::npos, "still pending: " << pending);
  }
}

namespace {

// `call` throws exactly E naming `argument` (argument() and, quoted, what()).
template <typename E>
void expect_batch_error(const std::string& label, const std::string& argument,
                        const std::function<void()>& call) {
  BOOST_TEST_CONTEXT(label) {
    try {
      call();
      BOOST_ERROR("no exception");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_CHECK_MESSAGE(typeid(e) == typeid(E), "threw another ArgumentError type: " << e.what());
      BOOST_CHECK_MESSAGE(e.argument() == argument,
                          "argument() is '" << e.argument() << "', expected '" << argument << "'");
      BOOST_CHECK_MESSAGE(std::string(e.what()).find("'" + argument + "'") != std::string::npos,
                          "what() does not name '" << argument << "': " << e.what());
    } catch (const std::exception& e) {
      BOOST_ERROR("threw a non-ArgumentError: " << e.what());
    }
  }
}

// Batches that are invalid in one op (the last): a bad peer, an undefined
// tensor, a non-contiguous tensor, a bad tag -- after valid ones.
std::vector<std::pair<std::string, std::vector<P2POp>>> rejected_batches(const ProcessGroup& g) {
  using K = P2POp::Kind;
  const int peer = (g.rank() + 1) % g.size();
  const at::Tensor t = at::ones({6}, at::TensorOptions(at::kFloat).device(spmd::device()));
  const at::Tensor nc = at::ones({4, 6}, t.options()).t();
  return {
      {"bad peer in ops[1]", {p2p(K::Send, t, peer, 0), p2p(K::Recv, t.clone(), g.size() + 3, 0)}},
      {"undefined tensor in ops[1]", {p2p(K::Send, t, peer, 0), p2p(K::Recv, at::Tensor(), peer, 0)}},
      {"non-contiguous in ops[2]",
       {p2p(K::Recv, t.clone(), peer, 0), p2p(K::Send, t, peer, 0), p2p(K::Recv, nc, peer, 1)}},
      {"tag 32768 in ops[1]", {p2p(K::Send, t, peer, 0), p2p(K::Send, t, peer, 32768)}},
  };
}

// The group still exchanges correctly (nothing half-issued is left behind).
void check_batch_still_works(ProcessGroup& g) {
  using K = P2POp::Kind;
  const int next = (g.rank() + 1) % g.size();
  const int prev = (g.rank() + g.size() - 1) % g.size();
  const at::Tensor out = make_input(at::kFloat, 7, g.rank(), 40).to(spmd::device());
  const std::vector<at::Tensor> all = exchange(g, out);
  at::Tensor in = filled({7}, at::kFloat);
  for (const WorkPtr& w : counted_batch(g, {p2p(K::Send, out, next, 0), p2p(K::Recv, in, prev, 0)})) {
    finish(w, true);
  }
  CHECK_MATCH(in, at::kFloat, exact(all[static_cast<size_t>(prev)]));
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_errors) {
  using K = P2POp::Kind;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;  // ops[0] below needs a valid peer
    const int peer = (g.rank() + 1) % g.size();
    const at::Tensor t = at::ones({6}, at::TensorOptions(at::kFloat).device(spmd::device()));
    const at::Tensor nc = at::ones({4, 6}, t.options()).t();  // not contiguous
    BOOST_TEST_CONTEXT("group " << tg.label) {
      const fsdp::CollectiveCounters before = fsdp::collective_counters();
      BOOST_TEST(g.batch_isend_irecv({}).empty());
      BOOST_TEST(all_counts(fsdp::collective_counters()) == all_counts(before));

      expect_batch_error<fsdp::ArgumentError>("peer == size", "ops[0].peer", [&] {
        g.batch_isend_irecv({p2p(K::Send, t, g.size(), 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("peer -1", "ops[0].peer", [&] {
        g.batch_isend_irecv({p2p(K::Recv, t.clone(), -1, 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("peer out of range in ops[1]", "ops[1].peer", [&] {
        g.batch_isend_irecv({p2p(K::Send, t, peer, 0), p2p(K::Recv, t.clone(), g.size() + 3, 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("undefined tensor", "ops[0].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Recv, at::Tensor(), peer, 0)});
      });
      expect_batch_error<fsdp::ArgumentError>("undefined tensor in ops[1]", "ops[1].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Send, t, peer, 0), p2p(K::Recv, at::Tensor(), peer, 0)});
      });
      expect_batch_error<fsdp::LayoutError>("non-contiguous", "ops[0].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Send, nc, peer, 0)});
      });
      expect_batch_error<fsdp::LayoutError>("non-contiguous in ops[2]", "ops[2].tensor", [&] {
        g.batch_isend_irecv({p2p(K::Recv, t.clone(), peer, 0), p2p(K::Send, t, peer, 0),
                             p2p(K::Recv, nc, peer, 1)});
      });
      check_batch_still_works(g);
    }
  }
}

// "Errors as for send/recv, naming ops[i]" (comm.h): a bad tag too.
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_bad_tag_names_the_op) {
  using K = P2POp::Kind;
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;
    const int peer = (g.rank() + 1) % g.size();
    const at::Tensor t = at::ones({6}, at::TensorOptions(at::kFloat).device(spmd::device()));
    BOOST_TEST_CONTEXT("group " << tg.label) {
      for (const int tag : {32768, -1}) {
        try {
          g.batch_isend_irecv({p2p(K::Send, t, peer, 0), p2p(K::Send, t, peer, tag)});
          BOOST_ERROR("tag " << tag << ": no exception");
        } catch (const fsdp::ArgumentError& e) {
          const std::string msg = e.what();
          BOOST_TEST(msg.find("ops[1]") != std::string::npos, "does not name ops[1]: " << msg);
          BOOST_TEST(msg.find(std::to_string(tag)) != std::string::npos,
                     "does not quote the tag: " << msg);
        }
      }
      check_batch_still_works(g);
    }
  }
}

// A rejected batch issues and counts nothing -- also when the bad op comes
// after valid ones (the counters count collectives as they are issued).
BOOST_AUTO_TEST_CASE(test_batch_isend_irecv_rejected_batch_counts_nothing) {
  for (const TestGroup& tg : test_groups()) {
    ProcessGroup& g = *tg.group;
    if (g.size() < 2) continue;
    for (const auto& batch : rejected_batches(g)) {
      const std::string& label = batch.first;
      const std::vector<P2POp>& ops = batch.second;
      BOOST_TEST_CONTEXT("group " << tg.label << ", " << label) {
        const fsdp::CollectiveCounters before = fsdp::collective_counters();
        BOOST_CHECK_THROW(g.batch_isend_irecv(ops), fsdp::ArgumentError);
        const fsdp::CollectiveCounters after = fsdp::collective_counters();
        BOOST_TEST(all_counts(after) == all_counts(before),
                   "the rejected batch was counted: " << all_counts(after) - all_counts(before)
                                                      << " ops");
        BOOST_TEST(after.sequence.size() == before.sequence.size());
      }
    }
    check_batch_still_works(g);
  }
}
