// HDF5 reads and writes of checkpoint pieces (h5io.h).
#include "checkpoint/h5io.h"

#include <ATen/ops/empty.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace fsdp::dcp::detail {

Handle& Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    if (id_ >= 0 && close_) close_(id_);
    id_ = o.id_;
    close_ = o.close_;
    o.id_ = -1;
  }
  return *this;
}

Handle::~Handle() {
  if (id_ >= 0 && close_) close_(id_);
}

void quiet_hdf5() {
  // Per thread in a thread-safe HDF5 (background savers call it too), and
  // cheap: set on every call rather than remembered.
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

std::string hdf5_error() {
  std::string msg;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* out = static_cast<std::string*>(data);
        if (e->desc && *e->desc) {
          if (!out->empty()) *out += "; ";
          *out += e->desc;
        }
        return n >= 2 ? 1 : 0;  // the outermost few say enough
      },
      &msg);
  H5Eclear2(H5E_DEFAULT);
  return msg.empty() ? "HDF5 error" : msg;
}

Handle self_contained_access() {
  Handle dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
  H5Pset_elink_cb(
      dapl.get(),
      [](const char*, const char*, const char*, const char*, unsigned*, hid_t, void*) -> herr_t {
        return -1;
      },
      nullptr);
  return dapl;
}

std::string foreign_storage(hid_t dataset) {
  Handle dcpl(H5Dget_create_plist(dataset), H5Pclose);
  if (!dcpl.valid()) return "its creation properties cannot be read";
  if (H5Pget_layout(dcpl.get()) == H5D_VIRTUAL) return "it is a virtual dataset (data in other files)";
  if (H5Pget_external_count(dcpl.get()) != 0) return "its data is stored in external files";
  return "";
}

namespace {

[[noreturn]] void fail(CheckpointError::Kind kind, const std::string& tensor,
                       const std::string& file, const std::string& what) {
  throw CheckpointError(kind, tensor, file, what + " (" + hdf5_error() + ")");
}

// 4 MiB: large enough that HDF5's per-block work (filter, B-tree entry,
// one write or read call) is small against the bytes, small enough that a
// byte-range read of a few rows reads little beyond them.
constexpr int64_t kBlockBytes = int64_t{4} << 20;

// Dataset access without HDF5's chunk cache: whole blocks then go straight
// between the file and our buffers (through the filter) instead of through
// a 1 MiB cache that holds less than one block.
// External links are refused: a dataset path in a checkpoint must not lead
// into another file.
Handle uncached_access() {
  Handle dapl = self_contained_access();
  H5Pset_chunk_cache(dapl.get(), 0, 0, 1.0);
  return dapl;
}

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"},
    {at::kBFloat16, "bfloat16"}, {at::kLong, "int64"}, {at::kInt, "int32"},
    {at::kShort, "int16"}, {at::kChar, "int8"}, {at::kByte, "uint8"}, {at::kBool, "bool"},
};

// A 16-bit IEEE-style float with `mantissa` bits (float16: 10, bfloat16: 7).
Handle float16_type(size_t exponent_bits, size_t mantissa_bits, size_t bias) {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, 15 - exponent_bits, exponent_bits, 0, mantissa_bits);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, bias);
  return Handle(t, H5Tclose);
}

std::vector<hsize_t> dims_of(const std::vector<int64_t>& v) {
  return std::vector<hsize_t>(v.begin(), v.end());
}

// Storage blocks of about kBlockBytes: whole rows of the trailing dims where
// they fit, so a read of a row range touches few blocks.
std::vector<hsize_t> chunk_dims(const std::vector<int64_t>& sizes, size_t elem) {
  const int64_t target = std::max<int64_t>(1, kBlockBytes / static_cast<int64_t>(elem));
  std::vector<hsize_t> c(sizes.begin(), sizes.end());
  int64_t inner = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    if (inner * sizes[d] <= target) {
      inner *= sizes[d];
      continue;
    }
    c[d] = static_cast<hsize_t>(std::max<int64_t>(1, target / inner));
    for (size_t e = 0; e < d; ++e) c[e] = 1;
    break;
  }
  return c;
}

}  // namespace

std::string dtype_name(at::ScalarType t, const std::string& tensor) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  throw ArgumentError("state", "distributed checkpoint: '" + tensor + "' has dtype " +
                                   std::string(c10::toString(t)) +
                                   ", which cannot be saved; accepted: float32, float64, float16, "
                                   "bfloat16, int64, int32, int16, int8, uint8, bool");
}

at::ScalarType dtype_of(const std::string& name, const std::string& tensor,
                        const std::string& file) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  throw CheckpointError(CheckpointError::Kind::Format, tensor, file,
                        file + ": tensor '" + tensor + "' has dtype '" + name +
                            "', which this libfsdp does not read");
}

