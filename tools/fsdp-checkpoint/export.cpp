// export: full tensors to one HDF5 or safetensors file, one tensor (and
// one block of rows) at a time.
#include "common.h"

#include <fsdp_h5/util.h>

#include <H5Cpp.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace fsdp_checkpoint {

namespace {

namespace fs = std::filesystem;
using Info = fsdp::dcp::Reader::TensorInfo;

// The checkpoint's absolute path (the files' "source").
std::string source_of(const fsdp::dcp::Reader& reader) {
  std::error_code ec;
  const fs::path p = fs::absolute(reader.path(), ec);
  return ec ? reader.path() : p.lexically_normal().string();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// `name` starts with `prefix` (plain text: "model/fc1" takes model/fc1.weight).
bool under(const std::string& name, const std::string& prefix) {
  return name.compare(0, prefix.size(), prefix) == 0;
}

// The tensors to export, in the index's (name) order.
std::vector<const Info*> selected(const fsdp::dcp::Reader& reader, const ExportArgs& args) {
  std::vector<const Info*> out;
  std::vector<bool> used(args.only.size(), false);
  for (const auto& t : reader.tensors()) {
    if (t.kind == "rank_local" && !args.include_rank_local) continue;
    bool take = args.only.empty();
    for (size_t i = 0; i < args.only.size(); ++i) {
      if (under(t.name, args.only[i])) take = used[i] = true;
    }
    if (take) out.push_back(&t);
  }
  for (size_t i = 0; i < args.only.size(); ++i) {
    if (!used[i]) {
      throw UsageError(fmt::format("--only {}: no tensor name of {} starts with it{}", args.only[i],
                                   reader.path(),
                                   args.include_rank_local ? "" : " (rank-local ones skipped)"));
    }
  }
  return out;
}

// ---- HDF5 ---------------------------------------------------------------

// The file and memory type of an exported dtype (bfloat16/float16 -> float32).
const H5::PredType& h5_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return H5::PredType::IEEE_F64LE;
    case at::kLong: return H5::PredType::STD_I64LE;
    case at::kInt: return H5::PredType::STD_I32LE;
    case at::kShort: return H5::PredType::STD_I16LE;
    case at::kChar: return H5::PredType::STD_I8LE;
    case at::kByte:
    case at::kBool: return H5::PredType::STD_U8LE;
    default: return H5::PredType::IEEE_F32LE;  // float32, float16, bfloat16
  }
}

at::ScalarType h5_export_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 ? at::kFloat : t;
}

// The group that holds dataset `name` ("a/b/c" -> group a/b, created as needed).
H5::Group parent_group(H5::H5File& file, const std::string& name, std::string& leaf) {
  H5::Group g = file.openGroup("/");
  size_t begin = 0;
  for (size_t slash; (slash = name.find('/', begin)) != std::string::npos; begin = slash + 1) {
    const std::string part = name.substr(begin, slash - begin);
    if (g.nameExists(part)) {
      if (g.childObjType(part) != H5O_TYPE_GROUP) {
        throw UsageError(fmt::format("tensor '{}': '{}' is a dataset already; HDF5 cannot hold "
                                     "both (export with --only, or to .safetensors)",
                                     name, name.substr(0, slash)));
      }
      g = g.openGroup(part);
    } else {
      g = g.createGroup(part);
    }
  }
  leaf = name.substr(begin);
  return g;
}

