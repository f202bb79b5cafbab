// HDF5 files of single-card reference runs, data/reference/<device>/<case>.h5:
//
//   attributes  case, plan_ids, config (stored_config's JSON), config_hash,
//               libtorch_version, blas_core (OpenBLAS kernel set: bitwise
//               reproducibility holds on the same one), generator
//   /loss, /grad_norm                 float64 [steps]
//   /norms/<name>                     float64 [steps]
//   /chunk_losses                     float64 [steps, chunks]   (chunked CE)
//   /unchunked_loss                   float64 [steps]           (chunked CE)
//   /routing_margin                   float64 [steps]           (MoE)
//   /step<k>/routing/<layer>          int64 [tokens, top_k]     (MoE)
//   /step<k>/grad/<param>             float32, the parameter's shape
//   /step<k>/param/<param>            float32, after optimizer step k
#pragma once

#include "reference/case.h"

#include <stdexcept>
#include <string>

namespace ref {

// A cached reference does not match the case (config hash) or is missing.
class StaleReference : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct StoredReference {
  RunRecord record;
  std::string config_json;
  std::string config_hash;
  std::string libtorch_version;
  std::string blas_core;
};

// Where the committed references live (the source tree's data/reference).
std::string default_reference_dir();
std::string reference_path(const std::string& dir, const std::string& device,
                           const std::string& case_name);

// Writes atomically (temporary name, then rename). Creates directories.
void write_reference(const std::string& path, const Case& c, const RunRecord& record);
// Reads and checks the config hash against the case: StaleReference with
// "stale reference for <case>: ... regenerate with ..." on mismatch or a
// missing file.
StoredReference read_reference(const std::string& path, const Case& c);
// Reads without checking (for comparing two files).
StoredReference read_reference_unchecked(const std::string& path);

// The OpenBLAS kernel set in use ("" when not OpenBLAS).
std::string blas_core_name();

}  // namespace ref
