// load_weights (fsdp/weights_file.h): a full-tensor file read box by box
// into this rank's pieces of the module -- the boxes come from the same
// Items a distributed checkpoint loads (items.h), so the placement rule is
// DTensor's, not restated here -- with one verdict agreed by every rank
// before anything is installed, as dcp::load does.
#include "fsdp/weights_file.h"

#include "fsdp/distributed_checkpoint.h"
#include "fsdp/errors.h"
#include "fsdp/mesh.h"

#include "base/shape_str.h"
#include "checkpoint/exchange.h"
#include "checkpoint/files.h"
#include "checkpoint/h5io.h"
#include "checkpoint/index.h"
#include "checkpoint/items.h"
#include "checkpoint/layout.h"
#include "comm/group_registry.h"

#include <ATen/ops/empty.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>

namespace fsdp {
namespace {

using dcp::CheckpointError;
using dcp::detail::Box;
using Kind = CheckpointError::Kind;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian and is read into tensors as it lies");

// A tensor as a file describes it. `dtype` is unset for a file dtype this
// library has no ScalarType for (`dtype_text` names it then).
struct FileTensor {
  std::optional<at::ScalarType> dtype;
  std::string dtype_text;
  std::vector<int64_t> shape;
};

// "float32" and the like (the names dcp messages use), whatever the dtype.
std::string dtype_str(at::ScalarType t) {
  try {
    return dcp::detail::dtype_name(t, "");
  } catch (const Error&) {
    return c10::toString(t);
  }
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// One file format: its tensors by name, and reads of boxes of them.
class Source {
 public:
  virtual ~Source() = default;
  virtual const char* format() const = 0;
  virtual std::vector<std::string> names() const = 0;
  virtual std::optional<FileTensor> find(const std::string& name) = 0;
  // The box `box` of tensor `name` into `dst` (contiguous CPU, the box's
  // sizes, the tensor's dtype -- or bool for an HDF5 uint8 dataset).
  virtual void read(const std::string& name, const Box& box, at::Tensor& dst) = 0;
  int64_t bytes_read() const { return bytes_read_; }

 protected:
  int64_t bytes_read_ = 0;
};

// ---- safetensors ----------------------------------------------------------

class Safetensors : public Source {
 public:
  explicit Safetensors(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      throw CheckpointError(Kind::Io, "", path_,
                            "cannot open " + path_ + ": " + std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      throw CheckpointError(Kind::Io, "", path_,
                            "cannot stat " + path_ + ": " + std::strerror(errno));
    }
    size_ = static_cast<int64_t>(st.st_size);
    if (size_ < 8) {
      corrupt("", "is " + std::to_string(size_) + " bytes, shorter than the header length");
    }
    uint8_t len[8];
    pread_all(len, 8, 0, "");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    if (n > static_cast<uint64_t>(size_ - 8)) {
      corrupt("", "says its header has " + std::to_string(n) + " bytes; the file has " +
                      std::to_string(size_) + " (truncated?)");
    }
    if (n > kMaxHeaderBytes) {
      corrupt("", "says its header has " + std::to_string(n) + " bytes; safetensors allows " +
                      std::to_string(kMaxHeaderBytes));
    }
    std::string header(static_cast<size_t>(n), '\0');
    pread_all(header.data(), header.size(), 8, "");
    data_start_ = 8 + static_cast<int64_t>(n);
    bytes_read_ = data_start_;
    nlohmann::json j;
    try {
      // A header nests 3 deep; far deeper would only exhaust the stack.
      j = nlohmann::json::parse(header, [this](int depth, nlohmann::json::parse_event_t,
                                               nlohmann::json&) {
        if (depth > 16) corrupt("", "has a header nested more than 16 deep");
        return true;
      });
    } catch (const nlohmann::json::exception& e) {
      corrupt("", std::string("has a header that is not valid JSON: ") + e.what());
    }
    if (!j.is_object()) corrupt("", "has a header that is not a JSON object");
    for (const auto& [name, v] : j.items()) {
      if (name == "__metadata__") continue;
      parse_entry(name, v);
    }
    check_disjoint();
  }
  ~Safetensors() override {
    if (fd_ >= 0) ::close(fd_);
  }
  Safetensors(const Safetensors&) = delete;
  Safetensors& operator=(const Safetensors&) = delete;

  const char* format() const override { return "safetensors"; }

  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& [name, e] : entries_) out.push_back(name);
    return out;
  }

