// fsdp::memory_report and FSDPModule::memory: what each unit holds now, by
// category; and the out-of-memory errors of fully_shard's own allocations
// (sharding/memory_guard.h), which report the same totals.
#include "fsdp/memory.h"

#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/optim_state.h"
#include "fsdp/runtime.h"
#include "fsdp/trace.h"
#include "comm/watchdog.h"
#include "sharding/memory_guard.h"
#include "sharding/registry.h"
#include "sharding/state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#ifdef FSDP_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstdio>
#include <iomanip>
#include <sstream>
#include <unordered_set>

namespace fsdp {
namespace detail {
// memory_tracking.cpp
std::optional<int64_t> tracked_live_if_installed();
std::optional<int64_t> tracked_peak_if_installed();
}  // namespace detail

namespace {

// Counts each storage once across a whole report: views of one buffer (a
// fused all-gather output and its parameters, a shard and the parameter
// pointing at it) share a StorageImpl.
class StorageCounter {
 public:
  int64_t bytes(const at::Tensor& t) {
    // A meta tensor (fsdp::MetaInit's shards before materialize()) has a
    // storage size but no memory.
    if (!t.defined() || !t.has_storage() || t.is_meta()) return 0;
    const void* impl = t.storage().unsafeGetStorageImpl();
    if (!seen_.insert(impl).second) return 0;
    return static_cast<int64_t>(t.storage().nbytes());
  }

 private:
  std::unordered_set<const void*> seen_;
};

// Every tensor an optimizer keeps for one parameter (the state kinds of
// LibTorch's optimizers; a kind it does not know counts nothing).
std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& s) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<const AdamWParamState*>(&s)) {
    return {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  }
  if (auto* a = dynamic_cast<const AdamParamState*>(&s)) {
    return {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  }
  if (auto* m = dynamic_cast<const SGDParamState*>(&s)) return {m->momentum_buffer()};
  if (auto* g = dynamic_cast<const AdagradParamState*>(&s)) return {g->sum()};
  if (auto* r = dynamic_cast<const RMSpropParamState*>(&s)) {
    return {r->square_avg(), r->momentum_buffer(), r->grad_avg()};
  }
  return {};
}

int64_t optimizer_bytes_of(const torch::optim::Optimizer& opt, const at::Tensor& param,
                           StorageCounter& counter) {
  const auto& state = opt.state();
  auto it = state.find(optimizer_state_key(opt, param));
  if (it == state.end() || !it->second) return 0;
  int64_t n = 0;
  for (const auto& t : state_tensors(*it->second)) n += counter.bytes(t);
  return n;
}

UnitMemory measure_unit(UnitState& unit, const torch::optim::Optimizer* opt,
                        StorageCounter& counter) {
  UnitMemory m;
  m.unit = unit.label();
  for (const auto& group : unit.groups) {
    // Shards first: a parameter whose full tensor is its shard (one rank)
    // then counts nothing as unsharded.
    for (const auto& p : group.params()) m.shard_bytes += counter.bytes(p.shard_storage());
    for (const auto& p : group.params()) {
      m.unsharded_bytes += counter.bytes(p.unsharded_buffer());
      // Sharded gradients (the fp32 main gradient is also installed as the
      // parameter's gradient: the same storage, counted once). While the
      // parameter is unsharded, its .grad() is autograd's full gradient.
      m.grad_bytes += counter.bytes(p.main_grad()) + counter.bytes(p.stashed_grad());
      if (p.unsharded()) {
        m.reduce_buffer_bytes += counter.bytes(p.param().grad());
      } else {
        m.grad_bytes += counter.bytes(p.param().grad());
      }
      m.reduce_buffer_bytes += counter.bytes(p.pass_grad()) + counter.bytes(p.unsynced_grad());
      if (opt != nullptr) m.optimizer_bytes += optimizer_bytes_of(*opt, p.param(), counter);
    }
    m.unsharded_bytes += counter.bytes(group.fused_gather_out());
    for (const auto& t : group.post_forward_pieces()) m.unsharded_bytes += counter.bytes(t);
    for (const auto& t : group.reduce_buffers()) m.reduce_buffer_bytes += counter.bytes(t);
    for (const auto& lg : group.local_grads()) m.reduce_buffer_bytes += counter.bytes(lg.second);
    for (const auto& t : group.partial_sums()) m.reduce_buffer_bytes += counter.bytes(t);
    for (const auto& t : group.base_grads()) m.reduce_buffer_bytes += counter.bytes(t);
  }
  return m;
}

void add_to(UnitMemory& total, const UnitMemory& m) {
  total.shard_bytes += m.shard_bytes;
  total.unsharded_bytes += m.unsharded_bytes;
  total.grad_bytes += m.grad_bytes;
  total.reduce_buffer_bytes += m.reduce_buffer_bytes;
  total.optimizer_bytes += m.optimizer_bytes;
}

CudaMemoryStats cuda_stats(const std::vector<std::shared_ptr<UnitState>>& units) {
  CudaMemoryStats s;
#ifdef FSDP_WITH_NCCL
  int device = -1;
  for (const auto& u : units) {
    for (const auto& g : u->groups) {
      for (const auto& p : g.params()) {
        if (p.compute_device().is_cuda()) device = p.compute_device().index();
      }
    }
  }
  if (device < 0) return s;
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto stats = alloc::getDeviceStats(device);
  // StatType::AGGREGATE (all pools): index 0 in every LibTorch; the enum
  // itself moved namespaces in 2.x (c10::CachingAllocator).
  constexpr size_t agg = 0;
  s.available = true;
  s.device = device;
  s.allocated_bytes = stats.allocated_bytes[agg].current;
  s.reserved_bytes = stats.reserved_bytes[agg].current;
  s.peak_allocated_bytes = stats.allocated_bytes[agg].peak;
#else
  (void)units;  // a CPU-only build: no CUDA tensors to account
#endif
  return s;
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1024.0 * 1024.0);
  return os.str();
}

}  // namespace

