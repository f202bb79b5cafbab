// L0: every collective x dtype x op against a naive reference built from
// MPI point-to-point messages.
#include "spmd.h"

#include <fsdp/comm.h>
#include <fsdp/mesh.h>

#include <ATen/ATen.h>

BOOST_AUTO_TEST_CASE(smoke_all_reduce) {
  auto mesh = fsdp::init_device_mesh(c10::kCPU, {spmd::world_size()});
  auto t = at::full({4}, static_cast<double>(spmd::rank() + 1), at::kFloat);
  mesh.get_group(0)->all_reduce(t);
  const int n = spmd::world_size();
  BOOST_TEST(t[0].item<float>() == n * (n + 1) / 2);
}
