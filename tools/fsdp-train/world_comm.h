// The driver's own collectives (the logged loss mean, memory peaks, expert
// load, checkpoint agreement) over a CPU process group of the whole world.
//
// They go through fsdp::ProcessGroup rather than raw MPI so the watchdog
// covers them as it covers the model's: a rank that stops between two steps
// (after its optimizer step, in a checkpoint save) leaves its peers waiting
// here, and that wait is reported and aborts the job (FSDP_TIMEOUT) instead
// of hanging in an MPI call nobody watches. Every call is collective over
// the world, blocking, in the same order on every rank.
#pragma once

#include <fsdp/comm.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_train {

class WorldComm {
 public:
  // Collective over MPI_COMM_WORLD: makes the group (fsdp::init_device_mesh).
  // world_size: the Runtime's.
  explicit WorldComm(int world_size);

  int rank() const;
  int size() const;

  double sum(double value) const;
  int64_t max(int64_t value) const;
  // Every rank's value, in rank order, on every rank.
  std::vector<int64_t> all_gather(int64_t value) const;
  // Elementwise sum of every rank's `values` (same length on every rank).
  std::vector<int64_t> sum(const std::vector<int64_t>& values) const;
  // root's text on every rank.
  std::string broadcast(const std::string& text, int root) const;
  // Every rank's text in rank order; the texts must have equal lengths.
  std::vector<std::string> all_gather(const std::string& text) const;

 private:
  fsdp::ProcessGroupPtr group_;
};

}  // namespace fsdp_train
