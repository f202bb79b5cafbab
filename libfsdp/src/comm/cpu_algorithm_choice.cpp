// The CPU collective settings (set_cpu_collectives) and the algorithm each
// collective runs under them (cpu::choose); the algorithms themselves are
// cpu_algorithms.h's.
#include "comm/cpu_collectives.h"

#include "comm/cpu_reduce.h"
#include "fsdp/cpu_collectives.h"
#include "fsdp/errors.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

std::string to_string(CpuAlgorithm a) {
  switch (a) {
    case CpuAlgorithm::Auto: return "auto";
    case CpuAlgorithm::Mpi: return "mpi";
    case CpuAlgorithm::Ring: return "ring";
    case CpuAlgorithm::Pairwise: return "pairwise";
    case CpuAlgorithm::Shm: return "shm";
    case CpuAlgorithm::TwoLevel: return "two_level";
  }
  return "unknown";
}

CpuAlgorithm parse_cpu_algorithm(const std::string& text, const std::string& argument) {
  for (CpuAlgorithm a : {CpuAlgorithm::Auto, CpuAlgorithm::Mpi, CpuAlgorithm::Ring,
                         CpuAlgorithm::Pairwise, CpuAlgorithm::Shm, CpuAlgorithm::TwoLevel}) {
    if (text == to_string(a)) return a;
  }
  throw ArgumentError(argument, "'" + argument + "' = '" + text +
                                    "'; accepted: auto, mpi, ring, pairwise, shm, two_level");
}

namespace {
std::mutex g_settings_mu;
CpuCollectives g_settings;
}  // namespace

void set_cpu_collectives(const CpuCollectives& settings) {
  CpuCollectives checked = settings;
  for (const auto& [name, value] : detail::cpu::thresholds(checked)) {
    if (*value < 0) {
      throw ArgumentError(name, std::string("set_cpu_collectives: '") + name + "' = " +
                                    std::to_string(*value) + "; accepted: 0 or more bytes");
    }
  }
  std::lock_guard<std::mutex> lock(g_settings_mu);
  g_settings = settings;
}

CpuCollectives cpu_collectives() {
  std::lock_guard<std::mutex> lock(g_settings_mu);
  return g_settings;
}

namespace {
std::string bytes_text(int64_t b) {
  if (b >= (1 << 20) && b % (1 << 20) == 0) return std::to_string(b >> 20) + "M";
  if (b >= (1 << 10) && b % (1 << 10) == 0) return std::to_string(b >> 10) + "K";
  return std::to_string(b) + "B";
}
}  // namespace

std::string to_string(const CpuCollectives& s) {
  if (s.algorithm != CpuAlgorithm::Auto) return to_string(s.algorithm);
  auto band = [](int64_t from, int64_t below) {
    return bytes_text(from) + ".." + bytes_text(below);
  };
  return "auto (per-peer block; on one node shm for all-gather " +
         band(s.all_gather_shm_min_bytes, s.all_gather_shm_max_bytes) + ", reduce-scatter " +
         band(s.reduce_scatter_shm_min_bytes, s.reduce_scatter_shm_max_bytes) +
         ", all-reduce " + band(s.all_reduce_shm_min_bytes, s.all_reduce_shm_max_bytes) +
         " and for shared-memory operands; else pairwise from all-gather " +
         bytes_text(s.all_gather_min_bytes) + ", reduce-scatter " +
         bytes_text(s.reduce_scatter_min_bytes) + ", all-reduce " +
         bytes_text(s.all_reduce_min_bytes) + ", 16-bit reductions " +
         bytes_text(s.half_reduce_min_bytes) + ", Open MPI's below; across nodes two_level from " +
         bytes_text(s.two_level_min_bytes) + ")";
}

}  // namespace fsdp

namespace fsdp::detail::cpu {

std::vector<std::pair<const char*, int64_t*>> thresholds(CpuCollectives& s) {
  return {{"all_gather_min_bytes", &s.all_gather_min_bytes},
          {"reduce_scatter_min_bytes", &s.reduce_scatter_min_bytes},
          {"all_reduce_min_bytes", &s.all_reduce_min_bytes},
          {"half_reduce_min_bytes", &s.half_reduce_min_bytes},
          {"all_gather_shm_min_bytes", &s.all_gather_shm_min_bytes},
          {"all_gather_shm_max_bytes", &s.all_gather_shm_max_bytes},
          {"reduce_scatter_shm_min_bytes", &s.reduce_scatter_shm_min_bytes},
          {"reduce_scatter_shm_max_bytes", &s.reduce_scatter_shm_max_bytes},
          {"all_reduce_shm_min_bytes", &s.all_reduce_shm_min_bytes},
          {"all_reduce_shm_max_bytes", &s.all_reduce_shm_max_bytes},
          {"two_level_min_bytes", &s.two_level_min_bytes}};
}

Choice choose(Collective op, c10::ScalarType dtype, int64_t block_bytes, int size,
              bool has_arena, bool has_two_level) {
  if (size == 1) return {};
  const CpuCollectives s = cpu_collectives();
  if (s.algorithm != CpuAlgorithm::Auto) {
    // Shm and TwoLevel where their structure is missing: pairwise, which
    // both fall back to (and whose order shm shares).
    const bool missing = (s.algorithm == CpuAlgorithm::Shm && !has_arena) ||
                         (s.algorithm == CpuAlgorithm::TwoLevel && !has_two_level);
    const CpuAlgorithm a = missing ? CpuAlgorithm::Pairwise : s.algorithm;
    return {a, a};
  }
  // A group spanning nodes has no arena of its own (has_arena is false), so
  // the shared choice never applies there.
  if (has_two_level && block_bytes >= s.two_level_min_bytes) {
    return {CpuAlgorithm::TwoLevel, CpuAlgorithm::TwoLevel};
  }
  const bool gather = op == Collective::AllGather;
  int64_t from = gather                             ? s.all_gather_min_bytes
                 : op == Collective::ReduceScatter ? s.reduce_scatter_min_bytes
                                                   : s.all_reduce_min_bytes;
  if (!gather && acc_type(dtype) != dtype) from = s.half_reduce_min_bytes;
  Choice c;
  c.plain = block_bytes >= from ? CpuAlgorithm::Pairwise : CpuAlgorithm::Mpi;
  c.shared = c.plain;
  if (!has_arena) return c;
  const auto [shm_from, shm_below] =
      gather ? std::pair(s.all_gather_shm_min_bytes, s.all_gather_shm_max_bytes)
      : op == Collective::ReduceScatter
          ? std::pair(s.reduce_scatter_shm_min_bytes, s.reduce_scatter_shm_max_bytes)
          : std::pair(s.all_reduce_shm_min_bytes, s.all_reduce_shm_max_bytes);
  if (block_bytes >= shm_from && block_bytes < shm_below) c.plain = CpuAlgorithm::Shm;
  // All-reduce overwrites its operand, so shm stages it wherever it lives.
  c.shared = op == Collective::AllReduce ? c.plain : CpuAlgorithm::Shm;
  return c;
}

}  // namespace fsdp::detail::cpu
