#include "checkpoint.h"

#include "config.h"

#include <ATen/ops/empty.h>
#include <fsdp/optim_state.h>
#include <H5Cpp.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (fmt >= 11 keeps it here)
#include <mpi.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>

namespace fsdp_train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "fsdp-train checkpoint 1";

// Every rank passes its own outcome; if any failed, the failing ranks print
// their reason and every rank throws the same ConfigError.
void agree(bool ok, const std::string& local_error, const std::string& what) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all == 1) return;
  if (!ok) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::cerr << "fsdp-train: rank " << rank << ": " << local_error << std::endl;
  }
  throw ConfigError(what + (ok ? " (failed on another rank; see its message)" : ": " + local_error));
}

std::string rank_file(const std::string& dir, int rank) {
  return dir + "/rank" + std::to_string(rank) + ".h5";
}

void write_string_attr(H5::H5Object& obj, const std::string& name, const std::string& value) {
  H5::StrType type(H5::PredType::C_S1, value.empty() ? 1 : value.size());
  obj.createAttribute(name, type, H5::DataSpace(H5S_SCALAR)).write(type, value);
}

std::string read_string_attr(const H5::H5Object& obj, const std::string& name) {
  H5::Attribute a = obj.openAttribute(name);
  std::string out;
  a.read(a.getStrType(), out);
  return out;
}

void write_int_attr(H5::H5Object& obj, const std::string& name, int64_t value) {
  obj.createAttribute(name, H5::PredType::STD_I64LE, H5::DataSpace(H5S_SCALAR))
      .write(H5::PredType::NATIVE_INT64, &value);
}

int64_t read_int_attr(const H5::H5Object& obj, const std::string& name) {
  int64_t v = 0;
  obj.openAttribute(name).read(H5::PredType::NATIVE_INT64, &v);
  return v;
}

// Exact bytes of an fp32 tensor (any shape, zero rows included).
void write_tensor(H5::Group& g, const std::string& name, const at::Tensor& t) {
  if (t.scalar_type() != at::kFloat) {
    throw std::runtime_error("checkpoint: " + name + " is not float32");
  }
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  std::vector<hsize_t> dims(c.sizes().begin(), c.sizes().end());
  H5::DataSpace space(static_cast<int>(dims.size()), dims.data());
  H5::DataSet ds = g.createDataSet(name, H5::PredType::IEEE_F32LE, space);
  if (c.numel() > 0) ds.write(c.data_ptr<float>(), H5::PredType::NATIVE_FLOAT);
}

at::Tensor read_tensor(const H5::Group& g, const std::string& name) {
  H5::DataSet ds = g.openDataSet(name);
  H5::DataSpace space = ds.getSpace();
  std::vector<hsize_t> dims(static_cast<size_t>(space.getSimpleExtentNdims()));
  space.getSimpleExtentDims(dims.data());
  at::Tensor t = at::empty(std::vector<int64_t>(dims.begin(), dims.end()), at::kFloat);
  if (t.numel() > 0) ds.read(t.data_ptr<float>(), H5::PredType::NATIVE_FLOAT);
  return t;
}

void write_int(H5::Group& g, const std::string& name, int64_t v) {
  g.createDataSet(name, H5::PredType::STD_I64LE, H5::DataSpace(H5S_SCALAR))
      .write(&v, H5::PredType::NATIVE_INT64);
}

int64_t read_int(const H5::Group& g, const std::string& name) {
  int64_t v = 0;
  g.openDataSet(name).read(&v, H5::PredType::NATIVE_INT64);
  return v;
}