void export_h5(const fsdp::dcp::Reader& reader, const std::vector<const Info*>& tensors,
               const std::string& path) {
  H5::Exception::dontPrint();
  H5::H5File file(path, H5F_ACC_TRUNC);
  fsdp_h5::write_int_attr(file, "step", reader.step());
  fsdp_h5::write_string_attr(file, "source", source_of(reader), fsdp_h5::EmptyString::Space);
  for (const Info* t : tensors) {
    std::string leaf;
    H5::Group g = parent_group(file, t->name, leaf);
    const H5::PredType& type = h5_type(t->dtype);
    const at::ScalarType out_dtype = h5_export_dtype(t->dtype);
    const std::vector<hsize_t> dims(t->shape.begin(), t->shape.end());
    if (numel(t->shape) == 0 || t->shape.empty()) {  // scalar or empty: one write
      at::Tensor v =
          read_box(reader, t->name, std::vector<int64_t>(t->shape.size(), 0), t->shape)
              .to(out_dtype)
              .contiguous();
      fsdp_h5::write_dataset(g, leaf, type, dims, v.data_ptr(), type);
      continue;
    }
    H5::DataSet ds = g.createDataSet(leaf, type, H5::DataSpace(static_cast<int>(dims.size()),
                                                              dims.data()));
    for_each_block(reader, *t, kBlockBytes, [&](const at::Tensor& block, int64_t row) {
      at::Tensor v = block.to(out_dtype).contiguous();
      std::vector<hsize_t> start(dims.size(), 0), count(v.sizes().begin(), v.sizes().end());
      start[0] = static_cast<hsize_t>(row);
      H5::DataSpace fspace = ds.getSpace();
      fspace.selectHyperslab(H5S_SELECT_SET, count.data(), start.data());
      H5::DataSpace mspace(static_cast<int>(count.size()), count.data());
      ds.write(v.data_ptr(), type, mspace, fspace);
    });
  }
}

// ---- safetensors --------------------------------------------------------

const char* st_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: throw UsageError(fmt::format("dtype {} has no safetensors name", c10::toString(t)));
  }
}

void export_safetensors(const fsdp::dcp::Reader& reader, const std::vector<const Info*>& tensors,
                        const std::string& path) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"step", std::to_string(reader.step())}, {"source", source_of(reader)}};
  int64_t offset = 0;
  for (const Info* t : tensors) {
    const int64_t bytes = tensor_bytes(*t);
    header[t->name] = {{"dtype", st_dtype(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw UsageError(fmt::format("--to {}: cannot create: {}", path, std::strerror(errno)));
  unsigned char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const Info* t : tensors) {
    // CPU tensors in the host's byte order: little-endian on every machine
    // LibTorch builds for.
    for_each_block(reader, *t, kBlockBytes, [&](const at::Tensor& block, int64_t) {
      const at::Tensor v = block.contiguous();
      out.write(static_cast<const char*>(v.data_ptr()), static_cast<std::streamsize>(v.nbytes()));
    });
  }
  out.flush();
  if (!out) throw UsageError(fmt::format("--to {}: write failed: {}", path, std::strerror(errno)));
}

}  // namespace

int run_export(const ExportArgs& args) {
  const bool h5 = ends_with(args.to, ".h5") || ends_with(args.to, ".hdf5");
  if (!h5 && !ends_with(args.to, ".safetensors")) {
    throw UsageError(fmt::format("--to {}: unknown format; accepted: a name ending in .h5, .hdf5 "
                                 "or .safetensors", args.to));
  }
  const fsdp::dcp::Reader reader = open_reader(args.dir, "<dir>");
  const auto tensors = selected(reader, args);
  // Written beside the target and renamed into place: no half-written file
  // under the asked-for name.
  const std::string partial = args.to + ".partial";
  try {
    if (h5) {
      try {
        export_h5(reader, tensors, partial);
      } catch (const H5::Exception& e) {
        throw UsageError(fmt::format("--to {}: HDF5 could not write it ({}: {})", args.to,
                                     e.getFuncName(), e.getDetailMsg()));
      }
    } else {
      export_safetensors(reader, tensors, partial);
    }
    std::error_code ec;
    fs::rename(partial, args.to, ec);
    if (ec) throw UsageError(fmt::format("--to {}: cannot rename {} to it: {}", args.to, partial,
                                         ec.message()));
  } catch (...) {
    std::error_code ec;
    fs::remove(partial, ec);
    throw;
  }
  int64_t bytes = 0;
  for (const Info* t : tensors) bytes += tensor_bytes(*t);
  fmt::print("exported {} tensors ({} bytes) of {} (step {}) to {}\n", tensors.size(), bytes,
             reader.path(), reader.step(), args.to);
  return kExitOk;
}

}  // namespace fsdp_checkpoint
