// A State as Items (items.h): module tensors by how they are laid out
// (fully_shard's shards, TP/EP DTensors, plain tensors), optimizer state
// laid out like its parameter, and the user's tensors.
#include "checkpoint/items.h"

#include "checkpoint/h5io.h"

#include "fsdp/optim_state.h"
#include "fsdp/parallel_module.h"
#include "base/shape_str.h"
#include "sharding/query.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cctype>
#include <set>
#include <sstream>
#include <unordered_map>

namespace fsdp::dcp::detail {

using nlohmann::json;
using Kind = CheckpointError::Kind;

void check_name(const std::string& name, const char* argument) {
  bool ok = !name.empty() && name.front() != '/' && name.back() != '/' &&
            name.find("//") == std::string::npos && name.rfind("__", 0) != 0;
  for (char c : name) {
    const bool allowed = std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' ||
                         c == '-' || c == '/';
    ok = ok && allowed;
  }
  if (!ok) {
    throw ArgumentError(argument, std::string("distributed checkpoint: ") + argument + " '" +
                                      name +
                                      "' is not accepted; accepted: '/'-separated non-empty "
                                      "components of [A-Za-z0-9_.-], not starting with \"__\"");
  }
}

std::string rank_local_name(int rank, const std::string& name) {
  return "__rank" + std::to_string(rank) + "/" + name;
}

namespace {

std::string layout_str(const DTensor& t) {
  std::ostringstream os;
  for (size_t i = 0; i < t.placements().size(); ++i) {
    os << (i ? ", " : "") << t.placements()[i].to_string();
  }
  os << " on " << t.device_mesh().to_string();
  return os.str();
}

void copy_into(at::Tensor dst, const at::Tensor& values) {
  c10::NoGradGuard no_grad;
  dst.copy_(values);
}

// How one module tensor is laid out on this rank.
struct Placed {
  at::Tensor local;
  std::vector<LocalBox> boxes;
  std::vector<int64_t> shape;
  std::string layout;
  std::function<void(const at::Tensor&)> load;
};

struct ModuleLayouts {
  std::unordered_map<const c10::TensorImpl*, fsdp::detail::ManagedShard> managed;
  std::unordered_map<const c10::TensorImpl*, DTensor> distributed;
};

Placed place(const std::string& name, const at::Tensor& p, const ModuleLayouts& layouts) {
  Placed out;
  const auto* impl = p.unsafeGetTensorImpl();
  if (auto it = layouts.managed.find(impl); it != layouts.managed.end()) {
    const auto& m = it->second;
    if (m.unsharded) {
      throw StateError("distributed checkpoint: '" + name +
                       "' belongs to a unit that holds full parameters right now; call "
                       "reshard() on it (or finish the step) before saving or loading");
    }
    out.local = m.shard.to_local();
    out.boxes = local_boxes(name, m.shard);
    out.shape = m.shard.shape();
    out.layout = layout_str(m.shard);
    out.load = m.load;
    return out;
  }
  out.local = p;
  if (auto it = layouts.distributed.find(impl); it != layouts.distributed.end()) {
    out.boxes = local_boxes(name, it->second);
    out.shape = it->second.shape();
    out.layout = layout_str(it->second);
  } else {
    out.shape = p.sizes().vec();
    out.boxes = whole_box(out.shape);
    out.layout = "whole";
  }
  out.load = [p](const at::Tensor& values) { copy_into(p, values); };
  return out;
}

void add_distributed(const torch::nn::Module& module, ModuleLayouts& l) {
  for (const auto& dp : dtensor_params(module)) {
    l.distributed.emplace(dp.param.to_local().unsafeGetTensorImpl(), dp.param);
  }
}

ModuleLayouts layouts_of(const State& state) {
  ModuleLayouts l;
  l.managed = fsdp::detail::managed_shards();
  for (const auto& m : state.modules()) add_distributed(*m.module, l);
  return l;
}

struct ModuleTensor {
  std::string name;  // "<prefix>/<name>" in a State, else the module name
  std::string kind;  // "param" or "buffer"
  at::Tensor tensor;
};

// `module`'s tensors named "<head><name>".
std::vector<ModuleTensor> module_tensors(const torch::nn::Module& module, const std::string& head) {
  std::vector<ModuleTensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    out.push_back({head + p.key(), "param", p.value()});
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.push_back({head + b.key(), "buffer", b.value()});
  }
  return out;
}

Item item_of(const ModuleTensor& mt, const Placed& p) {
  Item it;
  it.name = mt.name;
  it.kind = mt.kind;
  it.dtype = p.local.scalar_type();
  it.shape = p.shape;
  it.local = p.local;
  it.boxes = p.boxes;
  it.layout = p.layout;
  it.install = p.load;
  return it;
}

// Every module tensor of `state` as an Item (install: its load), and its
// placement by full name (optimizer state is laid out like it).
void add_module_items(const State& state, std::vector<Item>& items,
                      std::map<std::string, Placed>& placed) {
  const ModuleLayouts layouts = layouts_of(state);
  for (const auto& m : state.modules()) {
    for (auto& mt : module_tensors(*m.module, m.prefix + "/")) {
      Placed p = place(mt.name, mt.tensor, layouts);
      items.push_back(item_of(mt, p));
      placed.emplace(mt.name, std::move(p));
    }
  }
}

}  // namespace