  std::optional<FileTensor> find(const std::string& name) override {
    auto it = entries_.find(name);
    if (it == entries_.end()) return std::nullopt;
    return it->second.info;
  }

  // A box of a row-major tensor is a set of equal runs of contiguous
  // elements: the box's extent in the last dimension it does not span
  // whole, times everything after it. One pread per run, in the box's own
  // row-major order, so each lands right after the previous one in dst.
  void read(const std::string& name, const Box& box, at::Tensor& dst) override {
    const Entry& e = entries_.at(name);
    const std::vector<int64_t>& shape = e.info.shape;
    const std::vector<int64_t>&offsets = box.offsets, &sizes = box.sizes;
    const int64_t esize = static_cast<int64_t>(dst.element_size());
    auto* out = static_cast<char*>(dst.data_ptr());
    if (shape.empty()) {
      pread_all(out, static_cast<size_t>(esize), data_start_ + e.begin, name);
      bytes_read_ += esize;
      return;
    }
    if (numel_of(sizes) == 0) return;
    std::vector<int64_t> stride(shape.size(), 1);  // in elements
    for (size_t d = shape.size() - 1; d-- > 0;) stride[d] = stride[d + 1] * shape[d + 1];
    size_t k = shape.size() - 1;  // the last dimension the box does not span whole
    while (k > 0 && sizes[k] == shape[k]) --k;
    const int64_t run = sizes[k] * stride[k] * esize;
    std::vector<int64_t> idx(offsets.begin(), offsets.begin() + static_cast<std::ptrdiff_t>(k));
    for (int64_t written = 0;;) {
      int64_t element = offsets[k] * stride[k];
      for (size_t d = 0; d < k; ++d) element += idx[d] * stride[d];
      pread_all(out + written, static_cast<size_t>(run), data_start_ + e.begin + element * esize,
                name);
      written += run;
      bytes_read_ += run;
      size_t d = k;  // the next outer index, the last dimension fastest
      while (d > 0 && ++idx[d - 1] == offsets[d - 1] + sizes[d - 1]) {
        idx[d - 1] = offsets[d - 1];
        --d;
      }
      if (d == 0) break;
    }
  }

 private:
  struct Entry {
    FileTensor info;
    int64_t begin = 0, end = 0;  // byte offsets after the header
  };

  [[noreturn]] void corrupt(const std::string& tensor, const std::string& what) const {
    throw CheckpointError(Kind::Corrupt, tensor, path_,
                          path_ + (tensor.empty() ? "" : " ('" + tensor + "')") + " " + what);
  }

