// Test-only: flips one byte of the stored data of dataset <dataset> in HDF5
// file <file> (fsdp_h5::testing::flip_chunk_byte: the middle data byte of its
// first storage chunk), so the file keeps its size and its metadata verifies
// but the chunk's Fletcher-32 checksum does not.
//
//   dcp-flip-byte <file> <dataset>
#include <fsdp_h5/testing.h>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <file.h5> <dataset>\n", argv[0]);
    return 2;
  }
  try {
    const auto at = fsdp_h5::testing::flip_chunk_byte(argv[1], argv[2]);
    std::printf("flipped the byte at offset %llu (chunk at %llu, %llu bytes) of %s in %s\n",
                static_cast<unsigned long long>(at.offset),
                static_cast<unsigned long long>(at.chunk_address),
                static_cast<unsigned long long>(at.chunk_size), argv[2], argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
