// fully_shard: PyTorch-FSDP2-style sharding of LibTorch modules.
//
// Apply bottom-up -- each block, then the root:
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() { for (int i = 0; i < 4; ++i) blocks.push_back(register_module(
//                   "block" + std::to_string(i), Block())); ... }
//     torch::Tensor forward(torch::Tensor x) {
//       for (auto& b : blocks) x = b(x);        // fsdp::Sharded<Block>: intercepts
//       return head(x);
//     }
//     std::vector<fsdp::Sharded<Block>> blocks;
//     torch::nn::Linear head{nullptr};
//   };
//   TORCH_MODULE(Net);
//
//   Net net;
//   for (auto& b : net->blocks) fsdp::fully_shard(b, options);
//   fsdp::Sharded<Net> model = fsdp::fully_shard(net, options);   // the root
//   auto loss = model(x).sum(); loss.backward(); optimizer.step();
//
// Forward interception. C++ modules have no forward hooks, so a sharded unit
// is called through fsdp::Sharded<M>, a module holder the parent declares in
// place of M (it behaves like M: ->, ptr(), forward(), operator()). Children
// of torch::nn::Sequential need nothing: fully_shard(root) re-routes the
// Sequential's entries for sharded children through the unit (tensor in,
// tensor out); afterwards the Sequential's ptr(i) / operator[] return those
// routing entries, while its registered children (children(),
// named_children(), parameters()) are still your modules. A Sharded<M>
// whose module is not sharded simply forwards.
//
// After fully_shard, between steps, every managed parameter's data is its
// local shard (dim 0 by default, ceil-div layout: trailing ranks may own zero
// rows); an optimizer built on module->parameters() steps the shards and the
// next forward all-gathers the updated values.
#pragma once

#include "fsdp/dtensor.h"
#include "fsdp/memory.h"
#include "fsdp/mesh.h"
#include "fsdp/module_holder.h"
#include "fsdp/options.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace c10 {
struct Event;
}  // namespace c10

namespace fsdp {

struct UnitState;

// Handle returned by FSDPModule::unshard(async_op=true).
class UnshardHandle {
 public:
  UnshardHandle() = default;
  // Blocks until the parameters are unsharded. Idempotent.
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<UnitState> unit) : unit_(std::move(unit)) {}
  std::shared_ptr<UnitState> unit_;
};

// The FSDP interface of one sharded unit (cheap to copy; refers to the unit).
// Methods with `recurse` act on this unit and every unit inside its module
// (recurse=true) or on this unit only (recurse=false).
class FSDPModule {
 public:
  FSDPModule() = default;

  // The module this unit was applied to.
  std::shared_ptr<torch::nn::Module> module() const;

  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // HSDP only matters: false skips the all-reduce over the replicate dim.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  // A bool, ReshardAfterForward() for the default (every unit but the root),
  // or a rank count / ReshardAfterForward::within_node() (hpZ, options.h).
  // The hpZ forms create the post-forward process group on first use: every
  // rank of the shard dim calls this with the same value, as with
  // fully_shard. ArgumentError naming "reshard_after_forward" for a count that
  // does not divide a unit's shard dim (every unit is checked before any
  // changes).
  void set_reshard_after_forward(ReshardAfterForward reshard_after_forward, bool recurse = true);
  // false keeps the parameters full after backward; their sharded gradients
  // reach param.grad() at the next reshard(), so call reshard() before the
  // optimizer steps.
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  // "sum" or "avg" (default); ArgumentError naming "reduce_op" otherwise.
  void set_reduce_op_type(const std::string& reduce_op);
  // Multiplies gradients in the reduction; nullopt clears. Finite and > 0.
  void set_gradient_scaling_factor(std::optional<double> factor);
  // With "avg", gradients are divided by `factor` instead of the mesh's
  // data-parallel size (e.g. experts sharded on a sub-mesh whose gradients
  // must still be averaged over the whole data-parallel world); nullopt
  // restores the mesh's size. Finite and > 0. Recursive.
  void set_gradient_divide_factor(std::optional<double> factor);
  // false: backward may end with reductions still in flight (they are
  // finished by the next forward, backward or finish_pending_reductions()).
  void set_is_last_backward(bool is_last_backward);
  // The units whose all-gathers this unit's pre-forward (pre-backward)
  // issues, ahead of their use. Default (never set): forward, the unit that
  // ran forward after this one in the previous step (none in the first
  // step); backward, the unit that ran forward before this one, on CUDA
  // (FullyShardOptions::implicit_backward_prefetch). An empty list turns
  // prefetching off for this unit.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  // false: the unit's pre-backward does not all-gather its parameters --
  // for a unit whose backward needs none of their values (an embedding, a
  // bias-only unit: their gradients depend on the inputs alone). Backward
  // then sees full-shape parameters without storage; an op of the unit that
  // does read them in backward (a Linear's weight) reads freed memory, as in
  // FSDP2: only set it where that cannot happen. Gradients are reduced as
  // usual. This unit only; default true.
  void set_unshard_in_backward(bool unshard_in_backward);
  // The next forward's all-gathers are ordered after `event` (a CUDA event
  // the user recorded after an optimizer step run on another stream) by
  // making the current stream wait on it at the root's pre-forward, once;
  // the event is then dropped. On CPU units it is a no-op by design: CPU
  // collectives are issued in program order, after the optimizer step has
  // returned. Acts on this unit's root. ArgumentError naming "event" for a
  // null event or one whose device type is not the unit's.
  void set_post_optim_event(std::shared_ptr<c10::Event> event);
  // A hook on the reduced gradients of this unit (comm_hooks.h: when it
  // runs, what it sees); an empty function clears it. This unit only.
  void set_all_reduce_hook(AllReduceHook hook);
  // This unit's own all-gather / reduce-scatter (comm_hooks.h); std::nullopt
  // restores the group's. ArgumentError naming "all_gather" /
  // "reduce_scatter" for a struct without its collective function. This
  // unit only; takes effect from its next unshard / reduction.
  void set_custom_all_gather(std::optional<CustomAllGather> comm);
  void set_custom_reduce_scatter(std::optional<CustomReduceScatter> comm);

  // All-gathers the parameters (returns at once with async_op=true; call
  // wait() before reading them). Idempotent.
  UnshardHandle unshard(bool async_op = false);
  // Frees the unsharded parameters; the module sees its shards. Idempotent.
  void reshard();
  // Drops the gradients of every managed parameter of this unit (and its
  // nested units): param.grad() is undefined afterwards.
  void zero_grad();
  // Waits for reductions left in flight by set_is_last_backward(false).
  void finish_pending_reductions();
  // Reduces the gradients that backwards run with
  // set_requires_gradient_sync(false) accumulated locally -- the same
  // reduce-scatter (and HSDP all-reduce), divide factor and scaling as a
  // synchronised backward -- on this unit and (recurse) every unit inside
  // it, waits for them and reshards: param.grad() then holds the sharded
  // gradient (added to any it held). Pipeline schedules call it once after
  // the last microbatch instead of a last synchronised backward. Collective
  // over each unit's mesh (every rank calls it, units in the same order);
  // StateError while a forward or backward of a unit is running. A parameter
  // no rank accumulated a gradient for keeps its param.grad().
  void reduce_gradients(bool recurse = true);

  // Managed parameters as DTensors (local shard + mesh + placements), in
  // module order; names are relative to module().
  std::vector<std::pair<std::string, DTensor>> sharded_parameters() const;
  // Full gradients accumulated locally while set_requires_gradient_sync(false)
  // (reduce dtype; undefined where none), by parameter name. They differ
  // across ranks until the next synchronised backward reduces them.
  std::vector<std::pair<std::string, at::Tensor>> unsynced_grads() const;
  // fp32 main gradients (apply_grad_on_fp32_main_grad), by parameter name.
  std::vector<std::pair<std::string, at::Tensor>> main_grads() const;

  // Sharded state dict: name -> DTensor (parameters, ignored ones excluded).
  std::vector<std::pair<std::string, DTensor>> state_dict() const;
  // Full state dict: name -> full tensor (collective over the mesh).
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() const;
  // Accepts, per managed parameter name, a DTensor with matching placements,
  // a tensor of the local shard shape, or a tensor of the global shape.
  // ShapeError naming the entry otherwise; unknown names -> ArgumentError;
  // a DTensor on another mesh (other ranks or shape) -> MeshError naming
  // "state", the entry and both meshes.
  void load_state_dict(const std::vector<std::pair<std::string, DTensor>>& state);
  void load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state);

  const DeviceMesh& mesh() const;
  bool is_root() const;
  // What this unit holds on this rank now (fsdp/memory.h; no optimizer
  // state: fsdp::memory_report attributes that). Reads only.
  UnitMemory memory() const;

 private:
  friend FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>&, FullyShardOptions);
  friend std::vector<FSDPModule> fully_shard(
      const std::vector<std::shared_ptr<torch::nn::Module>>&, FullyShardOptions);
  friend std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module&);
  FSDPModule(std::shared_ptr<UnitState> unit, size_t module_index)
      : unit_(std::move(unit)), module_index_(module_index) {}
  UnitState& unit() const;
  static std::vector<std::weak_ptr<UnitState>> prefetch_units(
      const std::vector<FSDPModule>& modules, const char* fn);
  std::shared_ptr<UnitState> unit_;
  size_t module_index_ = 0;  // which of the unit's modules this handle names
};