std::vector<Item> module_items(torch::nn::Module& module) {
  ModuleLayouts layouts;
  layouts.managed = fsdp::detail::managed_shards();
  add_distributed(module, layouts);
  std::vector<Item> items;
  for (const auto& mt : module_tensors(module, "")) {
    items.push_back(item_of(mt, place(mt.name, mt.tensor, layouts)));
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.name < b.name; });
  return items;
}

namespace {

// The user's DTensors (add_dtensor); load writes into their local tensors.
void add_dtensor_items(const State& state, std::vector<Item>& items) {
  for (const auto& [name, dt] : state.dtensors()) {
    Item it;
    it.name = name;
    it.kind = "tensor";
    it.dtype = dt.to_local().scalar_type();
    it.shape = dt.shape();
    it.local = dt.to_local();
    it.boxes = local_boxes(name, dt);
    it.layout = layout_str(dt);
    at::Tensor dst = dt.to_local();
    it.install = [dst](const at::Tensor& values) { copy_into(dst, values); };
    items.push_back(std::move(it));
  }
}

// ---- optimizers ----

struct Field {
  const char* name;
  bool required;  // for a parameter that has state at all
};

std::vector<Field> fields_of(const std::string& type, const torch::optim::OptimizerOptions& o) {
  if (type == "AdamW" || type == "Adam") {
    const bool ams = type == "AdamW"
                         ? static_cast<const torch::optim::AdamWOptions&>(o).amsgrad()
                         : static_cast<const torch::optim::AdamOptions&>(o).amsgrad();
    return {{"step", true}, {"exp_avg", true}, {"exp_avg_sq", true}, {"max_exp_avg_sq", ams}};
  }
  if (type == "SGD") return {{"momentum_buffer", true}};
  if (type == "Adagrad") return {{"step", true}, {"sum", true}};
  const auto& r = static_cast<const torch::optim::RMSpropOptions&>(o);
  return {{"step", true},
          {"square_avg", true},
          {"momentum_buffer", r.momentum() > 0},
          {"grad_avg", r.centered()}};
}

at::Tensor get_field(const torch::optim::OptimizerParamState& s, const std::string& type,
                     const std::string& f) {
  using namespace torch::optim;
  auto step = [](int64_t v) { return at::scalar_tensor(v, at::kLong); };
  if (type == "AdamW") {
    const auto& a = static_cast<const AdamWParamState&>(s);
    if (f == "step") return step(a.step());
    return f == "exp_avg" ? a.exp_avg() : f == "exp_avg_sq" ? a.exp_avg_sq() : a.max_exp_avg_sq();
  }
  if (type == "Adam") {
    const auto& a = static_cast<const AdamParamState&>(s);
    if (f == "step") return step(a.step());
    return f == "exp_avg" ? a.exp_avg() : f == "exp_avg_sq" ? a.exp_avg_sq() : a.max_exp_avg_sq();
  }
  if (type == "SGD") return static_cast<const SGDParamState&>(s).momentum_buffer();
  if (type == "Adagrad") {
    const auto& a = static_cast<const AdagradParamState&>(s);
    return f == "step" ? step(a.step()) : a.sum();
  }
  const auto& r = static_cast<const RMSpropParamState&>(s);
  if (f == "step") return step(r.step());
  return f == "square_avg" ? r.square_avg() : f == "momentum_buffer" ? r.momentum_buffer() : r.grad_avg();
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state(const std::string& type) {
  using namespace torch::optim;
  if (type == "AdamW") return std::make_unique<AdamWParamState>();
  if (type == "Adam") return std::make_unique<AdamParamState>();
  if (type == "SGD") return std::make_unique<SGDParamState>();
  if (type == "Adagrad") return std::make_unique<AdagradParamState>();
  return std::make_unique<RMSpropParamState>();
}

void set_field(torch::optim::OptimizerParamState& s, const std::string& type, const std::string& f,
               const at::Tensor& v) {
  using namespace torch::optim;
  if (type == "AdamW" || type == "Adam") {
    auto set = [&](auto& a) {
      if (f == "step") a.step(v.item<int64_t>());
      else if (f == "exp_avg") a.exp_avg(v);
      else if (f == "exp_avg_sq") a.exp_avg_sq(v);
      else a.max_exp_avg_sq(v);
    };
    if (type == "AdamW") set(static_cast<AdamWParamState&>(s));
    else set(static_cast<AdamParamState&>(s));
  } else if (type == "SGD") {
    static_cast<SGDParamState&>(s).momentum_buffer(v);
  } else if (type == "Adagrad") {
    auto& a = static_cast<AdagradParamState&>(s);
    if (f == "step") a.step(v.item<int64_t>());
    else a.sum(v);
  } else {
    auto& r = static_cast<RMSpropParamState&>(s);
    if (f == "step") r.step(v.item<int64_t>());
    else if (f == "square_avg") r.square_avg(v);
    else if (f == "momentum_buffer") r.momentum_buffer(v);
    else r.grad_avg(v);
  }
}

// The optimizer's parameters with their names in the module added as
// module_prefix, in param-group order.
struct NamedParam {
  std::string name;  // without prefix
  at::Tensor param;
  size_t group;
};
std::vector<NamedParam> optimizer_params(const State& state, const State::Optimizer& o) {
  const State::Module* module = nullptr;
  for (const auto& m : state.modules()) {
    if (m.prefix == o.module_prefix) module = &m;
  }
  if (module == nullptr) {
    throw ArgumentError("module_prefix", "distributed checkpoint: optimizer '" + o.prefix +
                                             "' names module '" + o.module_prefix +
                                             "', which was not added with add_module");
  }
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& p : module->module->named_parameters(/*recurse=*/true)) {
    names.emplace(p.value().unsafeGetTensorImpl(), p.key());
  }
  std::vector<NamedParam> out;
  const auto& groups = o.optimizer->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        throw ArgumentError("optimizer", "distributed checkpoint: optimizer '" + o.prefix +
                                             "' has a parameter of shape " +
                                             shape_str(p.sizes()) + " that is not a parameter of module '" +
                                             o.module_prefix + "'");
      }
      out.push_back({it->second, p, g});
    }
  }
  return out;
}

}  // namespace

