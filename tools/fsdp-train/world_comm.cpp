#include "world_comm.h"

#include <fsdp/mesh.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <stdexcept>

namespace fsdp_train {
namespace {

// One int64 element per byte: the messages are short (checkpoint faults,
// digests), and ProcessGroup has no byte dtype.
at::Tensor bytes_tensor(const std::string& text) {
  at::Tensor t = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  int64_t* p = t.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = static_cast<unsigned char>(text[i]);
  return t;
}

std::string tensor_text(const at::Tensor& t, int64_t offset, int64_t length) {
  const int64_t* p = t.data_ptr<int64_t>() + offset;
  std::string text(static_cast<size_t>(length), '\0');
  for (int64_t i = 0; i < length; ++i) text[static_cast<size_t>(i)] = static_cast<char>(p[i]);
  return text;
}

}  // namespace

WorldComm::WorldComm(int world_size)
    : group_(fsdp::init_device_mesh(c10::kCPU, {world_size}, {"world"}).get_group(0)) {}

int WorldComm::rank() const { return group_->rank(); }
int WorldComm::size() const { return group_->size(); }

double WorldComm::sum(double value) const {
  at::Tensor t = at::empty({1}, at::kDouble);
  t.data_ptr<double>()[0] = value;
  group_->all_reduce(t, fsdp::ReduceOp::SUM)->wait();
  return t.data_ptr<double>()[0];
}

int64_t WorldComm::max(int64_t value) const {
  at::Tensor t = at::empty({1}, at::kLong);
  t.data_ptr<int64_t>()[0] = value;
  group_->all_reduce(t, fsdp::ReduceOp::MAX)->wait();
  return t.data_ptr<int64_t>()[0];
}

std::vector<int64_t> WorldComm::all_gather(int64_t value) const {
  at::Tensor in = at::empty({1}, at::kLong);
  in.data_ptr<int64_t>()[0] = value;
  at::Tensor out = at::empty({size()}, at::kLong);
  group_->all_gather_into_tensor(out, in)->wait();
  const int64_t* p = out.data_ptr<int64_t>();
  return {p, p + size()};
}

std::vector<int64_t> WorldComm::sum(const std::vector<int64_t>& values) const {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  if (!values.empty()) group_->all_reduce(t, fsdp::ReduceOp::SUM)->wait();
  const int64_t* p = t.data_ptr<int64_t>();
  return {p, p + values.size()};
}

std::string WorldComm::broadcast(const std::string& text, int root) const {
  at::Tensor length = at::empty({1}, at::kLong);
  length.data_ptr<int64_t>()[0] = static_cast<int64_t>(text.size());
  group_->broadcast(length, root)->wait();
  const int64_t n = length.data_ptr<int64_t>()[0];
  if (n == 0) return {};
  at::Tensor t = rank() == root ? bytes_tensor(text) : at::zeros({n}, at::kLong);
  group_->broadcast(t, root)->wait();
  return tensor_text(t, 0, n);
}

std::vector<std::string> WorldComm::all_gather(const std::string& text) const {
  const auto n = static_cast<int64_t>(text.size());
  if (max(n) != -max(-n)) {  // every rank sees the same maximum and minimum
    throw std::logic_error("WorldComm::all_gather: the ranks' texts differ in length");
  }
  std::vector<std::string> all(static_cast<size_t>(size()));
  if (n == 0) return all;
  at::Tensor out = at::empty({n * size()}, at::kLong);
  group_->all_gather_into_tensor(out, bytes_tensor(text))->wait();
  for (int r = 0; r < size(); ++r) all[static_cast<size_t>(r)] = tensor_text(out, r * n, n);
  return all;
}

}  // namespace fsdp_train
