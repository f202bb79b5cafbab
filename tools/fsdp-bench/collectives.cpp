// fsdp-bench collectives: bandwidth of libfsdp's ProcessGroup collectives
// under each CPU algorithm (fsdp::CpuAlgorithm) against the raw MPI calls and
// against the machine's limit, nccl-tests style.
//
// The libfsdp columns and raw MPI run on the same buffers, interleaved call
// by call, so load from other processes and frequency changes hit them
// alike. The limit (memcpy and add of the bytes one rank must receive) is
// timed right after each size's collectives, on buffers of its own.
#include "harness.h"

#include "fsdp/comm.h"
#include "fsdp/mesh.h"

#include <ATen/ops/zeros.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>

namespace fsdp_bench {
namespace {

constexpr int64_t kMiB = 1024 * 1024;
// The MPI backend takes int element counts; 2 GiB keeps every dtype below
// that per call.
constexpr int64_t kMaxBytes = 2048 * kMiB;
// The project's goal for auto: all-gather and reduce-scatter from 1 MiB up
// (where per-call overhead should be negligible) within this multiple of
// the machine's limit at world size <= 2, and of the looser one beyond, where
// every rank exchanges with more peers.
constexpr double kTargetSmallWorld = 2.0;
constexpr double kTargetLargeWorld = 3.0;
// The libfsdp columns, in table order.
constexpr fsdp::CpuAlgorithm kAlgorithms[] = {fsdp::CpuAlgorithm::Mpi, fsdp::CpuAlgorithm::Ring,
                                              fsdp::CpuAlgorithm::Pairwise,
                                              fsdp::CpuAlgorithm::Shm,
                                              fsdp::CpuAlgorithm::TwoLevel,
                                              fsdp::CpuAlgorithm::Auto};
// Flat algorithms that two_level is compared with, in its ratio columns.
constexpr fsdp::CpuAlgorithm kFlat[] = {fsdp::CpuAlgorithm::Mpi, fsdp::CpuAlgorithm::Ring,
                                        fsdp::CpuAlgorithm::Pairwise, fsdp::CpuAlgorithm::Shm};

struct Options {
  int64_t min_bytes = 1024;
  int64_t max_bytes = 256 * kMiB;
  int step_factor = 2;
  TimingOptions timing;
  std::vector<std::string> ops{"all_gather", "reduce_scatter", "all_reduce"};
  std::vector<std::string> algorithms{"mpi", "ring", "pairwise", "shm", "auto"};
  std::string dtype = "float32";
  std::string json_path;
  bool shared_inputs = false;
};

struct Collective {
  const char* mpi_call;
  const char* library_call;
  bool reduces;
  // nccl-tests: busbw = algbw * factor(n) is the per-link traffic of an
  // optimal ring, comparable across collectives and world sizes.
  double (*bus_factor)(int n);
  // The machine's limit, in passes over the (n-1)/n of the size that one
  // rank must receive: memcpys (the transfer) and adds (the reduction).
  // all_reduce is a reduce-scatter then an all-gather of the same size.
  int limit_copies;
  int limit_adds;
};

const std::map<std::string, Collective>& collectives() {
  static const std::map<std::string, Collective> table{
      {"all_gather", {"MPI_Allgather (MPI_IN_PLACE)",
                      "all_gather_into_tensor in place (input = this rank's block of output, "
                      "as fully_shard gathers)",
                      false,
                      [](int n) { return static_cast<double>(n - 1) / n; }, 1, 0}},
      {"reduce_scatter", {"MPI_Reduce_scatter_block", "reduce_scatter_tensor", true,
                          [](int n) { return static_cast<double>(n - 1) / n; }, 1, 1}},
      {"all_reduce", {"MPI_Allreduce", "all_reduce", true,
                      [](int n) { return 2.0 * (n - 1) / n; }, 2, 1}},
  };
  return table;
}

const std::map<std::string, c10::ScalarType>& dtypes() {
  static const std::map<std::string, c10::ScalarType> table{
      {"float32", c10::kFloat}, {"float64", c10::kDouble}, {"bfloat16", c10::kBFloat16},
      {"float16", c10::kHalf},  {"int32", c10::kInt},      {"int64", c10::kLong},
  };
  return table;
}

void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw std::runtime_error(fmt::format("{} returned {}", call, rc));
}

// Widen to float32 and round once, as the library's 16-bit sum does, so
// both sides do the same arithmetic.
template <typename T>
void sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// The MPI datatype and sum op for the raw calls. MPI has no 16-bit floats,
// and the library keeps its own 16-bit op private, so the raw side brings
// its own.
class RawTypes {
 public:
  explicit RawTypes(c10::ScalarType t) {
    switch (t) {
      case c10::kFloat: datatype_ = MPI_FLOAT; break;
      case c10::kDouble: datatype_ = MPI_DOUBLE; break;
      case c10::kInt: datatype_ = MPI_INT32_T; break;
      case c10::kLong: datatype_ = MPI_INT64_T; break;
      case c10::kBFloat16:
      case c10::kHalf:
        datatype_ = MPI_UINT16_T;
        check_mpi(MPI_Op_create(t == c10::kBFloat16 ? sum16<c10::BFloat16> : sum16<c10::Half>, 1,
                                &own_op_),
                  "MPI_Op_create");
        sum_ = own_op_;
        break;
      default: throw std::logic_error("RawTypes: dtype outside dtypes()");
    }
  }
  ~RawTypes() {
    if (own_op_ != MPI_OP_NULL) MPI_Op_free(&own_op_);
  }
  RawTypes(const RawTypes&) = delete;
  RawTypes& operator=(const RawTypes&) = delete;

