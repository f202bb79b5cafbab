// fsdp-bench train: one training step of the test plan's LLM decoder under
// single-process, a plain DDP baseline, three FSDP configurations, FSDP
// composed with tensor parallelism and FSDP inside pipeline stages (fsdp::pp),
// in one run, on the same model, seed and global batch -- and, for scale, the
// mixture-of-experts decoder with expert parallelism (fsdp::moe) on the same
// batch.
//
// Every configuration builds a fresh models::Decoder from the same seed (the
// TP configurations copy their slices of it into a models::TPDecoder, the
// pipeline configurations keep their stages of it, models::DecoderStage;
// the expert-parallel one builds models::MoEDecoder from the same seed) and
// trains it with AdamW (zero_grad, forward, backward, step per iteration).
// The configurations run interleaved step by step (the harness's
// time_interleaved), so load drift hits them alike. Memory is measured by a
// counting wrapper around LibTorch's CPU allocator that attributes every
// allocation to the configuration whose step (or construction) was running.
#include "harness.h"

#include "fsdp/allocator_compat.h"
#include "fsdp/comm.h"
#include "fsdp/fully_shard.h"
#include "fsdp/mesh.h"
#include "fsdp/moe.h"
#include "fsdp/pipeline.h"
#include "fsdp/tensor_parallel.h"

#include <models/decoder_stages.h>
#include <models/init.h>
#include <models/llm.h>
#include <models/moe_llm.h>
#include <models/tp_llm.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>

namespace fsdp_bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
// Targets of the project: FSDP (the default reshard_after_forward) within 5% of
// DDP's step time at 2 ranks, and its persistent memory per rank within 2%
// of an ideal 1/N split of the single-process state.
constexpr double kStepTarget = 1.05;
constexpr int kStepTargetWorld = 2;
constexpr double kMemoryTarget = 1.02;

// ---- memory accounting ------------------------------------------------------
// LibTorch's CPU allocator wrapped to count live bytes and their peak per
// account. The account of an allocation is the one current when it was made
// (a process-wide setting, so allocations on libfsdp's communication threads
// count for the configuration whose step issued them); a free goes back to
// the allocation's account, wherever it happens. Installed before any model
// is built and never removed or destroyed: it must outlive every tensor it
// allocated.

class CountingAllocator final : public c10::Allocator {
 public:
  static constexpr int kAccounts = 16;  // 0 = nothing in particular

  // Some kernels take scratch memory through raw_allocate(), which requires
  // the DataPtr's context to be its data pointer and a raw deleter: so the
  // size and account live in a header in front of the data, one alignment
  // unit long so that the data keeps c10's alignment.
  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    Header h{n, current_.load(std::memory_order_relaxed)};
    std::memcpy(base, &h, sizeof h);
    add(h.account, static_cast<int64_t>(n));
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &CountingAllocator::release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
#if FSDP_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif

  static CountingAllocator& get() {
    static auto* instance = new CountingAllocator();  // never freed: see above
    return *instance;
  }
  // Priority above LibTorch's default CPU allocator (registered at 0).
  // Also counts libfsdp's shared-memory arenas (fully_shard's all-gather
  // outputs and reduce-scatter inputs), which LibTorch's allocator never
  // sees, in the current account: they are made and freed within a step.
  void install() {
    c10::SetCPUAllocator(this, /*priority=*/1);
    fsdp::set_shared_memory_observer(
        [](int64_t delta) { get().add(get().current_.load(std::memory_order_relaxed), delta); });
  }
  bool installed() const { return c10::GetCPUAllocator() == this; }