std::string optimizer_type(const torch::optim::Optimizer& opt) {
  using namespace torch::optim;
  if (dynamic_cast<const AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<const Adam*>(&opt)) return "Adam";
  if (dynamic_cast<const SGD*>(&opt)) return "SGD";
  if (dynamic_cast<const Adagrad*>(&opt)) return "Adagrad";
  if (dynamic_cast<const RMSprop*>(&opt)) return "RMSprop";
  throw ArgumentError("optimizer",
                      "distributed checkpoint: this optimizer type cannot be saved; accepted: "
                      "AdamW, Adam, SGD, Adagrad, RMSprop");
}

json optimizer_groups(const torch::optim::Optimizer& opt) {
  using namespace torch::optim;
  const std::string type = optimizer_type(opt);
  json groups = json::array();
  for (const auto& g : opt.param_groups()) {
    const auto& o = g.options();
    json j;
    if (type == "AdamW" || type == "Adam") {
      auto fill = [&](const auto& a) {
        j = {{"lr", a.lr()},
             {"betas", {std::get<0>(a.betas()), std::get<1>(a.betas())}},
             {"eps", a.eps()},
             {"weight_decay", a.weight_decay()},
             {"amsgrad", a.amsgrad()}};
      };
      if (type == "AdamW") fill(static_cast<const AdamWOptions&>(o));
      else fill(static_cast<const AdamOptions&>(o));
    } else if (type == "SGD") {
      const auto& s = static_cast<const SGDOptions&>(o);
      j = {{"lr", s.lr()}, {"momentum", s.momentum()}, {"dampening", s.dampening()},
           {"weight_decay", s.weight_decay()}, {"nesterov", s.nesterov()}};
    } else if (type == "Adagrad") {
      const auto& a = static_cast<const AdagradOptions&>(o);
      j = {{"lr", a.lr()}, {"lr_decay", a.lr_decay()}, {"weight_decay", a.weight_decay()},
           {"initial_accumulator_value", a.initial_accumulator_value()}, {"eps", a.eps()}};
    } else {
      const auto& r = static_cast<const RMSpropOptions&>(o);
      j = {{"lr", r.lr()}, {"alpha", r.alpha()}, {"eps", r.eps()},
           {"weight_decay", r.weight_decay()}, {"momentum", r.momentum()},
           {"centered", r.centered()}};
    }
    j["params"] = g.params().size();
    groups.push_back(j);
  }
  return groups;
}

