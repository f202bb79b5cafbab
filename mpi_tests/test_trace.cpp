// Timeline tracing (FSDP_TRACE, fsdp/trace.h): each rank's Chrome-trace file
// is valid JSON, holds the FSDP spans of a small training run, and every
// thread's spans nest. CTest sets FSDP_TRACE (the Runtime reads it at start).
#include "spmd.h"
#include "toy_models.h"

#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>
#include <fsdp/trace.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace {

using nlohmann::json;

struct Event {
  std::string name;
  double ts = 0, dur = 0;
  int64_t tid = 0;
  json args;
  double end() const { return ts + dur; }
  bool contains(const Event& o, double eps = 1e-3) const {
    return o.ts >= ts - eps && o.end() <= end() + eps;
  }
};

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

json read_trace() {
  const std::string path = fsdp::trace::file_path();
  std::ifstream in(path);
  BOOST_TEST_REQUIRE(in.good(), "no trace file " << path);
  json doc;
  BOOST_REQUIRE_NO_THROW(doc = json::parse(in));
  return doc;
}

std::vector<Event> complete_events(const json& doc) {
  std::vector<Event> out;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    out.push_back({e.at("name").get<std::string>(), e.at("ts").get<double>(),
                   e.at("dur").get<double>(), e.at("tid").get<int64_t>(),
                   e.value("args", json::object())});
  }
  return out;
}

std::map<int64_t, std::string> thread_names(const json& doc) {
  std::map<int64_t, std::string> out;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") {
      out[e.at("tid").get<int64_t>()] = e.at("args").at("name").get<std::string>();
    }
  }
  return out;
}

// The events lying inside the (single) span named `window`.
std::vector<Event> inside(const std::vector<Event>& events, const std::string& window) {
  const Event* w = nullptr;
  for (const auto& e : events) {
    if (e.name == window) w = &e;
  }
  BOOST_TEST_REQUIRE(w != nullptr, "no span named '" << window << "'");
  std::vector<Event> out;
  for (const auto& e : events) {
    if (&e != w && w->contains(e)) out.push_back(e);
  }
  return out;
}

std::vector<Event> named(const std::vector<Event>& events, const std::string& name) {
  std::vector<Event> out;
  for (const auto& e : events) {
    if (e.name == name) out.push_back(e);
  }
  return out;
}

size_t count_prefix(const std::vector<Event>& events, const std::string& prefix) {
  return static_cast<size_t>(std::count_if(events.begin(), events.end(), [&](const Event& e) {
    return starts_with(e.name, prefix);
  }));
}

