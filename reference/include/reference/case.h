// The reference cases of the test plan's Level 3 (real networks) and the one
// runner that trains them under every layout the suite compares:
//
//   Single  one process, fp32: what fsdp-reference caches in HDF5;
//   DDP     an independent data-parallel baseline (full replicas, gradients
//           all-reduced with MPI_Allreduce after backward -- no libfsdp code);
//   FSDP    fully_shard per block and per sub-model root on a 1-D (FSDP) or
//           2-D (replicate, shard) HSDP mesh; with tensor parallelism, or
//           with expert parallelism (dp2ep: dense weights on (replicate,
//           efsdp x ep), experts on ep and (replicate, efsdp)).
//
// Every layout sees the same global batch per step (each rank takes its
// slice) and the same initial weights (from the case's seed), steps AdamW,
// and records per step the loss, the global gradient norm, named sub-norms,
// per-chunk losses (chunked CE) and the full values of the gradients and
// post-step parameters the plan's assertions name. Records are global: the
// mean loss over the global batch, norms over the whole model.
#pragma once

#include <fsdp/fully_shard.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ref {

enum class Layout { Single, DDP, FSDP };

// Tensor parallelism under FSDP: the case's TP form on a tp dim appended to
// the FSDP mesh (ranks of one tp group see the same data).
struct TPSpec {
  int64_t size = 1;  // 1: no TP
  bool sequence_parallel = false;
  bool loss_parallel = false;
};

// Expert parallelism under FSDP (PARALLELISM.md 6.1 (a), torchtitan's
// dp2ep): every rank sees different data; the case's EP form splits the
// experts over an ep dim of the world mesh (replicate, efsdp, ep).
struct EPSpec {
  int64_t size = 1;  // 1: no EP
};

struct RunSpec {
  Layout layout = Layout::Single;
  // FSDP: {dp} (1-D) or {replicate, shard} (HSDP); product * tp.size = world.
  // With EP: {replicate, efsdp}; product * ep.size = world.
  std::vector<int64_t> mesh_shape;
  // Every unit's (the root's too): true, false, or hpZ's rank count.
  fsdp::ReshardAfterForward reshard_after_forward = true;
  TPSpec tp;  // FSDP only
  EPSpec ep;  // FSDP only, not with TP
  // Where the model computes: built and its data drawn on the CPU (the same
  // values everywhere), then moved here; the mesh is of this device type.
  // DDP all-reduces through host copies. The cached references are Single
  // runs on the CPU.
  c10::Device device = c10::Device(c10::kCPU);
};

struct StepRecord {
  double loss = 0;
  double grad_norm = 0;
  std::map<std::string, double> norms;     // sub-model / layer gradient norms
  std::vector<double> chunk_losses;        // chunked CE only, global chunk order
  // Chunked CE only: the mean CE of the same logits computed in one piece
  // (the check that the chunks partition the loss).
  std::optional<double> unchunked_loss;
  std::map<std::string, at::Tensor> grads;   // full gradients (fp32, CPU)
  std::map<std::string, at::Tensor> params;  // full parameters after the step
  // MoE cases: per MoE layer the chosen experts [tokens, top_k] (int64) of
  // the global batch in token order, and the smallest routing margin (k-th
  // minus (k+1)-th score) over every layer and token (+inf without MoE).
  std::map<std::string, at::Tensor> routing;
  double routing_margin = std::numeric_limits<double>::infinity();
  // FSDP: this rank's collectives of the step in issue order, as
  // "<op>@<group role>" (roles: the mesh dims the runner built, e.g. dense,
  // efsdp, ep). Local, unlike the rest of the record; not stored.
  std::vector<std::string> collectives;
};

// Where a parameter lives in a run: its placements on its unit's mesh
// ("Shard(0)", "Replicate()", one per mesh dim, comma-separated; empty when
// no unit manages it: Single and DDP runs) and its local and full shapes.
struct ParamPlacement {
  std::string placements;
  std::vector<int64_t> local_shape;
  std::vector<int64_t> full_shape;
};

struct RunRecord {
  std::vector<StepRecord> steps;
  // Every parameter by name, as sharded before the first step. Local, like
  // StepRecord::collectives, and not stored: what "not sharded" is checked
  // on (the recorded gradients are full tensors under any layout).
  std::map<std::string, ParamPlacement> placements;
};

// What a case's forward produced on this rank's slice.
struct LocalLoss {
  at::Tensor loss;          // mean over the local slice (what backward starts from)
  // Chunked CE only (the others return {loss}):
  at::Tensor chunk_losses{};    // [chunks] local, each a share of `loss`
  at::Tensor unchunked_loss{};  // scalar: `loss` computed without chunking
};