  // Makes `account` current until the returned guard is destroyed.
  class Scope {
   public:
    explicit Scope(int account) : previous_(get().current_.exchange(account)) {}
    ~Scope() { get().current_.store(previous_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    int previous_;
  };

  int64_t live(int account) const { return live_[check(account)].load(); }
  int64_t peak(int account) const { return peak_[check(account)].load(); }
  // Starts a new peak window at the account's current live bytes.
  void reset_peak(int account) { peak_[check(account)].store(live_[account].load()); }

 private:
  struct Header {
    size_t bytes;
    int account;
  };
  static constexpr size_t kHeader = c10::gAlignment;
  static_assert(kHeader >= sizeof(Header), "the header holds size and account");

  static int check(int account) {
    if (account < 0 || account >= kAccounts) throw std::logic_error("bad memory account");
    return account;
  }
  static void release(void* data) {
    if (data == nullptr) return;
    char* base = static_cast<char*>(data) - kHeader;
    Header h{};
    std::memcpy(&h, base, sizeof h);
    get().add(h.account, -static_cast<int64_t>(h.bytes));
    c10::free_cpu(base);
  }
  void add(int account, int64_t n) const {
    const int64_t now = live_[account].fetch_add(n) + n;
    int64_t peak = peak_[account].load();
    while (now > peak && !peak_[account].compare_exchange_weak(peak, now)) {
    }
  }

  std::atomic<int> current_{0};
  mutable std::array<std::atomic<int64_t>, kAccounts> live_{};
  mutable std::array<std::atomic<int64_t>, kAccounts> peak_{};
};

// ---- options and configurations ---------------------------------------------
struct Options {
  int batch = 8;  // global batch, sequences
  int64_t seq = 0, layers = 0, hidden = 0, vocab = 0, heads = 0;  // 0 = DecoderConfig default
  TimingOptions timing{2, 10};
  uint64_t seed = 1234;
  double lr = 1e-3;
  bool forward_prefetch = false;
  int tp = 0;  // 0: 2 when the world size is even, else the TP configs are skipped
  int pp = 0;  // likewise for the pipeline configs
  int microbatches = 0;  // 0: one per sequence of the per-pipeline batch
  int ep = 0;  // likewise for the expert-parallel config
  std::vector<std::string> configs;
  std::string json_path;
  std::string device = "cpu";  // cpu | cuda (single and fsdp* configs only)
  c10::Device resolved_device{c10::kCPU};
  // The data-parallel FSDP configs (data_parallel_fsdp_keys()):
  // MixedPrecisionPolicy param_dtype (reduce_dtype float32); the others stay float32.
  std::string param_dtype = "float32";
};

enum class Kind { Single, Ddp, Fsdp, Hsdp, FsdpTp, FsdpPp, FsdpEp };

// The expert-parallel config's MoE layers (models::MoEDecoder's defaults).
constexpr int64_t kExperts = 4, kTopK = 2;

struct ConfigSpec {
  std::string key;
  Kind kind;
  fsdp::ReshardAfterForward reshard_after_forward;
  bool comm_fusion;
  std::string legend;
  models::TPOptions tp{};  // FsdpTp only
  // FsdpPp only.
  fsdp::pp::ScheduleKind schedule = fsdp::pp::ScheduleKind::OneFOneB;
  int stages_per_rank = 1;
  // false: no forward prefetch at all (set_modules_to_forward_prefetch({})
  // on every unit), to measure the implicit one.
  bool forward_prefetch = true;
  // Default: the library's (implicit on CUDA, none on the CPU); Implicit:
  // implicit_backward_prefetch=true; None: set_modules_to_backward_prefetch({}).
  enum class Backward { Default, Implicit, None } backward_prefetch = Backward::Default;
};

const std::vector<ConfigSpec>& all_configs() {
  static const std::vector<ConfigSpec> table{
      {"single", Kind::Single, false, false,
       "full model, whole global batch, no communication; EVERY rank runs it at once (each on "
       "its share of the cores, as the parallel configs do), the step time is the slowest "
       "rank's"},
      {"ddp", Kind::Ddp, false, false,
       "full replica per rank, batch/N each; after backward all gradients are copied into one "
       "flat bucket, summed by ONE MPI_Allreduce and divided by N; no libfsdp code; does NOT "
       "overlap communication with backward"},
      {"fsdp", Kind::Fsdp, {}, false,
       "fully_shard each decoder layer then the root, reshard_after_forward unset (the "
       "default, FSDP2's: every unit but the root reshards after forward)"},
      {"fsdp-reshard-all", Kind::Fsdp, true, false,
       "as fsdp, reshard_after_forward=true (the root too: one more all-gather per step)"},
      {"fsdp-no-reshard", Kind::Fsdp, false, false, "as fsdp, reshard_after_forward=false"},
      {"fsdp-no-prefetch", Kind::Fsdp, {}, false,
       "as fsdp without forward prefetch (set_modules_to_forward_prefetch({}) on every unit: "
       "each unit's all-gather is issued at its own pre-forward)",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, false},
      {"fsdp-no-bwd-prefetch", Kind::Fsdp, {}, false,
       "as fsdp without backward prefetch (set_modules_to_backward_prefetch({}) on every "
       "unit: each unit's backward all-gather is issued at its own pre-backward; on the CPU "
       "the default already is)",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, true, ConfigSpec::Backward::None},
      {"fsdp-bwd-prefetch", Kind::Fsdp, {}, false,
       "as fsdp with implicit_backward_prefetch=true (each unit's pre-backward issues the "
       "all-gather of the unit before it, FSDP2's default; the library's on CUDA only)",
       {}, fsdp::pp::ScheduleKind::OneFOneB, 1, true, ConfigSpec::Backward::Implicit},
      {"fsdp-fused", Kind::Fsdp, {}, true, "as fsdp, comm_fusion=true"},
      {"hsdp", Kind::Hsdp, {}, false,
       "as fsdp on a (replicate = ranks / 2, shard = 2) mesh: sharded over pairs of ranks, "
       "gradients all-reduced across the pairs"},
      {"fsdp-tp", Kind::FsdpTp, true, false,
       "models::TPDecoder (Megatron column/row-parallel layers, vocab-parallel tied "
       "embedding; the same initial weights, sliced) over tp on a (shard, tp) mesh, then as "
       "fsdp over shard; the tp ranks of one shard coordinate take the same batch slice",
       {/*sequence_parallel=*/false, /*loss_parallel=*/false}},
      {"fsdp-tp-sp", Kind::FsdpTp, true, false,
       "as fsdp-tp, sequence parallel (activations between blocks split over tp on seq) and "
       "loss parallel (cross-entropy on the vocab slices; the logits are never gathered)",
       {/*sequence_parallel=*/true, /*loss_parallel=*/true}},
      {"fsdp-pp-gpipe", Kind::FsdpPp, true, false,
       "models::DecoderStage: the decoder cut by layers into pp stages on a (pp, dp) mesh "
       "(embedding on the first, final norm + a copy of the tied output on the last, the tied "
       "pair's gradients exchanged after backward), each stage's layers then the stage "
       "fully_shard over dp (gathered across microbatches); fsdp::pp GPipe over the "
       "microbatches; the pp ranks of one dp coordinate take the same batch slice",
       {}, fsdp::pp::ScheduleKind::GPipe, 1},
      {"fsdp-pp-1f1b", Kind::FsdpPp, true, false, "as fsdp-pp-gpipe, schedule 1F1B", {},
       fsdp::pp::ScheduleKind::OneFOneB, 1},
      {"fsdp-pp-interleaved", Kind::FsdpPp, true, false,
       "as fsdp-pp-gpipe, interleaved 1F1B with 2 stages per rank (looped: rank r holds stages "
       "r and r + pp)",
       {}, fsdp::pp::ScheduleKind::Interleaved1F1B, 2},
      {"fsdp-ep-moe", Kind::FsdpEp, true, false,
       "ANOTHER MODEL: models::MoEDecoder (the same dims, odd layers MoE: 4 SwiGLU experts of "
       "ffn 2 x hidden, top-2, fp32 softmax router) from the same seed, experts split over ep "
       "on an (efsdp, ep) mesh; every rank takes its own batch slice; dense layers and the root "
       "fully_shard over all ranks, each MoE layer with fsdp::moe::expert_options (experts on "
       "efsdp, divide factor = ranks); its loss and persistent ratio are not the dense "
       "decoder's"},
  };
  return table;
}

// The configs --param-dtype applies to and --device cuda runs beside single.
std::string data_parallel_fsdp_keys() {
  std::vector<std::string> keys;
  for (const ConfigSpec& s : all_configs()) {
    if (s.kind == Kind::Fsdp || s.kind == Kind::Hsdp) keys.push_back(s.key);
  }
  return fmt::format("{}", fmt::join(keys, ", "));
}

int64_t nbytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// fully_shard each layer of a decoder (plain or TP form), then the root
// (embedding + tied output + final norm). A TP module's parameters must be
// handed over as DTensors right before its own fully_shard, bottom-up; the
// plain decoder has none.
// forward_prefetch: explicit (each unit prefetches the next), implicit (the
// library's default: the next unit of the previous step's order) or none.
enum class ForwardPrefetch { Explicit, Implicit, None };

template <typename DecoderHolder>
fsdp::Sharded<DecoderHolder> shard_decoder(DecoderHolder decoder,
                                           const fsdp::FullyShardOptions& fo,
                                           ForwardPrefetch forward_prefetch,
                                           ConfigSpec::Backward backward_prefetch) {
  std::vector<fsdp::FSDPModule> units;
  for (auto& layer : decoder->layers) {
    units.push_back(
        fsdp::fully_shard(layer.holder(), fsdp::options_for(*layer.holder().ptr(), fo)));
  }
  fsdp::Sharded<DecoderHolder> net =
      fsdp::fully_shard(decoder, fsdp::options_for(*decoder, fo));
  units.insert(units.begin(), *fsdp::fsdp_module_of(*decoder));
  if (forward_prefetch == ForwardPrefetch::Explicit) {
    // Each unit's forward issues the next one's all-gather; the root's
    // issues the first layer's.
    for (size_t i = 0; i + 1 < units.size(); ++i) {
      units[i].set_modules_to_forward_prefetch({units[i + 1]});
    }
  } else if (forward_prefetch == ForwardPrefetch::None) {
    for (auto& u : units) u.set_modules_to_forward_prefetch({});
  }
  if (backward_prefetch == ConfigSpec::Backward::None) {
    for (auto& u : units) u.set_modules_to_backward_prefetch({});
  }
  return net;
}

ForwardPrefetch prefetch_mode(const ConfigSpec& spec, const Options& o) {
  if (!spec.forward_prefetch) return ForwardPrefetch::None;
  return o.forward_prefetch ? ForwardPrefetch::Explicit : ForwardPrefetch::Implicit;
}

// One configuration's model, optimizer and step. `mesh`: (shard) for Fsdp,
// (shard, tp) for FsdpTp, (pp, dp) for FsdpPp, (efsdp, ep) for FsdpEp,
// unused otherwise.
class Trainer {
 public:
  Trainer(const ConfigSpec& spec, int account, const models::DecoderConfig& cfg,
          const Options& o, const std::optional<fsdp::DeviceMesh>& mesh, MPI_Comm comm)
      : spec_(spec), account_(account), comm_(comm), device_(o.resolved_device) {
    MPI_Comm_size(comm, &world_);
    if (spec.kind != Kind::Single) {
      MPI_Comm_rank(comm, &data_rank_);
      data_size_ = world_;
    }
    const CountingAllocator::Scope scope(account_);
    models::Decoder decoder(cfg);
    models::init_weights(*decoder, o.seed);
    decoder->to(device_);
    fsdp::FullyShardOptions fo;
    fo.mesh = mesh;
    fo.shard_dim = "shard";
    fo.reshard_after_forward = spec.reshard_after_forward;
    fo.comm_fusion = spec.comm_fusion;
    if (spec.backward_prefetch == ConfigSpec::Backward::Implicit) {
      fo.implicit_backward_prefetch = true;
    }
    if (spec.kind == Kind::Hsdp) fo.replicate_dim = "replicate";
    const bool data_parallel_fsdp = spec.kind == Kind::Fsdp || spec.kind == Kind::Hsdp;
    if (data_parallel_fsdp && o.param_dtype == "bfloat16") {
      // FSDP2's usual CPU/GPU mixed precision: bf16 all-gathers and compute,
      // fp32 gradient reduction and optimizer state.
      fo.mp_policy.param_dtype = at::kBFloat16;
      fo.mp_policy.reduce_dtype = at::kFloat;
    }
    if (spec.kind == Kind::FsdpPp) {
      build_pipeline(decoder, fo, o, *mesh);
    } else if (spec.kind == Kind::FsdpEp) {
      build_moe(cfg, fo, o, *mesh);
    } else if (spec.kind == Kind::FsdpTp) {
      tp_group_ = mesh->get_group("tp")->name();
      data_rank_ = mesh->get_local_rank("shard");
      data_size_ = static_cast<int>(mesh->size("shard"));
      models::TPDecoder tp(cfg, (*mesh)["tp"], spec.tp);
      tp->load_full(*decoder);
      auto net = shard_decoder(tp, fo, prefetch_mode(spec, o), spec.backward_prefetch);
      loss_ = [net, tp](const at::Tensor& inputs, const at::Tensor& targets) mutable {
        return tp->loss(net(inputs), targets);
      };
      model_ = tp.ptr();
    } else {
      // Not sharded (single, ddp): Sharded simply forwards.
      fsdp::Sharded<models::Decoder> net =
          data_parallel_fsdp
              ? shard_decoder(decoder, fo, prefetch_mode(spec, o), spec.backward_prefetch)
                                  : fsdp::Sharded<models::Decoder>(decoder);
      loss_ = [net](const at::Tensor& inputs, const at::Tensor& targets) mutable {
        return models::lm_loss(net(inputs), targets);
      };
      model_ = decoder.ptr();
    }
    optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(),
                                                       torch::optim::AdamWOptions(o.lr));
    if (spec.kind == Kind::Ddp) {
      int64_t total = 0;
      for (const auto& p : model_->parameters()) total += p.numel();
      if (total > INT_MAX) throw std::invalid_argument("DDP bucket above INT_MAX elements");
      bucket_ = at::zeros({total}, model_->parameters().front().options());
    }
  }

