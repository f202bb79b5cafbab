#include "reference/case.h"

#include <fsdp/clip_grad.h>
#include <fsdp/comm.h>
#include <fsdp/dtensor.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <mpi.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <set>
#include <stdexcept>

namespace ref {

namespace {

struct World {
  int rank = 0;
  int size = 1;
};

World world_of(Layout layout) {
  World w;
  if (layout != Layout::Single) {
    MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  }
  return w;
}

double mean_over_world(double v, const World& w) {
  if (w.size == 1) return v;
  double sum = 0;
  MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return sum / w.size;
}

bool has_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes) {
    if (name.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

// The DDP baseline's whole gradient synchronisation: a plain MPI all-reduce
// of each full gradient, then the mean.
void ddp_all_reduce(const std::vector<at::Tensor>& params, const World& w) {
  for (const auto& p : params) {
    const at::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (!g.is_contiguous() || g.scalar_type() != at::kFloat) {
      throw std::logic_error("DDP baseline: expected contiguous float32 gradients");
    }
    // MPI sees host memory only: a device gradient goes through a copy.
    at::Tensor host = g.is_cpu() ? g : g.to(at::kCPU);
    MPI_Allreduce(MPI_IN_PLACE, host.data_ptr<float>(), static_cast<int>(host.numel()), MPI_FLOAT,
                  MPI_SUM, MPI_COMM_WORLD);
    if (!g.is_cpu()) g.copy_(host);
    g.div_(w.size);
  }
}

// Global norm of full (replicated) gradients, in double.
double plain_norm(const std::vector<at::Tensor>& params) {
  double sq = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sq);
}

// Full values of a parameter (or of its gradient) under any layout.
class FullView {
 public:
  FullView(const std::shared_ptr<torch::nn::Module>& model, const std::vector<Unit>& units) {
    for (const auto& item : model->named_parameters()) params_.emplace(item.key(), item.value());
    for (const auto& u : units) {
      for (const auto& [name, dt] : u.module.sharded_parameters()) {
        dtensors_.emplace(u.prefix + name, dt);
      }
    }
  }
  at::Tensor value(const std::string& name, bool grad) const {
    auto p = params_.find(name);
    if (p == params_.end()) throw std::logic_error("reference case records unknown parameter " + name);
    at::Tensor local = grad ? p->second.grad() : p->second.detach();
    if (!local.defined()) throw std::logic_error("reference case: no gradient for " + name);
    auto d = dtensors_.find(name);
    if (d != dtensors_.end()) {
      const fsdp::DTensor& dt = d->second;
      local = fsdp::DTensor::from_local(local, dt.device_mesh(), dt.placements(), dt.shape())
                  .full_tensor();
    }
    return local.detach().to(at::kCPU, at::kFloat).clone();
  }
  ParamPlacement placement(const std::string& name) const {
    const at::Tensor& p = params_.at(name);
    ParamPlacement out;
    out.local_shape = p.sizes().vec();
    out.full_shape = out.local_shape;
    auto d = dtensors_.find(name);
    if (d != dtensors_.end()) {
      for (const auto& pl : d->second.placements()) {
        out.placements += (out.placements.empty() ? "" : ",") + pl.to_string();
      }
      out.full_shape = d->second.shape();
    }
    return out;
  }

 private:
  std::map<std::string, at::Tensor> params_;
  std::map<std::string, fsdp::DTensor> dtensors_;
};

// The role of each communicator of the meshes a run built: the names of the
// mesh dims whose group it is ("dense", "ep", or "dense+ep" when two dims
// have the same ranks). Size-1 groups never communicate and are left out.
class GroupRoles {
 public:
  void add(const fsdp::DeviceMesh& mesh) {
    for (int i = 0; i < mesh.ndim(); ++i) {
      if (mesh.size(i) > 1) roles_[mesh.get_group(i)->name()].insert(mesh.dim_names()[i]);
    }
  }
  // "<op>@<role>" per record, in issue order.
  std::vector<std::string> describe(const std::vector<fsdp::CollectiveRecord>& sequence) const {
    std::vector<std::string> out;
    for (const auto& r : sequence) {
      auto it = roles_.find(r.group);
      std::string role;
      if (it == roles_.end()) {
        role = "unbuilt " + r.group;
      } else {
        for (const auto& n : it->second) role += (role.empty() ? "" : "+") + n;
      }
      out.push_back(r.op + "@" + role);
    }
    return out;
  }

 private:
  std::map<std::string, std::set<std::string>> roles_;
};

// Every rank's rows of a per-rank [T, K] int64 tensor, in rank order.
at::Tensor gather_rows(const at::Tensor& local, const World& w) {
  const at::Tensor mine = local.to(at::kCPU, at::kLong).contiguous();
  if (w.size == 1) return mine.clone();
  std::vector<int64_t> shape = mine.sizes().vec();
  shape[0] *= w.size;
  at::Tensor all = at::empty(shape, mine.options());
  MPI_Allgather(mine.data_ptr<int64_t>(), static_cast<int>(mine.numel()), MPI_INT64_T,
                all.data_ptr<int64_t>(), static_cast<int>(mine.numel()), MPI_INT64_T,
                MPI_COMM_WORLD);
  return all;
}

// oneDNN chooses its kernels by the machine's instruction set (jit:avx2 on one
// CPU, jit:avx512 on another) and LibTorch 1.13 sends CPU GELU and Conv2d to
// it, so references made with it would differ bitwise between machines. A run
// uses ATen's own kernels and the BLAS, whose kernels the tests pin
// (OPENBLAS_CORETYPE, ATEN_CPU_CAPABILITY).
class WithoutOneDnn {
 public:
  WithoutOneDnn() : was_(at::globalContext().userEnabledMkldnn()) {
    at::globalContext().setUserEnabledMkldnn(false);
  }
  ~WithoutOneDnn() { at::globalContext().setUserEnabledMkldnn(was_); }
  WithoutOneDnn(const WithoutOneDnn&) = delete;
  WithoutOneDnn& operator=(const WithoutOneDnn&) = delete;

 private:
  bool was_;
};

}  // namespace

RunRecord run(const Case& c, const RunSpec& spec) {
  const WithoutOneDnn without_onednn;
  const World w = world_of(spec.layout);
  const int64_t tp = spec.layout == Layout::FSDP ? spec.tp.size : 1;
  const int64_t ep = spec.layout == Layout::FSDP ? spec.ep.size : 1;
  if (tp < 1 || w.size % tp != 0) {
    throw std::invalid_argument("RunSpec.tp.size: expected a divisor of the world size " +
                                std::to_string(w.size));
  }
  if (ep < 1 || w.size % ep != 0 || (ep > 1 && tp > 1)) {
    throw std::invalid_argument("RunSpec.ep.size: expected a divisor of the world size " +
                                std::to_string(w.size) + ", and no TP with it");
  }
  // Ranks of one tp group share a data slice: the data-parallel coordinate.
  World data = w;
  data.rank = w.rank / static_cast<int>(tp);
  data.size = w.size / static_cast<int>(tp);
  std::shared_ptr<torch::nn::Module> model;
  std::vector<Unit> units;
  GroupRoles roles;
  if (spec.layout == Layout::FSDP && ep > 1) {
    // dp2ep: the dense weights are sharded over every data-parallel rank of
    // a replica (efsdp x ep); the sparse view of the same ranks splits that
    // dim into (efsdp, ep).
    if (spec.mesh_shape.size() != 2 || spec.mesh_shape[0] * spec.mesh_shape[1] * ep != w.size) {
      throw std::invalid_argument("RunSpec.mesh_shape: with EP expected {replicate, efsdp} with "
                                  "product " + std::to_string(w.size / ep));
    }
    const int64_t replicate = spec.mesh_shape[0], efsdp = spec.mesh_shape[1];
    const fsdp::DeviceMesh dense =
        fsdp::init_device_mesh(spec.device.type(), {replicate, efsdp * ep}, {"replicate", "dense"});
    const fsdp::DeviceMesh sparse = dense.unflatten("dense", {efsdp, ep}, {"efsdp", "ep"});
    roles.add(dense);
    roles.add(sparse);
    fsdp::FullyShardOptions options;
    options.mesh = dense;
    // replicate_dim stays unset: fully_shard would also look that name up in
    // the experts' (replicate, efsdp) mesh, which has no dim named
    // shard_dim, and reject it; FSDP's default finds "replicate" anyway.
    options.shard_dim = "dense";
    options.reshard_after_forward = spec.reshard_after_forward;
    model = c.build_ep(sparse["ep"]);
    model->to(spec.device);
    // A size-1 replicate dim issues no collective, so (replicate, efsdp)
    // serves both replicate = 1 and HSDP.
    units = c.shard_ep(model, options, sparse[{"replicate", "efsdp"}],
                       static_cast<double>(w.size));
  } else if (spec.layout == Layout::FSDP) {
    int64_t product = 1;
    for (int64_t d : spec.mesh_shape) product *= d;
    if (spec.mesh_shape.empty() || spec.mesh_shape.size() > 2 || product * tp != w.size) {
      throw std::invalid_argument("RunSpec.mesh_shape: expected {dp} or {replicate, shard} "
                                  "with product " + std::to_string(w.size / tp));
    }
    std::vector<int64_t> shape = spec.mesh_shape;
    std::vector<std::string> names = shape.size() == 1 ? std::vector<std::string>{"shard"}
                                                       : std::vector<std::string>{"replicate",
                                                                                  "shard"};
    if (tp > 1) {
      shape.push_back(tp);
      names.push_back("tp");
    }
    fsdp::FullyShardOptions options;
    options.mesh = fsdp::init_device_mesh(spec.device.type(), shape, names);
    options.shard_dim = "shard";
    if (shape.size() > 1 && names[0] == "replicate") options.replicate_dim = "replicate";
    options.reshard_after_forward = spec.reshard_after_forward;
    roles.add(*options.mesh);
    model = tp > 1 ? c.build_tp((*options.mesh)["tp"], spec.tp) : c.build();
    model->to(spec.device);
    units = c.shard(model, options);
  } else {
    model = c.build();
    model->to(spec.device);
  }
  const auto cfg = c.config().at("optimizer");
  const auto betas = cfg.at("betas");
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(cfg.at("lr").get<double>())
                              .betas({betas[0].get<double>(), betas[1].get<double>()})
                              .eps(cfg.at("eps").get<double>())
                              .weight_decay(cfg.at("weight_decay").get<double>()));
  const FullView view(model, units);
  const auto named = model->named_parameters();
  auto norm_of = [&](const std::vector<at::Tensor>& ps) {
    return spec.layout == Layout::FSDP ? fsdp::total_grad_norm(ps) : plain_norm(ps);
  };