  void pread_all(void* buf, size_t n, int64_t at, const std::string& tensor) const {
    auto* p = static_cast<char*>(buf);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(at));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) {
        throw CheckpointError(Kind::Io, tensor, path_,
                              "reading " + path_ + (tensor.empty() ? "" : " ('" + tensor + "')") +
                                  " failed: " + std::strerror(errno));
      }
      if (got == 0) {
        corrupt(tensor, "ends at byte " + std::to_string(at) + " while " + std::to_string(n) +
                            " more bytes were to be read (truncated)");
      }
      p += got;
      n -= static_cast<size_t>(got);
      at += got;
    }
  }

  // The dtypes of the safetensors format and their element sizes; the ones
  // without a ScalarType here are still checked for size.
  static std::optional<at::ScalarType> scalar_type(const std::string& t, int64_t& size) {
    static const std::map<std::string, std::pair<int64_t, std::optional<at::ScalarType>>> table = {
        {"F64", {8, at::kDouble}}, {"F32", {4, at::kFloat}},  {"F16", {2, at::kHalf}},
        {"BF16", {2, at::kBFloat16}}, {"I64", {8, at::kLong}}, {"I32", {4, at::kInt}},
        {"I16", {2, at::kShort}}, {"I8", {1, at::kChar}},    {"U8", {1, at::kByte}},
        {"BOOL", {1, at::kBool}},  {"U64", {8, std::nullopt}}, {"U32", {4, std::nullopt}},
        {"U16", {2, std::nullopt}}, {"F8_E4M3", {1, std::nullopt}},
        {"F8_E5M2", {1, std::nullopt}}};
    auto it = table.find(t);
    size = it == table.end() ? 0 : it->second.first;
    return it == table.end() ? std::nullopt : it->second.second;
  }

  void parse_entry(const std::string& name, const nlohmann::json& v) {
    Entry e;
    const auto bad = [&](const std::string& what) {
      corrupt(name, "has a header entry that " + what);
    };
    if (!v.is_object() || !v.contains("dtype") || !v["dtype"].is_string() ||
        !v.contains("shape") || !v["shape"].is_array() || !v.contains("data_offsets") ||
        !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      bad("lacks dtype, shape or data_offsets [begin, end]");
    }
    e.info.dtype_text = v["dtype"].get<std::string>();
    for (const auto& s : v["shape"]) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0) bad("has a shape that is not sizes >= 0");
      e.info.shape.push_back(s.get<int64_t>());
    }
    for (const auto& o : v["data_offsets"]) {
      if (!o.is_number_integer() || o.get<int64_t>() < 0) bad("has data_offsets that are not >= 0");
    }
    e.begin = v["data_offsets"][0].get<int64_t>();
    e.end = v["data_offsets"][1].get<int64_t>();
    int64_t esize = 0;
    e.info.dtype = scalar_type(e.info.dtype_text, esize);
    if (e.info.dtype) e.info.dtype_text = dtype_str(*e.info.dtype) + " (" + e.info.dtype_text + ")";
    if (e.end < e.begin) bad("has data_offsets with end before begin");
    int64_t bytes = esize;
    for (int64_t s : e.info.shape) {
      if (__builtin_mul_overflow(bytes, s, &bytes)) bad("has a shape of more than 2^63 bytes");
    }
    if (esize > 0 && e.end - e.begin != bytes) {
      bad("has data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
          ") that do not hold " + shape_str(e.info.shape) + " of " + e.info.dtype_text);
    }
    if (e.end > size_ - data_start_) {
      corrupt(name, "has data up to byte " + std::to_string(data_start_ + e.end) +
                        " but the file ends at " + std::to_string(size_) + " (truncated)");
    }
    entries_.emplace(name, std::move(e));
  }

  // Every byte belongs to at most one tensor: overlapping entries would
  // make one tensor's bytes another's.
  void check_disjoint() const {
    std::vector<std::pair<const std::string*, const Entry*>> byte_order;
    for (const auto& [name, e] : entries_) {
      if (e.end > e.begin) byte_order.emplace_back(&name, &e);
    }
    std::sort(byte_order.begin(), byte_order.end(),
              [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
    for (size_t i = 1; i < byte_order.size(); ++i) {
      const auto& [prev_name, prev] = byte_order[i - 1];
      const auto& [name, e] = byte_order[i];
      if (e->begin < prev->end) {
        corrupt(*name, "has data_offsets [" + std::to_string(e->begin) + ", " +
                           std::to_string(e->end) + ") overlapping those of '" + *prev_name +
                           "' [" + std::to_string(prev->begin) + ", " + std::to_string(prev->end) +
                           ")");
      }
    }
  }

  // The safetensors format's own bound on the header.
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0, data_start_ = 0;
  std::map<std::string, Entry> entries_;
};

// ---- HDF5 -----------------------------------------------------------------

using dcp::detail::Handle;

herr_t collect_dataset(hid_t group, const char* name, const H5L_info_t* info, void* data) {
  // Soft and external links are not tensors of this file (and an external
  // one would open another file).
  if (info->type != H5L_TYPE_HARD) return 0;
  const hid_t obj = H5Oopen(group, name, H5P_DEFAULT);
  if (obj < 0) return 0;  // a dangling link: not a tensor
  if (H5Iget_type(obj) == H5I_DATASET) {
    static_cast<std::vector<std::string>*>(data)->push_back(name);
  }
  H5Oclose(obj);
  return 0;
}

class Hdf5 : public Source {
 public:
  explicit Hdf5(std::string path)
      : path_(std::move(path)), file_(dcp::detail::open_file(path_, path_)) {}

  const char* format() const override { return "hdf5"; }

  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    H5Lvisit(file_.get(), H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &out);
    std::sort(out.begin(), out.end());
    return out;
  }

  std::optional<FileTensor> find(const std::string& name) override {
    // Each group on the way must exist before H5Lexists may be asked about
    // the next component.
    for (size_t slash = name.find('/');; slash = name.find('/', slash + 1)) {
      const std::string part = name.substr(0, slash);
      if (part.empty() || H5Lexists(file_.get(), part.c_str(), access_.get()) <= 0) {
        return std::nullopt;
      }
      if (slash == std::string::npos) break;
    }
    Handle ds(H5Dopen2(file_.get(), name.c_str(), access_.get()), H5Dclose);
    if (!ds.valid()) return std::nullopt;  // a group of that name, or behind an external link
    const std::string foreign = dcp::detail::foreign_storage(ds.get());
    if (!foreign.empty()) fail(name, "dataset " + name + " is refused: " + foreign);
    FileTensor t;
    Handle type(H5Dget_type(ds.get()), H5Tclose);
    const size_t size = H5Tget_size(type.get());
    const H5T_class_t cls = H5Tget_class(type.get());
    if (cls == H5T_FLOAT) {
      size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
      H5Tget_fields(type.get(), &spos, &epos, &esize, &mpos, &msize);
      if (size == 8) t.dtype = at::kDouble;
      if (size == 4) t.dtype = at::kFloat;
      if (size == 2 && msize == 10) t.dtype = at::kHalf;
      if (size == 2 && msize == 7) t.dtype = at::kBFloat16;
    } else if (cls == H5T_INTEGER) {
      const bool is_signed = H5Tget_sign(type.get()) != H5T_SGN_NONE;
      if (is_signed && size == 8) t.dtype = at::kLong;
      if (is_signed && size == 4) t.dtype = at::kInt;
      if (is_signed && size == 2) t.dtype = at::kShort;
      if (is_signed && size == 1) t.dtype = at::kChar;
      if (!is_signed && size == 1) t.dtype = at::kByte;
    }
    t.dtype_text = t.dtype ? dtype_str(*t.dtype)
                           : "an HDF5 type of class " + std::to_string(static_cast<int>(cls)) +
                                 " and " + std::to_string(size) + " bytes";
    Handle space(H5Dget_space(ds.get()), H5Sclose);
    const int ndim = H5Sget_simple_extent_ndims(space.get());
    std::vector<hsize_t> dims(static_cast<size_t>(std::max(ndim, 0)));
    H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
    for (hsize_t d : dims) t.shape.push_back(static_cast<int64_t>(d));
    file_size_[name] = static_cast<int64_t>(size);
    return t;
  }

  void read(const std::string& name, const Box& box, at::Tensor& dst) override {
    Handle ds(H5Dopen2(file_.get(), name.c_str(), access_.get()), H5Dclose);
    if (!ds.valid()) fail(name, "cannot open dataset " + name);
    Handle fspace(H5Dget_space(ds.get()), H5Sclose);
    Handle mspace;
    if (box.sizes.empty()) {
      mspace = Handle(H5Screate(H5S_SCALAR), H5Sclose);
    } else {
      if (numel_of(box.sizes) == 0) return;
      std::vector<hsize_t> start(box.offsets.begin(), box.offsets.end());
      std::vector<hsize_t> count(box.sizes.begin(), box.sizes.end());
      H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(),
                          nullptr);
      mspace = Handle(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr),
                      H5Sclose);
    }
    Handle type = dcp::detail::h5_type(dst.scalar_type());
    const herr_t rc =
        H5Dread(ds.get(), type.get(), mspace.get(), fspace.get(), H5P_DEFAULT, dst.data_ptr());
    if (rc < 0) {
      fail(name, "reading " + dcp::detail::box_str(box) + " of dataset " + name + " failed (" +
                     dcp::detail::hdf5_error() + ")");
    }
    bytes_read_ += dst.numel() * file_size_.at(name);
  }

 private:
  [[noreturn]] void fail(const std::string& tensor, const std::string& what) const {
    throw CheckpointError(Kind::Corrupt, tensor, path_, path_ + " ('" + tensor + "'): " + what);
  }

  std::string path_;
  Handle file_;
  Handle access_ = dcp::detail::self_contained_access();
  std::map<std::string, int64_t> file_size_;  // element bytes in the file, by dataset
};