  const ConfigSpec& spec() const { return spec_; }
  int account() const { return account_; }
  // Name of the tp process group; empty without TP.
  const std::string& tp_group() const { return tp_group_; }
  // This rank's share of a global batch: the whole of it for single, the
  // slice of its data-parallel coordinate otherwise.
  at::Tensor share(const at::Tensor& global) const {
    return models::rank_slice(global, data_rank_, data_size_).to(device_);
  }

  // One training step on `inputs` -> `targets` (this rank's share). With
  // `record`, appends its phase times to phase_us() (and, pipelined, the
  // schedule's step and busy times to pipeline_steps()).
  void step(const at::Tensor& inputs, const at::Tensor& targets, bool record = false) {
    using Clock = std::chrono::steady_clock;
    const CountingAllocator::Scope scope(account_);
    // On a GPU the phases end when their kernels do, not when they are queued.
    const auto now = [this] {
      if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
      return Clock::now();
    };
    const auto t0 = now();
    optimizer_->zero_grad();
    at::Tensor loss;
    std::optional<fsdp::pp::StepResult> pipelined;
    if (spec_.kind == Kind::FsdpPp) {
      // Forward and backward of every microbatch; the first stage's ranks
      // take the inputs, the last stage's the targets.
      pipelined = schedule_->step(has_first_ ? inputs : at::Tensor(),
                                  has_last_ ? targets : at::Tensor());
    } else {
      loss = loss_(inputs, targets);
    }
    const auto t1 = now();
    if (!pipelined) loss.backward();
    const auto t2 = now();
    if (spec_.kind == Kind::Ddp) all_reduce_gradients();
    if (tied_.defined()) models::sum_tied_gradients(tied_, pp_group_, tied_peer_);
    const auto t3 = now();
    optimizer_->step();
    const auto t4 = now();
    if (pipelined) {
      last_step_ = *pipelined;
      if (record) pipeline_steps_.push_back(*pipelined);
    } else {
      last_loss_ = loss.detach();
    }
    if (record) {
      for (const auto& [a, b] : {std::pair{t0, t1}, {t1, t2}, {t2, t3}, {t3, t4}}) {
        phase_us_.push_back(std::chrono::duration<double, std::micro>(b - a).count());
      }
    }
  }
  // Phases: zero_grad + forward + loss (FSDP: with its all-gather waits;
  // pipelined: the whole schedule step, backward included), backward (FSDP:
  // with its reduce-scatters), DDP's all-reduce or the pipeline's tied
  // gradient exchange, AdamW step.
  static constexpr size_t kPhases = 4;
  // [recorded step][phase], microseconds on this rank.
  const std::vector<double>& phase_us() const { return phase_us_; }
  // Pipelined: the schedule's results of the recorded steps.
  const std::vector<fsdp::pp::StepResult>& pipeline_steps() const { return pipeline_steps_; }

  // This rank's loss of the last step, such that the mean over the world's
  // ranks is the global batch's loss. Pipelined: the global mean itself
  // (broadcast_loss over pp and dp: collective over the world).
  double last_loss() const {
    if (spec_.kind == Kind::FsdpPp) {
      return fsdp::pp::broadcast_loss(last_step_, *pp_mesh_, num_stages_, dp_mesh_);
    }
    return last_loss_.defined() ? last_loss_.item<double>() : 0.0;
  }

  // Bytes held between steps: parameters (local shards under FSDP),
  // gradients and AdamW state, as sums of tensor sizes.
  struct Persistent {
    int64_t params = 0, grads = 0, optimizer = 0;
    int64_t total() const { return params + grads + optimizer; }
  };
  Persistent persistent() const {
    Persistent out;
    for (const auto& p : model_->parameters()) {
      out.params += nbytes(p);
      out.grads += nbytes(p.grad());
    }
    for (const auto& entry : optimizer_->state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      out.optimizer += nbytes(s.exp_avg()) + nbytes(s.exp_avg_sq()) + nbytes(s.max_exp_avg_sq());
    }
    return out;
  }

 private:
  // The whole DDP synchronisation: flatten, one MPI_Allreduce, mean, unflatten.
  void all_reduce_gradients() {
    const auto params = model_->parameters();
    int64_t offset = 0;
    for (const auto& p : params) {
      at::Tensor slot = bucket_.narrow(0, offset, p.numel());
      if (p.grad().defined()) {
        slot.copy_(p.grad().reshape({-1}));
      } else {
        slot.zero_();
      }
      offset += p.numel();
    }
    const int rc = MPI_Allreduce(MPI_IN_PLACE, bucket_.data_ptr<float>(),
                                 static_cast<int>(bucket_.numel()), MPI_FLOAT, MPI_SUM, comm_);
    if (rc != MPI_SUCCESS) throw std::runtime_error(fmt::format("MPI_Allreduce returned {}", rc));
    bucket_.div_(world_);
    offset = 0;
    for (auto p : params) {
      if (p.grad().defined()) {
        p.mutable_grad().view({-1}).copy_(bucket_.narrow(0, offset, p.numel()));
      }
      offset += p.numel();
    }
  }

