// The HDF5 side of distributed checkpoints (HDF5's C API: virtual datasets
// and custom float types have no C++ wrapper in 1.10).
//
// Every saved piece is a chunked dataset with the Fletcher-32 filter, so
// HDF5 checks a checksum for every storage block (about 4 MiB) it reads --
// a byte-range read verifies exactly the bytes it reads -- and files are
// created with the newest format, whose metadata carries checksums too.
// Failures become CheckpointError naming the tensor and file given.
#pragma once

#include "fsdp/distributed_checkpoint.h"

#include "checkpoint/layout.h"

#include <ATen/core/Tensor.h>
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::dcp::detail {

// An hid_t closed with `close` when it goes out of scope.
class Handle {
 public:
  Handle() = default;
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle& operator=(Handle&& o) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle();
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// "float32", ... <-> at::ScalarType; CheckpointError(Format) for a name
// this library does not write; ArgumentError naming "state" and `tensor`
// for a dtype it cannot save.
std::string dtype_name(at::ScalarType t, const std::string& tensor);
at::ScalarType dtype_of(const std::string& name, const std::string& tensor,
                        const std::string& file);
// The HDF5 file type of a dtype (bfloat16 and float16 as HDF5 floats with
// their bit layout, bool as uint8), owned by the caller.
Handle h5_type(at::ScalarType t);

// A file being written (newest format: checksummed metadata).
Handle create_file(const std::string& path);
// A file opened read-only; CheckpointError(Incomplete) if missing,
// (Corrupt) if it is not a regular file (checked before opening: a FIFO or
// device would block or never end) or HDF5 cannot open it.
Handle open_file(const std::string& path, const std::string& shown_as);

// Dataset access that refuses to follow external links (into other files).
Handle self_contained_access();
// Why `dataset` keeps its data outside its file (a virtual dataset,
// external raw storage), or "" when it does not.
std::string foreign_storage(hid_t dataset);

// Writes `data` (contiguous CPU, of the piece's sizes) as dataset `path`
// (intermediate groups created), chunked with Fletcher-32.
void write_piece(hid_t file, const std::string& path, const at::Tensor& data,
                 const std::string& tensor, const std::string& file_name);
// Reads the part `want` of the piece stored at `path` (its box: `stored`)
// into `dst` (contiguous CPU, of want's sizes and the piece's dtype).
// CheckpointError(Corrupt) unless the dataset is stored as write_piece
// stores it: chunked with Fletcher-32 alone, in this file, of dst's dtype,
// of stored's extent.
void read_piece(hid_t file, const std::string& path, const Box& stored, const Box& want,
                at::Tensor& dst, const std::string& tensor, const std::string& file_name);

// The view file for h5py / h5dump: one virtual dataset per tensor over the
// pieces in the rank files (paths relative to the checkpoint directory); a
// 0-d tensor appears with shape [1].
struct GlobalView {
  struct Piece {
    std::string file, dataset;
    Box box;
  };
  struct Tensor {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    std::vector<Piece> pieces;
  };
  std::vector<Tensor> tensors;
};
void write_global_view(const std::string& path, const GlobalView& view, int64_t step);

// Silences HDF5's own error printing on this thread (we report errors
// ourselves).
void quiet_hdf5();
// The innermost HDF5 error message of the current error stack.
std::string hdf5_error();

}  // namespace fsdp::dcp::detail
