// Collective counting: the internal side of fsdp::collective_counters()
// (counters.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

void count_collective(const std::string& op, const std::string& group, int64_t bytes);

// ---- Cross-node bytes (CollectiveCounters::cross_node_bytes) ---------------
// One run of `op` ("all_gather", ...) on `group` by `algorithm` (the name
// to_string(CpuAlgorithm) gives: "mpi", "ring", "pairwise", "shm", or a new
// algorithm's; "nccl" for NCCL), in which this rank sent `cross_node_bytes`
// to ranks on other nodes. modelled: the bytes follow a model of a schedule
// libfsdp cannot see (Open MPI's collectives, NCCL's), not the messages it
// posted itself. Called by the backend that ran it, on the thread that ran it
// (before its Work completes); adds `algorithm` and `cross_node_bytes` args to
// the collective's trace span when that thread is inside one.
void count_cross_node(const std::string& op, const std::string& group,
                      const std::string& algorithm, int64_t cross_node_bytes, bool modelled);

// For an algorithm that knows its own schedule (e.g. a two-level one): adds
// `bytes` it sent to another node to the collective running on this thread.
// The MPI backend clears the tally before it runs an algorithm and, when
// anything was reported, records that instead of its own model
// (take_reported_cross_node_bytes).
void report_cross_node_bytes(int64_t bytes);
// Clears this thread's tally (begin) / returns it and clears it: -1 when
// nothing was reported since begin.
void begin_reported_cross_node_bytes();
int64_t take_reported_cross_node_bytes();

// The trace span (trace::detail token, 0: none) of the collective running on
// this thread; set by the comm thread around each traced task.
void set_current_comm_span(uint64_t token);

}  // namespace fsdp::detail