  // This rank's stages of `decoder` (rank r: stages r, r + pp, ...), each
  // sharded layer by layer then as a whole over dp, and their schedule.
  void build_pipeline(const models::Decoder& decoder, fsdp::FullyShardOptions fo,
                      const Options& o, const fsdp::DeviceMesh& mesh) {
    pp_mesh_ = mesh["pp"];
    dp_mesh_ = mesh["dp"];
    pp_group_ = mesh.get_group("pp");
    data_rank_ = mesh.get_local_rank("dp");
    data_size_ = static_cast<int>(mesh.size("dp"));
    const int pp = static_cast<int>(mesh.size("pp"));
    const int pp_rank = mesh.get_local_rank("pp");
    num_stages_ = pp * spec_.stages_per_rank;
    fo.mesh = mesh["dp"];
    fo.shard_dim = "dp";
    auto local = std::make_shared<torch::nn::Module>("PipelineRank");
    std::vector<fsdp::pp::PipelineStage> stages;
    bool tied_copy = false;
    for (int v = 0; v < spec_.stages_per_rank; ++v) {
      const int stage = pp_rank + v * pp;
      models::DecoderStage s(*decoder, stage, num_stages_);
      for (const auto& child : s->named_children()) {
        local->register_module(child.key(), child.value());
      }
      for (auto& layer : s->layers) fsdp::fully_shard(layer.holder(), fo);
      fsdp::fully_shard(s, fo);
      has_first_ = has_first_ || s->is_first;
      has_last_ = has_last_ || s->is_last;
      tied_copy = tied_copy || s->tied_copy;
      stages.emplace_back(s, stage, num_stages_, *pp_mesh_);
    }
    const auto named = local->named_parameters();
    if (has_first_ && !has_last_ && decoder->config.tie_output) {
      tied_ = named["embed.weight"];
      tied_peer_ = pp - 1;
    } else if (tied_copy) {
      tied_ = named["output.weight"];
      tied_peer_ = 0;
    }
    fsdp::pp::LossSpec loss;
    loss.sum = models::lm_loss_sum;
    loss.count = models::lm_loss_count;
    fsdp::pp::ScheduleOptions options;
    options.dp_mesh = mesh["dp"];
    const int local_batch = o.batch / data_size_;
    schedule_ = std::make_unique<fsdp::pp::Schedule>(
        std::move(stages), spec_.schedule, o.microbatches > 0 ? o.microbatches : local_batch,
        loss, options);
    model_ = local;
  }

  // models::MoEDecoder of the same dims and seed, its library form on
  // mesh's ep; dense units over the flattened mesh, MoE layers with the
  // experts on efsdp.
  void build_moe(const models::DecoderConfig& cfg, fsdp::FullyShardOptions fo, const Options& o,
                 const fsdp::DeviceMesh& mesh) {
    models::MoEDecoderConfig mc;
    mc.vocab = cfg.vocab;
    mc.hidden = cfg.hidden;
    mc.heads = cfg.heads;
    mc.layers = cfg.layers;
    mc.seq = cfg.seq;
    mc.experts = kExperts;
    mc.top_k = kTopK;
    models::MoEDecoder plain(mc);
    models::init_weights(*plain, o.seed);
    models::MoEDecoder net(mc, models::MoEForm::Library, mesh["ep"]);
    net->load_full(*plain);
    fo.mesh = mesh.flatten("shard");
    for (auto& layer : net->dense_layers) fsdp::fully_shard(layer.holder(), fo);
    for (auto& layer : net->moe_layers) {
      fsdp::fully_shard(layer.holder(),
                        fsdp::moe::expert_options(*layer.holder().ptr(), fo, mesh["efsdp"],
                                                  static_cast<double>(world_)));
    }
    fsdp::Sharded<models::MoEDecoder> root = fsdp::fully_shard(net, fo);
    loss_ = [root](const at::Tensor& inputs, const at::Tensor& targets) mutable {
      return models::lm_loss(root(inputs), targets);
    };
    model_ = net.ptr();
  }

