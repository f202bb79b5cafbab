// Test helper for tools/fsdp-train/tests/ckpt-verify-check.sh: damages a real fsdp-train
// checkpoint in the ways a resume must refuse, keeping the checksums right
// where the point is to reach a later check (NaN, shape, a lying step):
//
//   train-ckpt-tamper nan     <rank.h5> <dataset>   element 0 := NaN, checksum re-signed
//   train-ckpt-tamper reshape <rank.h5> <dataset>   one more row of zeros, checksum re-signed
//   train-ckpt-tamper delete  <rank.h5> <path>      unlinks a dataset or group
//   train-ckpt-tamper meta    <meta.json> <key> <json value>|--delete
//                                                   sets or deletes a key, re-signs meta.json
//
// (A flipped byte, where the checksum must NOT be re-signed, is written by
// the script with dd, below HDF5.)
#include "resume_files.h"

#include <H5Cpp.h>
#include <reference/h5_util.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>
#include <vector>

namespace {

void resign(H5::DataSet& ds, const std::vector<float>& v) {
  const uint64_t sum = fsdp_train::fnv1a64(v.data(), v.size() * sizeof(float));
  h5util::set_uint64_attr(ds, "fnv1a64", sum);
}

int usage() {
  std::cerr << "usage: train-ckpt-tamper nan|reshape|delete <rank.h5> <path>\n"
               "       train-ckpt-tamper meta <meta.json> <key> <json value>|--delete\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage();
  const std::string cmd = argv[1], file = argv[2], path = argv[3];
  try {
    if (cmd == "meta") {
      if (argc != 5) return usage();
      nlohmann::json meta;
      std::ifstream(file) >> meta;
      if (std::string(argv[4]) == "--delete") {
        meta.erase(path);
      } else {
        meta[path] = nlohmann::json::parse(argv[4]);
      }
      meta["checksum"] = fsdp_train::meta_checksum(meta);
      std::ofstream(file) << meta.dump(2) << "\n";
      return 0;
    }
    H5::H5File f(file, H5F_ACC_RDWR);
    if (cmd == "delete") {
      f.unlink(path);
    } else if (cmd == "nan" || cmd == "reshape") {
      H5::DataSet ds = f.openDataSet(path);
      std::vector<hsize_t> dims;
      std::vector<float> v = h5util::read_all<float>(ds, H5::PredType::NATIVE_FLOAT, &dims);
      if (cmd == "nan") {
        v.at(0) = std::numeric_limits<float>::quiet_NaN();
        ds.write(v.data(), H5::PredType::NATIVE_FLOAT);
        resign(ds, v);
      } else {
        ds.close();
        f.unlink(path);
        dims.at(0) += 1;
        v.resize(v.size() / (dims[0] - 1) * dims[0], 0.0f);
        H5::DataSet nds = h5util::write_dataset(f, path, H5::PredType::IEEE_F32LE, dims, v.data(),
                                                H5::PredType::NATIVE_FLOAT);
        resign(nds, v);
      }
    } else {
      return usage();
    }
  } catch (const H5::Exception& e) {
    std::cerr << "train-ckpt-tamper: " << file << " " << path << ": " << e.getDetailMsg() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "train-ckpt-tamper: " << file << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}
