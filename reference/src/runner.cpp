#include "reference/case.h"

#include <fsdp/clip_grad.h>
#include <fsdp/dtensor.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <mpi.h>
#include <torch/optim/adamw.h>

#include <cmath>
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
    at::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (!g.is_contiguous() || g.scalar_type() != at::kFloat) {
      throw std::logic_error("DDP baseline: expected contiguous float32 gradients");
    }
    MPI_Allreduce(MPI_IN_PLACE, g.data_ptr<float>(), static_cast<int>(g.numel()), MPI_FLOAT,
                  MPI_SUM, MPI_COMM_WORLD);
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

 private:
  std::map<std::string, at::Tensor> params_;
  std::map<std::string, fsdp::DTensor> dtensors_;
};

}  // namespace

RunRecord run(const Case& c, const RunSpec& spec) {
  const World w = world_of(spec.layout);
  const int64_t tp = spec.layout == Layout::FSDP ? spec.tp.size : 1;
  if (tp < 1 || w.size % tp != 0) {
    throw std::invalid_argument("RunSpec.tp.size: expected a divisor of the world size " +
                                std::to_string(w.size));
  }
  // Ranks of one tp group share a data slice: the data-parallel coordinate.
  World data = w;
  data.rank = w.rank / static_cast<int>(tp);
  data.size = w.size / static_cast<int>(tp);
  std::shared_ptr<torch::nn::Module> model;
  std::vector<Unit> units;
  if (spec.layout == Layout::FSDP) {
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
    options.mesh = fsdp::init_device_mesh("cpu", shape, names);
    options.shard_dim = "shard";
    if (shape.size() > 1 && names[0] == "replicate") options.replicate_dim = "replicate";
    options.reshard_after_forward = spec.reshard_after_forward;
    model = tp > 1 ? c.build_tp((*options.mesh)["tp"], spec.tp) : c.build();
    units = c.shard(model, options);
  } else {
    model = c.build();
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
  for (int64_t step = 0; step < c.steps(); ++step) {
    opt.zero_grad();
    LocalLoss out = c.forward(model, step, data.rank, data.size);
    out.loss.backward();
    if (spec.layout == Layout::DDP) ddp_all_reduce(model->parameters(), w);

    StepRecord s;
    s.loss = mean_over_world(out.loss.item<double>(), w);
    s.grad_norm = norm_of(model->parameters());
    for (const auto& [norm_name, prefixes] : c.sub_norms()) {
      std::vector<at::Tensor> subset;
      for (const auto& item : named) {
        if (has_prefix(item.key(), prefixes)) subset.push_back(item.value());
      }
      s.norms[norm_name] = norm_of(subset);
    }
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
    for (const auto& name : c.recorded()) s.grads[name] = view.value(name, /*grad=*/true);

    opt.step();
    for (const auto& name : c.recorded()) s.params[name] = view.value(name, /*grad=*/false);
    record.steps.push_back(std::move(s));
  }
  return record;
}

}  // namespace ref
