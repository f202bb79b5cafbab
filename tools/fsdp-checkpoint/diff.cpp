// diff: two checkpoints compared by tensor name (one tensor, one block of
// rows at a time) and by value.
#include "common.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <map>

namespace fsdp_checkpoint {

namespace {

using Info = fsdp::dcp::Reader::TensorInfo;

struct Compared {
  double max_abs = 0;        // max |a - b| (NaN where one side is NaN and the other not)
  int64_t differ = 0;        // elements not bitwise equal
  int64_t beyond = 0;        // elements beyond atol + rtol |b|
};

// Compares the whole tensor `name` in blocks of rows (same shape and dtype on both sides).
Compared compare(const fsdp::dcp::Reader& ra, const fsdp::dcp::Reader& rb, const Info& ta,
                 double atol, double rtol) {
  Compared c;
  // Half the block size each: two blocks in memory at once.
  for_each_block(ra, ta, kBlockBytes / 2, [&](const at::Tensor& a, int64_t row) {
    std::vector<int64_t> offsets(ta.shape.size(), 0);
    if (!offsets.empty()) offsets[0] = row;
    const at::Tensor b = read_box(rb, ta.name, offsets, a.sizes().vec());
    const at::Tensor ac = a.contiguous(), bc = b.contiguous();
    if (std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0) return;
    // Bitwise comparison per element through same-sized integers.
    const at::Tensor ai = ac.view(c10::elementSize(ac.scalar_type()) == 1 ? at::kByte
                                  : c10::elementSize(ac.scalar_type()) == 2 ? at::kShort
                                  : c10::elementSize(ac.scalar_type()) == 4 ? at::kInt
                                                                            : at::kLong);
    const at::Tensor bi = bc.view(ai.scalar_type());
    const at::Tensor bit_diff = ai.ne(bi);
    c.differ += bit_diff.sum().item<int64_t>();
    const at::Tensor ad = ac.to(at::kDouble), bd = bc.to(at::kDouble);
    const at::Tensor both_nan = ad.isnan().logical_and(bd.isnan());
    const at::Tensor abs = (ad - bd).abs().masked_fill(both_nan, 0.0);
    // Equal infinities give inf - inf = NaN: they are bitwise equal, so 0.
    const at::Tensor d = abs.masked_fill(bit_diff.logical_not(), 0.0);
    const at::Tensor allowed = bd.abs() * rtol + atol;
    // NaN against a number is beyond any tolerance (le is false for NaN).
    c.beyond += d.le(allowed).logical_not().sum().item<int64_t>();
    const double m = d.isnan().any().item<bool>() ? std::nan("") : d.max().item<double>();
    if (std::isnan(m) || m > c.max_abs) c.max_abs = m;
  });
  return c;
}

std::string value_text(const fsdp::dcp::Value& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) return fmt::format("{}", *d);
  if (const auto* s = std::get_if<std::string>(&v)) return "\"" + *s + "\"";
  return "<tensor>";
}

// Bitwise equality of two non-tensor values (doubles by their bits).
bool value_equal(const fsdp::dcp::Value& a, const fsdp::dcp::Value& b) {
  if (a.index() != b.index()) return false;
  if (const auto* i = std::get_if<int64_t>(&a)) return *i == std::get<int64_t>(b);
  if (const auto* d = std::get_if<double>(&a)) {
    return std::memcmp(d, &std::get<double>(b), sizeof(double)) == 0;
  }
  if (const auto* s = std::get_if<std::string>(&a)) return *s == std::get<std::string>(b);
  return false;  // tensors are not values (Reader lists them as tensors)
}

// Whether values a and b are within tolerance (numbers) or equal (strings, types).
bool value_within(const fsdp::dcp::Value& a, const fsdp::dcp::Value& b, double atol, double rtol) {
  auto num = [](const fsdp::dcp::Value& v, double& out) {
    if (const auto* i = std::get_if<int64_t>(&v)) return out = static_cast<double>(*i), true;
    if (const auto* d = std::get_if<double>(&v)) return out = *d, true;
    return false;
  };
  double x = 0, y = 0;
  if (a.index() != b.index() || !num(a, x) || !num(b, y)) return value_equal(a, b);
  if (std::isnan(x) && std::isnan(y)) return true;
  return std::abs(x - y) <= atol + rtol * std::abs(y);
}

}  // namespace

