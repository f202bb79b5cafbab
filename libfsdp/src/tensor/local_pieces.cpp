// local_pieces: along each tensor dim the rows this rank holds are found by
// distributing an arange over the same mesh with the placements that split
// that dim (the others read as Replicate), so DTensor's layout rule --
// StridedShard's nesting and fused pieces included -- is applied by
// distribute_tensor itself rather than restated. The rows come out as runs of
// consecutive indices; the pieces are the product of the runs of every dim.
#include "fsdp/dtensor.h"
#include "fsdp/errors.h"

#include <ATen/ops/arange.h>

namespace fsdp {
namespace {

struct Run {
  int64_t global = 0, local = 0, length = 0;
};

std::vector<Run> runs_of_dim(const DTensor& t, int64_t d) {
  std::vector<Placement> along;
  bool split = false;
  for (const Placement& p : t.placements()) {
    if ((p.is_shard() || p.is_strided_shard()) && p.dim() == d) {
      along.push_back(p.is_shard() ? Placement::Shard(0)
                                   : Placement::StridedShard(0, p.split_factor()));
      split = true;
    } else {
      along.push_back(Placement::Replicate());
    }
  }
  const int64_t n = t.shape()[static_cast<size_t>(d)];
  if (!split) return n > 0 ? std::vector<Run>{{0, 0, n}} : std::vector<Run>{};
  const at::Tensor rows =
      distribute_tensor(at::arange(n, at::kLong), t.device_mesh(), along).to_local().cpu().contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  std::vector<Run> runs;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    if (!runs.empty() && runs.back().global + runs.back().length == r[i]) {
      ++runs.back().length;
    } else {
      runs.push_back({r[i], i, 1});
    }
  }
  return runs;
}

}  // namespace

std::vector<LocalPiece> local_pieces(const DTensor& t) {
  for (const Placement& p : t.placements()) {
    if (p.is_partial()) {
      throw ArgumentError("placements", "local_pieces: placement " + p.to_string() +
                                            " holds a partial value, not a piece of the "
                                            "global tensor");
    }
  }
  const auto ndim = static_cast<int64_t>(t.shape().size());
  std::vector<std::vector<Run>> runs;
  for (int64_t d = 0; d < ndim; ++d) {
    runs.push_back(runs_of_dim(t, d));
    if (runs.back().empty()) return {};
  }
  std::vector<LocalPiece> out;
  std::vector<size_t> pick(static_cast<size_t>(ndim), 0);
  while (true) {
    LocalPiece b;
    for (int64_t d = 0; d < ndim; ++d) {
      const Run& r = runs[static_cast<size_t>(d)][pick[static_cast<size_t>(d)]];
      b.offsets.push_back(r.global);
      b.sizes.push_back(r.length);
      b.local_offsets.push_back(r.local);
    }
    out.push_back(std::move(b));
    int64_t d = ndim - 1;
    for (; d >= 0; --d) {
      auto& i = pick[static_cast<size_t>(d)];
      if (++i < runs[static_cast<size_t>(d)].size()) break;
      i = 0;
    }
    if (d < 0) break;
  }
  return out;
}

}  // namespace fsdp
