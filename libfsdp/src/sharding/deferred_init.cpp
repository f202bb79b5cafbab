// MetaInit, materialize and the seeded initialisers (fsdp/deferred_init.h).
//
// LibTorch's C++ API has no default-device context (Python's
// `with torch.device("meta")` is a Python-only mode), so MetaInit works one
// level down, in the dispatcher: it adds the DeferredInit dispatch key --
// reserved by PyTorch for deferred initialisation and registered by nothing
// in LibTorch itself -- to this thread's included keys, and a boxed fallback
// on that key rewrites the `device` argument of pure factory calls (no tensor
// arguments) made by the caller to meta before passing them on. Every other
// call, and every call nested inside one, passes through unchanged.
// Verified on Debian's LibTorch 1.13 and pip's 2.15.
#include "fsdp/deferred_init.h"

#include "base/torch_compat.h"
#include "fsdp/errors.h"
#include "sharding/param.h"
#include "sharding/param_group.h"
#include "sharding/registry.h"
#include "sharding/state.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/library.h>

#include <unordered_map>

namespace fsdp {
namespace {

constexpr c10::DispatchKey kMetaInitKey = c10::DispatchKey::DeferredInit;

// Whether the call takes a tensor (a Tensor, Tensor? or Tensor[] argument
// that is set): such calls create nothing from scratch and keep their device.
bool has_tensor_argument(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                         size_t first) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor() || v.isTensorList()) return true;
    if (v.isList() && args[i].type()->str().find("Tensor") != std::string::npos) return true;
  }
  return false;
}

void meta_factory_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                           torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  if (!has_tensor_argument(op.schema(), *stack, first)) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& name = args[i].name();
      if (name == "device") {
        (*stack)[first + i] = c10::IValue(c10::Device(c10::kMeta));
      } else if (name == "pin_memory") {
        (*stack)[first + i] = c10::IValue();  // meta memory is not pinned
      }
    }
  }
  // Calls made inside this one are the op's own business: an op on real
  // tensors may build temporaries (a wrapped scalar, scratch space) that must
  // stay where its inputs are, and a factory's own calls follow its options.
  c10::impl::ExcludeDispatchKeyGuard inside(kMetaInitKey);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kMetaInitKey),
                     stack);
}

// Registered on first use, once per process, not at load time: programs
// that never defer initialisation leave the dispatcher as they found it.
void ensure_fallback_registered() {
  static torch::Library* library = [] {
    auto* lib = new torch::Library(torch::Library::IMPL, "_", kMetaInitKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&meta_factory_fallback>());
    return lib;  // kept for the process: the registration lives as long as it
  }();
  (void)library;
}

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

constexpr int64_t kBlock1d = 1024;

// Fills `piece` row by row: draw(gen, n) returns n values of row `row`.
template <typename Draw>
void fill_seeded(const TensorPiece& piece, uint64_t seed, Draw draw) {
  if (!piece.local.defined()) {
    throw ArgumentError("piece", "seeded init: '" + piece.name + "' has no local tensor");
  }
  if (piece.local.is_meta()) {
    throw StateError("seeded init: '" + piece.name + "' is a meta tensor (materialize it first)");
  }
  const auto& shape = piece.global_shape;
  const at::ScalarType draw_dtype =
      piece.local.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::NoGradGuard no_grad;
  for (const LocalPiece& box : piece.pieces) {
    at::Tensor dst = piece.local;
    for (size_t d = 0; d < box.sizes.size(); ++d) {
      dst = dst.narrow(static_cast<int64_t>(d), box.local_offsets[d], box.sizes[d]);
    }
    if (shape.empty()) {  // a scalar: one row of one element
      dst.copy_(draw(seeded_row_seed(seed, piece.name, 0), 1, draw_dtype).reshape({}));
      continue;
    }
    if (shape.size() == 1) {
      // 1-D: blocks of kBlock1d elements, each drawn whole.
      const int64_t lo = box.offsets[0], hi = lo + box.sizes[0], n = shape[0];
      for (int64_t b = lo / kBlock1d; b * kBlock1d < hi; ++b) {
        const int64_t start = b * kBlock1d, len = std::min(kBlock1d, n - start);
        const at::Tensor row = draw(seeded_row_seed(seed, piece.name, b), len, draw_dtype);
        const int64_t from = std::max(lo, start), to = std::min(hi, start + len);
        dst.narrow(0, from - lo, to - from).copy_(row.narrow(0, from - start, to - from));
      }
      continue;
    }
    std::vector<int64_t> row_shape(shape.begin() + 1, shape.end());
    int64_t row_numel = 1;
    for (int64_t s : row_shape) row_numel *= s;
    for (int64_t i = 0; i < box.sizes[0]; ++i) {
      at::Tensor row =
          draw(seeded_row_seed(seed, piece.name, box.offsets[0] + i), row_numel, draw_dtype)
              .view(row_shape);
      for (size_t d = 1; d < box.sizes.size(); ++d) {
        row = row.narrow(static_cast<int64_t>(d - 1), box.offsets[d], box.sizes[d]);
      }
      dst.select(0, i).copy_(row);
    }
  }
}

}  // namespace

