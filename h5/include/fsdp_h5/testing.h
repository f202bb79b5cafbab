// fsdp_h5 test helpers: damage done to HDF5 files below HDF5, for the tests
// that check a reader refuses it (fsdp-checkpoint's dcp-flip-byte,
// fsdp-train's train-ckpt-tamper, test_dcp_features). Library
// fsdp_h5_testing, built with FSDP_BUILD_TESTS; nothing shipped links it.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp_h5::testing {

// Where flip_chunk_byte flipped, as byte offsets in the file.
struct FlippedByte {
  uint64_t offset;         // the flipped byte
  uint64_t chunk_address;  // the start of the chunk holding it
  uint64_t chunk_size;     // the chunk's stored bytes, its checksum included
};

// Flips every bit (XOR 0xFF) of one stored data byte of `dataset` (a path
// such as "/model/fc1.weight") in the HDF5 file `file`, in the file's bytes,
// as bit rot would. The byte: the middle one of the data in the dataset's
// first storage chunk (index 0 of H5Dget_chunk_info), at
// chunk address + (chunk size - 4) / 2, a chunk being its data followed by a
// 4-byte Fletcher-32 checksum (as in every file libfsdp writes). The file
// keeps its size and its metadata verifies; only the chunk's checksum can
// tell.
// Throws std::runtime_error naming the file and dataset when either cannot be
// opened, the dataset has no allocated chunk (not chunked, or never written),
// the chunk holds no data byte, or the byte cannot be read and rewritten.
FlippedByte flip_chunk_byte(const std::string& file, const std::string& dataset);

}  // namespace fsdp_h5::testing