// ---- distributed checkpoint -------------------------------------------------

class Dcp : public Source {
 public:
  explicit Dcp(const std::string& path) : reader_(path) {
    bytes_read_ = static_cast<int64_t>(reader_.index_text().size());
    for (const auto& t : reader_.tensors()) {
      if (t.kind == "param" || t.kind == "buffer") tensors_.emplace(t.name, &t);
    }
  }
  const char* format() const override { return "dcp"; }
  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& [name, t] : tensors_) out.push_back(name);
    return out;
  }
  std::optional<FileTensor> find(const std::string& name) override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return std::nullopt;
    return FileTensor{it->second->dtype, dtype_str(it->second->dtype), it->second->shape};
  }
  void read(const std::string& name, const Box& box, at::Tensor& dst) override {
    const at::Tensor values = reader_.read(name, box.offsets, box.sizes);
    dst.copy_(values);
    bytes_read_ += values.numel() * static_cast<int64_t>(values.element_size());
  }

 private:
  dcp::Reader reader_;
  std::map<std::string, const dcp::Reader::TensorInfo*> tensors_;
};

// ---- the format of a path ---------------------------------------------------

// The HDF5 superblock signature, at 0 or a power of two from 512 on (a user
// block before it).
bool is_hdf5(int fd, int64_t size) {
  static const char kSignature[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  for (int64_t at = 0; at + 8 <= size; at = at == 0 ? 512 : at * 2) {
    char buf[8];
    if (::pread(fd, buf, 8, static_cast<off_t>(at)) != 8) return false;
    if (std::memcmp(buf, kSignature, 8) == 0) return true;
  }
  return false;
}

std::unique_ptr<Source> open_source(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw ArgumentError("path", "load_weights: path '" + path + "' cannot be read: " +
                                    std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) {
    if (dcp::detail::exists(path + "/" + dcp::detail::kIndexFile) ||
        !dcp::list_checkpoints(path).empty()) {
      return std::make_unique<Dcp>(path);
    }
    throw ArgumentError("path", "load_weights: path '" + path +
                                    "' is a directory without a distributed checkpoint (no "
                                    "index.json in it, no complete step-* under it)");
  }
  if (!S_ISREG(st.st_mode)) {
    // A FIFO would block the open, a device never end.
    throw ArgumentError("path", "load_weights: path '" + path +
                                    "' is not a regular file (a FIFO, device or socket); "
                                    "accepted: a safetensors or HDF5 file, or a checkpoint "
                                    "directory");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    throw ArgumentError("path", "load_weights: path '" + path + "' cannot be opened: " +
                                    std::strerror(errno));
  }
  const bool hdf5 = is_hdf5(fd, static_cast<int64_t>(st.st_size));
  char first[9] = {};
  const bool json_next = ::pread(fd, first, 9, 0) == 9 && first[8] == '{';
  ::close(fd);
  if (hdf5) return std::make_unique<Hdf5>(path);
  const std::string ext = ".safetensors";
  const bool named = path.size() >= ext.size() &&
                     path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
  if (json_next || named) return std::make_unique<Safetensors>(path);
  throw ArgumentError("path", "load_weights: path '" + path +
                                  "' is neither a safetensors file, an HDF5 file nor a "
                                  "distributed checkpoint directory");
}

}  // namespace