void write_rank_file(const std::string& path, int64_t step, const nlohmann::json& numerics,
                     const std::vector<std::pair<std::string, at::Tensor>>& shards,
                     torch::optim::AdamW& opt, int rank, int world) {
  const auto& params = opt.param_groups().at(0).params();
  if (params.size() != shards.size()) {
    throw std::logic_error("checkpoint: optimizer and state dict disagree on the parameters");
  }
  H5::H5File file(path, H5F_ACC_TRUNC);
  H5::Group root = file.openGroup("/");
  write_string_attr(root, "format", kFormat);
  write_int_attr(root, "step", step);
  write_int_attr(root, "rank", rank);
  write_int_attr(root, "world", world);
  write_string_attr(root, "numerics", numerics.dump());
  H5::Group pg = file.createGroup("/params");
  H5::Group og = file.createGroup("/optim");
  auto& state = opt.state();
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& [name, shard] = shards[i];
    write_tensor(pg, name, shard);
    auto it = state.find(fsdp::optimizer_state_key(opt, params[i]));
    if (it == state.end()) continue;  // never stepped
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    H5::Group g = og.createGroup(name);
    write_int(g, "step", s.step());
    write_tensor(g, "exp_avg", s.exp_avg());
    write_tensor(g, "exp_avg_sq", s.exp_avg_sq());
  }
}

std::string h5_message(const H5::Exception& e) {
  return e.getFuncName() + ": " + e.getDetailMsg();
}

}  // namespace

std::string checkpoint_dir(const std::string& out) { return out + "/checkpoint"; }