// Checks that holds for the whole file: header, event fields, thread names,
// and that on every thread each span lies inside the enclosing one or starts
// at/after its end.
void check_well_formed(const json& doc, const std::vector<Event>& events) {
  BOOST_TEST(doc.at("displayTimeUnit") == "ms");
  BOOST_TEST(doc.at("otherData").at("rank").get<int>() == spmd::rank());
  BOOST_TEST(doc.at("otherData").at("world_size").get<int>() == spmd::world_size());
  BOOST_TEST(doc.at("otherData").contains("libfsdp_version"));
  for (const auto& e : doc.at("traceEvents")) {
    BOOST_TEST(e.at("pid").get<int>() == spmd::rank());
    if (e.at("ph") != "X") continue;
    BOOST_TEST(e.at("ts").get<double>() >= 0.0, e.dump());
    BOOST_TEST(e.at("dur").get<double>() >= 0.0, e.dump());
    BOOST_TEST(e.at("tid").is_number_integer(), e.dump());
  }
  const auto names = thread_names(doc);
  std::map<int64_t, std::vector<Event>> by_thread;
  for (const auto& e : events) by_thread[e.tid].push_back(e);
  for (auto& [tid, spans] : by_thread) {
    BOOST_TEST(names.count(tid) == 1u, "thread " << tid << " has no thread_name");
    std::sort(spans.begin(), spans.end(), [](const Event& a, const Event& b) {
      return a.ts != b.ts ? a.ts < b.ts : a.dur > b.dur;
    });
    std::vector<const Event*> stack;
    for (const auto& e : spans) {
      while (!stack.empty() && e.ts >= stack.back()->end() - 1e-3) stack.pop_back();
      if (!stack.empty()) {
        const Event& outer = *stack.back();
        BOOST_TEST(outer.contains(e), "on thread " << tid << " '" << e.name << "' [" << e.ts
                                                   << ", " << e.end() << "] overlaps '"
                                                   << outer.name << "' [" << outer.ts << ", "
                                                   << outer.end() << "]");
      }
      stack.push_back(&e);
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(fsdp_training_trace) {  // [ours]
  BOOST_TEST_REQUIRE(fsdp::trace::enabled(), "run with FSDP_TRACE=<dir> (CTest sets it)");
  const int ws = spmd::world_size(), rank = spmd::rank();
  {
    fsdp::trace::Span window("test window fsdp", "test");
    toy::Mlp model(1);
    fsdp::fully_shard(model->fc1);
    fsdp::fully_shard(model->fc2);
    fsdp::Sharded<toy::Mlp> root = fsdp::fully_shard(model);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    const auto batch = toy::slice(toy::global_batch(3, 8), rank, ws);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      toy::mse(root(batch.x), batch.y).backward();
      fsdp::trace::Span span("optimizer step", "optim");
      opt.step();
    }
  }
  fsdp::trace::flush();

  const json doc = read_trace();
  const auto all = complete_events(doc);
  check_well_formed(doc, all);
  const auto events = inside(all, "test window fsdp");
  const auto names = thread_names(doc);

  // Per step: fc1, fc2 and the root each run forward and backward once.
  BOOST_TEST(count_prefix(events, "forward ") == 6u);
  BOOST_TEST(named(events, "forward fc1").size() == 2u);
  BOOST_TEST(named(events, "forward fc2").size() == 2u);
  BOOST_TEST(count_prefix(events, "backward ") == 6u);
  BOOST_TEST(named(events, "backward fc1").size() == 2u);
  BOOST_TEST(named(events, "optimizer step").size() == 2u);
  for (const char* name : {"all-gather issue", "all-gather wait", "reshard", "reduce-scatter",
                           "reduce-scatter wait"}) {
    BOOST_TEST(!named(events, name).empty(), "no '" << name << "' span");
  }
  for (const auto& e : named(events, "all-gather issue")) {
    BOOST_TEST(e.args.value("bytes", int64_t{0}) > 0, e.args.dump());
    BOOST_TEST(e.args.contains("group"), e.args.dump());
    BOOST_TEST(e.args.contains("unit"), e.args.dump());
  }
  // A unit's reduce-scatter is issued inside its backward span.
  for (const auto& rs : named(events, "reduce-scatter")) {
    BOOST_TEST(rs.args.value("bytes", int64_t{0}) > 0, rs.args.dump());
    const bool in_backward = std::any_of(events.begin(), events.end(), [&](const Event& b) {
      return starts_with(b.name, "backward ") && b.tid == rs.tid &&
             b.args.value("unit", int64_t{-1}) == rs.args.value("unit", int64_t{-2}) &&
             b.contains(rs);
    });
    BOOST_TEST(in_backward, "reduce-scatter " << rs.args.dump() << " outside its unit's backward");
  }
  // The window (like everything the test ran) is on the main thread; the
  // collectives themselves ran on a "comm <group>" thread.
  BOOST_TEST(names.at(named(all, "test window fsdp").at(0).tid) == "main");
  for (const char* op : {"all_gather_into_tensor", "reduce_scatter_tensor"}) {
    const auto spans = named(events, op);
    BOOST_TEST(!spans.empty(), "no '" << op << "' span");
    for (const auto& e : spans) {
      BOOST_TEST(e.args.value("bytes", int64_t{0}) > 0, op << " " << e.args.dump());
      BOOST_TEST(e.args.contains("group"), op << " " << e.args.dump());
      BOOST_TEST(starts_with(names.at(e.tid), "comm "), op << " ran on " << names.at(e.tid));
    }
  }
}

// HSDP with a (world, 1) mesh: every rank is a replica, so gradients go
// through a real all-reduce over the replicate dim.
BOOST_AUTO_TEST_CASE(hsdp_trace_has_all_reduce) {  // [ours]
  BOOST_TEST_REQUIRE(fsdp::trace::enabled(), "run with FSDP_TRACE=<dir> (CTest sets it)");
  const int ws = spmd::world_size(), rank = spmd::rank();
  BOOST_TEST_REQUIRE(ws >= 2, "registered at np 2");
  {
    fsdp::trace::Span window("test window hsdp", "test");
    fsdp::FullyShardOptions options;
    options.mesh = fsdp::init_device_mesh("cpu", {ws, 1}, {"replicate", "shard"});
    toy::Mlp model(2);
    fsdp::fully_shard(model->fc1, options);
    fsdp::fully_shard(model->fc2, options);
    fsdp::Sharded<toy::Mlp> root = fsdp::fully_shard(model, options);
    const auto batch = toy::slice(toy::global_batch(5, 8), rank, ws);
    toy::mse(root(batch.x), batch.y).backward();
  }
  fsdp::trace::flush();

  const json doc = read_trace();
  const auto all = complete_events(doc);
  check_well_formed(doc, all);
  const auto events = inside(all, "test window hsdp");
  const auto all_reduce = named(events, "all-reduce");
  BOOST_TEST(all_reduce.size() == 3u);  // one per unit with gradients: fc1, fc2, root (fc3)
  for (const auto& e : all_reduce) {
    BOOST_TEST(e.args.value("bytes", int64_t{0}) > 0, e.args.dump());
    BOOST_TEST(e.args.contains("group"), e.args.dump());
  }
  const auto collectives = named(events, "all_reduce");
  BOOST_TEST(!collectives.empty());
  for (const auto& e : collectives) {
    BOOST_TEST(e.args.value("bytes", int64_t{0}) > 0, e.args.dump());
  }
}

// Memory counters (docs/memory.md#trace-counters): each unit's "memory
// <unit>" counter events, against sizes worked out from the layer shapes:
// Linear(64, 48) holds weight [48, 64] and bias [48], 48 * 65 fp32 values.
BOOST_AUTO_TEST_CASE(memory_counters_trace) {  // [ours] issue #41
  const int64_t ws = spmd::world_size();
  BOOST_TEST_REQUIRE(ws >= 2, "registered at np 2");
  const int64_t full_bytes = 48 * 65 * 4;  // 48 rows split evenly at np 2 and 4
  {
    torch::nn::Sequential seq(torch::nn::Linear(64, 48), torch::nn::ReLU(),
                              torch::nn::Linear(48, 16));
    fsdp::fully_shard(seq->ptr(0));
    auto root = fsdp::fully_shard(seq);
    root(at::ones({4, 64})).sum().backward();
  }
  fsdp::trace::flush();
  const json doc = read_trace();
  std::vector<json> counters;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "C" && e.at("name") == "memory 0") counters.push_back(e);
  }
  BOOST_TEST_REQUIRE(counters.size() >= 3u, "unshard, reshard, reduction");
  std::stable_sort(counters.begin(), counters.end(), [](const json& a, const json& b) {
    return a.at("ts").get<double>() < b.at("ts").get<double>();
  });
  // While unsharded (forward and backward): the full parameters in their
  // dtype; the first counter is the forward's unshard.
  BOOST_TEST(counters.front().at("args").at("unsharded").get<int64_t>() == full_bytes,
             counters.front().dump());
  BOOST_TEST(counters.front().at("args").at("shard").get<int64_t>() == full_bytes / ws);
  bool reduce_seen = false;
  for (const auto& c : counters) reduce_seen = reduce_seen || c.at("args").at("reduce_buffer").get<int64_t>() > 0;
  BOOST_TEST(reduce_seen, "no counter shows the reduce-scatter buffers");
  // At the end: resharded, reduced, the sharded gradient in place.
  const json& last = counters.back().at("args");
  BOOST_TEST(last.at("unsharded").get<int64_t>() == 0, last.dump());
  BOOST_TEST(last.at("reduce_buffer").get<int64_t>() == 0, last.dump());
  BOOST_TEST(last.at("grad").get<int64_t>() == full_bytes / ws, last.dump());
}
