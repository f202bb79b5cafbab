// Global gradient clipping for sharded models, as torch.nn.utils.clip_grad_norm_
// over the whole data-parallel model rather than over this rank's pieces.
//
//   loss.backward();
//   double norm = fsdp::clip_grad_norm_({root}, {}, /*max_norm=*/1.0);
//   optimizer.step();
//
// or, with the module's parameter list (sharded, replicated and plain
// parameters are told apart by the library):
//
//   double norm = fsdp::clip_grad_norm_(model->parameters(), 1.0);
//
// What each kind of parameter contributes to the norm:
//  - sharded (managed by a unit, Shard placement): its local shard holds only
//    the rows this rank owns -- never padding -- so the |g|^p of the local
//    shards are summed (max for the inf-norm) over the unit's shard group.
//    HSDP replicas hold identical shards after the synchronised backward, so
//    nothing is reduced over the replicate dim: each replica is counted once.
//  - replicated (managed, replicate_params or 0-dim): the full gradient,
//    identical on every rank after the all-reduce, counted once.
//  - plain (ignored_params, or a tensor no unit manages): not communicated;
//    each rank counts its own gradient. That is the right global norm when
//    these gradients are the same on every rank (the user synchronises them,
//    or they are replicated); when they differ per rank, so do the total norm
//    and the clip coefficient, and the ranks' sharded gradients are scaled by
//    different factors.
// The norm covers what param.grad() holds: call it after the synchronised
// backward. Gradients accumulated under set_requires_gradient_sync(false)
// are not yet in param.grad() and are not counted; after a backward with
// set_requires_all_reduce(false), HSDP replicas differ and so does the norm
// per replica. Reductions left in flight by set_is_last_backward(false) are
// finished first.
//
// Collective over the shard groups of the units involved (one all-reduce of
// a scalar per distinct shard group of more than one rank -- for the
// inf-norm two doubles, the value and a NaN flag, since MAX drops NaN; none
// for a world of one rank or a (replicate, 1) mesh): every rank must call it
// with the same parameters in the same order. NaN gradients give a NaN
// norm for every norm_type, the inf-norm included.
//
// Errors (ArgumentError naming the argument, thrown on every rank before any
// communication): max_norm NaN or <= 0; norm_type NaN, <= 0 or -inf; an
// undefined tensor in `parameters` or `extra_params`; an FSDPModule that
// refers to no sharded module in `modules`. StateError: a unit involved is unsharded (its sharded
// gradients are set aside until it reshards -- call reshard() first).
#pragma once

#include "fsdp/fully_shard.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp {

// The total norm of order `norm_type` (any p > 0, or infinity) of the
// gradients of `parameters`, taken as one vector over the data-parallel
// mesh. Tensors without a gradient are skipped. If the total exceeds
// max_norm, every gradient is multiplied in place by
// max_norm / (total + 1e-6) -- precisely, whenever that coefficient is < 1,
// as torch does; a NaN total multiplies by NaN, as torch does, unless
// error_if_nonfinite, which throws ArgumentError naming "parameters" on a
// NaN or infinite total instead (before scaling). max_norm = +inf only
// measures (for a finite total). Duplicate tensors are counted and scaled
// once. Returns the total norm before clipping.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);

// The same over every parameter of `modules` -- each unit's modules, with
// the units nested in them and their plain (ignored or unmanaged)
// parameters, as module->parameters() lists them -- plus `extra_params`
// (plain tensors outside those modules, e.g. an unsharded head).
double clip_grad_norm_(const std::vector<FSDPModule>& modules,
                       const std::vector<at::Tensor>& extra_params, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);

// The total gradient norm alone (same rules, same collectives, no scaling).
double total_grad_norm(const std::vector<at::Tensor>& parameters, double norm_type = 2.0);
double total_grad_norm(const std::vector<FSDPModule>& modules,
                       const std::vector<at::Tensor>& extra_params, double norm_type = 2.0);

}  // namespace fsdp