  MPI_Datatype datatype() const { return datatype_; }
  MPI_Op sum() const { return sum_; }

 private:
  MPI_Datatype datatype_ = MPI_DATATYPE_NULL;
  MPI_Op sum_ = MPI_SUM;
  MPI_Op own_op_ = MPI_OP_NULL;
};

// One collective at one size: its buffers, held by the closures, and the
// ways to run it. `ours` runs whichever CpuAlgorithm is set when it is called.
struct Case {
  int64_t bytes = 0;
  int64_t count = 0;
  std::function<void()> ours, raw;
};

// `requested` bytes rounded down so that every rank gets whole elements;
// count 0 means the size is too small for this world.
// shared: the reduce-scatter input, all-gather output and all-reduce tensor
// come from the group's empty_for_collectives (shared memory on one node),
// as fully_shard's reduce-scatter inputs do.
Case make_case(const std::string& op, int64_t requested, c10::ScalarType dtype,
               const RawTypes& raw, MPI_Comm comm, bool shared) {
  const fsdp::ProcessGroupPtr pg = fsdp::world_group();
  const int n = pg->size();
  const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
  const auto opts = c10::TensorOptions().dtype(dtype);
  const auto zeros = [&](int64_t numel) {
    return shared ? pg->empty_for_collectives({numel}, opts).zero_() : at::zeros({numel}, opts);
  };
  Case c;
  c.count = requested / elem;
  // Zeros: sums of zeros stay zero, so repeated in-place reductions never
  // reach inf or denormals, whose arithmetic would time differently.
  if (op == "all_reduce") {
    at::Tensor t = zeros(c.count);
    const int count = static_cast<int>(c.count);
    c.ours = [pg, t] { pg->all_reduce(t, fsdp::ReduceOp::SUM); };
    c.raw = [t, count, &raw, comm] {
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), count, raw.datatype(), raw.sum(), comm),
                "MPI_Allreduce");
    };
  } else {
    c.count -= c.count % n;
    const int64_t block = c.count / n;
    const bool gather = op == "all_gather";
    at::Tensor whole = zeros(c.count);
    // all_gather in place: each rank's input is its block of the output.
    at::Tensor part = gather ? whole.narrow(0, block * pg->rank(), block) : at::zeros({block}, opts);
    const int count = static_cast<int>(block);
    if (gather) {
      c.ours = [pg, whole, part] { pg->all_gather_into_tensor(whole, part); };
      c.raw = [whole, part, count, &raw, comm] {
        check_mpi(MPI_Allgather(MPI_IN_PLACE, count, raw.datatype(), whole.data_ptr(), count,
                                raw.datatype(), comm),
                  "MPI_Allgather");
      };
    } else {
      c.ours = [pg, whole, part] { pg->reduce_scatter_tensor(part, whole, fsdp::ReduceOp::SUM); };
      c.raw = [whole, part, count, &raw, comm] {
        check_mpi(MPI_Reduce_scatter_block(whole.data_ptr(), part.data_ptr(), count,
                                           raw.datatype(), raw.sum(), comm),
                  "MPI_Reduce_scatter_block");
      };
    }
  }
  c.bytes = c.count * elem;
  return c;
}

