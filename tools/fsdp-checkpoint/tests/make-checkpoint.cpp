// Test-only (fsdp-checkpoint's cli-check.sh), under mpiexec -n 2:
//
//   dcp-make-checkpoint <root> <baseline dir>
//
// Trains a tiny fully_sharded model (Linear 5->7, Linear 7->3: uneven rows,
// plus a buffer) with AdamW and saves it with fsdp::dcp::save after step 1
// and step 2 (<root>/step-000000000001, <root>/step-000000000002), with
// values of every kind and a rank-local tensor. Rank 0 writes, for step 1,
// a baseline obtained without the checkpoint code: parameters from
// FSDPModule::full_state_dict(), optimizer state gathered with MPI_Gatherv
// of each rank's rows (FSDP's ceil-div shards are row ranges in rank order),
// the values as set. <baseline dir>/baseline.h5 holds them laid out as
// `fsdp-checkpoint export --to x.h5` writes (bfloat16 as float32), and
// <baseline dir>/raw/<n>.bin their exact bytes, listed in manifest.json.
#include <fsdp/distributed_checkpoint.h>
#include <fsdp/fsdp.h>
#include <fsdp/mesh.h>
#include <fsdp/optim_state.h>

#include <fsdp_h5/util.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <mpi.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
    scale = register_buffer("scale", at::arange(3, at::kFloat) * 0.5 + 1);
  }
  at::Tensor forward(at::Tensor x) { return fc2(at::tanh(fc1(x))) * scale; }
  fsdp::Sharded<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Net);

// Rank 0: `local` (rows of a dim-0 ceil-div shard, rank order) concatenated
// over the world; other ranks: undefined.
at::Tensor gather_rows(const at::Tensor& local, int rank, int world) {
  const at::Tensor t = local.contiguous();
  const int bytes = static_cast<int>(t.nbytes());
  std::vector<int> counts(static_cast<size_t>(world)), displs(static_cast<size_t>(world));
  MPI_Gather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < world; ++r) {
    displs[static_cast<size_t>(r)] = total;
    total += counts[static_cast<size_t>(r)];
  }
  std::vector<int64_t> rows(static_cast<size_t>(world));
  const int64_t mine = t.size(0);
  MPI_Gather(&mine, 1, MPI_INT64_T, rows.data(), 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  at::Tensor out;
  if (rank == 0) {
    std::vector<int64_t> shape = t.sizes().vec();
    shape[0] = 0;
    for (int64_t r : rows) shape[0] += r;
    out = at::empty(shape, t.options());
  }
  MPI_Gatherv(t.data_ptr(), bytes, MPI_BYTE, rank == 0 ? out.data_ptr() : nullptr, counts.data(),
              displs.data(), MPI_BYTE, 0, MPI_COMM_WORLD);
  return out;
}

const H5::PredType& h5_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return H5::PredType::IEEE_F32LE;
    case at::kDouble: return H5::PredType::IEEE_F64LE;
    case at::kLong: return H5::PredType::STD_I64LE;
    default: throw std::runtime_error("baseline: unexpected dtype");
  }
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    default: throw std::runtime_error("baseline: unexpected dtype");
  }
}