int run_diff(const DiffArgs& args) {
  const fsdp::dcp::Reader ra = open_reader(args.a, "<dirA>");
  const fsdp::dcp::Reader rb = open_reader(args.b, "<dirB>");
  fmt::print("A: {} (step {}, {} ranks)\nB: {} (step {}, {} ranks)\n", ra.path(), ra.step(),
             ra.world_size(), rb.path(), rb.step(), rb.world_size());
  fmt::print("tolerance: |a - b| <= {} + {} |b|{}\n", args.atol, args.rtol,
             args.atol == 0 && args.rtol == 0 ? " (bitwise)" : "");
  std::map<std::string, const Info*> in_b;
  for (const auto& t : rb.tensors()) in_b[t.name] = &t;

  int only_a = 0, only_b = 0, mismatched = 0, identical = 0, within = 0, beyond = 0;
  for (const auto& ta : ra.tensors()) {
    const auto it = in_b.find(ta.name);
    if (it == in_b.end()) {
      fmt::print("only in A: {} {} {}\n", ta.name, dtype_str(ta.dtype), shape_str(ta.shape));
      ++only_a;
      continue;
    }
    const Info& tb = *it->second;
    in_b.erase(it);
    if (ta.dtype != tb.dtype || ta.shape != tb.shape) {
      fmt::print("differs: {}: A {} {}, B {} {}\n", ta.name, dtype_str(ta.dtype),
                 shape_str(ta.shape), dtype_str(tb.dtype), shape_str(tb.shape));
      ++mismatched;
      continue;
    }
    const Compared c = compare(ra, rb, ta, args.atol, args.rtol);
    if (c.differ == 0) {
      ++identical;
      continue;
    }
    const bool ok = c.beyond == 0;
    ok ? ++within : ++beyond;
    fmt::print("{}: {} {} {}: max |a - b| {:.6g}, {} of {} elements differ, {} beyond tolerance\n",
               ok ? "within tolerance" : "differs", ta.name, dtype_str(ta.dtype),
               shape_str(ta.shape), c.max_abs, c.differ, numel(ta.shape), c.beyond);
  }
  for (const auto& [name, tb] : in_b) {
    fmt::print("only in B: {} {} {}\n", name, dtype_str(tb->dtype), shape_str(tb->shape));
    ++only_b;
  }

  int values_differ = 0, values_within = 0, values_same = 0;
  std::map<std::string, fsdp::dcp::Value> vb = rb.values();
  for (const auto& [name, a] : ra.values()) {
    const auto it = vb.find(name);
    if (it == vb.end()) {
      fmt::print("only in A: value {} = {}\n", name, value_text(a));
      ++values_differ;
      continue;
    }
    if (value_equal(a, it->second)) {
      ++values_same;
    } else if (value_within(a, it->second, args.atol, args.rtol)) {
      fmt::print("within tolerance: value {}: A {}, B {}\n", name, value_text(a),
                 value_text(it->second));
      ++values_within;
    } else {
      fmt::print("differs: value {}: A {}, B {}\n", name, value_text(a), value_text(it->second));
      ++values_differ;
    }
    vb.erase(it);
  }
  for (const auto& [name, b] : vb) {
    fmt::print("only in B: value {} = {}\n", name, value_text(b));
    ++values_differ;
  }

  const bool same = only_a + only_b + mismatched + beyond + values_differ == 0;
  fmt::print("{}: tensors: {} identical, {} within tolerance, {} beyond, {} shape/dtype "
             "differences, {} only in A, {} only in B; values: {} identical, {} within "
             "tolerance, {} differ or missing\n",
             same ? "SAME" : "DIFFERENT", identical, within, beyond, mismatched, only_a, only_b,
             values_same, values_within, values_differ);
  return same ? kExitOk : kExitFailed;
}

}  // namespace fsdp_checkpoint