// Shards `module`'s parameters (those not already managed by a unit inside
// it, nor ignored) as one unit; a module whose parameters all belong to
// units inside it becomes a unit without parameters (e.g. a root). The
// parameters are split into one group per distinct FSDP mesh (see
// ShardPlacementResult), each with its own collectives. Errors: a module
// already sharded, a module with nothing to manage, a mesh whose FSDP dims
// cannot be told (3+ dims without shard_dim), a Shard(d) placement out of
// range or uneven on d != 0, a parameter both ignored and replicated, a
// DTensor parameter on a mesh unrelated to `mesh` -> ArgumentError (or
// subclass) naming the argument.
//
// Every rank must run the same units' forwards in the same order (SPMD);
// then reductions are issued in reverse forward order on every rank,
// whichever gradients each rank received. A parameter no rank produced a
// gradient for keeps none; one that some ranks did is reduced with zeros
// for the others. An exception in forward or backward that the user catches
// leaves nothing behind: the root's next forward discards what the failed
// pass left (in-flight collectives, partial gradients) and reshards.
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                       FullyShardOptions options = {});
// One unit over several modules: their parameters are gathered and reduced
// together (in one all-gather and one reduce-scatter with comm_fusion).
// Returns one FSDPModule per module, in the order given: element i's
// module() is modules[i]. Every control (the setters, unshard, reshard,
// zero_grad, reduce_gradients) through any element acts on the one shared
// unit, i.e. on all of the modules, exactly as through any other element; a
// later call through another element overrides it. As in FSDP2, the modules
// of one list cannot be controlled apart: shard them with separate
// fully_shard calls for that.
std::vector<FSDPModule> fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                    FullyShardOptions options = {});

