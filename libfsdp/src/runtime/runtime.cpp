// Runtime: MPI bootstrap, topology, device choice, thread pinning, shutdown.
#include "fsdp/runtime.h"

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "comm/cpu_collectives.h"
#include "comm/comm_settings.h"
#include "comm/group_registry.h"
#include "comm/mpi_types.h"
#include "comm/topology.h"
#include "comm/watchdog.h"
#include "runtime/device_binding.h"
#include "base/torch_compat.h"
#ifdef FSDP_WITH_NCCL
#include "runtime/cuda_device.h"
#endif

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <sstream>
#include <string_view>
#include <thread>
#include <vector>

namespace fsdp {
namespace {

Runtime* g_runtime = nullptr;

int cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

int threads_from_env() {
  const char* env = std::getenv("FSDP_NUM_THREADS");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (*end != '\0' || n < 1 || n > 1024) {
    throw ArgumentError("FSDP_NUM_THREADS", std::string("FSDP_NUM_THREADS='") + env +
                                                "'; accepted: an integer in 1..1024");
  }
  return static_cast<int>(n);
}

// "600 s", "2.5 s"
std::string seconds_text(double s) {
  std::ostringstream os;
  os << s << " s";
  return os.str();
}

double timeout_from(const std::optional<double>& option) {
  if (option) {
    if (!(*option >= 0) || *option > 1e9) {
      throw ArgumentError("timeout_seconds", "RuntimeOptions::timeout_seconds = " +
                                                 std::to_string(*option) +
                                                 "; accepted: 0 (off) or seconds up to 1e9");
    }
    return *option;
  }
  const char* env = std::getenv("FSDP_TIMEOUT");
  if (env == nullptr || *env == '\0') return 600;
  if (std::string(env) == "off") return 0;
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  if (*end != '\0' || !(s > 0) || s > 1e9) {
    throw ArgumentError("FSDP_TIMEOUT", std::string("FSDP_TIMEOUT='") + env +
                                            "'; accepted: seconds (> 0, up to 1e9) or off");
  }
  return s;
}

bool check_collectives_from(const std::optional<bool>& option) {
  if (option) return *option;
  const char* env = std::getenv("FSDP_DEBUG");
  if (env == nullptr || *env == '\0' || std::string(env) == "off") return false;
  if (std::string(env) == "detail") return true;
  throw ArgumentError("FSDP_DEBUG",
                      std::string("FSDP_DEBUG='") + env + "'; accepted: detail, off or empty");
}

CpuCollectives cpu_collectives_from(const std::optional<CpuCollectives>& option) {
  if (option) {
    CpuCollectives c = *option;
    for (const auto& [name, value] : detail::cpu::thresholds(c)) {
      if (*value < 0) {
        throw ArgumentError("cpu_collectives", std::string("RuntimeOptions::cpu_collectives: '") +
                                                   name + "' = " + std::to_string(*value) +
                                                   " bytes; accepted: 0 or more bytes");
      }
    }
    return c;
  }
  CpuCollectives c;
  const char* algo = std::getenv("FSDP_MPI_ALGO");
  if (algo != nullptr && *algo != '\0') c.algorithm = parse_cpu_algorithm(algo, "FSDP_MPI_ALGO");
  const char* min = std::getenv("FSDP_MPI_ALGO_MIN_BYTES");
  if (min != nullptr && *min != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(min, &end, 10);
    if (*end != '\0' || errno != 0 || v < 0) {
      throw ArgumentError("FSDP_MPI_ALGO_MIN_BYTES",
                          std::string("FSDP_MPI_ALGO_MIN_BYTES='") + min +
                              "'; accepted: a whole number of bytes, 0 or more");
    }
    for (const auto& [name, value] : detail::cpu::thresholds(c)) {
      if (std::string_view(name).find("_min_bytes") != std::string_view::npos) *value = v;
    }
  }
  return c;
}

// OpenBLAS keeps its own pool; pin it too when it is the loaded BLAS.
void set_blas_threads(int n) {
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(n);
  }
}

// MPI_Init_thread(MPI_THREAD_MULTIPLE), unless the caller has initialised
// MPI; whether this call did (and so owns MPI). Refuses a lower thread level.
bool init_mpi(int* argc, char*** argv) {
  bool owns_mpi = false;
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    // Each rank runs its compute threads (all its cores) plus a comm thread
    // per process group, so Open MPI's default busy-polling inside blocking
    // calls steals the cores compute needs (measured by fsdp-bench train at
    // np 2 on 2 cores: FSDP 1.43x DDP's step time busy-polling, 0.97x
    // yielding). An explicit setting by the user wins.
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
    detail::check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided),
                      "MPI_Init_thread");
    owns_mpi = true;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    if (owns_mpi) MPI_Finalize();
    throw StateError(
        "MPI provides thread level " + std::to_string(provided) +
        " but libfsdp needs MPI_THREAD_MULTIPLE (each process group communicates on its own "
        "thread); use an MPI built with thread support (Debian's Open MPI has it)");
  }
  return owns_mpi;
}