// What a case's model routed in its last forward (MoE cases).
struct Routing {
  std::map<std::string, at::Tensor> ids;  // per MoE layer, this rank's tokens [T, top_k]
  double margin = std::numeric_limits<double>::infinity();  // over this rank's tokens
};

// A sharded unit and the prefix of its module's parameter names in the model.
struct Unit {
  std::string prefix;
  fsdp::FSDPModule module;
};

class Case {
 public:
  virtual ~Case() = default;
  // File stem of the reference: data/reference/<device>/<name>.h5.
  virtual std::string name() const = 0;
  // Test-plan ids this reference serves.
  virtual std::vector<std::string> plan_ids() const = 0;
  // Everything that determines the numbers: model dimensions, seed, steps,
  // global batch, optimizer. Its hash marks a cached reference stale.
  virtual nlohmann::json config() const = 0;
  // The model, initialised from the seed (same on every rank).
  virtual std::shared_ptr<torch::nn::Module> build() const = 0;
  // Its tensor-parallel form on the 1-D mesh `tp`, holding this rank's
  // slices of build()'s values under the same names. std::logic_error for a
  // case without one.
  virtual std::shared_ptr<torch::nn::Module> build_tp(const fsdp::DeviceMesh& tp,
                                                      const TPSpec& spec) const;
  // Its expert-parallel form: this rank's experts of the 1-D mesh `ep` and
  // build()'s values under the same names. std::logic_error for a case
  // without one.
  virtual std::shared_ptr<torch::nn::Module> build_ep(const fsdp::DeviceMesh& ep) const;
  // fully_shard of the EP form: as shard(), but the blocks that hold experts
  // shard them on `expert_mesh` ((replicate, efsdp)) with gradient divide
  // factor `data_parallel_size` (fsdp::moe::expert_options).
  // std::logic_error for a case without an EP form.
  virtual std::vector<Unit> shard_ep(const std::shared_ptr<torch::nn::Module>& model,
                                     const fsdp::FullyShardOptions& options,
                                     const fsdp::DeviceMesh& expert_mesh,
                                     double data_parallel_size) const;
  // Applies fully_shard bottom-up (blocks, sub-model roots, the root last)
  // with `options` as the base, and returns every unit.
  virtual std::vector<Unit> shard(const std::shared_ptr<torch::nn::Module>& model,
                                  const fsdp::FullyShardOptions& options) const = 0;
  // Forward on slice `rank` of `world` of step `step`'s global batch (the
  // data-parallel rank and size: tp ranks share a slice). Under the Single
  // and DDP layouts it must run no libfsdp code of its own (plan rule 1).
  virtual LocalLoss forward(const std::shared_ptr<torch::nn::Module>& model, int64_t step,
                            int64_t rank, int64_t world, Layout layout) const = 0;
  // Parameters (full names) whose gradients and post-step values are recorded.
  virtual std::vector<std::string> recorded() const = 0;
  // Named gradient norms: name -> parameter-name prefixes it covers.
  virtual std::map<std::string, std::vector<std::string>> sub_norms() const { return {}; }
  // Gradient norms the case computes from the model itself after the
  // synchronised backward (per-expert norms), the same on every rank.
  // Collective under FSDP: every rank calls it in the same order.
  virtual std::map<std::string, double> model_norms(const torch::nn::Module&) const { return {}; }
  // The routing of the last forward (none: the model does not route).
  virtual std::optional<Routing> routing(const torch::nn::Module&) const { return std::nullopt; }

  int64_t steps() const;
  double lr() const;
  // Global batch size (sequences / images per step); divisible by 4.
  int64_t global_batch() const;
};

// Registered cases, by name: llm_decoder, chunked_ce, vit, multimodal, moe_llm.
std::vector<std::string> case_names();
// ArgumentError-style std::invalid_argument naming the known cases.
std::unique_ptr<Case> make_case(const std::string& name);

// config() plus what the case records (recorded(), sub_norms()): what a
// reference file stores, so a reference that lacks a tensor the case now
// compares is stale rather than compared over fewer names.
nlohmann::json stored_config(const Case& c);
// Hex digest of stored_config() (what a reference file stores).
std::string config_hash(const Case& c);

// Trains c.steps() steps under `spec`. DDP/FSDP are collective over
// MPI_COMM_WORLD; Single uses this process only. Returns the same global
// record on every rank.
RunRecord run(const Case& c, const RunSpec& spec);

}  // namespace ref