MemoryReport memory_report(const torch::nn::Module& root, const torch::optim::Optimizer* optimizer) {
  MemoryReport r;
  r.totals.unit = "total";
  StorageCounter counter;
  std::vector<std::shared_ptr<UnitState>> units;
  std::unordered_set<const UnitState*> done;
  // named_modules() is not const in LibTorch; it only reads.
  auto& mutable_root = const_cast<torch::nn::Module&>(root);
  for (const auto& item : mutable_root.named_modules("", /*include_self=*/true)) {
    auto unit = detail::unit_for_module(*item.value());
    if (!unit || !done.insert(unit.get()).second) continue;
    units.push_back(unit);
    r.units.push_back(measure_unit(*unit, optimizer, counter));
    add_to(r.totals, r.units.back());
  }
  if (optimizer != nullptr) {
    UnitMemory outside;
    outside.unit = "(not sharded)";
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        if (!detail::is_managed(p)) outside.optimizer_bytes += optimizer_bytes_of(*optimizer, p, counter);
      }
    }
    if (outside.optimizer_bytes > 0) {
      r.units.push_back(outside);
      add_to(r.totals, outside);
    }
  }
  r.tracked_live_bytes = detail::tracked_live_if_installed();
  r.peak_allocated_bytes = detail::tracked_peak_if_installed();
  r.cuda = cuda_stats(units);
  return r;
}

UnitMemory FSDPModule::memory() const {
  StorageCounter counter;
  return measure_unit(unit(), nullptr, counter);
}

std::string to_string(const MemoryReport& report) {
  size_t width = 5;
  for (const auto& u : report.units) width = std::max(width, u.unit.size());
  std::ostringstream os;
  auto row = [&](const std::string& name, const std::vector<std::string>& cells) {
    os << std::left << std::setw(static_cast<int>(width)) << name << std::right;
    for (const auto& c : cells) os << "  " << std::setw(10) << c;
    os << "\n";
  };
  row("unit (MiB)", {"shard", "unsharded", "grad", "reduce", "optimizer", "total"});
  auto cells = [](const UnitMemory& u) {
    return std::vector<std::string>{mib(u.shard_bytes),     mib(u.unsharded_bytes),
                                    mib(u.grad_bytes),      mib(u.reduce_buffer_bytes),
                                    mib(u.optimizer_bytes), mib(u.total())};
  };
  for (const auto& u : report.units) row(u.unit, cells(u));
  row(report.totals.unit, cells(report.totals));
  if (report.tracked_live_bytes) {
    os << "tracked CPU allocator: live " << mib(*report.tracked_live_bytes) << " MiB, peak "
       << mib(report.peak_allocated_bytes.value_or(0)) << " MiB\n";
  }
  if (report.cuda.available) {
    os << "CUDA device " << report.cuda.device << ": allocated " << mib(report.cuda.allocated_bytes)
       << " MiB, reserved " << mib(report.cuda.reserved_bytes) << " MiB, peak allocated "
       << mib(report.cuda.peak_allocated_bytes) << " MiB\n";
  }
  return os.str();
}

namespace detail {

void trace_unit_memory(UnitState& unit) {
  if (!trace::enabled()) return;
  StorageCounter counter;
  const UnitMemory m = measure_unit(unit, nullptr, counter);
  trace::detail::counter("memory " + m.unit, "fsdp-memory",
                         {{"shard", m.shard_bytes},
                          {"unsharded", m.unsharded_bytes},
                          {"grad", m.grad_bytes},
                          {"reduce_buffer", m.reduce_buffer_bytes}});
}

bool is_out_of_memory(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  const std::string& m = e.msg();
  return m.find("not enough memory") != std::string::npos ||
         m.find("can't allocate memory") != std::string::npos ||
         m.find("out of memory") != std::string::npos;
}

void raise_out_of_memory(const char* op, int64_t bytes_requested, const std::string& cause) {
  const int64_t unit_id = trace::detail::current_unit();
  std::string unit = trace::detail::unit_label(unit_id);
  if (unit.empty() && unit_id >= 0) unit = "unit " + std::to_string(unit_id);
  // What this rank's units hold now (no optimizer: it is not known here).
  StorageCounter counter;
  UnitMemory held;
  for (const auto& u : live_units()) add_to(held, measure_unit(*u, nullptr, counter));
  const int rank = Runtime::alive() ? Runtime::get().world_rank() : 0;
  // The cause's first line: c10's messages go on with a C++ backtrace.
  const std::string first = cause.substr(0, cause.find('\n'));
  std::ostringstream os;
  os << "out of memory on rank " << rank << " in " << op << " of FSDP unit '" << unit << "': "
     << bytes_requested << " B requested, " << held.total() << " B held by this rank's units ("
     << "shards " << held.shard_bytes << ", unsharded " << held.unsharded_bytes << ", gradients "
     << held.grad_bytes << ", reduce buffers " << held.reduce_buffer_bytes << "): " << first;
  const std::string what = os.str();
  // The other ranks wait (or will) in a collective this rank cannot issue.
  announce_fatal_error("OutOfMemoryError: " + what);
  throw OutOfMemoryError(unit, op, bytes_requested, held.total(), what);
}

}  // namespace detail
}  // namespace fsdp
