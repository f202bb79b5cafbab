// Test-only: flips one byte in the middle of the stored data of dataset
// <dataset> in HDF5 file <file> (its first storage chunk, found with
// H5Dget_chunk_info), so the file keeps its size and its metadata verifies
// but the chunk's Fletcher-32 checksum does not.
//
//   dcp-flip-byte <file> <dataset>
#include <hdf5.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <file.h5> <dataset>\n", argv[0]);
    return 2;
  }
  haddr_t addr = HADDR_UNDEF;
  hsize_t size = 0;
  {
    const hid_t f = H5Fopen(argv[1], H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) return 2;
    const hid_t ds = H5Dopen2(f, argv[2], H5P_DEFAULT);
    if (ds < 0) return 2;
    const hid_t space = H5Dget_space(ds);
    hsize_t offset[H5S_MAX_RANK];
    unsigned mask = 0;
    if (H5Dget_chunk_info(ds, space, 0, offset, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF) {
      std::fprintf(stderr, "%s: %s has no allocated chunk\n", argv[1], argv[2]);
      return 2;
    }
    H5Sclose(space);
    H5Dclose(ds);
    H5Fclose(f);
  }
  // The chunk holds the data then its 4-byte checksum: flip a data byte.
  const long at = static_cast<long>(addr + (size - 4) / 2);
  std::FILE* fp = std::fopen(argv[1], "r+b");
  if (!fp || std::fseek(fp, at, SEEK_SET) != 0) return 2;
  const int c = std::fgetc(fp);
  if (c == EOF || std::fseek(fp, at, SEEK_SET) != 0) return 2;
  std::fputc(c ^ 0xFF, fp);
  std::fclose(fp);
  std::printf("flipped the byte at offset %ld (chunk at %llu, %llu bytes) of %s in %s\n", at,
              static_cast<unsigned long long>(addr), static_cast<unsigned long long>(size),
              argv[2], argv[1]);
  return 0;
}