  ConfigSpec spec_;
  int account_;
  MPI_Comm comm_;
  c10::Device device_;
  int world_ = 1;
  int data_rank_ = 0, data_size_ = 1;
  std::string tp_group_;
  // FsdpPp only.
  std::optional<fsdp::DeviceMesh> pp_mesh_, dp_mesh_;
  fsdp::ProcessGroupPtr pp_group_;
  int num_stages_ = 1;
  bool has_first_ = false, has_last_ = false;
  at::Tensor tied_;  // this rank's member of the tied pair, if any
  int tied_peer_ = -1;
  std::unique_ptr<fsdp::pp::Schedule> schedule_;
  fsdp::pp::StepResult last_step_;
  std::vector<fsdp::pp::StepResult> pipeline_steps_;
  std::shared_ptr<torch::nn::Module> model_;
  // Forward and mean cross-entropy of this rank's share.
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  at::Tensor bucket_;  // DDP only
  at::Tensor last_loss_;
  std::vector<double> phase_us_;
};

std::vector<Column> columns() {
  const std::string step = "step time";
  const std::string mem = "memory per rank";
  return {
      {"config", "config", "", 19, -1, ""},
      {"step_ms", "median", "(ms)", 9, 1, step},
      {"step_min_ms", "min", "(ms)", 9, 1, step},
      {"step_max_ms", "max", "(ms)", 0, 1, step},
      {"vs_ddp", "vs DDP", "(x)", 7, 3, step},
      {"vs_single", "vs single", "(x)", 9, 3, step},
      {"persistent_mib", "persistent", "(MiB)", 10, 2, mem},
      {"vs_single_over_n", "vs single/N", "(x)", 11, 3, mem},
      {"held_mib", "held", "(MiB)", 8, 2, mem},
      {"peak_mib", "peak", "(MiB)", 8, 2, mem},
      {"forward_ms", "fwd", "(ms)", 7, 1, "phases (median)"},
      {"backward_ms", "bwd", "(ms)", 7, 1, "phases (median)"},
      {"sync_ms", "sync", "(ms)", 7, 1, "phases (median)"},
      {"optimizer_ms", "optim", "(ms)", 7, 1, "phases (median)"},
      {"collectives_per_step", "AG/RS/AR", "per step", 9, -1, ""},
      {"tp_collectives_per_step", "tp AG/RS/AR", "per step", 11, -1, ""},
      {"bubble", "bubble", "(frac)", 7, 3, ""},
      {"persistent_bytes", "", "", 0, -1, mem},
      {"params_bytes", "", "", 0, -1, mem},
      {"grads_bytes", "", "", 0, -1, mem},
      {"optimizer_bytes", "", "", 0, -1, mem},
      {"held_bytes", "", "", 0, -1, mem},
      {"peak_bytes", "", "", 0, -1, mem},
      {"comm_bytes_per_step", "", "", 0, -1, ""},
      {"final_loss", "", "", 0, -1, ""},
  };
}

// num / den, or "-" where the reference did not run (den 0).
Cell ratio_or_dash(double num, double den) {
  if (den <= 0) return std::string("-");
  return num / den;
}

int run(Options o, const fsdp::Runtime& rt) {
  CountingAllocator& alloc = CountingAllocator::get();
  alloc.install();
  const int world = rt.world_size();
  const int rank = rt.world_rank();

  models::DecoderConfig cfg;
  if (o.seq > 0) cfg.seq = o.seq;
  if (o.layers > 0) cfg.layers = o.layers;
  if (o.hidden > 0) cfg.hidden = o.hidden;
  if (o.vocab > 0) cfg.vocab = o.vocab;
  if (o.heads > 0) cfg.heads = o.heads;
  std::vector<ConfigSpec> specs;
  for (const ConfigSpec& s : all_configs()) {
    if (o.configs.empty() ||
        std::find(o.configs.begin(), o.configs.end(), s.key) != o.configs.end()) {
      specs.push_back(s);
    }
  }
  if (o.device == "cuda") {
    // DDP's MPI_Allreduce and the TP, pipeline and expert-parallel configs
    // build CPU meshes; on a GPU the run compares single with the fsdp ones.
    auto cpu_only = [](const ConfigSpec& s) {
      return s.kind != Kind::Single && s.kind != Kind::Fsdp && s.kind != Kind::Hsdp;
    };
    std::vector<std::string> named;
    for (const ConfigSpec& s : specs) {
      if (cpu_only(s) && !o.configs.empty()) named.push_back(s.key);
    }
    std::string bad;
    if (!rt.device().is_cuda()) {
      bad = fmt::format("--device cuda: LibTorch {} sees no CUDA device here (a CPU build, or no "
                        "GPU visible); accepted: cpu, cuda",
                        TORCH_VERSION);
    } else if (!named.empty()) {
      bad = fmt::format("--configs {}: CPU only; with --device cuda: single, {}",
                        fmt::join(named, ","), data_parallel_fsdp_keys());
    }
    if (!bad.empty()) {
      if (rank == 0) std::cerr << "fsdp-bench train: " << bad << '\n';
      return 1;
    }
    specs.erase(std::remove_if(specs.begin(), specs.end(), cpu_only), specs.end());
    o.resolved_device = rt.device();
  }
  // Drops the configs of `kind` when `fits` is false, and says why ("" when
  // nothing was dropped); returns whether any config of `kind` is left.
  auto drop_unless = [&specs](Kind kind, bool fits, const std::string& why, std::string& skipped) {
    auto of_kind = [kind](const ConfigSpec& s) { return s.kind == kind; };
    if (!fits) {
      for (const ConfigSpec& s : specs) {
        if (of_kind(s)) skipped += (skipped.empty() ? "" : ", ") + s.key;
      }
      if (!skipped.empty()) skipped += " skipped: " + why;
      specs.erase(std::remove_if(specs.begin(), specs.end(), of_kind), specs.end());
    }
    return std::any_of(specs.begin(), specs.end(), of_kind);
  };
  const auto default_needs_even = [world](const char* flag) {
    return fmt::format("the default {} 2 needs an even world size, not {}", flag, world);
  };
  const int tp = o.tp > 0 ? o.tp : 2;
  auto is_tp = [](const ConfigSpec& s) { return s.kind == Kind::FsdpTp; };
  std::string tp_skipped, pp_skipped, ep_skipped, hsdp_skipped;
  const bool any_tp =
      drop_unless(Kind::FsdpTp, o.tp > 0 || world % tp == 0, default_needs_even("--tp"), tp_skipped);
  const int pp = o.pp > 0 ? o.pp : 2;
  auto is_pp = [](const ConfigSpec& s) { return s.kind == Kind::FsdpPp; };
  const bool any_pp =
      drop_unless(Kind::FsdpPp, o.pp > 0 || world % pp == 0, default_needs_even("--pp"), pp_skipped);
  const int ep = o.ep > 0 ? o.ep : 2;
  auto is_ep = [](const ConfigSpec& s) { return s.kind == Kind::FsdpEp; };
  const bool any_ep =
      drop_unless(Kind::FsdpEp, o.ep > 0 || world % ep == 0, default_needs_even("--ep"), ep_skipped);
  // HSDP needs at least two replicas of a 2-rank shard group.
  const bool any_hsdp = drop_unless(
      Kind::Hsdp, world % 2 == 0 && world >= 4,
      fmt::format("a (replicate, shard = 2) mesh needs an even world size of 4 or more, not {}",
                  world),
      hsdp_skipped);
  // The pipelines' data-parallel size, batch and microbatches.
  const int pp_dp = world % pp == 0 ? world / pp : 1;
  const int pp_local_batch = o.batch / pp_dp;
  const int microbatches = o.microbatches > 0 ? o.microbatches : pp_local_batch;
  const bool any_parallel = std::any_of(specs.begin(), specs.end(),
                                        [](const ConfigSpec& s) { return s.kind != Kind::Single; });
  std::string bad;
  if (any_parallel && o.batch % world != 0) {
    bad = fmt::format("--batch {} is not a multiple of the world size {}", o.batch, world);
  } else if (any_tp && world % tp != 0) {
    bad = fmt::format("--tp {} does not divide the world size {}", tp, world);
  } else if (cfg.hidden % cfg.heads != 0) {
    bad = fmt::format("--hidden {} is not a multiple of --heads {}", cfg.hidden, cfg.heads);
  } else if (any_ep && (world % ep != 0 || kExperts % ep != 0)) {
    bad = fmt::format("--ep {} does not divide both the world size {} and the {} experts", ep,
                      world, kExperts);
  } else if (any_pp && world % pp != 0) {
    bad = fmt::format("--pp {} does not divide the world size {}", pp, world);
  } else if (any_pp && pp_local_batch % microbatches != 0) {
    bad = fmt::format("--microbatches {} does not divide the per-pipeline batch {} (--batch {} / "
                      "{} data-parallel ranks)",
                      microbatches, pp_local_batch, o.batch, pp_dp);
  }
  for (const ConfigSpec& s : specs) {
    if (!bad.empty() || !is_pp(s)) continue;
    const int stages = pp * s.stages_per_rank;
    if (cfg.layers % stages != 0) {
      bad = fmt::format("{}: --layers {} do not split into {} pipeline stages ({} per rank)",
                        s.key, cfg.layers, stages, s.stages_per_rank);
    } else if (s.schedule != fsdp::pp::ScheduleKind::GPipe && microbatches < pp) {
      bad = fmt::format("{}: --microbatches {} is below --pp {}", s.key, microbatches, pp);
    } else if (s.schedule == fsdp::pp::ScheduleKind::Interleaved1F1B && microbatches % pp != 0) {
      bad = fmt::format("{}: --microbatches {} is not a multiple of --pp {}", s.key, microbatches,
                        pp);
    }
  }
  const std::string json_problem = json_path_problem(o.json_path, MPI_COMM_WORLD);
  if (bad.empty()) bad = json_problem;
  if (!bad.empty()) {
    // Every rank sees the same numbers and returns alike.
    if (rank == 0) std::cerr << "fsdp-bench train: " << bad << '\n';
    return 1;
  }

  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);

