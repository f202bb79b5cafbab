// fsdp_h5: the HDF5 helpers of the programs around libfsdp (the reference
// store in reference/, fsdp-checkpoint's export and its test checkpoints):
// scalar string and integer attributes, a dataset's extent and type name, a
// group's members, whole-dataset reads and writes. HDF5's C++ API only, no
// LibTorch and no libfsdp (libfsdp's own checkpoint I/O is
// libfsdp/src/checkpoint/h5io.cpp). Errors are HDF5's H5::Exception unless
// said otherwise. Test-only helpers: fsdp_h5/testing.h.
#pragma once

#include <H5Cpp.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp_h5 {

// An attribute asked for strictly that is missing or of another class:
// "attribute <name> is missing", "attribute <name> is not a string",
// "attribute <name> is not an integer".
struct AttributeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How a string attribute stores "" (a string type needs at least one byte):
//   Nul    a one-byte string holding NUL; values read back as stored
//          (for text whose exact bytes matter, e.g. one a digest covers)
//   Space  " ", and " " reads back as "" (the reference files)
enum class EmptyString { Nul, Space };

// A scalar fixed-length string attribute, created.
void write_string_attr(H5::H5Object& obj, const std::string& name, const std::string& value,
                       EmptyString empty);
// The string attribute `name`; nullopt when missing. Not a string: the
// H5::Exception of the read.
std::optional<std::string> find_string_attr(const H5::H5Object& obj, const std::string& name,
                                            EmptyString empty);
// The same, strict: AttributeError when missing or not a string.
std::string read_string_attr(const H5::H5Object& obj, const std::string& name,
                             EmptyString empty);

// A scalar int64 attribute (STD_I64LE), created.
void write_int_attr(H5::H5Object& obj, const std::string& name, int64_t value);
// Strict: AttributeError when missing or not an integer.
int64_t read_int_attr(const H5::H5Object& obj, const std::string& name);

// A scalar uint64 attribute (STD_U64LE): written over if it exists, else
// created. read_uint64_attr: the H5::Exception of the open when missing.
void set_uint64_attr(H5::H5Object& obj, const std::string& name, uint64_t value);
uint64_t read_uint64_attr(const H5::H5Object& obj, const std::string& name);

// The dataset's extent ({} for a scalar), as HDF5 and as int64.
std::vector<hsize_t> extent(const H5::DataSet& ds);
std::vector<int64_t> dims_of(const H5::DataSet& ds);
// "float32", "int64" (class and bits), "string", or "a non-numeric type".
std::string type_name(const H5::DataSet& ds);

// The names of a group's members, in HDF5's index order.
std::vector<std::string> child_names(const H5::Group& g);

// Creates dataset `name` in `g` of `file_type` and extent `dims` ({}:
// scalar) and writes `data` (of `mem_type`) into it unless it has no
// elements.
H5::DataSet write_dataset(H5::Group& g, const std::string& name, const H5::PredType& file_type,
                          const std::vector<hsize_t>& dims, const void* data,
                          const H5::PredType& mem_type);

// Every element of `ds` as `mem_type` (matching T); `dims`, if given, gets
// its extent.
template <typename T>
std::vector<T> read_all(const H5::DataSet& ds, const H5::PredType& mem_type,
                        std::vector<hsize_t>* dims = nullptr) {
  H5::DataSpace space = ds.getSpace();
  std::vector<T> v(static_cast<size_t>(space.getSimpleExtentNpoints()));
  ds.read(v.data(), mem_type);
  if (dims) *dims = extent(ds);
  return v;
}

}  // namespace fsdp_h5