std::vector<Item> items_for_save(const State& state) {
  std::vector<Item> items;
  std::map<std::string, Placed> placed;  // module tensors by full name
  add_module_items(state, items, placed);
  for (const auto& o : state.optimizers()) {
    const std::string type = optimizer_type(*o.optimizer);
    auto& opt = *o.optimizer;
    for (const auto& np : optimizer_params(state, o)) {
      auto st = opt.state().find(optimizer_state_key(opt, np.param));
      if (st == opt.state().end()) continue;
      const Placed& p = placed.at(o.module_prefix + "/" + np.name);
      for (const Field& f : fields_of(type, opt.param_groups()[np.group].options())) {
        at::Tensor v = get_field(*st->second, type, f.name);
        if (!v.defined()) continue;
        Item it;
        it.name = o.prefix + "/" + np.name + "/" + f.name;
        it.kind = "optim";
        it.dtype = v.scalar_type();
        it.local = v;
        if (v.dim() == 0 && std::string(f.name) == "step") {
          it.boxes = whole_box({});
          it.layout = "whole";
        } else {
          if (v.sizes() != p.local.sizes()) {
            throw ArgumentError("optimizer", "distributed checkpoint: optimizer '" + o.prefix +
                                                 "' state " + f.name + " of '" + np.name +
                                                 "' has shape " + shape_str(v.sizes()) +
                                                 ", its parameter's shard " +
                                                 shape_str(p.local.sizes()));
          }
          it.shape = p.shape;
          it.boxes = p.boxes;
          it.layout = p.layout;
        }
        items.push_back(std::move(it));
      }
    }
  }
  add_dtensor_items(state, items);
  const int rank = world_group()->rank();
  for (const auto& [name, e] : state.entries()) {
    const auto* t = std::get_if<at::Tensor>(&e.value);
    if (t == nullptr) continue;
    if (!t->defined()) {
      throw ArgumentError("name", "distributed checkpoint: value '" + name +
                                      "' is an undefined tensor");
    }
    Item it;
    it.name = e.rank_local ? rank_local_name(rank, name) : name;
    it.kind = e.rank_local ? "rank_local" : "tensor";
    it.dtype = t->scalar_type();
    it.shape = t->sizes().vec();
    it.local = *t;
    it.boxes = whole_box(it.shape);
    it.layout = "whole";
    items.push_back(std::move(it));
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.name < b.name; });
  for (size_t i = 1; i < items.size(); ++i) {
    if (items[i].name == items[i - 1].name) {
      throw ArgumentError("state", "distributed checkpoint: two entries are named '" +
                                       items[i].name + "'");
    }
  }
  for (auto& it : items) dtype_name(it.dtype, it.name);  // refuses what cannot be stored
  return items;
}