Handle h5_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return Handle(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
    case at::kDouble: return Handle(H5Tcopy(H5T_IEEE_F64LE), H5Tclose);
    case at::kHalf: return float16_type(5, 10, 15);
    case at::kBFloat16: return float16_type(8, 7, 127);
    case at::kLong: return Handle(H5Tcopy(H5T_STD_I64LE), H5Tclose);
    case at::kInt: return Handle(H5Tcopy(H5T_STD_I32LE), H5Tclose);
    case at::kShort: return Handle(H5Tcopy(H5T_STD_I16LE), H5Tclose);
    case at::kChar: return Handle(H5Tcopy(H5T_STD_I8LE), H5Tclose);
    case at::kByte:
    case at::kBool: return Handle(H5Tcopy(H5T_STD_U8LE), H5Tclose);
    default: break;
  }
  throw ArgumentError("state", "distributed checkpoint: dtype " + std::string(c10::toString(t)) +
                                   " cannot be saved");
}

Handle create_file(const std::string& path) {
  quiet_hdf5();
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
  Handle f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!f.valid()) fail(CheckpointError::Kind::Io, "", path, "cannot create " + path);
  return f;
}

Handle open_file(const std::string& path, const std::string& shown_as) {
  quiet_hdf5();
  {
    // The type before HDF5 opens it: opening a FIFO blocks, a device never ends.
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) {
        throw CheckpointError(CheckpointError::Kind::Incomplete, "", shown_as,
                              shown_as + " is missing");
      }
      throw CheckpointError(CheckpointError::Kind::Corrupt, "", shown_as,
                            shown_as + " cannot be opened: " + std::strerror(errno));
    }
    struct stat st {};
    const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    ::close(fd);
    if (!regular) {
      throw CheckpointError(CheckpointError::Kind::Corrupt, "", shown_as,
                            shown_as + " is not a regular file");
    }
  }
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    fail(CheckpointError::Kind::Corrupt, "", shown_as, shown_as + " is not a readable HDF5 file");
  }
  Handle f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!f.valid()) fail(CheckpointError::Kind::Corrupt, "", shown_as, "cannot open " + shown_as);
  return f;
}

void write_piece(hid_t file, const std::string& path, const at::Tensor& data,
                 const std::string& tensor, const std::string& file_name) {
  std::vector<int64_t> sizes = data.sizes().vec();
  if (sizes.empty()) sizes = {1};  // a 0-d tensor is stored as one element
  Handle type = h5_type(data.scalar_type());
  const auto dims = dims_of(sizes);
  Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  const auto chunk = chunk_dims(sizes, data.element_size());
  H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data());
  H5Pset_fletcher32(dcpl.get());
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Handle dapl = uncached_access();
  Handle ds(H5Dcreate2(file, path.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(),
                       dapl.get()),
            H5Dclose);
  if (!ds.valid()) {
    fail(CheckpointError::Kind::Io, tensor, file_name,
         "cannot create dataset " + path + " of '" + tensor + "' in " + file_name);
  }
  if (H5Dwrite(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data_ptr()) < 0) {
    fail(CheckpointError::Kind::Io, tensor, file_name,
         "cannot write '" + tensor + "' to " + file_name);
  }
}

namespace {

// A piece is read only as this library writes it: chunked storage in this
// file, Fletcher-32 its one filter (so every block read is checked, and no
// filter plugin is ever loaded for it), the index's dtype.
void check_as_written(hid_t ds, at::ScalarType dtype, const std::string& path,
                      const std::string& tensor, const std::string& file_name) {
  const auto refuse = [&](const std::string& why) {
    throw CheckpointError(CheckpointError::Kind::Corrupt, tensor, file_name,
                          file_name + ": dataset " + path + " of '" + tensor + "': " + why);
  };
  const std::string foreign = foreign_storage(ds);
  if (!foreign.empty()) refuse(foreign);
  Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (H5Pget_layout(dcpl.get()) != H5D_CHUNKED) refuse("it is not stored in checksummed blocks");
  const int filters = H5Pget_nfilters(dcpl.get());
  unsigned flags = 0, config = 0;
  size_t nvalues = 0;
  const H5Z_filter_t filter =
      filters == 1 ? H5Pget_filter2(dcpl.get(), 0, &flags, &nvalues, nullptr, 0, nullptr, &config)
                   : H5Z_FILTER_ERROR;
  if (filter != H5Z_FILTER_FLETCHER32) {
    refuse("its filters are not exactly Fletcher-32 (" + std::to_string(filters) +
           " filter(s)): its blocks are not checksummed as written");
  }
  Handle stored(H5Dget_type(ds), H5Tclose);
  Handle want = h5_type(dtype);
  if (!stored.valid() || H5Tequal(stored.get(), want.get()) <= 0) {
    const size_t bytes = stored.valid() ? H5Tget_size(stored.get()) : 0;
    refuse("it stores another element type (HDF5 class " +
           std::to_string(stored.valid() ? static_cast<int>(H5Tget_class(stored.get())) : -1) +
           ", " + std::to_string(bytes) + " bytes) than the index's " + dtype_name(dtype, tensor));
  }
}

}  // namespace