// Settings that change which messages a collective sends must agree: a
// rank with the desync check (communicators and an exchange per
// collective) or another CPU algorithm would leave the others waiting.
// One MPI_Allreduce(MIN) of each value and its negation finds any mismatch,
// reported (after MPI_Finalize when `owns_mpi`) as an ArgumentError naming
// the setting.
// (`cpu` by value: detail::cpu::thresholds hands out pointers into it.)
void agree_on_collective_settings(bool check_collectives, CpuCollectives cpu, int64_t shm_bytes,
                                  bool owns_mpi) {
  std::vector<int64_t> mine = {check_collectives ? 1 : 0, static_cast<int64_t>(cpu.algorithm)};
  for (const auto& field : detail::cpu::thresholds(cpu)) mine.push_back(*field.second);
  mine.push_back(shm_bytes);  // last: checked on its own below
  const int kAgreed = static_cast<int>(mine.size());
  std::vector<int64_t> both(2 * mine.size()), agreed(2 * mine.size());
  for (int i = 0; i < kAgreed; ++i) {
    both[static_cast<size_t>(i)] = mine[static_cast<size_t>(i)];
    both[static_cast<size_t>(kAgreed + i)] = -mine[static_cast<size_t>(i)];
  }
  detail::check_mpi(MPI_Allreduce(both.data(), agreed.data(), 2 * kAgreed, MPI_INT64_T, MPI_MIN,
                                  MPI_COMM_WORLD),
                    "MPI_Allreduce");
  auto differs = [&](int i) {
    return agreed[static_cast<size_t>(i)] != -agreed[static_cast<size_t>(kAgreed + i)];
  };
  bool any = false;
  for (int i = 0; i < kAgreed; ++i) any = any || differs(i);
  if (!any) return;
  if (owns_mpi) MPI_Finalize();
  if (differs(0)) {
    throw ArgumentError("FSDP_DEBUG",
                        std::string("FSDP_DEBUG / RuntimeOptions::check_collectives differ "
                                    "across ranks (this rank: ") +
                            (check_collectives ? "detail" : "off") +
                            "); set it the same on every rank");
  }
  if (differs(kAgreed - 1)) {
    throw ArgumentError("FSDP_SHM_BYTES",
                        "FSDP_SHM_BYTES differs across ranks (this rank: " +
                            (shm_bytes < 0 ? std::string("unset") : std::to_string(shm_bytes)) +
                            "); set it the same on every rank");
  }
  std::string fields;
  const auto named = detail::cpu::thresholds(cpu);
  for (int i = 2; i < kAgreed - 1; ++i) {
    if (!differs(i)) continue;
    const auto& [name, value] = named[static_cast<size_t>(i - 2)];
    fields += std::string(", ") + name + " " + std::to_string(*value) + " B";
  }
  throw ArgumentError("FSDP_MPI_ALGO",
                      "FSDP_MPI_ALGO / FSDP_MPI_ALGO_MIN_BYTES / "
                      "RuntimeOptions::cpu_collectives differ across ranks (this rank: " +
                          to_string(cpu.algorithm) + fields +
                          "); set them the same on every rank");
}

// Compute threads per rank: the option, else FSDP_NUM_THREADS, else the
// cores shared out among the node's ranks.
int threads_per_rank(const RuntimeOptions& options, int local_size) {
  int n = options.num_threads > 0 ? options.num_threads : threads_from_env();
  if (n == 0) n = std::max(1, cores_available() / local_size);
  // When mpirun binds each rank to its own cores the affinity mask is already
  // the per-rank share; never exceed it.
  if (options.num_threads == 0) n = std::min(n, cores_available());
  return n;
}

