// Distributed-checkpoint suites: one small network in every layout libfsdp
// produces, with the same parameter names in each, its training loop, and
// the global tensors of a layout gathered without the checkpoint code (the
// baseline a load is compared against).
//
// The network: fc1 (12 -> 16, column-parallel under TP), tanh, fc2 (16 -> 8,
// row-parallel: its bias is replicated over tp), a buffer `scale` [8] and a
// plain parameter `offset` [8] that fully_shard ignores; beside it a
// DTensor `table` [16, 4] of the user's (not trained) whose placements
// differ per layout -- StridedShard under TP: FSDP inside a TP shard on
// tp2, fused pieces on tp4. Layouts (valid world sizes):
//   plain      every rank the whole network, no sharding (any)
//   fsdp       fully_shard over all ranks, Shard(0) (any)
//   fsdp_dim1  fully_shard over all ranks, weights Shard(1) (any)
//   hsdp       (replicate 2, shard w/2) (2, 4)
//   tp2        (shard w/2, tp 2): TP layers on tp, FSDP on shard (2, 4)
//   tp4        (shard 1, tp 4) (4)
//   pp2        two stages of w/2 ranks: fc1 + scale on stage 0, fc2 +
//              offset on stage 1, each fully_shard over its stage (2, 4)
//   ep2, ep4   fully_shard like fsdp, and the grouped experts (4 experts,
//              not used in forward, so untrained) Shard(0) over an ep mesh
//              of 2 (2, 4) or 4 (4) ranks; in every other layout they are
//              plain, whole on every rank (fully_shard ignores them)
#pragma once

#include "raw_mpi.h"
#include "spmd.h"

#include <fsdp/distributed_checkpoint.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/moe.h>
#include <fsdp/optim_state.h>
#include <fsdp/parallel_module.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dcpt {

namespace tp = fsdp::tp;
constexpr int64_t kIn = 12, kHidden = 16, kOut = 8, kBatch = 8;

inline std::vector<std::string> layouts_for(int world) {
  std::vector<std::string> l = {"plain", "fsdp", "fsdp_dim1"};
  if (world == 2 || world == 4) {
    l.push_back("hsdp");
    l.push_back("tp2");
    l.push_back("pp2");
  }
  if (world == 2 || world == 4) l.push_back("ep2");
  if (world == 4) {
    l.push_back("tp4");
    l.push_back("ep4");
  }
  return l;
}

struct NetImpl : torch::nn::Module {
  bool has_fc1 = true, has_fc2 = true;
  std::shared_ptr<torch::nn::Module> fc1, fc2;
  fsdp::moe::GroupedExperts experts{nullptr};
  // Calls through fsdp::Sharded<> so that the units' hooks run.
  std::function<at::Tensor(const at::Tensor&)> call1, call2;
  at::Tensor scale, offset;
  at::Tensor forward(at::Tensor x) {
    if (has_fc1) x = at::tanh(call1(x));
    if (has_fc2) x = call2(x) * scale + offset;
    return x;
  }
};
TORCH_MODULE(Net);

// One network in one layout on this rank.
struct Built {
  std::string layout;
  Net net{nullptr};
  std::optional<fsdp::Sharded<Net>> sharded;
  std::optional<fsdp::DeviceMesh> mesh;
  int dp_rank = 0, dp_size = 1;  // which batch slice this rank trains on
  int stage = -1;                // pp2: this rank's stage
  std::unique_ptr<torch::optim::AdamW> opt;
  fsdp::DTensor table;

  at::Tensor forward(const at::Tensor& x) { return sharded ? (*sharded)(x) : net(x); }
};

// The global network of `seed`: every layout slices the same tensors.
struct Global {
  at::Tensor w1, b1, w2, b2, scale, offset, table;
};
inline Global global_net(int64_t seed) {
  at::manual_seed(seed);
  Global g;
  g.w1 = at::randn({kHidden, kIn}) * 0.3;
  g.b1 = at::randn({kHidden}) * 0.1;
  g.w2 = at::randn({kOut, kHidden}) * 0.3;
  g.b2 = at::randn({kOut}) * 0.1;
  g.scale = at::rand({kOut}) + 0.5;
  g.offset = at::randn({kOut}) * 0.1;
  g.table = at::randn({16, 4});
  return g;
}

