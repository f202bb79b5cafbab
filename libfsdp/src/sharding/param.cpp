// ShardedParam: shard layout, unshard/reshard by set_data, gradient capture.
#include "sharding/param.h"

#include "comm/group_registry.h"
#include "fsdp/errors.h"
#include "base/torch_compat.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp::detail {
namespace {

// Runs a callback after AccumulateGrad stored the full gradient.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

int64_t product(c10::IntArrayRef v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// Places the rows of `src` ([n, rest...], shard dim first) into `dst`
// ([ranks, chunk * rest], one row per destination rank): source row k goes
// to rank k / chunk, row k % chunk; rows past n are zero. Splitting a dim is
// always a view, so neither side is copied on the way.
void scatter_rows(const at::Tensor& dst, const at::Tensor& src, int64_t chunk, bool add) {
  const int64_t ranks = dst.size(0);
  if (chunk == 0) return;
  std::vector<int64_t> shape{ranks, chunk};
  for (int64_t i = 1; i < src.dim(); ++i) shape.push_back(src.size(i));
  const at::Tensor d = dst.view(shape);
  const int64_t n = src.size(0);
  const int64_t whole = n / chunk;
  const int64_t rest = n % chunk;
  auto put = [add](const at::Tensor& to, const at::Tensor& from) {
    if (add) {
      to.add_(from);
    } else {
      to.copy_(from);
    }
  };
  if (whole > 0) {
    std::vector<int64_t> split = shape;
    split[0] = whole;
    put(d.narrow(0, 0, whole), src.narrow(0, 0, whole * chunk).view(split));
  }
  if (whole < ranks) {
    const at::Tensor partial = d.select(0, whole);
    if (rest > 0) put(partial.narrow(0, 0, rest), src.narrow(0, whole * chunk, rest));
    if (!add) {
      partial.narrow(0, rest, chunk - rest).zero_();
      d.narrow(0, whole + 1, ranks - whole - 1).zero_();
    }
  }
}

}  // namespace

ShardedParam::ShardedParam(std::string name, at::Tensor param, ParamLayout layout,
                           const UnitDtypes& dtypes, c10::Device compute_device, bool offload,
                           bool pin_memory)
    : name_(std::move(name)),
      param_(std::move(param)),
      layout_(std::move(layout)),
      full_shape_(param_.sizes().vec()),
      orig_dtype_(param_.scalar_type()),
      param_dtype_(dtypes.param.value_or(orig_dtype_)),
      reduce_dtype_(dtypes.reduce.value_or(param_dtype_)),
      compute_device_(compute_device),
      shard_size_(layout_.shard_group->size()),
      shard_rank_(layout_.shard_group->rank()) {
  offload_ = offload;
  pin_memory_ = pin_memory;
  deferred_ = param_.is_meta();
  const at::Tensor full = param_.detach();
  // Deferred: the shard's layout is fixed now, its storage by materialize().
  const at::TensorOptions options =
      deferred_ ? full.options().device(c10::kMeta) : storage_options();
  if (layout_.fsdp.is_shard()) {
    dim_ = layout_.fsdp.dim();
    const at::Tensor moved = full.movedim(dim_, 0);
    moved_shape_ = moved.sizes().vec();
    const int64_t rows = moved_shape_[0];
    chunk_ = shard_chunk(rows, shard_size_);
    const ShardExtent ext = shard_extent(rows, shard_size_, shard_rank_);
    owned_rows_ = ext.length;
    std::vector<int64_t> block_shape = moved_shape_;
    block_shape[0] = chunk_;
    padded_ = at::zeros(block_shape, options);
    if (!deferred_) padded_.narrow(0, 0, owned_rows_).copy_(moved.narrow(0, ext.offset, owned_rows_));
    block_numel_ = product(block_shape);
  } else {
    padded_ = at::empty(full.sizes(), options);
    if (!deferred_) padded_.copy_(full);
    block_numel_ = full.numel();
  }
  local_ = owned(padded_);
  full_is_shard_ = full_is_shard_now();
  if (full_is_shard_) full_ = local_;
  param_.mutable_grad() = at::Tensor();  // a full-shape gradient has no place on a shard
  to_sharded();
}

bool ShardedParam::full_is_shard_now() const {
  // An extension's full tensor is its post_all_gather's, never the shard.
  return (!layout_.fsdp.is_shard() || shard_size_ == 1) && param_dtype_ == orig_dtype_ &&
         padded_.device() == compute_device_ && !extension_;
}

void ShardedParam::set_extension(std::shared_ptr<const AllGatherExtension> extension) {
  extension_ = std::move(extension);
  full_is_shard_ = full_is_shard_now();
  if (!full_is_shard_ && full_.defined() && !unsharded_buf_.defined()) full_ = at::Tensor();
}

at::Tensor ShardedParam::shard_2d() const {
  check_materialized("all-gathered");
  return padded_.to(compute_device_).view({chunk_, -1});
}

void ShardedParam::install_full(const at::Tensor& full_padded) {
  all_gather_output().copy_(full_padded.reshape({-1}));
}

void ShardedParam::drop_full_buffer() {
  if (unsharded_ || full_is_shard_) return;
  unsharded_buf_ = at::Tensor();
  full_ = at::Tensor();
}

void ShardedParam::to_value_free_full() {
  if (unsharded_) return;
  if (param_.grad().defined()) {
    stashed_grad_ = param_.grad();
    param_.mutable_grad() = at::Tensor();
  }
  // AccumulateGrad checks a gradient's shape, dtype and device against the
  // variable's; a stride-0 tensor has them with one element of memory (and,
  // not being dense, lets autograd keep the contiguous gradient it made).
  const auto options = at::TensorOptions().dtype(param_dtype_).device(compute_device_);
  param_.set_data(at::zeros({1}, options).expand(full_shape_));
}

at::TensorOptions ShardedParam::storage_options() const {
  const auto storage_device = offload_ ? c10::Device(c10::kCPU) : compute_device_;
  auto options = at::TensorOptions().dtype(orig_dtype_).device(storage_device);
  if (offload_ && pin_memory_ && compute_device_.is_cuda()) options = options.pinned_memory(true);
  return options;
}

void ShardedParam::check_materialized(const char* op) const {
  if (!deferred_) return;
  throw StateError("fully_shard: parameter '" + name_ + "' is still on the meta device (built "
                   "under fsdp::MetaInit) and cannot be " + op +
                   "; call fsdp::materialize on the model first (fsdp/deferred_init.h)");
}

void ShardedParam::materialize() {
  if (!deferred_) return;
  // Zeros: the padding rows past the owned ones must stay zero (they are
  // all-gathered and reduced like the rest).
  padded_ = at::zeros(padded_.sizes(), storage_options());
  local_ = owned(padded_);
  deferred_ = false;
  full_is_shard_ = full_is_shard_now();
  full_ = full_is_shard_ ? local_ : at::Tensor();
  compat::rebind_meta_variable(param_, local_);
  to_sharded();
}

at::Tensor ShardedParam::owned(const at::Tensor& block) const {
  if (!layout_.fsdp.is_shard()) return block;
  return block.narrow(0, 0, owned_rows_).movedim(0, dim_);
}

DTensor ShardedParam::dtensor() const {
  return DTensor::from_local(local_, *layout_.spmd_mesh, layout_.spmd_placements,
                             layout_.global_shape);
}

void ShardedParam::unshard_locally() {
  check_materialized("unsharded");
  if (!full_is_shard_) copy_in(all_gather_output());
}

void ShardedParam::copy_in(const at::Tensor& dst) {
  check_materialized("all-gathered");
  // An offloaded shard is pinned on CUDA runs: its upload does not block the
  // host, and the host waits for it before it next writes the shard.
  const bool upload = compute_device_.is_cuda() && padded_.is_pinned();
  dst.copy_(padded_.view({-1}), /*non_blocking=*/upload);
  if (upload) host_copies_.record(compute_device_, at::Tensor());
}

at::Tensor ShardedParam::all_gather_output(
    const std::function<at::Tensor(int64_t, const at::TensorOptions&)>* allocate) {
  const int64_t numel = block_numel_ * (layout_.fsdp.is_shard() ? shard_size_ : 1);
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(param_dtype_);
  if (!unsharded_buf_.defined()) {
    std::vector<int64_t> shape = layout_.fsdp.is_shard() ? moved_shape_ : full_shape_;
    if (layout_.fsdp.is_shard()) shape[0] = chunk_ * shard_size_;
    // In the shard group's shared memory where it has some: the shm
    // all-gather then publishes this rank's block in place, and peers copy
    // straight out of it. Released and regrown there on every reshard.
    const at::TensorOptions options =
        padded_.options().dtype(param_dtype_).device(compute_device_).pinned_memory(false);
    if (allocate != nullptr && *allocate) {
      unsharded_buf_ = (*allocate)(numel, options).view(shape);
    } else {
      unsharded_buf_ = layout_.fsdp.is_shard() && layout_.shard_group != nullptr
                           ? layout_.shard_group->empty_for_collectives(shape, options)
                           : at::empty(shape, options);
    }
    full_ = layout_.fsdp.is_shard()
                ? unsharded_buf_.narrow(0, 0, moved_shape_[0]).movedim(0, dim_)
                : unsharded_buf_;
  } else {
    compat::restore_storage(unsharded_buf_, nbytes);
  }
  return unsharded_buf_.view({-1});
}

void ShardedParam::to_unsharded() {
  if (unsharded_) return;
  check_materialized("unsharded");
  if (!layout_.fsdp.is_shard() && !full_is_shard_) all_gather_output().copy_(padded_.view({-1}));
  // The sharded gradient waits aside while autograd works on the full one.
  if (param_.grad().defined()) {
    stashed_grad_ = param_.grad();
    param_.mutable_grad() = at::Tensor();
  }
  param_.set_data(full_);
  unsharded_ = true;
}

void ShardedParam::to_sharded() {
  const bool was_unsharded = unsharded_;
  param_.set_data(local_);
  unsharded_ = false;
  if (stashed_grad_.defined()) {
    param_.mutable_grad() = stashed_grad_;
    stashed_grad_ = at::Tensor();
  }
  if (was_unsharded && unsharded_buf_.defined()) compat::release_storage(unsharded_buf_);
}

void ShardedParam::ensure_grad_hook(std::function<void()> on_ready) {
  if (!param_.requires_grad()) return;
  // Created now, while the parameter is in its full compute form, so its
  // metadata accepts full gradients; a dtype change by set_data replaces the
  // node, hence the identity check.
  auto accumulator = torch::autograd::impl::grad_accumulator(param_);
  if (accumulator == hooked_accumulator_) return;
  accumulator->add_post_hook(std::make_unique<GradReadyHook>(std::move(on_ready)));
  hooked_accumulator_ = std::move(accumulator);
}

void ShardedParam::take_pass_grad() {
  at::Tensor g = param_.grad();
  if (!g.defined()) return;
  param_.mutable_grad() = at::Tensor();
  // Autograd hands over a fresh tensor; keeping it (or its cast) is safe.
  at::Tensor r = g.to(reduce_dtype_);
  pass_grad_ = pass_grad_.defined() ? pass_grad_.add_(r) : r;
}

at::Tensor ShardedParam::summed_grad(bool copy_pass) const {
  // The accumulation stays until the pass commits (a failed pass keeps it).
  if (accumulated_grad_.defined()) {
    return pass_grad_.defined() ? accumulated_grad_ + pass_grad_ : accumulated_grad_.clone();
  }
  return copy_pass && pass_grad_.defined() ? pass_grad_.clone() : pass_grad_;
}

at::Tensor ShardedParam::partial_summed_grad() const {
  // Every member joins, with zeros where it has no gradient. The reduction
  // group keeps these sums ordered among FSDP's own collectives, apart
  // from the model's TP collectives on the same ranks.
  at::Tensor g = summed_grad(/*copy_pass=*/true);
  if (!g.defined()) {
    g = at::zeros(full_shape_, at::TensorOptions().dtype(reduce_dtype_).device(compute_device_));
  }
  g = g.contiguous();
  for (const auto& group : layout_.grad_partial_groups) {
    reduction_group_for(group)->all_reduce(g, ReduceOp::SUM);
  }
  return g;
}

at::Tensor ShardedParam::take_local_grad() {
  const bool any = has_local_grad();
  const at::Tensor g = layout_.grad_partial_groups.empty() ? summed_grad(/*copy_pass=*/false)
                                                           : partial_summed_grad();
  pass_grad_ = at::Tensor();
  return any ? g : at::Tensor();
}

void ShardedParam::write_reduce_input(const at::Tensor& dst) const {
  if (!layout_.grad_partial_groups.empty()) {
    const at::Tensor g = partial_summed_grad();
    if (layout_.fsdp.is_shard()) {
      scatter_rows(dst, g.movedim(dim_, 0), chunk_, /*add=*/false);
    } else {
      dst.view(full_shape_).copy_(g);
    }
    return;
  }
  const bool any = has_local_grad();
  if (!layout_.fsdp.is_shard()) {
    const at::Tensor d = dst.view(full_shape_);
    if (!any) {
      d.zero_();
      return;
    }
    d.copy_(accumulated_grad_.defined() ? accumulated_grad_ : pass_grad_);
    if (accumulated_grad_.defined() && pass_grad_.defined()) d.add_(pass_grad_);
    return;
  }
  if (!any) {
    dst.zero_();
    return;
  }
  const at::Tensor& first = accumulated_grad_.defined() ? accumulated_grad_ : pass_grad_;
  scatter_rows(dst, first.movedim(dim_, 0), chunk_, /*add=*/false);
  if (accumulated_grad_.defined() && pass_grad_.defined()) {
    scatter_rows(dst, pass_grad_.movedim(dim_, 0), chunk_, /*add=*/true);
  }
}

void ShardedParam::commit_pass(bool reduced) {
  if (reduced) {
    pass_grad_ = at::Tensor();
    accumulated_grad_ = at::Tensor();
    return;
  }
  if (!pass_grad_.defined()) return;
  accumulated_grad_ =
      accumulated_grad_.defined() ? accumulated_grad_.add_(pass_grad_) : pass_grad_;
  pass_grad_ = at::Tensor();
}

at::Tensor ShardedParam::current_sharded_grad() const {
  return unsharded_ ? stashed_grad_ : param_.grad();
}

void ShardedParam::set_grad(const at::Tensor& g) {
  if (unsharded_) {
    stashed_grad_ = g;
  } else {
    param_.mutable_grad() = g;
  }
}

void ShardedParam::add_reduced_grad(const at::Tensor& reduced, double scale,
                                    bool to_fp32_main_grad) {
  at::Tensor g;
  if (layout_.fsdp.is_shard()) {
    std::vector<int64_t> block_shape = moved_shape_;
    block_shape[0] = chunk_;
    g = owned(reduced.view(block_shape));
  } else {
    g = reduced.view(full_shape_);
  }
  install_grad(g, scale, to_fp32_main_grad, /*owned=*/false);
}

void ShardedParam::add_local_grad(const at::Tensor& g, double scale, bool to_fp32_main_grad) {
  // A view (autograd's gradient of several parameters at once, sliced) must
  // not become a gradient: optimizers detach_() gradients in place.
  install_grad(g, scale, to_fp32_main_grad, /*owned=*/!g.is_view());
}

void ShardedParam::install_grad(const at::Tensor& g, double scale, bool to_fp32_main_grad,
                                bool owned) {
  // `s` is the gradient to add; `fresh`: a tensor of our own, which may be
  // kept as the gradient. The multiply is the copy when g is not ours.
  const bool fresh = owned || scale != 1;
  const at::Tensor s = scale == 1 ? g : (owned ? g.mul_(scale) : g.mul(scale));
  if (to_fp32_main_grad) {
    at::Tensor g32 = s.to(padded_.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/!fresh);
    main_grad_ = main_grad_.defined() ? main_grad_.add_(g32) : g32;
    set_grad(main_grad_);
    return;
  }
  at::Tensor existing = current_sharded_grad();
  if (!existing.defined() && s.is_cuda() && padded_.is_pinned()) {
    // Offloaded: into pinned memory without blocking (s is kept alive until
    // the copy has run).
    at::Tensor host = at::empty(s.sizes(), s.options().device(at::kCPU).pinned_memory(true));
    host.copy_(s, /*non_blocking=*/true);
    host_copies_.record(s.device(), s);
    set_grad(host);
    return;
  }
  set_grad(existing.defined()
               ? existing.add_(s.to(existing.device(), existing.scalar_type()))
               : s.to(padded_.device(), s.scalar_type(), /*non_blocking=*/false, /*copy=*/!fresh));
}

at::Tensor ShardedParam::sharded_grad_copy(bool fp32_main_grad) const {
  const at::Tensor g = fp32_main_grad ? main_grad_ : current_sharded_grad();
  return g.defined() ? g.clone() : g;
}

void ShardedParam::restore_grad(const at::Tensor& g, bool fp32_main_grad) {
  if (fp32_main_grad) main_grad_ = g;
  set_grad(g);
}

void ShardedParam::zero_grad() {
  param_.mutable_grad() = at::Tensor();
  stashed_grad_ = at::Tensor();
  pass_grad_ = at::Tensor();
  accumulated_grad_ = at::Tensor();
  main_grad_ = at::Tensor();
}

void ShardedParam::load_local(const at::Tensor& local_values) {
  check_materialized("loaded");
  host_copies_.wait();  // an upload may still read the shard
  at::NoGradGuard no_grad;
  local_.copy_(local_values);
}

}  // namespace fsdp::detail
