#include "reference/store.h"

#include "fsdp_h5/util.h"

#include <ATen/ATen.h>
#include <H5Cpp.h>
#include <dlfcn.h>
#include <torch/version.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#ifndef FSDP_REFERENCE_DIR
#error "FSDP_REFERENCE_DIR must name the source tree's data/reference"
#endif

namespace ref {

namespace {

const char* kRegenerate =
    "regenerate with `cmake --build build --target regenerate-references` "
    "(or `build/reference/fsdp-reference --case %s`)";

using fsdp_h5::EmptyString;

// The store's strings: "" is stored as " ", and a missing one reads as "".
void write_string_attr(H5::H5Object& obj, const std::string& name, const std::string& value) {
  fsdp_h5::write_string_attr(obj, name, value, EmptyString::Space);
}

std::string read_string_attr(const H5::H5Object& obj, const std::string& name) {
  return fsdp_h5::find_string_attr(obj, name, EmptyString::Space).value_or("");
}

void write_doubles(H5::Group& g, const std::string& name, const std::vector<double>& v,
                   std::vector<hsize_t> dims = {}) {
  if (dims.empty()) dims = {v.size()};
  fsdp_h5::write_dataset(g, name, H5::PredType::IEEE_F64LE, dims, v.data(),
                        H5::PredType::NATIVE_DOUBLE);
}

std::vector<double> read_doubles(const H5::Group& g, const std::string& name,
                                 std::vector<hsize_t>* dims_out = nullptr) {
  return fsdp_h5::read_all<double>(g.openDataSet(name), H5::PredType::NATIVE_DOUBLE, dims_out);
}

void write_tensor(H5::Group& g, const std::string& name, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  fsdp_h5::write_dataset(g, name, H5::PredType::IEEE_F32LE, {c.sizes().begin(), c.sizes().end()},
                        c.data_ptr<float>(), H5::PredType::NATIVE_FLOAT);
}

// The dataset as a new tensor of `dtype`, read as `mem_type`.
at::Tensor read_as(const H5::Group& g, const std::string& name, at::ScalarType dtype,
                   const H5::PredType& mem_type) {
  H5::DataSet ds = g.openDataSet(name);
  at::Tensor t = at::empty(fsdp_h5::dims_of(ds), dtype);
  ds.read(t.data_ptr(), mem_type);
  return t;
}

at::Tensor read_tensor(const H5::Group& g, const std::string& name) {
  return read_as(g, name, at::kFloat, H5::PredType::NATIVE_FLOAT);
}

// Routing ids (int64).
void write_ids(H5::Group& g, const std::string& name, const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  fsdp_h5::write_dataset(g, name, H5::PredType::STD_I64LE, {c.sizes().begin(), c.sizes().end()},
                        c.data_ptr<int64_t>(), H5::PredType::NATIVE_INT64);
}

at::Tensor read_ids(const H5::Group& g, const std::string& name) {
  return read_as(g, name, at::kLong, H5::PredType::NATIVE_INT64);
}

std::vector<std::string> members(const H5::Group& g) { return fsdp_h5::child_names(g); }

std::string regenerate_hint(const std::string& case_name) {
  char buf[512];
  std::snprintf(buf, sizeof buf, kRegenerate, case_name.c_str());
  return buf;
}

}  // namespace

std::string default_reference_dir() { return FSDP_REFERENCE_DIR; }

std::string reference_path(const std::string& dir, const std::string& device,
                           const std::string& case_name) {
  return dir + "/" + device + "/" + case_name + ".h5";
}

std::string blas_core_name() {
  using CoreName = char* (*)();
  if (auto fn = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    if (const char* s = fn()) return s;
  }
  return "";
}

void write_reference(const std::string& path, const Case& c, const RunRecord& record) {
  namespace fs = std::filesystem;
  fs::create_directories(fs::path(path).parent_path());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    H5::H5File file(tmp, H5F_ACC_TRUNC);
    H5::Group root = file.openGroup("/");
    write_string_attr(root, "case", c.name());
    std::string ids;
    for (const auto& id : c.plan_ids()) ids += (ids.empty() ? "" : ",") + id;
    write_string_attr(root, "plan_ids", ids);
    write_string_attr(root, "config", stored_config(c).dump());
    write_string_attr(root, "config_hash", config_hash(c));
    write_string_attr(root, "libtorch_version", TORCH_VERSION);
    write_string_attr(root, "blas_core", blas_core_name());
    write_string_attr(root, "generator", "fsdp-reference (libfsdp), single process, fp32, 1 thread");

    std::vector<double> loss, norm, chunks, margins, unchunked;
    std::map<std::string, std::vector<double>> norms;
    size_t n_chunks = 0;
    for (const auto& s : record.steps) {
      loss.push_back(s.loss);
      norm.push_back(s.grad_norm);
      margins.push_back(s.routing_margin);
      for (const auto& [k, v] : s.norms) norms[k].push_back(v);
      n_chunks = s.chunk_losses.size();
      chunks.insert(chunks.end(), s.chunk_losses.begin(), s.chunk_losses.end());
      if (s.unchunked_loss) unchunked.push_back(*s.unchunked_loss);
    }
    write_doubles(root, "loss", loss);
    write_doubles(root, "grad_norm", norm);
    if (n_chunks > 0) write_doubles(root, "chunk_losses", chunks, {record.steps.size(), n_chunks});
    if (!unchunked.empty()) {
      if (unchunked.size() != record.steps.size()) {
        throw std::invalid_argument("write_reference: unchunked_loss recorded on " +
                                    std::to_string(unchunked.size()) + " of " +
                                    std::to_string(record.steps.size()) + " steps");
      }
      write_doubles(root, "unchunked_loss", unchunked);
    }
    const bool routed = !record.steps.empty() && !record.steps[0].routing.empty();
    if (routed) write_doubles(root, "routing_margin", margins);
    if (!norms.empty()) {
      H5::Group g = root.createGroup("norms");
      for (const auto& [k, v] : norms) write_doubles(g, k, v);
    }
    for (size_t k = 0; k < record.steps.size(); ++k) {
      H5::Group step = root.createGroup("step" + std::to_string(k));
      H5::Group grads = step.createGroup("grad");
      for (const auto& [name, t] : record.steps[k].grads) write_tensor(grads, name, t);
      H5::Group params = step.createGroup("param");
      for (const auto& [name, t] : record.steps[k].params) write_tensor(params, name, t);
      if (routed) {
        H5::Group routing = step.createGroup("routing");
        for (const auto& [name, t] : record.steps[k].routing) write_ids(routing, name, t);
      }
    }
  }
  fs::rename(tmp, path);
}