  Report report("train", columns(), o.json_path, rank == 0);
  report.note(fmt::format(
      "fsdp-bench train: models::Decoder vocab {} hidden {} heads {} layers {} ffn {} seq {} "
      "(tied output), {}; global batch {} x {} tokens; AdamW lr {}; {} timed steps after "
      "{} warm-up; seed {}",
      cfg.vocab, cfg.hidden, cfg.heads, cfg.layers, cfg.ffn_dim(), cfg.seq,
      o.param_dtype == "float32" ? std::string("float32")
                                 : "fsdp*/hsdp " + o.param_dtype +
                                       " parameters with float32 reduction, the rest float32",
      o.batch, cfg.seq,
      o.lr, o.timing.iters, o.timing.warmup, o.seed));
  report.meta("model", {{"vocab", cfg.vocab}, {"hidden", cfg.hidden}, {"heads", cfg.heads},
                        {"layers", cfg.layers}, {"ffn", cfg.ffn_dim()}, {"seq", cfg.seq},
                        {"tie_output", cfg.tie_output}});
  report.meta("global_batch", o.batch);
  report.meta("steps", o.timing.iters);
  report.meta("warmup", o.timing.warmup);
  report.meta("seed", o.seed);
  report.meta("lr", o.lr);
  report.meta("param_dtype", o.param_dtype,
              o.param_dtype == "float32"
                  ? ""
                  : "fsdp*, hsdp (not tp/pp/ep): MixedPrecisionPolicy param_dtype " +
                        o.param_dtype + ", reduce_dtype float32; every other config float32");
  report.meta("forward_prefetch", o.forward_prefetch ? "explicit" : "implicit",
              o.forward_prefetch ? "FSDP configs: explicit forward prefetch of the next unit"
                                 : "");
  add_runtime_meta(report, rt);
  report.meta("tensor_device", o.resolved_device.str(),
              fmt::format("models and batches on {} (--device)", o.resolved_device.str()));
  report.meta("tp", any_tp ? nlohmann::json(tp) : nlohmann::json(nullptr),
              any_tp ? fmt::format("fsdp-tp*: mesh (shard={}, tp={})", world / tp, tp)
                     : tp_skipped);
  report.meta("pp",
              any_pp ? nlohmann::json({{"size", pp}, {"dp", pp_dp}, {"microbatches", microbatches}})
                     : nlohmann::json(nullptr),
              any_pp ? fmt::format("fsdp-pp*: mesh (pp={}, dp={}), {} microbatches of {} "
                                   "sequence(s) per pipeline",
                                   pp, pp_dp, microbatches, pp_local_batch / microbatches)
                     : pp_skipped);
  report.meta("ep", any_ep ? nlohmann::json({{"size", ep}, {"efsdp", world / ep},
                                              {"experts", kExperts}, {"top_k", kTopK}})
                            : nlohmann::json(nullptr),
              any_ep ? fmt::format("fsdp-ep-moe: mesh (efsdp={}, ep={}), {} experts per MoE layer, "
                                   "top-{}",
                                   world / ep, ep, kExperts, kTopK)
                     : ep_skipped);
  report.meta("hsdp", any_hsdp ? nlohmann::json({{"replicate", world / 2}, {"shard", 2}})
                               : nlohmann::json(nullptr),
              any_hsdp ? fmt::format("hsdp: mesh (replicate={}, shard=2)", world / 2)
                       : hsdp_skipped);
  for (const ConfigSpec& s : specs) report.note(fmt::format("{:>19}: {}", s.key, s.legend));
  report.note("step: zero_grad + forward + loss + backward (+ DDP all-reduce) + AdamW step; "
              "each step after a barrier; time = slowest rank; configs interleaved step by "
              "step");
  report.note("persistent = parameters as held between steps (local shards under FSDP) + "
              "gradients + AdamW state, sums of tensor sizes, max over ranks");
  report.note("held / peak = LibTorch CPU-allocator bytes owned by the config between steps / "
              "at the highest point of a step, libfsdp's shared-memory arenas included "
              "(fsdp::set_shared_memory_observer) (max over timed steps and ranks; BLAS and MPI "
              "scratch not counted)");
  if (o.resolved_device.is_cuda()) {
    report.note(fmt::format("--device cuda: models, batches and meshes on {}; held / peak count "
                            "host memory only; each phase ends with a device synchronize",
                            o.resolved_device.str()));
  }
  report.note("phases (median over steps of the slowest rank): fwd = zero_grad + forward + "
              "loss (FSDP: with its all-gather waits; TP: with its tp collectives), bwd = "
              "backward (FSDP: with its reduce-scatters), sync = DDP's all-reduce, optim = "
              "AdamW step");
  report.note("AG/RS/AR = libfsdp all-gathers / reduce-scatters / all-reduces per step (one "
              "extra untimed step) on every group but tp: FSDP's, over shard (a size-1 dim "
              "issues none); DDP's single MPI_Allreduce is outside libfsdp");
  if (any_tp) {
    report.note("tp AG/RS/AR = the same on the tp group: TP's activation collectives and "
                "FSDP's all-reduce of gradients partial over tp (the SP norm weights)");
  }
  if (any_pp) {
    report.note("fsdp-pp*: fwd = the whole schedule step (every microbatch's forward and "
                "backward, the p2p transfers, FSDP's collectives), bwd = 0, sync = the tied "
                "embedding/output gradient exchange; bubble = fsdp::pp::bubble_fraction (idle "
                "share of the slowest rank's schedule step), median over the timed steps");
  }

  std::optional<fsdp::DeviceMesh> mesh, tp_mesh;
  if (std::any_of(specs.begin(), specs.end(),
                  [](const ConfigSpec& s) { return s.kind == Kind::Fsdp; })) {
    mesh = fsdp::init_device_mesh(o.resolved_device.type(), {world}, {"shard"});
  }
  if (any_tp) tp_mesh = fsdp::init_device_mesh("cpu", {world / tp, tp}, {"shard", "tp"});
  std::optional<fsdp::DeviceMesh> hsdp_mesh;
  if (any_hsdp) {
    hsdp_mesh = fsdp::init_device_mesh(o.resolved_device.type(), {world / 2, 2},
                                       {"replicate", "shard"});
  }
  std::optional<fsdp::DeviceMesh> pp_mesh, pp_world, ep_mesh;
  if (any_pp) {
    pp_mesh = fsdp::init_device_mesh("cpu", {pp, pp_dp}, {"pp", "dp"});
    pp_world = pp_mesh->flatten("world");  // bubble_fraction's group
  }
  if (any_ep) ep_mesh = fsdp::init_device_mesh("cpu", {world / ep, ep}, {"efsdp", "ep"});
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (size_t i = 0; i < specs.size(); ++i) {
    trainers.push_back(std::make_unique<Trainer>(
        specs[i], static_cast<int>(i) + 1, cfg, o,
        is_tp(specs[i])   ? tp_mesh
        : is_pp(specs[i]) ? pp_mesh
        : is_ep(specs[i]) ? ep_mesh
        : specs[i].kind == Kind::Hsdp ? hsdp_mesh
                          : mesh,
        comm));
  }
  const size_t n = trainers.size();

  // The data: one global batch per round (one more for counting
  // collectives), the same for every configuration, as each one's share on
  // this rank.
  const int rounds = o.timing.warmup + o.timing.iters;
  struct Batch {
    at::Tensor inputs, targets;
  };
  std::vector<std::vector<Batch>> data(n);  // [config][round]
  for (int r = 0; r < rounds + 1; ++r) {
    at::Tensor tokens =
        models::random_tokens(o.seed * 1000 + static_cast<uint64_t>(r), o.batch, cfg.seq + 1,
                              cfg.vocab);
    const at::Tensor inputs = tokens.narrow(1, 0, cfg.seq);
    const at::Tensor targets = tokens.narrow(1, 1, cfg.seq);
    for (size_t i = 0; i < n; ++i) {
      data[i].push_back({trainers[i]->share(inputs), trainers[i]->share(targets)});
    }
  }

