// Pretrained weights into a (sharded) model: each rank reads only the rows
// of its own shards from a full-tensor file, never a whole sharded tensor.
//
//   auto model = std::make_shared<Net>();
//   ... fully_shard(...) per layer and the root ...
//   fsdp::LoadWeightsReport r = fsdp::load_weights("model.safetensors", *model);
//
// Sources, told apart by their content (not the extension):
//  - a .safetensors file (8-byte little-endian header length, JSON header,
//    raw little-endian row-major data), read with pread;
//  - an HDF5 file with one dataset per tensor, '/' in a name being a group
//    (what `fsdp-checkpoint export --to x.h5` writes), read by hyperslab;
//  - a distributed checkpoint (a step directory or a root: its newest
//    complete step) written by fsdp::dcp::save; only its parameters and
//    buffers are read, optimizer state and values are ignored.
// Every parameter and buffer of the module (recursively, by its
// named_parameters / named_buffers name) is looked up as prefix + name. A
// tensor a fully_shard unit manages is read box by box for this rank's
// shard (HSDP replicas each read their shard); a TP/EP DTensor parameter
// reads its local boxes; any other tensor is read whole. Values are copied
// into the tensors' local storage in place (on their device), without
// autograd. No dtype conversion ever happens: a file dtype other than the
// tensor's is an error (an HDF5 uint8 dataset loads into a bool tensor, as
// HDF5 has no bool).
//
// Collective over the world: every rank calls it with the same arguments
// and a module of the same structure. Errors are raised alike on every rank
// (same type and message), and nothing is installed unless every rank read
// everything it needs:
//  - ArgumentError naming "path": no such path, a file of none of these
//    formats, or (strict) a module tensor the file lacks;
//  - ShapeError / DTypeError naming the tensor, with the file's and the
//    module's global shape / dtype;
//  - dcp::CheckpointError (Corrupt, naming the file and tensor): a header
//    that does not parse, data past the end of the file, a short read, or
//    an HDF5 read that fails; a distributed checkpoint's own errors as
//    dcp::load raises them;
//  - StateError: a unit holds full parameters right now (reshard() first).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

struct LoadWeightsOptions {
  // Put before every module tensor name to find it in the file, e.g.
  // "model/" for a distributed checkpoint saved with add_module("model", ..).
  std::string prefix;
  // true: every module tensor must be in the file. false: those it lacks are
  // left as they are and listed in LoadWeightsReport::missing.
  bool strict = true;
};

struct LoadWeightsReport {
  std::string format;  // "safetensors", "hdf5" or "dcp"
  int64_t tensors_loaded = 0;  // module tensors written (on every rank alike)
  int64_t bytes_read = 0;      // bytes this rank read from the file(s), headers included
  // Module tensor names the file lacks (strict = false), and file tensor
  // names (without the prefix where they carry it) no module tensor took;
  // both sorted, the same on every rank.
  std::vector<std::string> missing, unexpected;
  double seconds = 0;  // wall time on this rank, agreement included
};

// Loads `path` into `module` (see the top of this file).
LoadWeightsReport load_weights(const std::string& path, torch::nn::Module& module,
                               const LoadWeightsOptions& options = {});

}  // namespace fsdp