// Rank 0's start-up line (RuntimeOptions::log_banner).
void print_banner(const Runtime& rt, const CpuCollectives& cpu, bool check_collectives) {
  const std::string& blas = rt.blas_library();
  std::cerr << "[libfsdp] LibTorch " << compat::torch_version() << ", " << rt.world_size()
            << " rank(s), " << rt.local_size() << " per node, " << rt.num_threads()
            << " thread(s) per rank, device " << rt.device().str() << ", watchdog "
            << (rt.timeout_seconds() > 0 ? seconds_text(rt.timeout_seconds()) : "off")
            << (check_collectives ? ", collective checks on (FSDP_DEBUG=detail)" : "")
            << ", CPU collectives " << to_string(cpu)
            << ", BLAS " << blas
            << (blas.find("openblas") == std::string::npos && !at::hasMKL()
                    ? " (not OpenBLAS or MKL: GEMMs may be ~14x slower; install libopenblas0-pthread)"
                    : "")
            << std::endl;
}

}  // namespace

std::string loaded_blas_library() {
  void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr) return "unknown";
  char resolved[PATH_MAX];
  const std::string path = realpath(info.dli_fname, resolved) != nullptr ? resolved : info.dli_fname;
  // pip's and the official LibTorch link MKL into libtorch_cpu itself.
  return at::hasMKL() ? "MKL in " + path : path;
}

Runtime::Runtime(int* argc, char*** argv, RuntimeOptions options) {
  if (g_runtime != nullptr) throw StateError("an fsdp::Runtime is already alive in this process");
  timeout_seconds_ = timeout_from(options.timeout_seconds);
  check_collectives_ = check_collectives_from(options.check_collectives);
  cpu_collectives_ = cpu_collectives_from(options.cpu_collectives);
  const int64_t shm_bytes = detail::cpu::shm_bytes_setting();
  owns_mpi_ = init_mpi(argc, argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  agree_on_collective_settings(check_collectives_, cpu_collectives_, shm_bytes, owns_mpi_);
  MPI_Comm node = MPI_COMM_NULL;
  detail::check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_,
                                        MPI_INFO_NULL, &node),
                    "MPI_Comm_split_type");
  MPI_Comm_rank(node, &local_rank_);
  MPI_Comm_size(node, &local_size_);
  try {
    compute_topology(node);
    bind_device(options, node);
  } catch (...) {
    MPI_Comm_free(&node);
    if (owns_mpi_) MPI_Finalize();
    throw;
  }
  MPI_Comm_free(&node);

  num_threads_ = threads_per_rank(options, local_size_);
  compat::set_intra_op_threads(num_threads_);
  set_blas_threads(num_threads_);

  blas_library_ = loaded_blas_library();

  detail::init_mpi_types();
  const long online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
  detail::configure_comm({timeout_seconds_, check_collectives_, device_,
                          online_cpus > 0 && local_size_ > online_cpus});
  set_cpu_collectives(cpu_collectives_);
  detail::init_group_registry();
  g_runtime = this;
  std::vector<int> everyone(static_cast<size_t>(world_size_));
  for (int r = 0; r < world_size_; ++r) everyone[static_cast<size_t>(r)] = r;
  detail::group_for(everyone);  // the world group, so world_group() never communicates

  if (options.log_banner && world_rank_ == 0) print_banner(*this, cpu_collectives_, check_collectives_);
  trace::detail::start(world_rank_, world_size_);  // FSDP_TRACE
  detail::start_watchdog(world_rank_, world_size_);
}

// A node is named by its lowest world rank (the MIN over the node), and
// every rank learns every rank's name with one all-gather; the names in
// increasing order are the node indices, so they are the same everywhere and
// node 0 holds world rank 0.
void Runtime::compute_topology(MPI_Comm node) {
  int lowest = world_rank_;
  detail::check_mpi(MPI_Allreduce(&world_rank_, &lowest, 1, MPI_INT, MPI_MIN, node),
                    "MPI_Allreduce (node topology)");
  std::vector<int> lowest_of(static_cast<size_t>(world_size_));
  detail::check_mpi(MPI_Allgather(&lowest, 1, MPI_INT, lowest_of.data(), 1, MPI_INT,
                                  MPI_COMM_WORLD),
                    "MPI_Allgather (node topology)");
  std::vector<int> names = lowest_of;
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  node_of_.resize(lowest_of.size());
  for (size_t r = 0; r < lowest_of.size(); ++r) {
    node_of_[r] = static_cast<int>(std::lower_bound(names.begin(), names.end(), lowest_of[r]) -
                                   names.begin());
  }
  num_nodes_ = static_cast<int>(names.size());
  detail::set_node_map(node_of_);
}

