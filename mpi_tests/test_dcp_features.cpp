// Distributed checkpoints beyond the matrix [ours]: asynchronous save while
// training goes on, keep_last, every supported optimizer, values of every
// type, byte-range reads, mismatches that must be errors (and leave the
// model untouched), damage that must fall back or fail on every rank, and
// arguments that save refuses. np 1, 2, 4 (label dcp).
#include "dcp_util.h"

#include <fsdp/errors.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <fsdp_h5/testing.h>

#include <fstream>
#include <limits>

namespace {

using fsdp::dcp::CheckpointError;
using Kind = CheckpointError::Kind;

std::string scratch(const std::string& name) {
  return dcpt::fresh_dir(dcpt::matrix_root() + "-features/" + name + "-np" +
                         std::to_string(spmd::world_size()));
}

void barrier() {
  at::Tensor t = at::zeros({1});
  fsdp::world_group()->all_reduce(t)->wait();
}

std::map<std::string, at::Tensor> snapshot(dcpt::Built& b) { return dcpt::global_tensors(b); }

void expect_same(const std::map<std::string, at::Tensor>& a,
                 const std::map<std::string, at::Tensor>& b, const std::string& what) {
  BOOST_TEST(a.size() == b.size(), what << ": " << a.size() << " vs " << b.size() << " tensors");
  for (const auto& [n, t] : a) {
    auto it = b.find(n);
    if (it == b.end()) {
      BOOST_ERROR(what << ": " << n << " missing");
      continue;
    }
    BOOST_TEST(at::equal(t, it->second), what << ": " << n << " differs");
  }
}

// The checkpoint error `fn` must raise on every rank, with the kind and the
// words given.
template <typename Fn>
void expect_checkpoint_error(Fn fn, Kind kind, const std::vector<std::string>& words) {
  try {
    fn();
    BOOST_ERROR("no CheckpointError (" << fsdp::dcp::to_string(kind) << ")");
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    BOOST_TEST(fsdp::dcp::to_string(e.kind()) == fsdp::dcp::to_string(kind), msg);
    for (const auto& w : words) BOOST_TEST(msg.find(w) != std::string::npos, "'" << w << "' not in: " << msg);
  }
}

// The rank file and dataset holding `tensor`'s first piece.
std::pair<std::string, std::string> first_piece(const std::string& dir, const std::string& tensor) {
  fsdp::dcp::Reader r(dir);
  const auto& c = r.tensor(tensor).chunks.at(0);
  return {r.path() + "/" + c.file, c.dataset};
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_async_save_while_training) {  // [ours]
  const std::string dir = scratch("async");
  dcpt::Built b = dcpt::build("fsdp");
  auto state = dcpt::state_of(b);
  fsdp::dcp::SaveOptions defaults;
  defaults.keep_last = 2;
  fsdp::dcp::AsyncSaver saver(dir, defaults);
  std::map<int64_t, std::map<std::string, at::Tensor>> at_step;
  for (int64_t s = 0; s < 4; ++s) {
    dcpt::train_step(b, s);  // trains while the previous save is written
    at_step[s + 1] = snapshot(b);
    state.set("step", s + 1);
    saver.save(state, s + 1);
  }
  // The model moves on while the last save is in flight.
  dcpt::train_step(b, 4);
  const auto report = saver.wait();
  BOOST_REQUIRE(report.has_value());
  BOOST_TEST(report->step == 4);
  BOOST_TEST(!saver.wait().has_value());  // nothing in flight any more
  barrier();
  const auto kept = fsdp::dcp::list_checkpoints(dir);
  BOOST_REQUIRE(kept.size() == 2u);  // keep_last
  BOOST_TEST(kept[0] == dir + "/step-000000000004");
  BOOST_TEST(kept[1] == dir + "/step-000000000003");
  for (int64_t step : {3, 4}) {
    dcpt::Built fresh = dcpt::build("fsdp", 77);
    auto st = dcpt::state_of(fresh);
    st.set("step", int64_t{0});
    fsdp::dcp::LoadOptions lo;
    lo.step = step;
    fsdp::dcp::load(dir, st, lo);
    BOOST_TEST(st.get_int("step") == step);
    // What the snapshot held, not what training made of it afterwards.
    expect_same(snapshot(fresh), at_step[step], "step " + std::to_string(step));
  }
}

BOOST_AUTO_TEST_CASE(test_every_optimizer_reshards) {  // [ours]
  using namespace torch::optim;
  const std::string dir = scratch("optimizers");
  struct Make {
    std::string name;
    std::function<std::unique_ptr<Optimizer>(std::vector<at::Tensor>)> make;
    std::vector<std::string> fields;
  };
  const std::vector<Make> makes = {
      {"SGD", [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.1).momentum(0.9)); },
       {"momentum_buffer"}},
      {"Adagrad", [](auto p) { return std::make_unique<Adagrad>(p, AdagradOptions(0.1)); },
       {"step", "sum"}},
      {"Adam", [](auto p) { return std::make_unique<Adam>(p, AdamOptions(0.01).amsgrad(true)); },
       {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {"RMSprop",
       [](auto p) {
         return std::make_unique<RMSprop>(p, RMSpropOptions(0.01).momentum(0.5).centered(true));
       },
       {"step", "square_avg", "momentum_buffer", "grad_avg"}},
  };
  for (const auto& m : makes) {
    BOOST_TEST_CONTEXT(m.name) {
      const std::string sub = dcpt::fresh_dir(dir + "/" + m.name);
      dcpt::Built src = dcpt::build("fsdp");
      src.opt.reset();
      auto opt = m.make(src.net->parameters());
      for (int64_t s = 0; s < 2; ++s) {
        opt->zero_grad();
        at::manual_seed(s);
        const int64_t per = dcpt::kBatch / src.dp_size;
        at::Tensor x = at::randn({dcpt::kBatch, dcpt::kIn}).narrow(0, src.dp_rank * per, per);
        src.forward(x).pow(2).mean().backward();
        auto& g = src.net->offset.mutable_grad();
        fsdp::world_group()->all_reduce(g, fsdp::ReduceOp::AVG)->wait();
        opt->step();
      }
      fsdp::dcp::State st;
      st.add_module("model", src.net.ptr()).add_optimizer("optim", *opt, "model");
      fsdp::dcp::save(sub, st);
      fsdp::dcp::Reader reader(sub);
      for (const auto& f : m.fields) {
        BOOST_TEST(reader.tensor("optim/fc1.weight/" + f).shape.size() ==
                   (f == "step" ? 0u : 2u));
      }
      // Into the plain layout: every state tensor equals the sharded one
      // gathered (a full run of the plain model keeps the same numbers).
      dcpt::Built dst = dcpt::build("plain", 77);
      auto opt2 = m.make(dst.net->parameters());
      fsdp::dcp::State st2;
      st2.add_module("model", dst.net.ptr()).add_optimizer("optim", *opt2, "model");
      fsdp::dcp::load(sub, st2);
      for (const auto& f : m.fields) {
        if (f == "step") continue;
        const at::Tensor saved = reader.read("optim/fc1.weight/" + f);
        // The loaded state of the plain fc1.weight, found by its key.
        auto it = opt2->state().find(fsdp::optimizer_state_key(*opt2, dst.net->fc1->named_parameters()["weight"]));
        BOOST_REQUIRE(it != opt2->state().end());
        at::Tensor loaded;
        if (m.name == "SGD") loaded = static_cast<SGDParamState&>(*it->second).momentum_buffer();
        if (m.name == "Adagrad") loaded = static_cast<AdagradParamState&>(*it->second).sum();
        if (m.name == "Adam") {
          auto& a = static_cast<AdamParamState&>(*it->second);
          loaded = f == "exp_avg" ? a.exp_avg() : f == "exp_avg_sq" ? a.exp_avg_sq() : a.max_exp_avg_sq();
        }
        if (m.name == "RMSprop") {
          auto& r = static_cast<RMSpropParamState&>(*it->second);
          loaded = f == "square_avg" ? r.square_avg()
                   : f == "momentum_buffer" ? r.momentum_buffer() : r.grad_avg();
        }
        BOOST_TEST(at::equal(loaded.cpu(), saved), f);
        // And the saved tensor is the sharded state gathered by DTensor.
        auto lay = dcpt::layouts_of(src).at("fc1.weight");
        BOOST_REQUIRE(lay.has_value());
      }
      // An optimizer of another type is refused, naming both.
      dcpt::Built other = dcpt::build("plain", 77);
      const auto before = snapshot(other);
      fsdp::dcp::State st3;
      st3.add_module("model", other.net.ptr()).add_optimizer("optim", *other.opt, "model");
      expect_checkpoint_error([&] { fsdp::dcp::load(sub, st3); }, Kind::OptimizerMismatch,
                              {m.name, "AdamW", "optim"});
      expect_same(snapshot(other), before, "after a refused load");
    }
  }
}

BOOST_AUTO_TEST_CASE(test_values_of_every_type) {  // [ours]
  const std::string dir = scratch("values");
  const double nan = std::numeric_limits<double>::quiet_NaN();
  fsdp::dcp::State st;
  at::manual_seed(3);
  const at::Tensor bf = at::randn({3, 5}).to(at::kBFloat16);
  const at::Tensor half = at::randn({7}).to(at::kHalf);
  const at::Tensor flags = at::rand({4}) > 0.5;
  st.set("i", int64_t{-42})
      .set("d", -0.0)
      .set("nan", nan)
      .set("s", std::string("tokens.bin @ 12345"))
      .set("bf16", bf)
      .set("half", half)
      .set("flags", flags)
      .set("zero_d", at::scalar_tensor(2.5, at::kDouble))
      .set_rank_local("cursor", int64_t{100 + spmd::rank()})
      .set_rank_local("rng", at::full({2}, spmd::rank(), at::kLong));
  if (spmd::rank() == 0) st.set_rank_local("only_rank0", std::string("mine"));
  fsdp::dcp::save(dir, st);
  fsdp::dcp::State back;
  back.set("i", int64_t{0}).set("bf16", at::zeros({3, 5}, at::kBFloat16));
  const at::Tensor into = back.get_tensor("bf16");
  fsdp::dcp::load(dir, back);
  BOOST_TEST(back.get_int("i") == -42);
  BOOST_TEST(std::signbit(back.get_double("d")));
  BOOST_TEST(std::isnan(back.get_double("nan")));
  BOOST_TEST(back.get_string("s") == "tokens.bin @ 12345");
  BOOST_TEST(at::equal(back.get_tensor("bf16"), bf));
  BOOST_TEST(at::equal(into, bf));  // loaded into the tensor the state held
  BOOST_TEST(at::equal(back.get_tensor("half"), half));
  BOOST_TEST(at::equal(back.get_tensor("flags"), flags));
  BOOST_TEST(back.get_tensor("zero_d").dim() == 0);
  BOOST_TEST(back.get_tensor("zero_d").item<double>() == 2.5);
  BOOST_TEST(back.get_int("cursor") == 100 + spmd::rank());
  BOOST_TEST(at::equal(back.get_tensor("rng"), at::full({2}, spmd::rank(), at::kLong)));
  // A rank-local value only rank 0 set: the others get none.
  BOOST_TEST(back.has("only_rank0") == (spmd::rank() == 0));
  if (spmd::rank() == 0) BOOST_TEST(back.get_string("only_rank0") == "mine");
  // Values that differ between ranks are refused (they are per rank).
  if (spmd::world_size() > 1) {
    fsdp::dcp::State bad;
    bad.set("seed", int64_t{spmd::rank()});
    try {
      fsdp::dcp::save(dir, bad);
      BOOST_ERROR("differing set() values were saved");
    } catch (const fsdp::ArgumentError& e) {
      BOOST_TEST(e.argument() == "state");
      BOOST_TEST(std::string(e.what()).find("set_rank_local") != std::string::npos, e.what());
    }
  }
}

BOOST_AUTO_TEST_CASE(test_reads_only_its_byte_ranges) {  // [ours]
  const std::string dir = scratch("ranges");
  dcpt::Built b = dcpt::build("fsdp");
  dcpt::train_step(b, 0);
  auto st = dcpt::state_of(b);
  const auto saved = fsdp::dcp::save(dir, st);
  dcpt::Built fresh = dcpt::build("fsdp", 77);
  auto st2 = dcpt::state_of(fresh);
  const auto r = fsdp::dcp::load(dir, st2);
  // What this rank's layout holds: the local shards of parameters, their
  // AdamW state and the table, the whole buffer and ignored parameter, one
  // int64 step per parameter with state.
  int64_t expect = fresh.table.to_local().numel() * 4;
  for (const auto& [name, lay] : dcpt::layouts_of(fresh)) {
    const at::Tensor param = fresh.net->named_parameters()[name];
    const int64_t n = lay ? lay->to_local().numel() : param.numel();
    expect += n * 4;
    // exp_avg, exp_avg_sq and step where the saved model had AdamW state
    // (the experts, never used in forward, have none).
    if (b.opt->state().count(fsdp::optimizer_state_key(*b.opt, b.net->named_parameters()[name]))) {
      expect += n * 4 * 2 + 8;
    }
  }
  expect += fresh.net->scale.numel() * 4;
  BOOST_TEST(r.bytes_read == expect);
  if (spmd::world_size() > 1) BOOST_TEST(r.bytes_read < saved.total_bytes);
  BOOST_TEST(r.resharded.empty());  // the same layout: every piece read whole
}

BOOST_AUTO_TEST_CASE(test_mismatches_are_errors) {  // [ours]
  const std::string dir = scratch("mismatch");
  {
    dcpt::Built b = dcpt::build("fsdp");
    auto st = dcpt::state_of(b);
    st.set("step", int64_t{1});
    fsdp::dcp::save(dir, st);
  }
  auto expect_untouched = [&](dcpt::Built& b, fsdp::dcp::State& st, Kind kind,
                              const std::vector<std::string>& words) {
    const auto before = snapshot(b);
    expect_checkpoint_error([&] { fsdp::dcp::load(dir, st); }, kind, words);
    expect_same(snapshot(b), before, "after a refused load");
  };
  {  // another shape: fc1 built 12 -> 16, the state's table [16, 4] kept
    dcpt::Built b = dcpt::build("plain", 77);
    torch::nn::Linear wider(dcpt::kIn, 20);
    b.net->fc1 = b.net->replace_module("fc1", wider.ptr());
    fsdp::dcp::State st;  // the optimizer still holds the replaced fc1
    st.add_module("model", b.net.ptr());
    expect_untouched(b, st, Kind::ShapeMismatch, {"model/fc1.bias", "[16]", "[20]"});
  }
  {  // a tensor the checkpoint lacks
    dcpt::Built b = dcpt::build("plain", 77);
    b.net->register_parameter("extra", at::zeros({3}));
    auto st = dcpt::state_of(b);
    expect_untouched(b, st, Kind::MissingTensor, {"model/extra"});
  }
  {  // another dtype
    dcpt::Built b = dcpt::build("plain", 77);
    b.net->to(at::kDouble);
    fsdp::dcp::State st;
    st.add_module("model", b.net.ptr());
    expect_untouched(b, st, Kind::DtypeMismatch, {"float64", "float32"});
  }
  {  // another model altogether
    torch::nn::Linear other(3, 3);
    fsdp::dcp::State st;
    st.add_module("model", other.ptr());
    expect_checkpoint_error([&] { fsdp::dcp::load(dir, st); }, Kind::OtherModel,
                            {"another model"});
  }
  {  // a value the checkpoint does not have
    dcpt::Built b = dcpt::build("plain", 77);
    auto st = dcpt::state_of(b);
    st.set("epoch", int64_t{0});
    expect_untouched(b, st, Kind::MissingTensor, {"epoch"});
  }
  {  // not a checkpoint
    fsdp::dcp::State st;
    expect_checkpoint_error([&] { fsdp::dcp::load(dir + "/nothing-here", st); }, Kind::NotFound,
                            {"nothing-here"});
  }
}

BOOST_AUTO_TEST_CASE(test_damage_falls_back_or_fails_everywhere) {  // [ours]
  const std::string dir = scratch("damage");
  dcpt::Built b = dcpt::build("fsdp");
  auto st = dcpt::state_of(b);
  fsdp::dcp::SaveOptions o;
  o.keep_last = 3;
  std::map<int64_t, std::map<std::string, at::Tensor>> at_step;
  for (int64_t s = 1; s <= 2; ++s) {
    dcpt::train_step(b, s);
    at_step[s] = snapshot(b);
    st.set("step", s);
    o.step = s;
    fsdp::dcp::save(dir, st, o);
  }
  const std::string newest = dir + "/step-000000000002";
  const std::string backup = dir + "-pristine";
  if (spmd::rank() == 0) {
    std::filesystem::remove_all(backup);
    std::filesystem::copy(newest, backup);
  }
  auto restore = [&] {
    barrier();
    if (spmd::rank() == 0) {
      std::filesystem::remove_all(newest);
      std::filesystem::copy(backup, newest);
    }
    barrier();
  };
  // Each damage: with fallback, step 1 is loaded and the note says why;
  // without, every rank raises the same typed error naming the file.
  struct Damage {
    std::string what;
    std::function<void()> apply;
    Kind kind;
    std::vector<std::string> words;
  };
  const auto piece = first_piece(newest, "model/fc1.weight");
  const std::string file = piece.first.substr(piece.first.rfind('/') + 1);
  const std::vector<Damage> damages = {
      {"a flipped byte in a data block",
       [&] { fsdp_h5::testing::flip_chunk_byte(piece.first, piece.second); }, Kind::Corrupt,
       {"model/fc1.weight", file, "checksum"}},
      {"a truncated rank file",
       [&] { std::filesystem::resize_file(piece.first, std::filesystem::file_size(piece.first) / 2); },
       Kind::Corrupt, {file, "truncated"}},
      {"a missing rank file", [&] { std::filesystem::remove(piece.first); }, Kind::Incomplete,
       {file, "missing"}},
      {"an edited index",
       [&] {
         std::ifstream in(newest + "/index.json");
         std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
         const auto at = text.find("\"step\": 2");
         BOOST_REQUIRE(at != std::string::npos);
         text.replace(at, 9, "\"step\": 9");
         std::ofstream(newest + "/index.json", std::ios::trunc) << text;
       },
       Kind::Corrupt, {"index.json", "checksum"}},
  };
  for (const auto& d : damages) {
    BOOST_TEST_CONTEXT(d.what) {
      restore();
      if (spmd::rank() == 0) d.apply();
      barrier();
      dcpt::Built fresh = dcpt::build("fsdp", 77);
      auto s2 = dcpt::state_of(fresh);
      s2.set("step", int64_t{0});
      const auto before = snapshot(fresh);
      fsdp::dcp::LoadOptions strict;
      strict.fallback = false;
      expect_checkpoint_error([&] { fsdp::dcp::load(dir, s2, strict); }, d.kind, d.words);
      expect_same(snapshot(fresh), before, "after a refused load");
      const auto r = fsdp::dcp::load(dir, s2);
      BOOST_TEST(r.step == 1);
      BOOST_TEST(s2.get_int("step") == 1);
      BOOST_TEST(r.fallback_note.find("step-000000000002") != std::string::npos, r.fallback_note);
      expect_same(snapshot(fresh), at_step[1], "fallback to step 1");
    }
  }
  restore();
}

BOOST_AUTO_TEST_CASE(test_save_refuses_bad_arguments) {  // [ours]
  const std::string dir = scratch("refusals");
  auto expect_arg = [](const std::function<void()>& fn, const std::string& argument,
                       const std::string& word) {
    try {
      fn();
      BOOST_ERROR("no ArgumentError naming " << argument);
    } catch (const fsdp::ArgumentError& e) {
      BOOST_TEST(e.argument() == argument, e.what());
      BOOST_TEST(std::string(e.what()).find(word) != std::string::npos, e.what());
    }
  };
  fsdp::dcp::State st;
  expect_arg([&] { st.set("", int64_t{1}); }, "name", "accepted");
  expect_arg([&] { st.set("a//b", int64_t{1}); }, "name", "accepted");
  expect_arg([&] { st.set("__rank0/x", int64_t{1}); }, "name", "__");
  expect_arg([&] { st.set("sp ace", int64_t{1}); }, "name", "A-Za-z0-9");
  torch::nn::Linear lin(2, 2);
  st.add_module("m", lin.ptr());
  expect_arg([&] { st.add_module("m", lin.ptr()); }, "prefix", "taken");
  torch::optim::LBFGS lbfgs(lin->parameters());
  expect_arg([&] { st.add_optimizer("o", lbfgs, "m"); }, "optimizer", "AdamW, Adam, SGD");
  torch::optim::SGD sgd(lin->parameters(), 0.1);
  expect_arg([&] { st.add_optimizer("o", sgd, "nope"); }, "module_prefix", "nope");
  fsdp::dcp::SaveOptions o;
  o.keep_last = 0;
  expect_arg([&] { fsdp::dcp::save(dir, st, o); }, "keep_last", ">= 1");
  // A partial value has no single global tensor to save.
  auto mesh = fsdp::init_device_mesh(spmd::device().type(), {spmd::world_size()});
  fsdp::dcp::State partial;
  partial.add_dtensor("p", fsdp::DTensor::from_local(at::ones({2}), mesh,
                                                     {fsdp::Placement::Partial()}, {{2}}));
  expect_arg([&] { fsdp::dcp::save(dir, partial); }, "state", "Partial");
  // A unit holding full parameters.
  dcpt::Built b = dcpt::build("fsdp");
  auto unit = fsdp::fsdp_module_of(*b.net->fc1);
  BOOST_REQUIRE(unit.has_value());
  unit->unshard();
  auto sb = dcpt::state_of(b);
  try {
    fsdp::dcp::save(dir, sb);
    BOOST_ERROR("saved a unit holding full parameters");
  } catch (const fsdp::StateError& e) {
    BOOST_TEST(std::string(e.what()).find("reshard()") != std::string::npos, e.what());
  }
  unit->reshard();
  BOOST_CHECK_NO_THROW(fsdp::dcp::save(dir, sb));
}

BOOST_AUTO_TEST_CASE(test_non_finite_state_is_damage) {  // [ours]
  const std::string dir = scratch("nonfinite");
  dcpt::Built b = dcpt::build("fsdp");
  dcpt::train_step(b, 0);
  auto st = dcpt::state_of(b);
  fsdp::dcp::SaveOptions o;
  o.step = 1;
  fsdp::dcp::save(dir, st, o);
  const auto good = snapshot(b);
  // A diverged step: a NaN in fc2.weight's shard on rank 0 and an infinity
  // in an optimizer state, saved by a correct save (checksums and all).
  if (spmd::rank() == 0) {
    at::NoGradGuard ng;
    auto lay = dcpt::layouts_of(b).at("fc2.weight");
    lay->to_local().view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  }
  o.step = 2;
  fsdp::dcp::save(dir, st, o);
  dcpt::Built fresh = dcpt::build("fsdp", 77);
  auto s2 = dcpt::state_of(fresh);
  fsdp::dcp::LoadOptions strict;
  strict.fallback = false;
  expect_checkpoint_error([&] { fsdp::dcp::load(dir, s2, strict); }, Kind::Corrupt,
                          {"model/fc2.weight", "non-finite"});
  const auto r = fsdp::dcp::load(dir, s2);  // falls back to step 1
  BOOST_TEST(r.step == 1);
  BOOST_TEST(r.fallback_note.find("non-finite") != std::string::npos, r.fallback_note);
  expect_same(snapshot(fresh), good, "fallback past the NaN");
  // Asked for, the NaN loads.
  fsdp::dcp::LoadOptions as_is;
  as_is.check_finite = false;
  as_is.step = 2;
  fsdp::dcp::load(dir, s2, as_is);
  BOOST_TEST(at::isnan(snapshot(fresh).at("model/fc2.weight")).any().item<bool>());
}