void clear_optimizer_state(State& state) {
  for (const auto& o : state.optimizers()) {
    auto& opt = *o.optimizer;
    for (const auto& group : opt.param_groups()) {
      for (const auto& p : group.params()) opt.state().erase(optimizer_state_key(opt, p));
    }
  }
}

std::vector<Item> items_for_load(State& state, const Index& index, const std::string& shown_as,
                                 int rank, bool same_world) {
  std::vector<Item> items;
  std::map<std::string, Placed> placed;
  add_module_items(state, items, placed);
  for (const auto& o : state.optimizers()) {
    const std::string type = optimizer_type(*o.optimizer);
    auto* opt = o.optimizer;
    for (const auto& np : optimizer_params(state, o)) {
      const Placed& p = placed.at(o.module_prefix + "/" + np.name);
      const auto fields = fields_of(type, opt->param_groups()[np.group].options());
      const std::string base = o.prefix + "/" + np.name + "/";
      bool any = false;
      for (const Field& f : fields) any = any || index.tensors.count(base + f.name) > 0;
      if (!any) continue;  // saved before this parameter had state
      for (const Field& f : fields) {
        const std::string name = base + f.name;
        if (index.tensors.count(name) == 0) {
          if (!f.required) continue;
          throw CheckpointError(Kind::MissingTensor, name, shown_as,
                                shown_as + " lacks '" + name + "', which " + type +
                                    " needs for a parameter whose other state it has");
        }
        Item it;
        it.name = name;
        it.kind = "optim";
        const std::string field = f.name;
        const at::Tensor param = np.param;
        if (field == "step") {
          it.dtype = at::kLong;
          it.local = at::empty({}, at::kLong);
          it.boxes = whole_box({});
          it.layout = "whole";
        } else {
          it.dtype = p.local.scalar_type();
          it.shape = p.shape;
          it.local = p.local;
          it.boxes = p.boxes;
          it.layout = p.layout;
        }
        it.install = [opt, type, field, param](const at::Tensor& values) {
          auto key = optimizer_state_key(*opt, param);
          auto& slot = opt->state()[key];
          if (!slot) slot = new_state(type);
          set_field(*slot, type, field,
                    field == "step" ? values : values.to(param.device(), param.scalar_type()));
        };
        items.push_back(std::move(it));
      }
    }
  }
  add_dtensor_items(state, items);
  std::set<std::string> taken;
  for (const auto& it : items) taken.insert(it.name);
  const std::string mine = "__rank" + std::to_string(rank) + "/";
  for (const auto& [name, t] : index.tensors) {
    std::string value_name;
    bool rank_local = false;
    if (t.kind == "tensor" && taken.count(name) == 0) {
      value_name = name;
    } else if (t.kind == "rank_local" && same_world && name.rfind(mine, 0) == 0) {
      value_name = name.substr(mine.size());
      rank_local = true;
    } else {
      continue;
    }
    Item it;
    it.name = name;
    it.kind = t.kind;
    it.dtype = t.dtype;
    it.shape = t.shape;
    it.local = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
    it.boxes = whole_box(t.shape);
    it.layout = "whole";
    it.install = [&state, value_name, rank_local](const at::Tensor& values) {
      auto& entries = state.mutable_entries();
      auto e = entries.find(value_name);
      if (e != entries.end()) {
        if (auto* old = std::get_if<at::Tensor>(&e->second.value);
            old && old->defined() && old->sizes() == values.sizes() &&
            old->scalar_type() == values.scalar_type()) {
          copy_into(*old, values);
          return;
        }
      }
      entries[value_name] = State::Entry{values, rank_local};
    };
    items.push_back(std::move(it));
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return a.name < b.name; });
  return items;
}

}  // namespace fsdp::dcp::detail