// The unit `module` belongs to as the module fully_shard was applied to.
std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module);

namespace detail {
// ArgumentError naming "method" for a null member pointer (Sharded<M>::call).
void require_method(bool present);

// The pieces of a unit's forward, used by Sharded<M>: begin_forward runs the
// pre-forward (root logic, unshard, prefetch) and returns false when
// `module` is not sharded; cast_input applies cast_forward_inputs;
// finish_output casts to output_dtype and attaches the pre-backward hook;
// end_forward reshards (reshard_after_forward) and records forward order.
bool begin_forward(const torch::nn::Module& module, std::shared_ptr<UnitState>& unit);
at::Tensor cast_input(const std::shared_ptr<UnitState>& unit, const at::Tensor& t);
at::Tensor finish_output(const std::shared_ptr<UnitState>& unit, const at::Tensor& t);
void end_forward(const std::shared_ptr<UnitState>& unit);

template <typename T>
decltype(auto) cast_arg(const std::shared_ptr<UnitState>& unit, T&& value) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return at::Tensor(cast_input(unit, value));
  } else {
    return std::forward<T>(value);
  }
}

template <typename T>
T finish(const std::shared_ptr<UnitState>& unit, T out) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return finish_output(unit, out);
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    for (auto& t : out) t = finish_output(unit, t);
    return out;
  } else {
    static_assert(std::is_same_v<T, at::Tensor> || std::is_same_v<T, std::vector<at::Tensor>>,
                  "fsdp::Sharded<M>: a sharded unit's forward must return at::Tensor or "
                  "std::vector<at::Tensor> (its outputs carry the pre-backward hook)");
    return out;
  }
}
}  // namespace detail

