// Test helper for tools/fsdp-train/tests/ckpt-verify-check.sh: damages a real
// fsdp-train checkpoint (an fsdp::dcp checkpoint, docs/distributed_checkpoint.md)
// in the ways a resume must refuse or fall back from:
//
//   train-ckpt-tamper flip  <rank-R.h5> <group>
//       flips a stored data byte of the first dataset under <group> (e.g.
//       /model/embed.weight) in the file's bytes below HDF5, as bit rot
//       would (fsdp_h5::testing::flip_chunk_byte): only the chunk's
//       Fletcher-32 checksum can tell.
//   train-ckpt-tamper nan <rank-R.h5> <group>
//       writes a NaN over element 0 of the first dataset under <group>
//       (float32) through HDF5, so its checksum is right: only a
//       finiteness check can tell.
//   train-ckpt-tamper index <index.json> set <json pointer> <json value>
//   train-ckpt-tamper index <index.json> delete <json pointer>
//   train-ckpt-tamper index <index.json> rename-prefix <from> <to>
//   train-ckpt-tamper index <index.json> rename-file <from> <to>
//   train-ckpt-tamper index <index.json> rename-chunks <from> <to>
//       edits index.json (set or delete an entry; rename every tensor whose
//       name starts with <from>; make every chunk in rank file <from> name
//       <to>, and the "files" entry too with rename-file) and re-signs its
//       checksum, so the edit reaches the checks after the checksum (a
//       missing tensor, another shape, another model, a path outside).
#include <fsdp_h5/testing.h>

#include <H5Cpp.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

int usage() {
  std::cerr << "usage: train-ckpt-tamper flip <rank-R.h5> <group>\n"
               "       train-ckpt-tamper index <index.json> set <json pointer> <json value>\n"
               "       train-ckpt-tamper index <index.json> delete <json pointer>\n"
               "       train-ckpt-tamper nan  <rank-R.h5> <group>\n"
               "       train-ckpt-tamper index <index.json> rename-prefix <from> <to>\n"
               "       train-ckpt-tamper index <index.json> rename-file|rename-chunks <from> <to>\n";
  return 2;
}

// The library's index checksum: FNV-1a 64 over the compact, key-sorted JSON
// without "checksum" (libfsdp/src/checkpoint/index.cpp).
std::string index_checksum(nlohmann::json j) {
  j.erase("checksum");
  const std::string text = j.dump();
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return std::string("fnv1a64:") + hex;
}

int edit_index(int argc, char** argv) {
  const std::string file = argv[2], op = argv[3];
  nlohmann::json j;
  {
    std::ifstream in(file);
    in >> j;
  }
  if (op == "set" && argc == 6) {
    j[nlohmann::json::json_pointer(argv[4])] = nlohmann::json::parse(argv[5]);
  } else if (op == "delete" && argc == 5) {
    const nlohmann::json::json_pointer ptr(argv[4]);
    if (!j.contains(ptr)) throw std::runtime_error(std::string("no entry ") + argv[4]);
    j[ptr.parent_pointer()].erase(ptr.back());
  } else if (op == "rename-prefix" && argc == 6) {
    const std::string from = argv[4], to = argv[5];
    nlohmann::json renamed = nlohmann::json::object();
    for (auto& [name, t] : j.at("tensors").items()) {
      renamed[name.rfind(from, 0) == 0 ? to + name.substr(from.size()) : name] = t;
    }
    j["tensors"] = renamed;
  } else if ((op == "rename-file" || op == "rename-chunks") && argc == 6) {
    const std::string from = argv[4], to = argv[5];
    int n = 0;
    for (auto& [name, t] : j.at("tensors").items()) {
      for (auto& c : t.at("chunks")) {
        if (c.at("file") == from) {
          c["file"] = to;
          ++n;
        }
      }
    }
    if (n == 0) throw std::runtime_error("no chunk is in " + from);
    if (op == "rename-file") {
      j["files"][to] = j.at("files").at(from);
      j["files"].erase(from);
    }
    std::cout << "    " << n << " chunk(s) of " << from << " now name " << to << "\n";
  } else {
    return usage();
  }
  j["checksum"] = index_checksum(j);
  std::ofstream(file) << j.dump(1);
  return 0;
}

// The first dataset under `group` (HDF5's index order): what flip and nan damage.
std::string first_dataset(H5::H5File& f, const std::string& group) {
  H5::Group g = f.openGroup(group);
  if (g.getNumObjs() == 0) throw std::runtime_error(group + " holds no dataset");
  return group + "/" + g.getObjnameByIdx(0);
}

int flip(const std::string& file, const std::string& group) {
  std::string dataset;
  {
    H5::H5File f(file, H5F_ACC_RDONLY);
    dataset = first_dataset(f, group);
  }
  const auto at = fsdp_h5::testing::flip_chunk_byte(file, dataset);
  std::cout << "    flipped byte " << at.offset << " of " << file << " (" << dataset
            << ", first chunk at " << at.chunk_address << ", " << at.chunk_size << " bytes)\n";
  return 0;
}

int write_nan(const std::string& file, const std::string& group) {
  H5::H5File f(file, H5F_ACC_RDWR);
  const std::string dataset = first_dataset(f, group);
  H5::DataSet ds = f.openDataSet(dataset);
  if (ds.getDataType() != H5::PredType::NATIVE_FLOAT) throw std::runtime_error(dataset + ": not float32");
  std::vector<float> values(static_cast<size_t>(ds.getSpace().getSimpleExtentNpoints()));
  if (values.empty()) throw std::runtime_error(dataset + ": empty");
  ds.read(values.data(), H5::PredType::NATIVE_FLOAT);
  values[0] = std::numeric_limits<float>::quiet_NaN();
  ds.write(values.data(), H5::PredType::NATIVE_FLOAT);
  std::cout << "    wrote NaN over element 0 of " << dataset << " in " << file << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage();
  const std::string cmd = argv[1], file = argv[2];
  try {
    if (cmd == "index") return edit_index(argc, argv);
    if (cmd == "flip" && argc == 4) return flip(file, argv[3]);
    if (cmd == "nan" && argc == 4) return write_nan(file, argv[3]);
    return usage();
  } catch (const H5::Exception& e) {
    std::cerr << "train-ckpt-tamper: " << file << ": " << e.getDetailMsg() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "train-ckpt-tamper: " << file << ": " << e.what() << "\n";
    return 1;
  }
}