  // Each variant counts its own calls: time_interleaved calls every variant
  // once per round, warm-up rounds first.
  std::vector<int> calls(n, 0);
  std::vector<int64_t> step_peak(n, 0), held(n, 0);
  std::vector<std::function<void()>> variants;
  for (size_t i = 0; i < n; ++i) {
    variants.push_back([&, i] {
      Trainer& t = *trainers[i];
      const Batch& b = data[i][static_cast<size_t>(calls[i])];
      const bool timed = calls[i]++ >= o.timing.warmup;
      if (timed) alloc.reset_peak(t.account());
      t.step(b.inputs, b.targets, timed);
      if (timed) {
        step_peak[i] = std::max(step_peak[i], alloc.peak(t.account()));
        held[i] = alloc.live(t.account());
      }
    });
  }
  const std::vector<Stats> stats = time_interleaved(comm, variants, o.timing);

  // After timing: losses, persistent bytes, then one more step per config
  // to count its collectives.
  std::vector<double> losses(n);
  std::vector<int64_t> mem;  // per config: persistent, params, grads, optimizer, held, peak
  for (size_t i = 0; i < n; ++i) {
    const Trainer& t = *trainers[i];
    // Data-parallel losses are of this rank's slice of the batch, so
    // the mean over ranks is the global batch's loss (single: the same on
    // every rank).
    losses[i] = t.last_loss() / world;
    const Trainer::Persistent p = t.persistent();
    mem.insert(mem.end(), {p.total(), p.params, p.grads, p.optimizer, held[i], step_peak[i]});
  }
  losses = sum_over_ranks(comm, losses);
  mem = max_over_ranks(comm, mem);
  // Pipelined: the median bubble over the timed steps (collective, -1 elsewhere).
  std::vector<double> bubble(n, -1.0);
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> fractions;
    for (const auto& r : trainers[i]->pipeline_steps()) {
      fractions.push_back(fsdp::pp::bubble_fraction(r, *pp_world));
    }
    if (!fractions.empty()) bubble[i] = summarize(fractions).median_us;
  }
  // Per config and phase: median over timed steps of the slowest rank's time.
  std::vector<std::array<double, Trainer::kPhases>> phase_ms(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<double> us = max_over_ranks(comm, trainers[i]->phase_us());
    for (size_t ph = 0; ph < Trainer::kPhases; ++ph) {
      std::vector<double> column;
      for (size_t k = ph; k < us.size(); k += Trainer::kPhases) column.push_back(us[k]);
      phase_ms[i][ph] = summarize(column).median_us / 1e3;
    }
  }
  // Per config: AG, RS, AR off the tp group, the same on it, bytes; and
  // the all-to-alls (the expert-parallel config's dispatch and combine).
  std::vector<std::array<int64_t, 7>> comm_counts(n);
  std::vector<int64_t> all_to_alls(n, 0);
  for (size_t i = 0; i < n; ++i) {
    MPI_Barrier(comm);
    fsdp::reset_collective_counters();
    const Batch& b = data[i].back();
    trainers[i]->step(b.inputs, b.targets);
    const fsdp::CollectiveCounters c = fsdp::collective_counters();
    all_to_alls[i] = c.total("all_to_all");
    int64_t bytes = 0;
    for (const auto& entry : c.bytes) bytes += entry.second;
    if (trainers[i]->spec().kind == Kind::Ddp) bytes = trainers[i]->persistent().grads;
    const std::string& tpg = trainers[i]->tp_group();
    // total(op, "") would be every group's.
    auto on_tp = [&](const char* op) { return tpg.empty() ? 0 : c.total(op, tpg); };
    const int64_t ag = on_tp("all_gather"), rs = on_tp("reduce_scatter"),
                  ar = on_tp("all_reduce");
    comm_counts[i] = {c.total("all_gather") - ag, c.total("reduce_scatter") - rs,
                      c.total("all_reduce") - ar, ag, rs, ar, bytes};
  }

  auto find = [&](const std::string& key) -> std::optional<size_t> {
    for (size_t i = 0; i < n; ++i) {
      if (specs[i].key == key) return i;
    }
    return std::nullopt;
  };
  const std::optional<size_t> single = find("single");
  const std::optional<size_t> ddp = find("ddp");
  // 0 where the reference configuration did not run.
  const double single_ms = single ? stats[*single].median_us / 1e3 : 0.0;
  const double ddp_ms = ddp ? stats[*ddp].median_us / 1e3 : 0.0;
  // DDP's replica holds exactly single's parameters, gradients and AdamW
  // state, so either gives the full model's persistent bytes.
  const std::optional<size_t> full = single ? single : ddp;
  const double ideal_share = full ? static_cast<double>(mem[*full * 6]) / world : 0.0;
  // HSDP shards over its shard dim (2) only: its ideal is single / 2.
  const auto ideal_for = [&](const ConfigSpec& s) {
    return s.kind == Kind::Hsdp ? ideal_share * world / 2 : ideal_share;
  };

  for (size_t i = 0; i < n; ++i) {
    const int64_t* m = &mem[i * 6];
    const double ms = stats[i].median_us / 1e3;
    const auto& cc = comm_counts[i];
    const std::string colls = trainers[i]->spec().kind == Kind::Ddp
                                  ? std::string("0/0/0+1")
                                  : fmt::format("{}/{}/{}", cc[0], cc[1], cc[2]);
    const std::string tp_colls = trainers[i]->tp_group().empty()
                                     ? std::string("-")
                                     : fmt::format("{}/{}/{}", cc[3], cc[4], cc[5]);
    report.row({specs[i].key, ms, stats[i].min_us / 1e3, stats[i].max_us / 1e3,
                ratio_or_dash(ms, ddp_ms), ratio_or_dash(ms, single_ms),
                static_cast<double>(m[0]) / kMiB,
                is_ep(specs[i]) ? Cell(std::string("-"))
                                : ratio_or_dash(static_cast<double>(m[0]), ideal_for(specs[i])),
                static_cast<double>(m[4]) / kMiB, static_cast<double>(m[5]) / kMiB,
                phase_ms[i][0], phase_ms[i][1], phase_ms[i][2], phase_ms[i][3], colls, tp_colls,
                bubble[i] >= 0 ? Cell(bubble[i]) : Cell(std::string("-")), m[0], m[1], m[2],
                m[3], m[4], m[5], cc[6], losses[i]});
  }
  if (ddp) {
    report.note(fmt::format("{:>19}: '+1' = its one raw MPI_Allreduce of {:.2f} MiB per step",
                            "ddp", static_cast<double>(mem[*ddp * 6 + 2]) / kMiB));
  }

  // Same data and seed: every configuration of the dense decoder should
  // reach the same loss (the MoE decoder is another model).
  double loss_lo = 0, loss_hi = 0;
  bool first_loss = true;
  for (size_t i = 0; i < n; ++i) {
    if (is_ep(specs[i])) continue;
    loss_lo = first_loss ? losses[i] : std::min(loss_lo, losses[i]);
    loss_hi = first_loss ? losses[i] : std::max(loss_hi, losses[i]);
    first_loss = false;
  }
  report.summary("final_loss_spread", loss_hi - loss_lo,
                 fmt::format("loss after the last timed step: {:.6f} .. {:.6f} across configs "
                             "(same seed and data: they should agree)",
                             loss_lo, loss_hi));

  const std::optional<size_t> fsdp = find("fsdp");
  if (fsdp && ddp) {
    const double r = stats[*fsdp].median_us / stats[*ddp].median_us;
    const bool applies = world == kStepTargetWorld;
    report.summary("step_ratio_fsdp_vs_ddp", r);
    report.summary("step_target_met", applies ? nlohmann::json(r <= kStepTarget) : nullptr,
                   fmt::format("target FSDP (default reshard_after_forward) step <= {:.2f}x DDP at "
                               "np {}: {:.3f}x -> {}",
                               kStepTarget, kStepTargetWorld, r,
                               !applies ? "n/a at this world size"
                                        : (r <= kStepTarget ? "MET" : "NOT MET")));
  } else {
    report.summary("step_target_met", nullptr,
                   "target FSDP step <= 1.05x DDP: not evaluated (needs configs fsdp and ddp)");
  }
  if (any_pp) {
    nlohmann::json ratio = nlohmann::json::object(), bubbles = nlohmann::json::object();
    std::string text;
    for (size_t i = 0; i < n; ++i) {
      if (!is_pp(specs[i])) continue;
      const double ms = stats[i].median_us / 1e3;
      ratio[specs[i].key] = ddp ? nlohmann::json(ms / ddp_ms) : nlohmann::json(nullptr);
      bubbles[specs[i].key] = bubble[i];
      text += fmt::format("{}{} {:.1f} ms{}, bubble {:.3f}", text.empty() ? "" : "; ",
                          specs[i].key, ms,
                          ddp ? fmt::format(" ({:.3f}x DDP)", ms / ddp_ms) : std::string(),
                          bubble[i]);
    }
    report.summary("step_ratio_pp_vs_ddp", ratio);
    report.summary("pipeline_bubble", bubbles,
                   fmt::format("pipelines (pp={}, dp={}, {} microbatches): {}", pp, pp_dp,
                               microbatches, text));
  }
  if (any_ep) {
    for (size_t i = 0; i < n; ++i) {
      if (!is_ep(specs[i])) continue;
      const double ms = stats[i].median_us / 1e3;
      report.summary("step_ratio_ep_vs_ddp",
                     ddp ? nlohmann::json(ms / ddp_ms) : nlohmann::json(nullptr),
                     fmt::format("{} {:.1f} ms{}, loss {:.6f} (the MoE decoder; {} all-to-alls "
                                 "per step)",
                                 specs[i].key, ms,
                                 ddp ? fmt::format(" ({:.3f}x DDP of the dense decoder)",
                                                   ms / ddp_ms)
                                     : std::string(),
                                 losses[i], all_to_alls[i]));
    }
  }
  if (full) {
    nlohmann::json per = nlohmann::json::object();
    std::string text;
    bool fsdp_met = true;
    for (size_t i = 0; i < n; ++i) {
      const Kind k = specs[i].kind;
      if (k != Kind::Fsdp && k != Kind::Hsdp && k != Kind::FsdpTp) continue;
      const double r = static_cast<double>(mem[i * 6]) / ideal_for(specs[i]);
      per[specs[i].key] = r;
      fsdp_met = fsdp_met && r <= kMemoryTarget;
      text += fmt::format("{}{} {:.4f}x", text.empty() ? "" : ", ", specs[i].key, r);
    }
    report.summary("persistent_vs_single_over_n", per);
    report.summary("memory_target_met", text.empty() ? nullptr : nlohmann::json(fsdp_met),
                   text.empty() ? "target FSDP persistent <= single/N + 2%: no FSDP config run"
                                : fmt::format("target FSDP persistent bytes/rank <= single/N + "
                                              "{:.0f}% (hsdp: single/2, its shard size): {} -> {}",
                                              (kMemoryTarget - 1) * 100, text,
                                              fsdp_met ? "MET" : "NOT MET"));
  } else {
    report.summary("memory_target_met", nullptr,
                   "target FSDP persistent <= single/N + 2%: not evaluated (needs config "
                   "single or ddp)");
  }
  report.finish();

  trainers.clear();
  MPI_Comm_free(&comm);
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, Command& chosen) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "train",
      "Training step time and memory per rank of the LLM decoder: single-process, DDP "
      "(one MPI_Allreduce) and FSDP variants on the same model and global batch. Run under "
      "mpiexec; rank 0 prints.");
  sub->add_option("--batch", o->batch, "Global batch in sequences (a multiple of the ranks)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  sub->add_option("-n,--steps", o->timing.iters, "Timed steps per configuration")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  sub->add_option("-w,--warmup", o->timing.warmup, "Untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  const models::DecoderConfig defaults;
  sub->add_option("--seq", o->seq, "Sequence length")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str(std::to_string(defaults.seq));
  sub->add_option("--layers", o->layers, "Decoder layers")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->default_str(std::to_string(defaults.layers));
  sub->add_option("--hidden", o->hidden, "Hidden size (a multiple of --heads)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->default_str(std::to_string(defaults.hidden));
  sub->add_option("--heads", o->heads, "Attention heads")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->default_str(std::to_string(defaults.heads));
  sub->add_option("--vocab", o->vocab, "Vocabulary size")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->default_str(std::to_string(defaults.vocab));
  // CLI11 would read "-1" into the unsigned seed as 2^64 - 1.
  sub->add_option("--seed", o->seed, "Model and data seed, in [0, 2^64 - 1]")
      ->check(CLI::Validator(
          [](const std::string& text) {
            const auto first = text.find_first_not_of(" \t");
            return first != std::string::npos && text[first] == '-'
                       ? "must be an integer in [0, 2^64 - 1], not " + text
                       : std::string();
          },
          "UINT64"))
      ->capture_default_str();
  sub->add_flag("--forward-prefetch", o->forward_prefetch,
                "FSDP configs: each unit's forward prefetches the next unit's all-gather "
                "(set_modules_to_forward_prefetch); default: the library's implicit prefetch of "
                "the unit that ran next in the previous step");
  std::vector<std::string> names;
  for (const ConfigSpec& s : all_configs()) names.push_back(s.key);
  sub->add_option("--configs", o->configs, "Configurations to run, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember(names))
      ->default_str(fmt::format("{}", fmt::join(names, ",")));
  sub->add_option("--tp", o->tp,
                  "Tensor-parallel size of the fsdp-tp configs (a divisor of the ranks); mesh "
                  "(shard = ranks / tp, tp)")
      ->check(CLI::Range(1, 4096))
      ->default_str("2 if the world size is even, else those configs are skipped");
  sub->add_option("--pp", o->pp,
                  "Pipeline stages of the fsdp-pp configs (a divisor of the ranks; the "
                  "interleaved one runs 2 per rank); mesh (pp, dp = ranks / pp)")
      ->check(CLI::Range(1, 4096))
      ->default_str("2 if the world size is even, else those configs are skipped");
  sub->add_option("--microbatches", o->microbatches,
                  "Microbatches per step of the fsdp-pp configs (dividing the per-pipeline "
                  "batch, --batch / dp)")
      ->check(CLI::Range(1, 1 << 20))
      ->default_str("one per sequence of the per-pipeline batch");
  sub->add_option("--ep", o->ep,
                  "Expert-parallel size of the fsdp-ep-moe config (dividing the ranks and its 4 "
                  "experts); mesh (efsdp = ranks / ep, ep)")
      ->check(CLI::Range(1, 4096))
      ->default_str("2 if the world size is even, else that config is skipped");
  sub->add_option("--device", o->device,
                  "Where the models and batches live: cpu, or cuda (cuda:<local rank>; the "
                  "single and fsdp* configs only)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--param-dtype", o->param_dtype,
                  data_parallel_fsdp_keys() +
                      ": all-gather and compute dtype (MixedPrecisionPolicy param_dtype; "
                      "gradients reduced in float32); the other configs stay float32")
      ->check(CLI::IsMember({"float32", "bfloat16"}))
      ->capture_default_str();
  sub->add_option("--json", o->json_path,
                  "Write JSON: '--json' alone prints it to stdout instead of the table; "
                  "'--json FILE' keeps the table and writes FILE")
      ->expected(0, 1)
      ->default_str("-");
  sub->callback([o, &chosen] { chosen = [o](const fsdp::Runtime& rt) { return run(*o, rt); }; });
}

}  // namespace fsdp_bench