// dst += src in one thread, as a plain loop. GCC's -O2 (this file's build)
// vectorises only loops whose trip count is a multiple of the vector width,
// hence the fixed-size inner loop.
template <typename T, typename Add>
void add_loop(T* __restrict dst, const T* __restrict src, int64_t n, Add add) {
  constexpr int kChunk = 64;
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    T* __restrict d = dst + i;
    const T* __restrict s = src + i;
    for (int j = 0; j < kChunk; ++j) d[j] = add(d[j], s[j]);
  }
  for (; i < n; ++i) dst[i] = add(dst[i], src[i]);
}

// a + b on bfloat16 bits, rounded to nearest even as c10::BFloat16 does (bit
// for bit, NaN included) but branch-free: c10's conversion branches on NaN,
// which keeps GCC from vectorising the loop, and a scalar limit was slower
// than libfsdp's own reduction -- no limit at all.
uint16_t add_bfloat16(uint16_t a, uint16_t b) {
  const auto widen = [](uint16_t bits) {
    const uint32_t u = uint32_t{bits} << 16;
    float f = 0;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  const float sum = widen(a) + widen(b);
  uint32_t u = 0;
  std::memcpy(&u, &sum, sizeof u);
  const auto rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded;
}

template <typename T, typename Add = std::plus<T>>
void add_typed(const at::Tensor& dst, const at::Tensor& src, Add add = {}) {
  add_loop(static_cast<T*>(dst.data_ptr()), static_cast<const T*>(src.data_ptr()), dst.numel(),
           add);
}

// float16 stays scalar: c10::Half's conversions branch too, and it is rare
// on CPUs.
void add_into(const at::Tensor& dst, const at::Tensor& src) {
  switch (dst.scalar_type()) {
    case c10::kFloat: return add_typed<float>(dst, src);
    case c10::kDouble: return add_typed<double>(dst, src);
    case c10::kInt: return add_typed<int32_t>(dst, src);
    case c10::kLong: return add_typed<int64_t>(dst, src);
    case c10::kBFloat16: return add_typed<uint16_t>(dst, src, add_bfloat16);
    case c10::kHalf: return add_typed<c10::Half>(dst, src);
    default: throw std::logic_error("add_into: dtype outside dtypes()");
  }
}

// The machine's limit for `c` on `count` elements: its copies and adds over
// the (n-1)/n of them one rank must receive, on buffers of its own so that
// it never starts from data a collective left in cache.
std::function<void()> make_limit(const Collective& c, int64_t count, c10::ScalarType dtype,
                                 int n) {
  const int64_t received = count - count / n;
  const auto opts = c10::TensorOptions().dtype(dtype);
  // zeros() writes them, so no first-touch page fault lands in the timing.
  at::Tensor src = at::zeros({received}, opts);
  at::Tensor dst = at::zeros({received}, opts);
  return [&c, src, dst] {
    for (int i = 0; i < c.limit_copies; ++i) {
      std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    }
    for (int i = 0; i < c.limit_adds; ++i) add_into(dst, src);
  };
}

// Sets `algorithm` right before each call, so every closure of a round runs
// its own algorithm whatever ran before it.
std::function<void()> with_algorithm(fsdp::CpuAlgorithm algorithm,
                                     const fsdp::CpuCollectives& startup,
                                     std::function<void()> call) {
  fsdp::CpuCollectives settings = startup;
  settings.algorithm = algorithm;
  return [settings, call = std::move(call)] {
    fsdp::set_cpu_collectives(settings);
    call();
  };
}

// The libfsdp columns --algorithms picked, in kAlgorithms' order whatever
// order it lists them in, so that tables of different runs line up.
std::vector<fsdp::CpuAlgorithm> selected_algorithms(const std::vector<std::string>& names) {
  std::vector<fsdp::CpuAlgorithm> out;
  for (const fsdp::CpuAlgorithm a : kAlgorithms) {
    if (std::find(names.begin(), names.end(), fsdp::to_string(a)) != names.end()) {
      out.push_back(a);
    }
  }
  return out;
}

bool has(const std::vector<fsdp::CpuAlgorithm>& algorithms, fsdp::CpuAlgorithm a) {
  return std::find(algorithms.begin(), algorithms.end(), a) != algorithms.end();
}

bool has_auto(const std::vector<fsdp::CpuAlgorithm>& algorithms) {
  return has(algorithms, fsdp::CpuAlgorithm::Auto);
}

// The flat algorithms selected with two_level, each getting a column
// "<flat>/two_level" (time ratio: > 1, two_level is faster); none without
// two_level.
std::vector<fsdp::CpuAlgorithm> compared_with_two_level(
    const std::vector<fsdp::CpuAlgorithm>& algorithms) {
  std::vector<fsdp::CpuAlgorithm> out;
  if (!has(algorithms, fsdp::CpuAlgorithm::TwoLevel)) return out;
  for (const fsdp::CpuAlgorithm a : kFlat) {
    if (has(algorithms, a)) out.push_back(a);
  }
  return out;
}

// One timed side's columns; x_limit only for libfsdp's, which the target is
// about.
std::vector<Column> timing_columns(const std::string& key, const std::string& group,
                                   bool x_limit) {
  std::vector<Column> out{
      {key + "_time_us", "time", "(us)", 10, 1, group},
      {key + "_algbw_gbps", "algbw", "(GB/s)", 0, 2, group},
      {key + "_busbw_gbps", "busbw", "(GB/s)", 7, 2, group},
  };
  if (x_limit) out.push_back({key + "_x_limit", "x_limit", "(x)", 7, 2, group});
  out.push_back({key + "_min_us", "min", "(us)", 0, 1, group});
  out.push_back({key + "_max_us", "max", "(us)", 0, 1, group});
  return out;
}

// Cells for timing_columns(), in its order.
std::vector<Cell> timing_cells(const Stats& s, double gb, double bus_factor,
                               std::optional<double> x_limit) {
  const double algbw = gb / (s.median_us * 1e-6);
  std::vector<Cell> out{s.median_us, algbw, algbw * bus_factor};
  if (x_limit) out.emplace_back(*x_limit);
  out.emplace_back(s.min_us);
  out.emplace_back(s.max_us);
  return out;
}

// Only the selected algorithms' groups: a Report cell cannot be null, and a
// "-" would turn a number column into a string in JSON. ratio needs auto.
std::vector<Column> columns(const std::vector<fsdp::CpuAlgorithm>& algorithms) {
  std::vector<Column> out{
      {"size_bytes", "size", "(B)", 12, -1, ""},
      {"count", "count", "(elements)", 12, -1, ""},
      {"dtype", "type", "", 8, -1, ""},
      {"collective", "collective", "", 14, -1, ""},
      {"redop", "redop", "", 5, -1, ""},
      {"limit_us", "limit", "(us)", 10, 1, ""},
      {"limit_min_us", "min", "(us)", 0, 1, ""},
      {"limit_max_us", "max", "(us)", 0, 1, ""},
  };
  for (const fsdp::CpuAlgorithm a : algorithms) {
    const std::string name = fsdp::to_string(a);
    for (Column& c : timing_columns(name, "libfsdp " + name, true)) out.push_back(std::move(c));
  }
  for (Column& c : timing_columns("raw", "raw MPI", false)) out.push_back(std::move(c));
  if (has_auto(algorithms)) out.push_back({"ratio", "ratio", "raw/auto", 8, 3, ""});
  for (const fsdp::CpuAlgorithm a : compared_with_two_level(algorithms)) {
    const std::string name = fsdp::to_string(a);
    out.push_back({name + "_over_two_level", name + "/", "two_level", 9, 3, ""});
  }
  return out;
}

std::vector<int64_t> sizes(const Options& o) {
  std::vector<int64_t> out;
  for (int64_t s = o.min_bytes; s <= o.max_bytes; s *= o.step_factor) {
    out.push_back(s);
    if (s > o.max_bytes / o.step_factor) break;
  }
  return out;
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

// The largest x_limit of one algorithm and op from 1 MiB up, and where.
struct Worst {
  double x_limit = 0;
  int64_t bytes = 0;
};

// What the sizes from 1 MiB up add up to, for the summary.
struct Large {
  std::map<fsdp::CpuAlgorithm, std::map<std::string, Worst>> worst;
  std::map<std::string, std::vector<double>> ratios;  // op -> raw/auto
  // flat algorithm -> op -> its time / two_level's
  std::map<fsdp::CpuAlgorithm, std::map<std::string, std::vector<double>>> two_level;
};

void notes(Report& report, const Options& o, const std::vector<fsdp::CpuAlgorithm>& algorithms,
           const fsdp::CpuCollectives& startup) {
  report.note("time: median over iterations of the slowest rank's time, each call after a "
              "barrier; the libfsdp and raw MPI columns alternate on the same buffers");
  report.note(fmt::format(
      "limit: the machine's floor for the (n-1)/n of the size one rank must receive, timed "
      "alike right after, every rank at once (they share memory bandwidth), on warm buffers of "
      "its own: all_gather = memcpy of it; reduce_scatter = that + an add of it (dst += src in "
      "{}: a plain loop on one thread, not at::add_; vectorised except for float16); "
      "all_reduce = reduce_scatter's + all_gather's",
      o.dtype));
  for (const std::string& op : o.ops) {
    const Collective& c = collectives().at(op);
    report.note(fmt::format("{:>14}: libfsdp = ProcessGroup::{} on world_group() (sync: inline "
                            "on the caller's thread); raw MPI = {} on MPI_Comm_dup(MPI_COMM_WORLD)",
                            op, c.library_call, c.mpi_call));
  }
  std::string names;
  for (const fsdp::CpuAlgorithm a : algorithms) {
    names += (names.empty() ? "" : ", ") + fsdp::to_string(a);
  }
  report.note(fmt::format("libfsdp ({}): fsdp::set_cpu_collectives with that algorithm before "
                          "each call; auto = the start-up settings: {}; x_limit = time / limit",
                          names, fsdp::to_string(startup)));
  report.note(std::string("algbw = size / time; busbw = algbw * (n-1)/n (all_gather, "
                          "reduce_scatter) or 2(n-1)/n (all_reduce)") +
              (has_auto(algorithms) ? "; ratio = raw MPI time / libfsdp auto time (> 1: auto "
                                      "is faster than plain Open MPI)"
                                    : "") +
              (compared_with_two_level(algorithms).empty()
                   ? ""
                   : "; <flat>/two_level = that algorithm's time / two_level's (> 1: two_level "
                     "is faster)"));
}

// Times one case, prints its row, and adds it to `large` from 1 MiB up.
void measure(Report& report, const Options& o, const std::string& op, const Case& k,
             const std::vector<fsdp::CpuAlgorithm>& algorithms,
             const fsdp::CpuCollectives& startup, c10::ScalarType dtype, MPI_Comm comm,
             Large& large) {
  const Collective& c = collectives().at(op);
  const int n = fsdp::world_group()->size();
  std::vector<std::function<void()>> variants;
  for (const fsdp::CpuAlgorithm a : algorithms) {
    variants.push_back(with_algorithm(a, startup, k.ours));
  }
  variants.push_back(k.raw);
  const std::vector<Stats> s = time_interleaved(comm, variants, o.timing);
  const Stats& raw = s.back();
  // Timed on its own, right after: interleaved, the collectives (which
  // share their buffers, so each finds them in cache) would evict its
  // buffers between calls, and a limit slower than warm-cache copies would
  // be no limit.
  const Stats limit = time_interleaved(comm, {make_limit(c, k.count, dtype, n)}, o.timing)[0];
  const double gb = static_cast<double>(k.bytes) / 1e9;

  std::vector<Cell> row{k.bytes, k.count, o.dtype, op, std::string(c.reduces ? "sum" : "none"),
                        limit.median_us, limit.min_us, limit.max_us};
  const auto append = [&row](std::vector<Cell> cells) {
    row.insert(row.end(), cells.begin(), cells.end());
  };
  for (size_t i = 0; i < algorithms.size(); ++i) {
    const double x = s[i].median_us / limit.median_us;
    append(timing_cells(s[i], gb, c.bus_factor(n), x));
    if (k.bytes < kMiB) continue;
    Worst& w = large.worst[algorithms[i]][op];
    if (x > w.x_limit) w = {x, k.bytes};
  }
  append(timing_cells(raw, gb, c.bus_factor(n), std::nullopt));
  if (has_auto(algorithms)) {
    // auto is last in kAlgorithms' order. Equal to the busbw ratio, and
    // defined when n = 1 makes busbw 0.
    const double ratio = raw.median_us / s[algorithms.size() - 1].median_us;
    if (k.bytes >= kMiB) large.ratios[op].push_back(ratio);
    row.emplace_back(ratio);
  }
  const auto index_of = [&algorithms](fsdp::CpuAlgorithm a) {
    return static_cast<size_t>(std::find(algorithms.begin(), algorithms.end(), a) -
                               algorithms.begin());
  };
  for (const fsdp::CpuAlgorithm a : compared_with_two_level(algorithms)) {
    const double ratio =
        s[index_of(a)].median_us / s[index_of(fsdp::CpuAlgorithm::TwoLevel)].median_us;
    if (k.bytes >= kMiB) large.two_level[a][op].push_back(ratio);
    row.emplace_back(ratio);
  }
  report.row(row);
}

void summarize_x_limits(Report& report, const std::vector<fsdp::CpuAlgorithm>& algorithms,
                        const Large& large) {
  nlohmann::json all = nlohmann::json::object();
  for (const fsdp::CpuAlgorithm a : algorithms) {
    const auto it = large.worst.find(a);
    if (it == large.worst.end()) continue;
    std::string text;
    for (const auto& [op, w] : it->second) {
      all[fsdp::to_string(a)][op] = w.x_limit;
      text += fmt::format("{}{} {:.2f} ({})", text.empty() ? "" : ", ", op, w.x_limit,
                          format_size(w.bytes));
    }
    report.note(fmt::format("worst x_limit from 1 MiB up, libfsdp {}: {}", fsdp::to_string(a),
                            text));
  }
  report.summary("worst_x_limit_from_1MiB", all);
}

// auto's worst all_gather or reduce_scatter from 1 MiB up: the op ("" when
// none ran) and the row.
std::pair<std::string, Worst> worst_for_target(const Large& large) {
  std::pair<std::string, Worst> out;
  const auto it = large.worst.find(fsdp::CpuAlgorithm::Auto);
  if (it == large.worst.end()) return out;
  for (const char* op : {"all_gather", "reduce_scatter"}) {
    const auto w = it->second.find(op);
    if (w != it->second.end() && w->second.x_limit >= out.second.x_limit) out = {op, w->second};
  }
  return out;
}

void summarize_target(Report& report, const Large& large, int world_size, int ranks_here) {
  const double bound = world_size <= 2 ? kTargetSmallWorld : kTargetLargeWorld;
  const unsigned cores = std::thread::hardware_concurrency();
  const bool oversubscribed = cores > 0 && static_cast<unsigned>(ranks_here) > cores;
  const std::string oversubscription =
      oversubscribed ? fmt::format(" (oversubscribed: {} ranks on {} cores)", ranks_here, cores)
                     : "";
  report.summary("target_x_limit", bound);
  report.summary("oversubscribed", oversubscribed);
  const auto [worst_op, worst] = worst_for_target(large);
  const std::string target = fmt::format(
      "target: libfsdp auto all_gather and reduce_scatter within {:.0f}x of the limit from 1 MiB "
      "up at world size {}",
      bound, world_size);
  // At world size 1 no rank receives anything: the limit is an empty loop.
  if (world_size == 1 || worst_op.empty()) {
    report.summary("target_met", nullptr,
                   target + ": no verdict (" +
                       (world_size == 1 ? "nothing to receive"
                                        : "needs auto and all_gather or reduce_scatter at a "
                                          "size >= 1 MiB") +
                       ")" + oversubscription);
    return;
  }
  const bool met = worst.x_limit <= bound;
  report.summary("target_met", met,
                 fmt::format("{}: {} (worst {:.2f}x, {} {}){}", target, met ? "MET" : "NOT MET",
                             worst.x_limit, worst_op, format_size(worst.bytes),
                             oversubscription));
}

// Per flat algorithm and op, the mean of its time / two_level's from 1 MiB up.
void summarize_two_level(Report& report, const Large& large) {
  nlohmann::json all = nlohmann::json::object();
  for (const auto& [a, per_op] : large.two_level) {
    std::string text;
    for (const auto& [op, ratios] : per_op) {
      all[fsdp::to_string(a)][op] = mean(ratios);
      text += fmt::format("{}{} {:.3f}", text.empty() ? "" : ", ", op, mean(ratios));
    }
    report.note(fmt::format("mean time ratio libfsdp {} / two_level for sizes >= 1 MiB: {}",
                            fsdp::to_string(a), text));
  }
  if (!all.empty()) report.summary("mean_over_two_level_from_1MiB", all);
}

void summarize_ratios(Report& report, const Large& large) {
  std::vector<double> all;
  nlohmann::json per_op = nlohmann::json::object();
  std::string per_op_text;
  for (const auto& [op, ratios] : large.ratios) {
    all.insert(all.end(), ratios.begin(), ratios.end());
    per_op[op] = mean(ratios);
    per_op_text += fmt::format("{}{} {:.3f}", per_op_text.empty() ? "" : ", ", op, mean(ratios));
  }
  if (all.empty()) {
    report.summary("mean_ratio_from_1MiB", nullptr,
                   "mean time ratio raw MPI / libfsdp auto: none (needs auto at a size >= 1 MiB)");
    return;
  }
  report.summary("mean_ratio_from_1MiB", mean(all),
                 fmt::format("mean time ratio raw MPI / libfsdp auto for sizes >= 1 MiB: {:.3f} "
                             "({})",
                             mean(all), per_op_text));
  report.summary("mean_ratio_from_1MiB_per_op", per_op);
}

int run(const Options& o, const fsdp::Runtime& rt) {
  const std::string problem = json_path_problem(o.json_path, MPI_COMM_WORLD);
  if (!problem.empty()) {
    if (rt.world_rank() == 0) std::cerr << "fsdp-bench collectives: " << problem << '\n';
    return 1;
  }
  const c10::ScalarType dtype = dtypes().at(o.dtype);
  const std::vector<fsdp::CpuAlgorithm> algorithms = selected_algorithms(o.algorithms);
  // Read once: every closure sets its algorithm with the start-up threshold,
  // and the start-up settings come back at the end.
  const fsdp::CpuCollectives startup = fsdp::cpu_collectives();
  // A communicator of our own, so the raw calls and the harness's barriers
  // share nothing with the library's communicators but the ranks.
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  const RawTypes raw(dtype);

  Report report("collectives", columns(algorithms), o.json_path, rt.world_rank() == 0);
  report.note(fmt::format("fsdp-bench collectives: sizes {}..{} x{}, {} iterations after {} "
                          "warm-up, dtype {}, reduce op sum",
                          format_size(o.min_bytes), format_size(o.max_bytes), o.step_factor,
                          o.timing.iters, o.timing.warmup, o.dtype));
  report.meta("min_bytes", o.min_bytes);
  report.meta("max_bytes", o.max_bytes);
  report.meta("step_factor", o.step_factor);
  report.meta("iters", o.timing.iters);
  report.meta("warmup", o.timing.warmup);
  report.meta("dtype", o.dtype);
  report.meta("shared_inputs", o.shared_inputs);
  if (o.shared_inputs) {
    report.note("--shared-inputs: reduce-scatter inputs, all-gather outputs and all-reduce "
                "tensors from world_group()->empty_for_collectives (shared memory), as "
                "fully_shard's reduce-scatter inputs");
  }
  nlohmann::json names = nlohmann::json::array();
  for (const fsdp::CpuAlgorithm a : algorithms) names.push_back(fsdp::to_string(a));
  report.meta("algorithms", names);
  report.meta("cpu_collectives_at_start",
              {{"algorithm", fsdp::to_string(startup.algorithm)},
               {"all_gather_min_bytes", startup.all_gather_min_bytes},
               {"reduce_scatter_min_bytes", startup.reduce_scatter_min_bytes},
               {"all_reduce_min_bytes", startup.all_reduce_min_bytes},
               {"half_reduce_min_bytes", startup.half_reduce_min_bytes},
               {"all_gather_shm_min_bytes", startup.all_gather_shm_min_bytes},
               {"all_gather_shm_max_bytes", startup.all_gather_shm_max_bytes},
               {"reduce_scatter_shm_min_bytes", startup.reduce_scatter_shm_min_bytes},
               {"reduce_scatter_shm_max_bytes", startup.reduce_scatter_shm_max_bytes},
               {"all_reduce_shm_min_bytes", startup.all_reduce_shm_min_bytes},
               {"all_reduce_shm_max_bytes", startup.all_reduce_shm_max_bytes},
               {"two_level_min_bytes", startup.two_level_min_bytes}});
  add_runtime_meta(report, rt);
  notes(report, o, algorithms, startup);

  Large large;
  for (const std::string& op : o.ops) {
    for (const int64_t requested : sizes(o)) {
      const Case k = make_case(op, requested, dtype, raw, comm, o.shared_inputs);
      if (k.count == 0) continue;
      measure(report, o, op, k, algorithms, startup, dtype, comm, large);
    }
  }
  fsdp::set_cpu_collectives(startup);

  summarize_x_limits(report, algorithms, large);
  summarize_target(report, large, rt.world_size(), rt.local_size());
  summarize_ratios(report, large);
  summarize_two_level(report, large);
  report.finish();
  MPI_Comm_free(&comm);
  return 0;
}

}  // namespace

void add_collectives_command(CLI::App& app, Command& chosen) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "collectives",
      "Bus bandwidth of libfsdp's collectives under each CPU algorithm against the raw MPI "
      "calls and the machine's memcpy/add limit, nccl-tests style. Run under mpiexec; rank 0 "
      "prints.");
  sub->add_option("-b,--min-bytes", o->min_bytes, "Smallest size (bytes; K, M, G suffixes)")
      ->transform(size_argument())
      ->check(CLI::Range(int64_t{1}, kMaxBytes))
      ->default_str("1K");
  sub->add_option("-e,--max-bytes", o->max_bytes, "Largest size (bytes; K, M, G suffixes)")
      ->transform(size_argument())
      ->check(CLI::Range(int64_t{1}, kMaxBytes))
      ->default_str("256M");
  sub->add_option("-f,--step-factor", o->step_factor, "Multiply the size by this each step")
      ->check(CLI::Range(2, 1024))
      ->capture_default_str();
  sub->add_option("-n,--iters", o->timing.iters, "Timed iterations per size and side")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  sub->add_option("-w,--warmup", o->timing.warmup, "Untimed iterations first")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  std::vector<std::string> op_names;
  for (const auto& entry : collectives()) op_names.push_back(entry.first);
  sub->add_option("--ops", o->ops, "Collectives to run, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(op_names))
      ->default_str("all_gather,reduce_scatter,all_reduce");
  std::vector<std::string> algorithm_names;
  for (const fsdp::CpuAlgorithm a : kAlgorithms) algorithm_names.push_back(fsdp::to_string(a));
  sub->add_option("--algorithms", o->algorithms,
                  "libfsdp CPU algorithms to run, comma-separated (columns in the order "
                  "mpi, ring, pairwise, shm, two_level, auto; with two_level, each flat one "
                  "selected gets a '<flat>/two_level' time-ratio column)")
      ->delimiter(',')
      ->check(CLI::IsMember(algorithm_names))
      ->default_str("mpi,ring,pairwise,shm,auto");
  sub->add_flag("--shared-inputs", o->shared_inputs,
                "Reduce-scatter inputs, all-gather outputs and all-reduce tensors from "
                "ProcessGroup::empty_for_collectives (shared memory on one node), as "
                "fully_shard allocates its reduce-scatter inputs; shm then copies nothing "
                "in");
  std::vector<std::string> dtype_names;
  for (const auto& entry : dtypes()) dtype_names.push_back(entry.first);
  sub->add_option("-d,--dtype", o->dtype, "Element type")
      ->check(CLI::IsMember(dtype_names))
      ->capture_default_str();
  add_json_option(sub, o->json_path);
  sub->callback([o, &chosen] {
    if (o->min_bytes > o->max_bytes) {
      throw CLI::ValidationError(
          "--min-bytes", fmt::format("{} is larger than --max-bytes {}", format_size(o->min_bytes),
                                     format_size(o->max_bytes)));
    }
    chosen = [o](const fsdp::Runtime& rt) { return run(*o, rt); };
  });
}

}  // namespace fsdp_bench
