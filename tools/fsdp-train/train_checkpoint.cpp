#include "train_checkpoint.h"

#include "pipelined_decoder.h"

#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <vector>

namespace fsdp_train {

std::string checkpoint_root(const std::string& out) { return out + "/checkpoint"; }

std::shared_ptr<torch::nn::Module> checkpoint_module(const ShardedDecoder& d) {
  if (!d.pipeline) return d.net;
  const Pipeline& p = *d.pipeline;
  if (!p.has_last || !p.stages.back()->tied_copy) return d.net;
  // The last stage's tied copy: never on a rank that holds stage 0 too
  // (stage 0 is pp rank 0's, the last pp rank pp - 1's), so "embed" is free.
  auto view = std::make_shared<torch::nn::Module>("FsdpTrainCheckpoint");
  for (const auto& child : d.net->named_children()) {
    if (child.key() == "embed") {
      throw std::logic_error("fsdp-train: a pipeline rank holds the embedding and its tied copy");
    }
    if (child.key() == "output") {
      auto tied = std::make_shared<torch::nn::Module>("TiedEmbeddingCopy");
      tied->register_parameter("weight", child.value()->named_parameters(false)["weight"]);
      view->register_module("embed", tied);
    } else {
      view->register_module(child.key(), child.value());
    }
  }
  return view;
}

fsdp::dcp::State make_state(const TrainingRun& run, int64_t step) {
  fsdp::dcp::State state;
  state.add_module("model", checkpoint_module(run.sharded))
      .add_optimizer("optim", run.opt, "model")
      .set("step", step)
      .set("numerics", run.numerics.dump())
      .set("layout", layout_json(run.cfg, run.comm.size()).dump());
  return state;
}

namespace {

fsdp::dcp::SaveOptions save_options() {
  fsdp::dcp::SaveOptions options;
  options.keep_last = 2;
  return options;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

Checkpointer::Checkpointer(const TrainingRun& run) : run_(run) {
  if (run.cfg.async_save) {
    async_ = std::make_unique<fsdp::dcp::AsyncSaver>(checkpoint_root(run.cfg.out), save_options());
  }
}

void Checkpointer::save(int64_t step) {
  const auto t0 = Clock::now();
  const fsdp::dcp::State state = make_state(run_, step);
  if (async_) {
    async_->save(state, step);  // first waits for the previous save (and raises its error)
    pending_step_ = step;
    if (run_.lead) {
      std::cout << fmt::format("checkpoint: step {} -> {}/step-{:012d} (snapshot {:.2f}s; written "
                               "in the background)",
                               step, checkpoint_root(run_.cfg.out), step, seconds_since(t0))
                << std::endl;
    }
    return;
  }
  fsdp::dcp::SaveOptions options = save_options();
  options.step = step;
  const fsdp::dcp::SaveReport r = fsdp::dcp::save(checkpoint_root(run_.cfg.out), state, options);
  if (run_.lead) {
    std::cout << fmt::format("checkpoint: step {} -> {} ({:.2f}s, {:.1f} MiB)", step, r.path,
                             seconds_since(t0), mib(r.total_bytes))
              << std::endl;
  }
}

void Checkpointer::finish() {
  if (!async_) return;
  const auto t0 = Clock::now();
  const std::optional<fsdp::dcp::SaveReport> r = async_->wait();
  if (r && run_.lead) {
    std::cout << fmt::format("checkpoint: step {} written to {} ({:.1f} MiB; waited {:.2f}s for "
                             "it at the end)",
                             r->step, r->path, mib(r->total_bytes), seconds_since(t0))
              << std::endl;
  }
  pending_step_ = -1;
}

namespace {

// The newest complete checkpoint's numerics against this run's, before
// anything is loaded (so that a checkpoint of another --layers is refused
// naming the flag rather than as a missing tensor). Rank 0 reads the index
// and tells the others. An index that does not read is left to the load
// (damage: it falls back).
void precheck_numerics(const TrainingRun& run, const std::string& root) {
  std::string refusal;
  if (run.comm.rank() == 0) {
    try {
      const auto all = fsdp::dcp::list_checkpoints(root);
      if (!all.empty()) {
        const fsdp::dcp::Reader reader(all.front());
        const auto it = reader.values().find("numerics");
        if (it != reader.values().end() && std::holds_alternative<std::string>(it->second)) {
          check_same_numerics(nlohmann::json::parse(std::get<std::string>(it->second)),
                              run.numerics, reader.path());
        }
      }
    } catch (const ConfigError& e) {
      refusal = e.what();
    } catch (const std::exception&) {
      // Damaged: the load decides (fallback or CheckpointError).
    }
  }
  refusal = run.comm.broadcast(refusal, 0);
  if (!refusal.empty()) throw ConfigError(refusal);
}

// How many of the checkpoint's model and optimizer tensors some rank read
// in pieces other than the saved ones, and how many it has. Collective.
std::pair<int64_t, int64_t> resharded_count(const TrainingRun& run,
                                            const fsdp::dcp::LoadReport& report) {
  const fsdp::dcp::Reader reader(report.path);
  std::vector<std::string> names;
  for (const auto& t : reader.tensors()) {
    if (t.kind == "param" || t.kind == "buffer" || t.kind == "optim") names.push_back(t.name);
  }
  std::set<std::string> mine;
  // Each line starts with the tensor's name, then a space.
  for (const auto& line : report.resharded) mine.insert(line.substr(0, line.find(' ')));
  std::vector<int64_t> flags(names.size(), 0);
  for (size_t i = 0; i < names.size(); ++i) flags[i] = mine.count(names[i]) > 0 ? 1 : 0;
  const std::vector<int64_t> any = run.comm.sum(flags);
  const auto k = std::count_if(any.begin(), any.end(), [](int64_t n) { return n > 0; });
  return {static_cast<int64_t>(k), static_cast<int64_t>(names.size())};
}

}  // namespace

Resumed resume(const TrainingRun& run) {
  const std::string root = checkpoint_root(run.cfg.out);
  precheck_numerics(run, root);
  fsdp::dcp::State state = make_state(run, 0);
  const fsdp::dcp::LoadReport report = fsdp::dcp::load(root, state);
  // The checkpoint loaded may be an older one than the prechecked (fallback).
  check_same_numerics(nlohmann::json::parse(state.get_string("numerics")), run.numerics,
                      report.path);
  const nlohmann::json saved_layout = nlohmann::json::parse(state.get_string("layout"));
  const nlohmann::json layout = layout_json(run.cfg, run.comm.size());
  const auto [k, t] = resharded_count(run, report);
  Resumed r;
  r.start = state.get_int("step");
  r.from = report.path;
  if (r.start != report.step) {
    throw ConfigError(fmt::format("--resume: {} holds step {} but is named for step {}",
                                  report.path, r.start, report.step));
  }
  r.line = fmt::format(
      "fsdp-train: resumed from {} at step {}, saved by {} ranks ({}), now {} ranks ({}); "
      "resharded {} of {} tensors",
      report.path, r.start, report.saved_world_size, layout_string(saved_layout),
      run.comm.size(), layout_string(layout), k, t);
  if (!report.fallback_note.empty()) {
    r.fallback = "fsdp-train: fallback: " + report.fallback_note;
  }
  return r;
}

}  // namespace fsdp_train