int Runtime::node_of(int world_rank) const {
  if (world_rank < 0 || world_rank >= world_size_) {
    throw ArgumentError("world_rank", "Runtime::node_of: 'world_rank' = " +
                                          std::to_string(world_rank) + "; accepted: 0.." +
                                          std::to_string(world_size_ - 1));
  }
  return node_of_[static_cast<size_t>(world_rank)];
}

// Every rank reaches the same verdict (the device errors are agreed over the
// world, the ids are gathered over the node), so a refusal throws on all of
// them instead of leaving some waiting.
void Runtime::bind_device(const RuntimeOptions& options, MPI_Comm node) {
  // Every error up to the device choice is caught and agreed on below: a
  // setting bad on one rank only (its FSDP_DEVICE) must not leave the others
  // waiting in the agreement.
  const auto cuda_devices = static_cast<int>(torch::cuda::device_count());
  detail::DeviceChoice choice;
  std::exception_ptr failure;
  try {
    detail::DeviceRequest request = detail::DeviceRequest::Auto;
    if (options.device) {
      if (*options.device != c10::kCPU && *options.device != c10::kCUDA) {
        throw ArgumentError("device", "RuntimeOptions::device = " +
                                          c10::DeviceTypeName(*options.device, true) +
                                          "; accepted: kCPU, kCUDA (unset: $FSDP_DEVICE or auto)");
      }
      request = *options.device == c10::kCPU ? detail::DeviceRequest::Cpu
                                             : detail::DeviceRequest::Cuda;
    } else if (const char* env = std::getenv("FSDP_DEVICE"); env != nullptr && *env != '\0') {
      request = detail::parse_device_request(env, "FSDP_DEVICE");
    }
    // The choice follows what Slurm gave the task (CUDA_VISIBLE_DEVICES,
    // SLURM_*); a task Slurm gave no GPU, or ranks sharing a node-wide list,
    // fail here with the srun option that fixes it.
    const detail::SlurmGpuFacts facts =
        detail::read_slurm_gpu_facts([](const char* name) { return std::getenv(name); });
    choice = detail::explain_device_choice(request, local_rank_, local_size_, cuda_devices, facts);
  } catch (const Error&) {
    failure = std::current_exception();
  }
  const int my_failure = failure ? world_rank_ : -1;
  int failed = -1;
  detail::check_mpi(MPI_Allreduce(&my_failure, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD),
                    "MPI_Allreduce (device choice)");
  if (failure) std::rethrow_exception(failure);
  if (failed >= 0) {
    throw StateError("world rank " + std::to_string(failed) +
                     " could not choose its device (its error says why and what to change); "
                     "this rank would have used " + choice.description);
  }
  device_ = choice.device;
  detail::set_bound_device_description(choice.description);
  if (!device_.is_cuda()) return;
  // Kernels, streams and contexts this process creates go to its own GPU,
  // not to cuda:0 in every rank.
  c10::impl::VirtualGuardImpl(c10::kCUDA).setDevice(device_);
#ifdef FSDP_WITH_NCCL
  constexpr int kIdBytes = 64;
  char mine[kIdBytes] = {};
  const std::string id = detail::cuda_pci_bus_id(device_.index());
  id.copy(mine, kIdBytes - 1);
  std::vector<char> all(static_cast<size_t>(kIdBytes) * static_cast<size_t>(local_size_));
  detail::check_mpi(MPI_Allgather(mine, kIdBytes, MPI_CHAR, all.data(), kIdBytes, MPI_CHAR, node),
                    "MPI_Allgather (GPU ids)");
  std::vector<std::string> ids;
  for (int r = 0; r < local_size_; ++r) ids.emplace_back(&all[static_cast<size_t>(r) * kIdBytes]);
  const std::string shared = detail::shared_gpu_error(ids, cuda_devices);
  if (!shared.empty()) throw StateError(shared);
#else
  (void)node;
#endif
}

Runtime::~Runtime() {
  // A rank that threw an error the others cannot get past (OutOfMemoryError
  // before a collective) must not wait for them in MPI_Finalize.
  if (detail::fatal_error_announced()) detail::abort_after_fatal_error(world_rank_);
  detail::stop_watchdog();
  detail::shutdown_group_registry();
  trace::detail::stop();  // writes the trace, comm-thread spans included (threads joined)
  detail::free_mpi_types();
  detail::set_node_map({});
  g_runtime = nullptr;
  if (owns_mpi_) MPI_Finalize();
}

Runtime& Runtime::get() {
  if (g_runtime == nullptr) throw StateError("no fsdp::Runtime is alive; create one in main()");
  return *g_runtime;
}

bool Runtime::alive() { return g_runtime != nullptr; }

}  // namespace fsdp
