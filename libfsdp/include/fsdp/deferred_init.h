// Deferred initialisation: build and shard a model larger than one rank's
// memory. The model is constructed on the meta device (shapes, no storage),
// sharded, and only then are this rank's shards allocated and initialised:
// the set-up peak per rank is the shards, not the model.
//
//   models::Decoder net{nullptr};
//   {
//     fsdp::MetaInit meta;                    // tensors made on this thread are meta
//     net = models::Decoder(config);
//   }
//   for (auto& layer : net->layers) fsdp::fully_shard(layer.holder(), options);
//   auto model = fsdp::fully_shard(net, options);       // meta shards: still no memory
//   fsdp::materialize(*net, rt.device(), [&](const fsdp::TensorPiece& t) {
//     fsdp::seeded_normal_(t, seed, 0.0, 0.02);        // same global values on any layout
//   });
//   torch::optim::AdamW optimizer(net->parameters(), ...);   // after materialize or before
//
// Or load pretrained weights instead of initialising: materialize(module,
// device) allocates (zeros) and fsdp::load_weights fills the shards.
#pragma once

#include "fsdp/dtensor.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

// While alive, every tensor a factory function creates on this thread
// (torch::empty, zeros, randn, arange, ..., and so every parameter and buffer
// a torch::nn module registers) is on the meta device: it has a shape and a
// dtype but no storage, and in-place initialisers on it do nothing.
// Operations on existing tensors run where those tensors are. Not supported
// inside: tensors built from host data (torch::tensor({...}),
// torch::from_blob) -- their values would be lost; compute such buffers in
// the init function. Nestable; thread-local; not copyable.
class MetaInit {
 public:
  MetaInit();
  ~MetaInit();
  MetaInit(const MetaInit&) = delete;
  MetaInit& operator=(const MetaInit&) = delete;

 private:
  bool was_active_;
};

// One tensor materialize() allocated, handed to the init function: this
// rank's storage (`local`: the local shard of a managed parameter, else the
// whole tensor; uninitialised) and where it sits in the global tensor.
struct TensorPiece {
  std::string name;                  // in the module materialize() was given
  at::Tensor local;                  // write into it (in place; no grad)
  std::vector<int64_t> global_shape;
  std::vector<LocalPiece> pieces;    // empty: this rank holds no element
  bool is_buffer = false;
};
using InitFn = std::function<void(const TensorPiece&)>;

// Allocates every meta parameter and buffer of `module` (recursively): for a
// parameter a fully_shard unit manages, only this rank's shard, on the
// unit's device (CPU memory with an offload_policy); anything else whole, on
// `device`. Then calls `init` on each, parameters before buffers, in
// named_parameters() / named_buffers() order (none: the storage is left
// zero, e.g. for fsdp::load_weights to fill). Tensors that are not meta are
// left alone. Local: no communication, so ranks may initialise differently
// if `init` does. Errors: ArgumentError naming "device" when a managed
// parameter's unit computes on another device type than `device`.
void materialize(torch::nn::Module& module, c10::Device device, const InitFn& init = {});

// Seeded initialisers whose values depend only on (seed, name, global index),
// never on the layout: each global row i of dim 0 (for a 1-D tensor each
// block of 1024 elements, for a scalar its one element) draws from its own
// CPU generator (at::detail::createCPUGenerator) seeded
//   row_seed = mix(mix(seed + fnv1a64(name)) + i),
// mix = SplitMix64's finaliser, fnv1a64 the 64-bit FNV-1a hash of the name's
// bytes; the row is drawn whole (float32; float64 for double tensors) and
// this rank's columns are cut out of it. So a 4-rank run initialises the
// same global tensors as a 1-rank run of the same seed, and a whole (plain)
// tensor can be initialised by the same rule: pass piece_of(name, tensor).
void seeded_normal_(const TensorPiece& piece, uint64_t seed, double mean, double std);
void seeded_uniform_(const TensorPiece& piece, uint64_t seed, double low, double high);
// The seed seeded_* use for `row` (documented above; exposed for tests).
uint64_t seeded_row_seed(uint64_t seed, const std::string& name, int64_t row);
// A whole tensor as a piece (no sharding): for initialising an unsharded
// reference model by the same rule.
TensorPiece piece_of(const std::string& name, const at::Tensor& whole);

}  // namespace fsdp