  RunRecord record;
  for (const auto& item : named) record.placements[item.key()] = view.placement(item.key());
  for (int64_t step = 0; step < c.steps(); ++step) {
    if (spec.layout == Layout::FSDP) fsdp::reset_collective_counters();
    opt.zero_grad();
    LocalLoss out = c.forward(model, step, data.rank, data.size, spec.layout);
    StepRecord s;
    if (auto r = c.routing(*model)) {
      // Routing cases are data parallel over the world (no TP form).
      for (const auto& [layer, ids] : r->ids) s.routing[layer] = gather_rows(ids, w);
      s.routing_margin = r->margin;
      if (w.size > 1) {
        MPI_Allreduce(MPI_IN_PLACE, &s.routing_margin, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
      }
    }
    out.loss.backward();
    if (spec.layout == Layout::DDP) ddp_all_reduce(model->parameters(), w);

    s.loss = mean_over_world(out.loss.item<double>(), w);
    s.grad_norm = norm_of(model->parameters());
    for (const auto& [norm_name, prefixes] : c.sub_norms()) {
      std::vector<at::Tensor> subset;
      for (const auto& item : named) {
        if (has_prefix(item.key(), prefixes)) subset.push_back(item.value());
      }
      s.norms[norm_name] = norm_of(subset);
    }
    for (const auto& [norm_name, v] : c.model_norms(*model)) s.norms[norm_name] = v;
    if (out.chunk_losses.defined()) {
      at::Tensor local = out.chunk_losses.detach().to(at::kCPU, at::kDouble).contiguous();
      at::Tensor all = at::empty({local.numel() * w.size}, local.options());
      if (w.size == 1) {
        all.copy_(local);
      } else {
        MPI_Allgather(local.data_ptr<double>(), static_cast<int>(local.numel()), MPI_DOUBLE,
                      all.data_ptr<double>(), static_cast<int>(local.numel()), MPI_DOUBLE,
                      MPI_COMM_WORLD);
      }
      all.div_(w.size);
      s.chunk_losses.assign(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
    }
    if (out.unchunked_loss.defined()) {
      s.unchunked_loss = mean_over_world(out.unchunked_loss.item<double>(), w);
    }
    for (const auto& name : c.recorded()) s.grads[name] = view.value(name, /*grad=*/true);

    opt.step();
    for (const auto& name : c.recorded()) s.params[name] = view.value(name, /*grad=*/false);
    if (spec.layout == Layout::FSDP) s.collectives = roles.describe(fsdp::collective_counters().sequence);
    record.steps.push_back(std::move(s));
  }
  return record;
}

}  // namespace ref
