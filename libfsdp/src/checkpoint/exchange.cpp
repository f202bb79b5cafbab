// Texts and verdicts exchanged over a process group (exchange.h).
#include "checkpoint/exchange.h"

#include "fsdp/distributed_checkpoint.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

namespace fsdp::dcp::detail {

std::vector<std::string> all_gather_text(const ProcessGroupPtr& group, const std::string& mine) {
  const int n = group->size();
  at::Tensor size = at::empty({1}, at::kLong);
  size.data_ptr<int64_t>()[0] = static_cast<int64_t>(mine.size());
  at::Tensor sizes = at::empty({n}, at::kLong);
  group->all_gather_into_tensor(sizes, size)->wait();
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) longest = std::max(longest, sizes.data_ptr<int64_t>()[r]);
  // Bytes travel as int64 words: the collectives take no byte type.
  const int64_t words = (longest + 7) / 8;
  std::vector<std::string> out(static_cast<size_t>(n));
  if (words == 0) return out;
  at::Tensor in = at::zeros({words}, at::kLong);
  std::memcpy(in.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({words * n}, at::kLong);
  group->all_gather_into_tensor(all, in)->wait();
  const char* bytes = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < n; ++r) {
    out[static_cast<size_t>(r)].assign(bytes + static_cast<size_t>(r) * words * 8,
                                       static_cast<size_t>(sizes.data_ptr<int64_t>()[r]));
  }
  return out;
}

std::string broadcast_text(const ProcessGroupPtr& group, const std::string& text, int root) {
  at::Tensor size = at::empty({1}, at::kLong);
  size.data_ptr<int64_t>()[0] = static_cast<int64_t>(text.size());
  group->broadcast(size, root)->wait();
  const int64_t n = size.data_ptr<int64_t>()[0];
  const int64_t words = (n + 7) / 8;
  if (words == 0) return "";
  at::Tensor buf = at::zeros({words}, at::kLong);
  if (group->rank() == root) std::memcpy(buf.data_ptr(), text.data(), text.size());
  group->broadcast(buf, root)->wait();
  return std::string(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
}

namespace {

using nlohmann::json;

std::string describe(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const CheckpointError& c) {
    return json{{"type", "checkpoint"}, {"kind", static_cast<int>(c.kind())},
                {"tensor", c.tensor()}, {"file", c.file()}, {"what", c.what()}}
        .dump();
  } catch (const ShapeError& a) {  // before ArgumentError: the subclass survives the trip
    return json{{"type", "shape"}, {"argument", a.argument()}, {"what", a.what()}}.dump();
  } catch (const DTypeError& a) {
    return json{{"type", "dtype"}, {"argument", a.argument()}, {"what", a.what()}}.dump();
  } catch (const ArgumentError& a) {
    return json{{"type", "argument"}, {"argument", a.argument()}, {"what", a.what()}}.dump();
  } catch (const StateError& s) {
    return json{{"type", "state"}, {"what", s.what()}}.dump();
  } catch (const std::exception& x) {
    return json{{"type", "error"}, {"what", x.what()}}.dump();
  } catch (...) {
    return json{{"type", "error"}, {"what", "unknown exception"}}.dump();
  }
}

}  // namespace

void agree(const ProcessGroupPtr& group, const std::exception_ptr& mine) {
  const auto all = all_gather_text(group, describe(mine));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const json j = json::parse(all[r]);
    std::string what = j.at("what").get<std::string>();
    // The same text on every rank, saying where it happened.
    if (group->size() > 1) what = "rank " + std::to_string(group->world_ranks()[r]) + ": " + what;
    const std::string type = j.at("type").get<std::string>();
    if (type == "checkpoint") {
      throw CheckpointError(static_cast<CheckpointError::Kind>(j.at("kind").get<int>()),
                            j.at("tensor").get<std::string>(), j.at("file").get<std::string>(),
                            what);
    }
    if (type == "shape") throw ShapeError(j.at("argument").get<std::string>(), what);
    if (type == "dtype") throw DTypeError(j.at("argument").get<std::string>(), what);
    if (type == "argument") throw ArgumentError(j.at("argument").get<std::string>(), what);
    if (type == "state") throw StateError(what);
    throw Error(what);
  }
}

}  // namespace fsdp::dcp::detail
