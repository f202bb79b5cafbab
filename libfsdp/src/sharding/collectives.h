// Internal: what a parameter group's collectives share (PyTorch keeps the
// collective work in _fsdp_collectives.py): the route through a custom
// collective (fsdp/comm_hooks.h) and the buffers it allocates, and the
// all-gather extensions' byte all-gather. The reduction side is
// gradient_reduction.h; ParamGroup (param_group.h) owns both and decides
// when they run. The rule: docs/architecture.md#collective-order.
#pragma once

#include "fsdp/process_group.h"
#include "fsdp/comm_hooks.h"
#include "sharding/param.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

// Tells the communication-thread span of the collective about to be issued
// on this thread its size (CPU tensors: the MPI backend's comm thread).
void hint_bytes(const at::Tensor& t);

// Bytes of the full (gathered) buffers of `params`' Shard placements: what
// an unshard allocates on this rank.
int64_t gathered_bytes(const std::vector<ShardedParam>& params, int64_t ws);

using Allocate = std::function<at::Tensor(int64_t, const at::TensorOptions&)>;

// The custom collectives of fsdp/comm_hooks.h, or the process group's own
// where none is set, and the buffers each allocates.
struct CollectiveRoute {
  std::shared_ptr<const CustomAllGather> custom_all_gather;
  std::shared_ptr<const CustomReduceScatter> custom_reduce_scatter;
  // For error messages: the owning unit's label ("block0 #2").
  std::function<std::string()> owner_label;

  std::string owner() const { return owner_label ? owner_label() : std::string("?"); }
  WorkPtr all_gather(const ProcessGroupPtr& group, at::Tensor out, const at::Tensor& in) const;
  WorkPtr reduce_scatter(const ProcessGroupPtr& group, at::Tensor out, const at::Tensor& in) const;
  // A buffer for an all-gather / reduce-scatter on `group`: the custom
  // collective's allocate (checked against the request) or the group's own.
  at::Tensor all_gather_buffer(const ProcessGroupPtr& group, at::IntArrayRef shape,
                               const at::TensorOptions& options) const;
  at::Tensor reduce_scatter_buffer(const ProcessGroupPtr& group, at::IntArrayRef shape,
                                   const at::TensorOptions& options) const;
  // The custom all-gather's allocate, checked; empty when it has none.
  Allocate all_gather_allocate() const;
};

// The parameters with an all-gather extension, gathered as the bytes of
// their pre_all_gather outputs in one byte all-gather.
class ExtensionGather {
 public:
  explicit ExtensionGather(size_t num_params) : outputs_(num_params) {}

  // Runs pre_all_gather and issues the all-gather over `group` (its work
  // appended to `works`).
  void issue(std::vector<ShardedParam>& params, const ProcessGroupPtr& group,
             const CollectiveRoute& route, std::vector<WorkPtr>& works);
  // After the gather completed: post_all_gather on each parameter's slices.
  void finish(std::vector<ShardedParam>& params, int64_t ws, const CollectiveRoute& route);
  // A group of one rank: pre and post without a collective.
  void unshard_locally(std::vector<ShardedParam>& params, const CollectiveRoute& route);
  // Forgets an issued gather's buffer (after its work completed).
  void drop();
  bool issued() const { return issued_; }
  // The byte all-gather's output while one is issued.
  const at::Tensor& buffer() const { return gather_out_; }

 private:
  // What the first pre_all_gather returned per output (shape, dtype), and
  // where its bytes sit in one rank's block of the byte all-gather.
  struct Output {
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
    int64_t offset = 0;  // bytes into a rank's block
    int64_t nbytes = 0;
  };
  // Every extension's pre_all_gather, checked against the first call's
  // outputs; per parameter (empty where none).
  std::vector<std::vector<at::Tensor>> run_pre_all_gathers(std::vector<ShardedParam>& params,
                                                           const CollectiveRoute& route);
  // Parameter p's post_all_gather on `gathered`, checked, then installed.
  static void run_post_all_gather(ShardedParam& p, const std::vector<at::Tensor>& gathered,
                                  int64_t ws, const CollectiveRoute& route);

  std::vector<std::vector<Output>> outputs_;  // per parameter (empty: none)
  int64_t block_bytes_ = 0;
  at::Tensor gather_out_;  // [ws * block_bytes_] uint8, while a gather is issued
  bool issued_ = false;
  bool recorded_ = false;
};

}  // namespace fsdp::detail
