// fsdp::dcp::State: what a checkpoint holds, by name.
#include "fsdp/distributed_checkpoint.h"

#include "checkpoint/items.h"

#include <algorithm>

namespace fsdp::dcp {

std::string to_string(CheckpointError::Kind kind) {
  using K = CheckpointError::Kind;
  switch (kind) {
    case K::NotFound: return "not-found";
    case K::Corrupt: return "corrupt";
    case K::Incomplete: return "incomplete";
    case K::MissingTensor: return "missing-tensor";
    case K::ShapeMismatch: return "shape-mismatch";
    case K::DtypeMismatch: return "dtype-mismatch";
    case K::OptimizerMismatch: return "optimizer-mismatch";
    case K::OtherModel: return "other-model";
    case K::Format: return "format";
    case K::Io: return "io";
  }
  return "unknown";
}

void State::claim(const std::string& name, const char* argument) {
  detail::check_name(name, argument);
  if (std::find(claimed_.begin(), claimed_.end(), name) != claimed_.end()) {
    throw ArgumentError(argument, std::string("distributed checkpoint: ") + argument + " '" + name +
                                      "' is taken already");
  }
  claimed_.push_back(name);
}

State& State::add_module(const std::string& prefix, std::shared_ptr<torch::nn::Module> module) {
  if (!module) throw ArgumentError("module", "distributed checkpoint: add_module got a null module");
  claim(prefix, "prefix");
  modules_.push_back({prefix, std::move(module)});
  return *this;
}

State& State::add_optimizer(const std::string& prefix, torch::optim::Optimizer& optimizer,
                            const std::string& module_prefix) {
  detail::optimizer_type(optimizer);  // refuses what cannot be saved
  const bool known = std::any_of(modules_.begin(), modules_.end(),
                                 [&](const Module& m) { return m.prefix == module_prefix; });
  if (!known) {
    throw ArgumentError("module_prefix", "distributed checkpoint: add_optimizer names module '" +
                                             module_prefix +
                                             "', which was not added with add_module (first)");
  }
  claim(prefix, "prefix");
  optimizers_.push_back({prefix, &optimizer, module_prefix});
  return *this;
}

State& State::add_dtensor(const std::string& name, const DTensor& tensor) {
  if (!tensor.defined()) {
    throw ArgumentError("tensor", "distributed checkpoint: add_dtensor('" + name +
                                      "') got an undefined DTensor");
  }
  claim(name, "name");
  dtensors_.emplace_back(name, tensor);
  return *this;
}

State& State::set(const std::string& name, Value value) {
  detail::check_name(name, "name");
  entries_[name] = Entry{std::move(value), false};
  return *this;
}

State& State::set_rank_local(const std::string& name, Value value) {
  detail::check_name(name, "name");
  entries_[name] = Entry{std::move(value), true};
  return *this;
}

bool State::has(const std::string& name) const { return entries_.count(name) > 0; }

const Value& State::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    throw ArgumentError("name", "distributed checkpoint: the state has no value '" + name + "'");
  }
  return it->second.value;
}

namespace {
template <typename T>
const T& typed(const State& s, const std::string& name, const char* type) {
  const auto* v = std::get_if<T>(&s.get(name));
  if (v == nullptr) {
    throw ArgumentError("name", "distributed checkpoint: value '" + name + "' is not " + type);
  }
  return *v;
}
}  // namespace

int64_t State::get_int(const std::string& name) const { return typed<int64_t>(*this, name, "an int64"); }
double State::get_double(const std::string& name) const { return typed<double>(*this, name, "a double"); }
const std::string& State::get_string(const std::string& name) const {
  return typed<std::string>(*this, name, "a string");
}
const at::Tensor& State::get_tensor(const std::string& name) const {
  return typed<at::Tensor>(*this, name, "a tensor");
}

}  // namespace fsdp::dcp