void read_piece(hid_t file, const std::string& path, const Box& stored, const Box& want,
                at::Tensor& dst, const std::string& tensor, const std::string& file_name) {
  Handle dapl = uncached_access();
  Handle ds(H5Dopen2(file, path.c_str(), dapl.get()), H5Dclose);
  if (!ds.valid()) {
    fail(CheckpointError::Kind::Incomplete, tensor, file_name,
         file_name + " lacks dataset " + path + " of '" + tensor + "'");
  }
  check_as_written(ds.get(), dst.scalar_type(), path, tensor, file_name);
  Handle fspace(H5Dget_space(ds.get()), H5Sclose);
  const int ndim = H5Sget_simple_extent_ndims(fspace.get());
  if (ndim < 0 || ndim > 64) {
    fail(CheckpointError::Kind::Corrupt, tensor, file_name,
         file_name + ": dataset " + path + " of '" + tensor + "' has no readable extent");
  }
  std::vector<hsize_t> extent(static_cast<size_t>(ndim));
  H5Sget_simple_extent_dims(fspace.get(), extent.data(), nullptr);
  std::vector<int64_t> expect = stored.sizes;
  if (expect.empty()) expect = {1};
  if (extent != dims_of(expect)) {
    throw CheckpointError(CheckpointError::Kind::Corrupt, tensor, file_name,
                          file_name + ": dataset " + path + " of '" + tensor +
                              "' does not have the extent the index gives");
  }
  std::vector<hsize_t> start, count;
  if (stored.sizes.empty()) {
    start = {0};
    count = {1};
  } else {
    for (size_t d = 0; d < want.sizes.size(); ++d) {
      start.push_back(static_cast<hsize_t>(want.offsets[d] - stored.offsets[d]));
      count.push_back(static_cast<hsize_t>(want.sizes[d]));
    }
  }
  H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
  Handle mspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr),
                H5Sclose);
  Handle type = h5_type(dst.scalar_type());
  if (H5Dread(ds.get(), type.get(), mspace.get(), fspace.get(), H5P_DEFAULT, dst.data_ptr()) < 0) {
    fail(CheckpointError::Kind::Corrupt, tensor, file_name,
         "corrupt piece of '" + tensor + "' " + box_str(stored) + " in " + file_name +
             ": reading " + box_str(want) + " failed its checksum or structure check");
  }
}

void write_global_view(const std::string& path, const GlobalView& view, int64_t step) {
  Handle f = create_file(path);
  {
    Handle space(H5Screate(H5S_SCALAR), H5Sclose);
    Handle attr(H5Acreate2(f.get(), "step", H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                H5Aclose);
    H5Awrite(attr.get(), H5T_NATIVE_INT64, &step);
  }
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  for (const auto& t : view.tensors) {
    Handle type = h5_type(t.dtype);
    // A 0-d tensor is stored as one element, so its view has shape [1].
    const std::vector<int64_t> shape = t.shape.empty() ? std::vector<int64_t>{1} : t.shape;
    const auto dims = dims_of(shape);
    Handle vspace(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                  H5Sclose);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    for (const auto& p : t.pieces) {
      const auto start = t.shape.empty() ? std::vector<hsize_t>{0} : dims_of(p.box.offsets);
      const auto count = t.shape.empty() ? std::vector<hsize_t>{1} : dims_of(p.box.sizes);
      H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(),
                          nullptr);
      Handle sspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr),
                    H5Sclose);
      if (H5Pset_virtual(dcpl.get(), vspace.get(), p.file.c_str(), p.dataset.c_str(),
                         sspace.get()) < 0) {
        fail(CheckpointError::Kind::Io, t.name, path, "cannot map '" + t.name + "' in " + path);
      }
    }
    H5Sselect_all(vspace.get());
    Handle ds(H5Dcreate2(f.get(), t.name.c_str(), type.get(), vspace.get(), lcpl.get(),
                         dcpl.get(), H5P_DEFAULT),
              H5Dclose);
    if (!ds.valid()) {
      fail(CheckpointError::Kind::Io, t.name, path, "cannot write '" + t.name + "' to " + path);
    }
  }
}

}  // namespace fsdp::dcp::detail