LoadWeightsReport load_weights(const std::string& path, torch::nn::Module& module,
                               const LoadWeightsOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const ProcessGroupPtr group =
      detail::side_group_for(world_group(), detail::SideGroup::Checkpoint);
  LoadWeightsReport report;
  std::vector<dcp::detail::Item> items;
  std::vector<at::Tensor> staging;  // this rank's values of each item; undefined: missing
  std::exception_ptr error;
  try {
    dcp::detail::quiet_hdf5();
    std::unique_ptr<Source> source = open_source(path);
    report.format = source->format();
    items = dcp::detail::module_items(module);
    std::set<std::string> taken;
    for (const auto& item : items) {
      const std::string stored = options.prefix + item.name;
      const std::optional<FileTensor> ft = source->find(stored);
      if (!ft) {
        if (options.strict) {
          throw ArgumentError("path", "load_weights: " + path + " has no tensor '" + stored +
                                          "' for the module's '" + item.name +
                                          "' (strict = false leaves such tensors as they are)");
        }
        report.missing.push_back(item.name);
        staging.emplace_back();
        continue;
      }
      taken.insert(stored);
      // HDF5 has no bool: a uint8 dataset holds one, byte for byte.
      const bool bool_bytes = report.format == std::string("hdf5") && item.dtype == at::kBool &&
                              ft->dtype == at::kByte;
      if (ft->dtype != item.dtype && !bool_bytes) {
        throw DTypeError("module", "load_weights: '" + item.name + "' is " + ft->dtype_text +
                                       " in " + path + " and " + dtype_str(item.dtype) +
                                       " in the module (no conversion is made)");
      }
      if (ft->shape != item.shape) {
        throw ShapeError("module", "load_weights: '" + item.name + "' has shape " +
                                       shape_str(ft->shape) + " in " + path + " and " +
                                       shape_str(item.shape) + " in the module");
      }
      const auto on_host = at::TensorOptions().dtype(item.dtype);
      at::Tensor values = at::empty(item.local.sizes(), on_host);
      for (const auto& lb : item.boxes) {
        at::Tensor dst = dcp::detail::region(values, lb);
        // Straight into the host buffer where the box is one block of it.
        at::Tensor buf = dst.is_contiguous() ? dst : at::empty(lb.global.sizes, on_host);
        source->read(stored, lb.global, buf);
        if (!buf.is_same(dst)) dst.copy_(buf);
      }
      staging.push_back(values);
    }
    for (const auto& name : source->names()) {
      if (taken.count(name)) continue;
      const bool prefixed = name.compare(0, options.prefix.size(), options.prefix) == 0;
      report.unexpected.push_back(prefixed ? name.substr(options.prefix.size()) : name);
    }
    std::sort(report.missing.begin(), report.missing.end());
    std::sort(report.unexpected.begin(), report.unexpected.end());
    report.bytes_read = source->bytes_read();
  } catch (...) {
    error = std::current_exception();
  }
  dcp::detail::agree(group, error);  // nothing is installed unless every rank read all it needs
  for (size_t i = 0; i < items.size(); ++i) {
    if (!staging[i].defined()) continue;
    items[i].install(staging[i]);
    ++report.tensors_loaded;
  }
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace fsdp