inline Built build(const std::string& layout, int64_t seed = 5) {
  const int w = spmd::world_size(), r = spmd::rank();
  const auto dev = spmd::device().type();
  const Global g = global_net(seed);
  Built b;
  b.layout = layout;
  b.net = Net();
  auto& n = *b.net;
  n.scale = n.register_buffer("scale", g.scale.clone());
  n.offset = n.register_parameter("offset", g.offset.clone());
  std::optional<fsdp::DeviceMesh> tp_mesh;
  fsdp::FullyShardOptions o;
  if (layout == "tp2" || layout == "tp4") {
    const int64_t t = layout == "tp2" ? 2 : 4;
    b.mesh = fsdp::init_device_mesh(dev, {w / t, t}, {"shard", "tp"});
    tp_mesh = (*b.mesh)["tp"];
    o.mesh = b.mesh;
    o.shard_dim = "shard";
    b.dp_rank = b.mesh->get_local_rank("shard");
    b.dp_size = static_cast<int>(w / t);
  } else if (layout == "hsdp") {
    b.mesh = fsdp::init_device_mesh(dev, {2, w / 2}, {"replicate", "shard"});
    o.mesh = b.mesh;
    b.dp_rank = r;
    b.dp_size = w;
  } else if (layout == "pp2") {
    // Stage meshes: ranks [0, w/2) and [w/2, w), each a 1-D FSDP mesh cut
    // from a (stage, shard) mesh.
    auto full = fsdp::init_device_mesh(dev, {2, w / 2}, {"stage", "shard"});
    b.mesh = full["shard"];
    o.mesh = b.mesh;
    b.stage = full.get_local_rank("stage");
    b.dp_rank = b.mesh->get_local_rank(0);
    b.dp_size = static_cast<int>(w / 2);
    n.has_fc1 = b.stage == 0;
    n.has_fc2 = b.stage == 1;
  } else if (layout != "plain") {  // fsdp, fsdp_dim1, ep2, ep4
    b.mesh = fsdp::init_device_mesh(dev, {w});
    o.mesh = b.mesh;
    b.dp_rank = r;
    b.dp_size = w;
  }
  {
    std::optional<fsdp::DeviceMesh> ep;
    if (layout == "ep2") {
      ep = w == 2 ? fsdp::init_device_mesh(dev, {2})
                  : fsdp::init_device_mesh(dev, {w / 2, 2}, {"dp", "ep"})["ep"];
    }
    if (layout == "ep4") ep = fsdp::init_device_mesh(dev, {4});
    at::manual_seed(seed + 1);  // the same global experts for every ep size
    n.experts = n.register_module("experts", fsdp::moe::GroupedExperts(8, 4, 4, ep));
  }
  if (n.has_fc1) {
    if (tp_mesh) {
      tp::ColumnParallelLinear l(kIn, kHidden, *tp_mesh);
      l->load_full(g.w1, g.b1);
      n.fc1 = l.ptr();
      n.call1 = [s = fsdp::Sharded<tp::ColumnParallelLinear>(l)](const at::Tensor& x) mutable {
        return s(x);
      };
    } else {
      torch::nn::Linear l(kIn, kHidden);
      at::NoGradGuard ng;
      l->weight.copy_(g.w1);
      l->bias.copy_(g.b1);
      n.fc1 = l.ptr();
      n.call1 = [s = fsdp::Sharded<torch::nn::Linear>(l)](const at::Tensor& x) mutable {
        return s(x);
      };
    }
    n.register_module("fc1", n.fc1);
  }
  if (n.has_fc2) {
    if (tp_mesh) {
      tp::RowParallelLinear l(kHidden, kOut, *tp_mesh);
      l->load_full(g.w2, g.b2);
      n.fc2 = l.ptr();
      n.call2 = [s = fsdp::Sharded<tp::RowParallelLinear>(l)](const at::Tensor& x) mutable {
        return s(x);
      };
    } else {
      torch::nn::Linear l(kHidden, kOut);
      at::NoGradGuard ng;
      l->weight.copy_(g.w2);
      l->bias.copy_(g.b2);
      n.fc2 = l.ptr();
      n.call2 = [s = fsdp::Sharded<torch::nn::Linear>(l)](const at::Tensor& x) mutable {
        return s(x);
      };
    }
    n.register_module("fc2", n.fc2);
  }
  b.net->to(spmd::device());
  if (layout != "plain") {
    if (layout == "fsdp_dim1") {
      o.shard_placement_fn = [](const std::string& name,
                                const at::Tensor&) -> std::optional<fsdp::ShardPlacementResult> {
        if (name.find("weight") != std::string::npos) return fsdp::Placement::Shard(1);
        return std::nullopt;
      };
    }
    o.ignored_params = {n.offset, n.experts->w1, n.experts->w2, n.experts->w3};
    if (n.has_fc1) fsdp::fully_shard(n.fc1, fsdp::options_for(*n.fc1, o));
    if (n.has_fc2) fsdp::fully_shard(n.fc2, fsdp::options_for(*n.fc2, o));
    fsdp::fully_shard(b.net.ptr(), o);
    b.sharded.emplace(b.net);
  }
  using P = fsdp::Placement;
  if (layout == "plain") {
    b.table = fsdp::distribute_tensor(g.table.to(spmd::device()),
                                      fsdp::init_device_mesh(dev, {w}), {P::Replicate()});
  } else {
    std::vector<P> placements = {P::Shard(0)};
    if (layout == "fsdp_dim1") placements = {P::Shard(1)};
    if (layout == "hsdp") placements = {P::Replicate(), P::Shard(0)};
    if (layout == "tp2") placements = {P::StridedShard(0, 2), P::Shard(0)};
    if (layout == "tp4") placements = {P::Replicate(), P::StridedShard(0, 2)};
    b.table = fsdp::distribute_tensor(g.table.to(spmd::device()), *b.mesh, placements);
  }
  b.opt = std::make_unique<torch::optim::AdamW>(
      b.net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  return b;
}

// One AdamW step on this rank's slice of step `step`'s global batch;
// returns the global loss (mean over the data-parallel ranks). Not for pp2.
inline double train_step(Built& b, int64_t step) {
  at::manual_seed(1000 + step);
  const at::Tensor x = at::randn({kBatch, kIn}).to(spmd::device());
  const at::Tensor y = at::randn({kBatch, kOut}).to(spmd::device());
  const int64_t per = kBatch / b.dp_size;
  const at::Tensor xs = x.narrow(0, b.dp_rank * per, per), ys = y.narrow(0, b.dp_rank * per, per);
  b.opt->zero_grad();
  at::Tensor loss = (b.forward(xs) - ys).pow(2).mean();
  loss.backward();
  if (b.layout == "plain") {
    // Every rank trained on the whole batch's slice it owns: average the
    // gradients as DDP would, so "plain" is an independent data-parallel run.
    for (auto& p : b.net->parameters()) {
      if (!p.grad().defined()) continue;
      raw_mpi::all_reduce_mean(p.mutable_grad());
    }
  } else {
    // The ignored parameter's gradient is each rank's own: average it.
    auto& g = b.net->offset.mutable_grad();
    if (g.defined()) raw_mpi::all_reduce_mean(g);
  }
  b.opt->step();
  return raw_mpi::mean_over_ranks(loss.item<double>());
}

inline fsdp::dcp::State state_of(Built& b) {
  fsdp::dcp::State s;
  s.add_module("model", b.net.ptr()).add_optimizer("optim", *b.opt, "model");
  s.add_dtensor("table", b.table);
  return s;
}

// The layout of every parameter this rank holds, by full name: its DTensor
// (from the units or the TP layers), or nullopt for a plain tensor.
inline std::map<std::string, std::optional<fsdp::DTensor>> layouts_of(Built& b) {
  std::map<std::string, std::optional<fsdp::DTensor>> out;
  std::map<const c10::TensorImpl*, fsdp::DTensor> distributed;  // ep experts
  for (const auto& dp : fsdp::dtensor_params(*b.net)) {
    distributed.emplace(dp.param.to_local().unsafeGetTensorImpl(), dp.param);
  }
  for (const auto& p : b.net->named_parameters()) {
    auto it = distributed.find(p.value().unsafeGetTensorImpl());
    if (it != distributed.end()) {
      out[p.key()] = it->second;
    } else {
      out[p.key()] = std::nullopt;
    }
  }
  for (const auto& m : b.net->named_modules()) {
    auto unit = fsdp::fsdp_module_of(*m.value());
    if (!unit || unit->module().get() != m.value().get()) continue;
    for (auto& [name, dt] : unit->sharded_parameters()) {
      out[m.key().empty() ? name : m.key() + "." + name] = dt;
    }
  }
  return out;
}

// Every tensor this rank holds, gathered to its global value by DTensor's
// collectives (not by the checkpoint code): "model/<param>", "model/scale"
// and "optim/<param>/<field>". Collective over the layout's meshes.
inline std::map<std::string, at::Tensor> global_tensors(Built& b) {
  std::map<std::string, at::Tensor> out;
  const auto layouts = layouts_of(b);
  auto full = [&](const std::string& name, const at::Tensor& local) {
    const auto& l = layouts.at(name);
    if (!l) return local.detach().to(at::kCPU).clone();
    return fsdp::DTensor::from_local(local.detach(), l->device_mesh(), l->placements(), l->shape())
        .full_tensor()
        .to(at::kCPU)
        .clone();  // on one rank full_tensor() is the live local tensor
  };
  for (const auto& p : b.net->named_parameters()) {
    const auto& l = layouts.at(p.key());
    out["model/" + p.key()] = l ? full(p.key(), l->to_local()) : full(p.key(), p.value());
    auto& st = b.opt->state();
    auto it = st.find(fsdp::optimizer_state_key(*b.opt, p.value()));
    if (it == st.end()) continue;
    const auto& a = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out["optim/" + p.key() + "/exp_avg"] = full(p.key(), a.exp_avg());
    out["optim/" + p.key() + "/exp_avg_sq"] = full(p.key(), a.exp_avg_sq());
    out["optim/" + p.key() + "/step"] = at::scalar_tensor(a.step(), at::kLong);
  }
  for (const auto& buf : b.net->named_buffers()) {
    out["model/" + buf.key()] = buf.value().to(at::kCPU).clone();
  }
  out["table"] = b.table.full_tensor().to(at::kCPU).clone();
  return out;
}

inline std::string matrix_root() {
  const char* env = std::getenv("FSDP_DCP_MATRIX_DIR");
  return env ? env : "/tmp/libfsdp-dcp-matrix";
}

// A fresh directory (rank 0 clears it; every rank waits for that).
inline std::string fresh_dir(const std::string& path) {
  if (spmd::rank() == 0) std::filesystem::remove_all(path);
  raw_mpi::barrier();
  return path;
}

}  // namespace dcpt