void save_checkpoint(const std::string& out, int64_t step, const nlohmann::json& numerics,
                     const nlohmann::json& run,
                     const std::vector<std::pair<std::string, at::Tensor>>& shards,
                     torch::optim::AdamW& opt, int rank, int world) {
  H5::Exception::dontPrint();
  const std::string final_dir = checkpoint_dir(out);
  const std::string tmp = out + "/checkpoint.tmp-" + std::to_string(step);
  const std::string old = out + "/checkpoint.old";
  std::string error;
  if (rank == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // a leftover of a crashed save of the same step
    fs::create_directories(tmp, ec);
    if (ec) error = "cannot create " + tmp + ": " + ec.message();
  }
  agree(error.empty(), error, "checkpoint: cannot write " + tmp);
  try {
    write_rank_file(rank_file(tmp, rank), step, numerics, shards, opt, rank, world);
  } catch (const H5::Exception& e) {
    error = "writing " + rank_file(tmp, rank) + ": " + h5_message(e);
  } catch (const std::exception& e) {
    error = "writing " + rank_file(tmp, rank) + ": " + e.what();
  }
  agree(error.empty(), error, "checkpoint: cannot write step " + std::to_string(step));
  if (rank == 0) {
    try {
      nlohmann::json meta = {{"format", kFormat}, {"step", step},         {"world", world},
                             {"numerics", numerics}, {"run", run}};
      for (int r = 0; r < world; ++r) meta["files"].push_back("rank" + std::to_string(r) + ".h5");
      for (const auto& [name, shard] : shards) meta["parameters"].push_back(name);
      {
        std::ofstream f(tmp + "/meta.json");
        f << meta.dump(2) << "\n";
        f.close();
        if (!f) throw std::runtime_error("cannot write " + tmp + "/meta.json");
      }
      fs::remove_all(old);
      if (fs::exists(final_dir)) fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
      fs::remove_all(old);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree(error.empty(), error, "checkpoint: cannot publish step " + std::to_string(step));
}

LoadedCheckpoint read_checkpoint(const std::string& out, const nlohmann::json& numerics, int rank,
                                 int world) {
  H5::Exception::dontPrint();
  LoadedCheckpoint ckpt;
  ckpt.dir = checkpoint_dir(out);
  // Between the two renames of a save only checkpoint.old/ is complete.
  if (!fs::exists(ckpt.dir + "/meta.json") && fs::exists(out + "/checkpoint.old/meta.json")) {
    ckpt.dir = out + "/checkpoint.old";
  }
  nlohmann::json meta;
  {
    std::ifstream f(ckpt.dir + "/meta.json");
    if (!f) {
      throw ConfigError("--resume: no checkpoint in " + checkpoint_dir(out) +
                        " (meta.json missing); train without --resume first");
    }
    try {
      f >> meta;
    } catch (const std::exception& e) {
      throw ConfigError("--resume: " + ckpt.dir + "/meta.json is not valid JSON: " + e.what());
    }
  }
  if (meta.value("format", "") != kFormat) {
    throw ConfigError("--resume: " + ckpt.dir + "/meta.json is not an fsdp-train checkpoint (" +
                      std::string(kFormat) + ")");
  }
  check_same_numerics(meta.at("numerics"), numerics, "the checkpoint in " + ckpt.dir);
  ckpt.step = meta.at("step").get<int64_t>();

  std::string error;
  const std::string path = rank_file(ckpt.dir, rank);
  try {
    H5::H5File file(path, H5F_ACC_RDONLY);
    H5::Group root = file.openGroup("/");
    if (read_string_attr(root, "format") != kFormat) {
      throw std::runtime_error("not an fsdp-train checkpoint file (" + std::string(kFormat) + ")");
    }
    if (read_int_attr(root, "step") != ckpt.step || read_int_attr(root, "rank") != rank ||
        read_int_attr(root, "world") != world) {
      throw std::runtime_error(fmt::format(
          "holds step {} of rank {}/{}, expected step {} of rank {}/{}",
          read_int_attr(root, "step"), read_int_attr(root, "rank"), read_int_attr(root, "world"),
          ckpt.step, rank, world));
    }
    H5::Group pg = file.openGroup("/params");
    for (hsize_t i = 0; i < pg.getNumObjs(); ++i) {
      const std::string name = pg.getObjnameByIdx(i);
      ckpt.shards.emplace_back(name, read_tensor(pg, name));
    }
    H5::Group og = file.openGroup("/optim");
    for (hsize_t i = 0; i < og.getNumObjs(); ++i) {
      const std::string name = og.getObjnameByIdx(i);
      H5::Group g = og.openGroup(name);
      ckpt.optim.emplace_back(
          name, AdamState{read_int(g, "step"), read_tensor(g, "exp_avg"), read_tensor(g, "exp_avg_sq")});
    }
  } catch (const H5::Exception& e) {
    error = path + ": " + h5_message(e);
  } catch (const std::exception& e) {
    error = path + ": " + e.what();
  }
  agree(error.empty(), error, "--resume: cannot read the checkpoint in " + ckpt.dir);
  return ckpt;
}

void load_optimizer_state(const LoadedCheckpoint& ckpt, const std::vector<std::string>& names,
                          torch::optim::AdamW& opt) {
  const auto& params = opt.param_groups().at(0).params();
  if (params.size() != names.size()) {
    throw std::logic_error("load_optimizer_state: names and parameters disagree");
  }
  std::map<std::string, const AdamState*> by_name;
  for (const auto& [name, s] : ckpt.optim) by_name[name] = &s;
  std::string error;
  for (size_t i = 0; i < params.size() && error.empty(); ++i) {
    auto it = by_name.find(names[i]);
    if (it == by_name.end()) continue;  // not stepped yet when saved
    const AdamState& s = *it->second;
    if (s.exp_avg.sizes() != params[i].sizes() || s.exp_avg_sq.sizes() != params[i].sizes()) {
      error = fmt::format("optimizer state of {} has shape [{}], the parameter shard [{}]", names[i],
                          fmt::join(s.exp_avg.sizes(), ", "), fmt::join(params[i].sizes(), ", "));
      break;
    }
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(s.step);
    state->exp_avg(s.exp_avg.to(params[i].device(), /*non_blocking=*/false, /*copy=*/true));
    state->exp_avg_sq(s.exp_avg_sq.to(params[i].device(), /*non_blocking=*/false, /*copy=*/true));
    opt.state()[fsdp::optimizer_state_key(opt, params[i])] = std::move(state);
  }
  agree(error.empty(), error, "--resume: cannot load the optimizer state from " + ckpt.dir);
}

}  // namespace fsdp_train
