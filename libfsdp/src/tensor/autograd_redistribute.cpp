// redistribute_local: DTensor::redistribute as an autograd Function on local
// tensors, the building block of tensor parallelism's conjugate collectives.
#include "fsdp/dtensor.h"

#include "fsdp/errors.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <utility>

namespace fsdp {
namespace {

// ctx->saved_data holds IValues only; a capsule carries the mesh and the
// placements (neither is an IValue type) to backward.
struct RedistributeState : torch::CustomClassHolder {
  RedistributeState(DeviceMesh m, std::vector<Placement> f, std::vector<Placement> g,
                    std::vector<int64_t> s)
      : mesh(std::move(m)), from(std::move(f)), grad(std::move(g)), shape(std::move(s)) {}
  DeviceMesh mesh;
  std::vector<Placement> from, grad;
  std::vector<int64_t> shape;
};

// A partial sum's gradient is the same on every rank, so the gradient
// returns to a Partial input as Replicate.
std::vector<Placement> grad_target(const std::vector<Placement>& from) {
  std::vector<Placement> out;
  out.reserve(from.size());
  for (const Placement& p : from) out.push_back(p.is_partial() ? Placement::Replicate() : p);
  return out;
}

struct Redistribute : torch::autograd::Function<Redistribute> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& local,
                            const c10::intrusive_ptr<RedistributeState>& state,
                            const std::vector<Placement>& to) {
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return DTensor::from_local(local, state->mesh, state->from, state->shape)
        .redistribute(to)
        .to_local();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<RedistributeState>(ctx->saved_data["state"].toCapsule());
    at::Tensor g = DTensor::from_local(grads[0], state->mesh, state->grad, state->shape)
                       .redistribute(grad_target(state->from))
                       .to_local();
    return {g, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor redistribute_local(const at::Tensor& local, const DeviceMesh& mesh,
                              const std::vector<Placement>& from,
                              const std::vector<Placement>& to,
                              const std::vector<int64_t>& shape,
                              std::optional<std::vector<Placement>> grad_placements) {
  if (grad_placements && static_cast<int64_t>(grad_placements->size()) != mesh.ndim()) {
    throw ArgumentError("grad_placements",
                        "redistribute_local: 'grad_placements' has " +
                            std::to_string(grad_placements->size()) +
                            " entries; expected one per mesh dim (" +
                            std::to_string(mesh.ndim()) + ")");
  }
  auto state = c10::make_intrusive<RedistributeState>(mesh, from, grad_placements.value_or(to),
                                                      shape);
  return Redistribute::apply(local, state, to);
}

}  // namespace fsdp