// baseline.h5 (bfloat16 as float32, '/' as groups, 0-d as scalar datasets)
// and raw/<i>.bin + manifest.json (exact bytes).
void write_baseline(const std::string& dir, const std::map<std::string, at::Tensor>& tensors,
                    const std::map<std::string, bool>& rank_local, int64_t step) {
  std::filesystem::create_directories(dir + "/raw");
  H5::H5File file(dir + "/baseline.h5", H5F_ACC_TRUNC);
  fsdp_h5::write_int_attr(file, "step", step);
  nlohmann::json manifest = nlohmann::json::object();
  int i = 0;
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor t = tensor.contiguous();
    const std::string raw = "raw/" + std::to_string(i++) + ".bin";
    std::ofstream(dir + "/" + raw, std::ios::binary)
        .write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    manifest[name] = {{"dtype", dtype_name(t.scalar_type())},
                      {"shape", t.sizes().vec()},
                      {"file", raw},
                      {"rank_local", rank_local.count(name) > 0}};
    const at::Tensor h = t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
    H5::Group g = file.openGroup("/");
    size_t begin = 0;
    for (size_t slash; (slash = name.find('/', begin)) != std::string::npos; begin = slash + 1) {
      const std::string part = name.substr(begin, slash - begin);
      g = g.nameExists(part) ? g.openGroup(part) : g.createGroup(part);
    }
    const std::vector<hsize_t> dims(h.sizes().begin(), h.sizes().end());
    fsdp_h5::write_dataset(g, name.substr(begin), h5_type(h.scalar_type()), dims, h.data_ptr(),
                          h5_type(h.scalar_type()));
  }
  std::ofstream(dir + "/manifest.json") << manifest.dump(1) << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::Runtime rt(&argc, &argv);
  if (argc != 3) {
    if (rt.world_rank() == 0) std::cerr << "usage: " << argv[0] << " <root> <baseline dir>\n";
    return 2;
  }
  const std::string root = argv[1], baseline = argv[2];
  const int rank = rt.world_rank(), world = rt.world_size();
  at::manual_seed(0);  // the same initial weights on every rank
  Net net;
  fsdp::FullyShardOptions o;
  o.mesh = fsdp::init_device_mesh(c10::kCPU, {world});
  auto unit1 = fsdp::fully_shard(net->fc1.ptr(), o);
  auto unit2 = fsdp::fully_shard(net->fc2.ptr(), o);
  fsdp::fully_shard(net.ptr(), o);  // the root: no parameters of its own
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  at::manual_seed(1);
  const at::Tensor x = at::randn({8, 5}), y = at::randn({8, 3});

  for (int64_t step = 1; step <= 2; ++step) {
    opt.zero_grad();
    const int64_t per = x.size(0) / world;
    auto loss = (net->forward(x.narrow(0, rank * per, per)) - y.narrow(0, rank * per, per))
                    .pow(2)
                    .mean();
    loss.backward();
    opt.step();

    const at::Tensor probe = (at::arange(6, at::kFloat).reshape({2, 3}) / 7 + 0.25 * step)
                                 .to(at::kBFloat16);
    const at::Tensor rng = at::arange(2, at::kLong) + 100 * rank + step;
    fsdp::dcp::State state;
    state.add_module("model", net.ptr())
        .add_optimizer("optim", opt, "model")
        .set("step", step)
        .set("lr", 1e-2)
        .set("note", std::string("fsdp-checkpoint test"))
        .set("probe_bf16", probe)
        .set_rank_local("cursor", int64_t{10} * rank + step)
        .set_rank_local("rng", rng);
    fsdp::dcp::SaveOptions so;
    so.step = step;
    const auto report = fsdp::dcp::save(root, state, so);
    if (rank == 0) std::cout << "saved " << report.path << " (" << report.total_bytes << " bytes)\n";

    if (step != 1) continue;
    // The baseline, without the checkpoint code.
    std::map<std::string, at::Tensor> full;
    std::map<std::string, bool> rank_local;
    // full_state_dict() is per unit: names relative to the unit's module.
    for (auto& [n, t] : unit1.full_state_dict()) full["model/fc1." + n] = t;
    for (auto& [n, t] : unit2.full_state_dict()) full["model/fc2." + n] = t;
    for (auto& b : net->named_buffers()) full["model/" + b.key()] = b.value();
    for (auto& np : net->named_parameters()) {
      const std::string& n = np.key();
      const at::Tensor& p = np.value();
      auto& s = static_cast<torch::optim::AdamWParamState&>(
          *opt.state().at(fsdp::optimizer_state_key(opt, p)));
      const at::Tensor exp_avg = gather_rows(s.exp_avg(), rank, world);
      const at::Tensor exp_avg_sq = gather_rows(s.exp_avg_sq(), rank, world);
      if (rank != 0) continue;
      full["optim/" + n + "/exp_avg"] = exp_avg;
      full["optim/" + n + "/exp_avg_sq"] = exp_avg_sq;
      full["optim/" + n + "/step"] = at::scalar_tensor(s.step(), at::kLong);
    }
    full["probe_bf16"] = probe;
    for (int r = 0; r < world; ++r) {
      const std::string name = "__rank" + std::to_string(r) + "/rng";
      full[name] = at::arange(2, at::kLong) + 100 * r + step;
      rank_local[name] = true;
    }
    if (rank == 0) {
      if (full.size() != 20) {
        std::cerr << "baseline: " << full.size() << " tensors, expected 20\n";
        return 1;
      }
      write_baseline(baseline, full, rank_local, step);
      std::cout << "baseline of step 1: " << full.size() << " tensors in " << baseline << "\n";
    }
  }
  return 0;
}
