// fsdp-bench checkpoint: distributed-checkpoint throughput against the
// disk, and the training step's stall under an asynchronous save.
//
//   mpiexec -n 2 fsdp-bench checkpoint --dir /tmp/ckpt-bench --params 64M
//
// Per rank, in one run on the same file system:
//  - dd write: `dd if=/dev/zero bs=4M conv=fdatasync` of as many bytes as
//    this rank's share of the checkpoint, every rank at once (the disk's
//    sequential write bandwidth under the same concurrency);
//  - save: fsdp::dcp::save of an FSDP-sharded MLP with its AdamW state
//    (fsync on), bytes this rank wrote / wall time of the whole save;
//  - dd read / load: the same files read back (page cache dropped first
//    where the kernel lets us: said in the output), load into the same
//    layout;
//  - step / step + async save: the median training step without saving and
//    with AsyncSaver::save() called in it; the stall is their difference,
//    against the host copy time of this rank's pieces (a plain memcpy of
//    the same bytes);
//  - peak memory: the snapshot's host bytes and VmHWM before and after.
#include "harness.h"

#include <fsdp/distributed_checkpoint.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

namespace fsdp_bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string dir = "/tmp/fsdp-bench-checkpoint";
  int64_t params = int64_t{64} << 20;  // bytes of fp32 parameters in all
  int64_t width = 1024;
  int steps = 6;
  std::string json_path;
};

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

// Drops the page cache (root only; harmless elsewhere). True if it worked.
bool drop_caches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  f.flush();
  return static_cast<bool>(f);
}

int64_t vm_hwm_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// Runs `dd`, every rank at once; returns this rank's seconds.
double run_dd(const std::string& args) {
  barrier();
  const auto t = Clock::now();
  const std::string cmd = "dd " + args + " status=none";
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("fsdp-bench checkpoint: `" + cmd + "` failed");
  const double s = since(t);
  barrier();
  return s;
}

struct Model {
  torch::nn::Sequential net{nullptr};
  std::optional<fsdp::Sharded<torch::nn::Sequential>> sharded;
  std::unique_ptr<torch::optim::AdamW> opt;
};

Model build(const Options& o, const fsdp::Runtime& rt) {
  const int64_t per_layer = o.width * o.width * 4;
  const int64_t layers = std::max<int64_t>(1, o.params / per_layer);
  Model m;
  at::manual_seed(0);
  m.net = torch::nn::Sequential();
  for (int64_t i = 0; i < layers; ++i) m.net->push_back(torch::nn::Linear(o.width, o.width));
  fsdp::FullyShardOptions f;
  f.mesh = fsdp::init_device_mesh(rt.device().type(), {rt.world_size()});
  for (auto& child : m.net->children()) fsdp::fully_shard(child, f);
  fsdp::fully_shard(m.net.ptr(), f);
  m.sharded.emplace(m.net);
  m.opt = std::make_unique<torch::optim::AdamW>(m.net->parameters(), torch::optim::AdamWOptions(1e-4));
  return m;
}

