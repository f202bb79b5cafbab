// Test-only damage to HDF5 files (fsdp_h5/testing.h).
#include "fsdp_h5/testing.h"

#include <hdf5.h>

#include <fstream>
#include <stdexcept>

namespace fsdp_h5::testing {

namespace {

// The address and stored size of the first chunk of `dataset`.
void first_chunk(const std::string& file, const std::string& dataset, haddr_t& address,
                 hsize_t& size) {
  const std::string what = file + ": " + dataset;
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) throw std::runtime_error(file + ": cannot open as HDF5");
  const hid_t ds = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  if (ds < 0) {
    H5Fclose(f);
    throw std::runtime_error(what + ": no such dataset");
  }
  const hid_t space = H5Dget_space(ds);
  hsize_t origin[H5S_MAX_RANK];
  unsigned filter_mask = 0;
  address = HADDR_UNDEF;
  size = 0;
  const herr_t rc = H5Dget_chunk_info(ds, space, 0, origin, &filter_mask, &address, &size);
  H5Sclose(space);
  H5Dclose(ds);
  H5Fclose(f);
  if (rc < 0 || address == HADDR_UNDEF) {
    throw std::runtime_error(what + ": no allocated storage chunk (not a chunked dataset?)");
  }
}

}  // namespace

FlippedByte flip_chunk_byte(const std::string& file, const std::string& dataset) {
  haddr_t address = HADDR_UNDEF;
  hsize_t size = 0;
  first_chunk(file, dataset, address, size);
  if (size <= 4) {
    throw std::runtime_error(file + ": " + dataset + ": its first chunk holds no data byte");
  }
  const FlippedByte at{address + (size - 4) / 2, address, size};
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(at.offset));
  char byte = 0;
  io.read(&byte, 1);
  const char flipped = static_cast<char>(byte ^ 0xFF);
  io.seekp(static_cast<std::streamoff>(at.offset));
  io.write(&flipped, 1);
  io.flush();
  if (!io) {
    throw std::runtime_error(file + ": cannot rewrite byte " + std::to_string(at.offset));
  }
  return at;
}

}  // namespace fsdp_h5::testing