MetaInit::MetaInit() : was_active_(c10::impl::tls_is_dispatch_key_included(kMetaInitKey)) {
  ensure_fallback_registered();
  c10::impl::tls_set_dispatch_key_included(kMetaInitKey, true);
}

MetaInit::~MetaInit() { c10::impl::tls_set_dispatch_key_included(kMetaInitKey, was_active_); }

void materialize(torch::nn::Module& module, c10::Device device, const InitFn& init) {
  std::unordered_map<const c10::TensorImpl*, detail::ShardedParam*> managed;
  for (const auto& unit : detail::live_units()) {
    for (auto& group : unit->groups) {
      for (auto& p : group.params()) managed[p.param().unsafeGetTensorImpl()] = &p;
    }
  }
  // Check every managed parameter before allocating any.
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    auto it = managed.find(item.value().unsafeGetTensorImpl());
    if (it != managed.end() && it->second->deferred() &&
        it->second->compute_device().type() != device.type()) {
      throw ArgumentError("device", "materialize: 'device' is " + device.str() + " but '" +
                                        item.key() + "' belongs to a unit computing on " +
                                        it->second->compute_device().str());
    }
  }
  std::vector<TensorPiece> made;
  auto plain = [&](const std::string& name, at::Tensor t, bool is_buffer) {
    at::Tensor storage = at::zeros(t.sizes(), t.options().device(device).requires_grad(false));
    compat::rebind_meta_variable(t, storage);
    made.push_back(piece_of(name, storage));
    made.back().is_buffer = is_buffer;
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    auto it = managed.find(t.unsafeGetTensorImpl());
    if (it != managed.end()) {
      detail::ShardedParam& p = *it->second;
      if (!p.deferred()) continue;
      p.materialize();
      const DTensor dt = p.dtensor();
      TensorPiece piece;
      piece.name = item.key();
      piece.local = p.local();
      piece.global_shape = dt.shape();
      piece.pieces = local_pieces(dt);
      made.push_back(std::move(piece));
    } else if (t.is_meta()) {
      plain(item.key(), t, false);
    }
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().is_meta()) plain(item.key(), item.value(), true);
  }
  if (!init) return;
  at::NoGradGuard no_grad;
  for (const TensorPiece& piece : made) init(piece);
}

uint64_t seeded_row_seed(uint64_t seed, const std::string& name, int64_t row) {
  return mix(mix(seed + fnv1a64(name)) + static_cast<uint64_t>(row));
}

void seeded_normal_(const TensorPiece& piece, uint64_t seed, double mean, double std) {
  fill_seeded(piece, seed, [&](uint64_t s, int64_t n, at::ScalarType dt) {
    at::Generator gen = at::detail::createCPUGenerator(s);
    return at::normal(mean, std, {n}, gen, at::TensorOptions().dtype(dt));
  });
}

void seeded_uniform_(const TensorPiece& piece, uint64_t seed, double low, double high) {
  fill_seeded(piece, seed, [&](uint64_t s, int64_t n, at::ScalarType dt) {
    at::Generator gen = at::detail::createCPUGenerator(s);
    return at::empty({n}, at::TensorOptions().dtype(dt)).uniform_(low, high, gen);
  });
}

TensorPiece piece_of(const std::string& name, const at::Tensor& whole) {
  TensorPiece piece;
  piece.name = name;
  piece.local = whole;
  piece.global_shape = whole.sizes().vec();
  bool empty = false;
  for (int64_t s : piece.global_shape) empty = empty || s == 0;
  if (!empty) {
    LocalPiece b;
    b.offsets.assign(piece.global_shape.size(), 0);
    b.sizes = piece.global_shape;
    b.local_offsets.assign(piece.global_shape.size(), 0);
    piece.pieces.push_back(std::move(b));
  }
  return piece;
}

}  // namespace fsdp