double train_step(Model& m, int64_t width) {
  const auto t = Clock::now();
  m.opt->zero_grad();
  at::Tensor x = at::randn({4, width});
  (*m.sharded)(x).pow(2).mean().backward();
  m.opt->step();
  return since(t);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run(const Options& o, const fsdp::Runtime& rt) {
  const int rank = rt.world_rank();
  Report report("checkpoint",
                {{"op", "operation", "", 22, -1, ""},
                 {"bytes", "bytes/rank", "", 12, -1, ""},
                 {"seconds", "time", "(s)", 10, 4, ""},
                 {"mb_per_s", "MB/s", "per rank", 10, 1, ""},
                 {"vs_disk", "vs dd", "", 8, 2, ""}},
                o.json_path, rank == 0);
  add_runtime_meta(report, rt);
  if (rank == 0) std::filesystem::remove_all(o.dir);
  barrier();
  std::filesystem::create_directories(o.dir);
  Model m = build(o, rt);
  train_step(m, o.width);  // AdamW state exists from here
  fsdp::dcp::State state;
  state.add_module("model", m.net.ptr()).add_optimizer("optim", *m.opt, "model");
  report.meta("dir", o.dir, "dir " + o.dir);
  report.meta("params_bytes", o.params, "fp32 parameters " + format_size(o.params) +
                                            " in all (+ AdamW exp_avg, exp_avg_sq)");

  // Save (synchronous, fsync on), then the disk with dd for the same bytes.
  const int64_t hwm_before = vm_hwm_bytes();
  fsdp::dcp::SaveOptions so;
  so.step = 1;
  barrier();
  auto t = Clock::now();
  const fsdp::dcp::SaveReport saved = fsdp::dcp::save(o.dir + "/ckpt", state, so);
  const double save_s = since(t);
  const int64_t hwm_after = vm_hwm_bytes();
  const int64_t mine = saved.bytes_written;
  const int64_t blocks = std::max<int64_t>(1, mine / (4 << 20));
  const std::string dd_file = o.dir + "/dd-rank" + std::to_string(rank);
  const double dd_write_s =
      run_dd("if=/dev/zero of=" + dd_file + " bs=4M count=" + std::to_string(blocks) + " conv=fdatasync");
  const int64_t dd_bytes = blocks * (int64_t{4} << 20);
  const bool dropped = drop_caches();
  const double dd_read_s = run_dd("if=" + dd_file + " of=/dev/null bs=4M");
  drop_caches();
  Model fresh = build(o, rt);
  train_step(fresh, o.width);
  fsdp::dcp::State into;
  into.add_module("model", fresh.net.ptr()).add_optimizer("optim", *fresh.opt, "model");
  barrier();
  t = Clock::now();
  const fsdp::dcp::LoadReport loaded = fsdp::dcp::load(o.dir + "/ckpt", into);
  const double load_s = since(t);

  // Worst rank decides: a collective save is as slow as its slowest rank.
  auto worst = max_over_ranks(MPI_COMM_WORLD, std::vector<double>{save_s, dd_write_s, dd_read_s, load_s});
  const double w_save = static_cast<double>(mine) / worst[0] / 1e6;
  const double w_dd = static_cast<double>(dd_bytes) / worst[1] / 1e6;
  const double r_dd = static_cast<double>(dd_bytes) / worst[2] / 1e6;
  const double r_load = static_cast<double>(loaded.bytes_read) / worst[3] / 1e6;
  report.row({std::string("dd write (fdatasync)"), dd_bytes, worst[1], w_dd, 1.0});
  report.row({std::string("save (fsync)"), mine, worst[0], w_save, w_save / w_dd});
  report.row({std::string("dd read"), dd_bytes, worst[2], r_dd, 1.0});
  report.row({std::string("load"), loaded.bytes_read, worst[3], r_load, r_load / r_dd});

  // The step's stall under an asynchronous save, against a plain copy of
  // the same bytes.
  std::vector<at::Tensor> pieces;
  for (const auto& p : m.net->parameters()) pieces.push_back(p);
  std::vector<double> copy_s, plain_s, call_s, during_s;
  // The baseline: copying the same bytes into buffers allocated beforehand
  // (the snapshot reuses its buffers from the second save on).
  std::vector<at::Tensor> copies;
  for (const auto& p : pieces) {
    for (int k = 0; k < 3; ++k) copies.push_back(at::empty_like(p));  // param, exp_avg, exp_avg_sq
  }
  for (int i = 0; i < o.steps; ++i) {
    t = Clock::now();
    for (size_t j = 0; j < copies.size(); ++j) copies[j].copy_(pieces[j / 3]);
    copy_s.push_back(since(t));
  }
  for (int i = 0; i < o.steps; ++i) plain_s.push_back(train_step(m, o.width));
  {
    fsdp::dcp::AsyncSaver saver(o.dir + "/async");
    for (int i = 0; i < o.steps; ++i) {
      saver.wait();  // the previous save is done: time the call alone
      barrier();
      t = Clock::now();
      saver.save(state, 100 + i);
      call_s.push_back(since(t));
      during_s.push_back(train_step(m, o.width));  // while the write goes on
    }
    saver.wait();
  }
  const auto medians = max_over_ranks(
      MPI_COMM_WORLD, std::vector<double>{median(plain_s), median(call_s), median(copy_s),
                                          median(during_s)});
  const double stall = medians[1];
  report.row({std::string("step"), int64_t{0}, medians[0], 0.0, 0.0});
  report.row({std::string("async save() call"), mine, medians[1], 0.0, 0.0});
  report.row({std::string("step during write"), int64_t{0}, medians[3], 0.0, 0.0});
  report.summary("stall_seconds", stall,
                 fmt::format("async save stall: {:.4f} s per save() call (snapshot); a host copy "
                             "of this rank's {} takes {:.4f} s: stall / copy = {:.2f}; the step "
                             "takes {:.4f} s, {:.4f} s while the background write runs",
                             stall, format_size(mine), medians[2], stall / medians[2], medians[0],
                             medians[3]));
  report.summary("save_vs_dd", w_save / w_dd,
                 fmt::format("save {:.1f} MB/s per rank vs dd {:.1f} MB/s: {:.2f}x; load {:.1f} "
                             "MB/s vs dd {:.1f} MB/s: {:.2f}x{}",
                             w_save, w_dd, w_save / w_dd, r_load, r_dd, r_load / r_dd,
                             dropped ? " (page cache dropped before reads)"
                                     : " (page cache NOT dropped: reads may come from memory)"));
  const auto mem = max_over_ranks(MPI_COMM_WORLD,
                     std::vector<int64_t>{saved.peak_snapshot_bytes, hwm_before, hwm_after});
  report.summary("snapshot_bytes", mem[0],
                 fmt::format("save peak memory: snapshot {} per rank (max); VmHWM {} before, {} "
                             "after the save",
                             format_size(mem[0]), format_size(mem[1]), format_size(mem[2])));
  report.finish();
  if (rank == 0) std::filesystem::remove_all(o.dir);
  return 0;
}

}  // namespace

void add_checkpoint_command(CLI::App& app, Command& chosen) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "checkpoint",
      "Distributed-checkpoint save/load throughput per rank against dd on the same file system, "
      "and the training step's stall under an asynchronous save. Run under mpiexec.");
  sub->add_option("--dir", o->dir, "Scratch directory (removed before and after)")
      ->capture_default_str();
  sub->add_option("--params", o->params, "fp32 parameter bytes in all (K, M, G suffixes)")
      ->transform(size_argument())
      ->default_str("64M");
  sub->add_option("--width", o->width, "Linear layer width")
      ->check(CLI::Range(int64_t{16}, int64_t{16384}))
      ->capture_default_str();
  sub->add_option("--steps", o->steps, "Timed training steps with and without saving")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  add_json_option(sub, o->json_path);
  sub->callback([o, &chosen] { chosen = [o](const fsdp::Runtime& rt) { return run(*o, rt); }; });
}

}  // namespace fsdp_bench