// Module holder that routes forward through the FSDP unit of its module.
// M is a LibTorch module holder (torch::nn::Linear, or TORCH_MODULE(Block)).
template <typename M>
class Sharded : public detail::HolderWrapper<M> {
 public:
  Sharded() : detail::HolderWrapper<M>(nullptr) {}
  Sharded(std::nullptr_t) : detail::HolderWrapper<M>(nullptr) {}  // NOLINT: like ModuleHolder
  Sharded(M holder) : detail::HolderWrapper<M>(std::move(holder)) {}  // NOLINT: implicit
  // What register_module returns for a holder.
  Sharded(std::shared_ptr<typename M::ContainedType> impl)  // NOLINT: implicit
      : detail::HolderWrapper<M>(M(std::move(impl))) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    std::shared_ptr<UnitState> unit;
    if (!detail::begin_forward(*this->holder_, unit)) {
      return this->holder_->forward(std::forward<Args>(args)...);
    }
    auto out = this->holder_->forward(detail::cast_arg(unit, std::forward<Args>(args))...);
    out = detail::finish(unit, std::move(out));
    detail::end_forward(unit);
    return out;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Runs another method of the module through the unit exactly as forward
  // (FSDP2's register_fsdp_forward_method): pre-forward (unshard, prefetch,
  // input casts), the method, then output casts, the pre-backward hook and
  // reshard. For methods such as `generate` or `encode` that use the
  // parameters without going through forward:
  //   auto ids = model.call(&DecoderImpl::generate, prompt, 16);
  // The method must belong to M's module type (a compile error otherwise)
  // and return at::Tensor or std::vector<at::Tensor>; a null pointer ->
  // ArgumentError naming "method". Nested units' forwards inside it unshard
  // and reshard as usual.
  template <typename Method, typename... Args>
  auto call(Method method, Args&&... args) {
    static_assert(std::is_member_function_pointer_v<Method>,
                  "fsdp::Sharded<M>::call: pass a member function pointer, &Impl::method");
    static_assert(std::is_invocable_v<Method, typename M::ContainedType&, Args...>,
                  "fsdp::Sharded<M>::call: the method is not a member of M's module type, or "
                  "does not accept these arguments");
    detail::require_method(method != nullptr);
    auto& impl = *this->holder_.ptr();
    std::shared_ptr<UnitState> unit;
    if (!detail::begin_forward(*this->holder_, unit)) {
      return (impl.*method)(std::forward<Args>(args)...);
    }
    auto out = (impl.*method)(detail::cast_arg(unit, std::forward<Args>(args))...);
    out = detail::finish(unit, std::move(out));
    detail::end_forward(unit);
    return out;
  }
};

// Typed convenience for the root: shards `holder`'s module and returns the
// holder that routes forward through the unit.
template <typename M, typename = std::enable_if_t<std::is_base_of_v<
                          torch::nn::ModuleHolder<typename M::ContainedType>, M>>>
Sharded<M> fully_shard(const M& holder, FullyShardOptions options = {}) {
  fully_shard(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), std::move(options));
  return Sharded<M>(holder);
}

template <typename M>
FSDPModule fully_shard(const Sharded<M>& sharded, FullyShardOptions options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(sharded.ptr()),
                     std::move(options));
}

}  // namespace fsdp