StoredReference read_reference_unchecked(const std::string& path) {
  H5::H5File file(path, H5F_ACC_RDONLY);
  H5::Group root = file.openGroup("/");
  StoredReference out;
  out.config_json = read_string_attr(root, "config");
  out.config_hash = read_string_attr(root, "config_hash");
  out.libtorch_version = read_string_attr(root, "libtorch_version");
  out.blas_core = read_string_attr(root, "blas_core");
  const auto loss = read_doubles(root, "loss");
  const auto norm = read_doubles(root, "grad_norm");
  out.record.steps.resize(loss.size());
  std::vector<hsize_t> chunk_dims;
  std::vector<double> chunks;
  if (root.nameExists("chunk_losses")) chunks = read_doubles(root, "chunk_losses", &chunk_dims);
  std::vector<double> unchunked;
  if (root.nameExists("unchunked_loss")) unchunked = read_doubles(root, "unchunked_loss");
  std::vector<double> margins;
  if (root.nameExists("routing_margin")) margins = read_doubles(root, "routing_margin");
  std::map<std::string, std::vector<double>> norms;
  if (root.nameExists("norms")) {
    H5::Group g = root.openGroup("norms");
    for (const auto& k : members(g)) norms[k] = read_doubles(g, k);
  }
  for (size_t k = 0; k < loss.size(); ++k) {
    StepRecord& s = out.record.steps[k];
    s.loss = loss[k];
    s.grad_norm = norm.at(k);
    for (const auto& [name, v] : norms) s.norms[name] = v.at(k);
    if (!chunks.empty()) {
      const size_t n = chunk_dims.at(1);
      s.chunk_losses.assign(chunks.begin() + static_cast<long>(k * n),
                            chunks.begin() + static_cast<long>((k + 1) * n));
    }
    if (!unchunked.empty()) s.unchunked_loss = unchunked.at(k);
    H5::Group step = root.openGroup("step" + std::to_string(k));
    H5::Group grads = step.openGroup("grad");
    for (const auto& name : members(grads)) s.grads[name] = read_tensor(grads, name);
    H5::Group params = step.openGroup("param");
    for (const auto& name : members(params)) s.params[name] = read_tensor(params, name);
    if (!margins.empty()) {
      s.routing_margin = margins.at(k);
      H5::Group routing = step.openGroup("routing");
      for (const auto& name : members(routing)) s.routing[name] = read_ids(routing, name);
    }
  }
  return out;
}

StoredReference read_reference(const std::string& path, const Case& c) {
  if (!std::filesystem::exists(path)) {
    throw StaleReference("missing reference for " + c.name() + " (" + path + "): " +
                         regenerate_hint(c.name()));
  }
  StoredReference out;
  try {
    out = read_reference_unchecked(path);
  } catch (const H5::Exception& e) {
    throw StaleReference("unreadable reference for " + c.name() + " (" + path + ": " +
                         e.getDetailMsg() + "): " + regenerate_hint(c.name()));
  }
  const std::string want = config_hash(c);
  if (out.config_hash != want) {
    throw StaleReference("stale reference for " + c.name() + " (" + path + " has config hash " +
                         out.config_hash + ", the case now hashes to " + want + "): " +
                         regenerate_hint(c.name()));
  }
  return out;
}

}  // namespace ref
