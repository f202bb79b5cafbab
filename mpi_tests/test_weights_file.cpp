// fsdp::load_weights [ours] (issue #41, "weights streamed into shards"):
// pretrained weights from a safetensors file (data/weights/tiny.safetensors,
// written by the PyPI safetensors package), from an HDF5 file this test
// writes with HDF5's C API, and from a distributed checkpoint, loaded into
// a model sharded with fully_shard (1-D FSDP, weights on dim 1, HSDP 2x2 at
// np 4) or not sharded at all. Every rank's shard must hold exactly the
// rows its placement gives -- computed here from the fixture's formula and
// torch.chunk's rule, not by the library -- and must have been read without
// reading whole tensors (bytes_read). Errors must be typed, alike on every
// rank, and leave the model untouched. np 1, 2, 4 (label dcp).
#include "dcp_util.h"

#include <fsdp/errors.h>
#include <fsdp/weights_file.h>

#include <hdf5.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <tuple>

#ifndef FSDP_WEIGHTS_FIXTURE
#error "FSDP_WEIGHTS_FIXTURE (the path of data/weights/tiny.safetensors) must be defined"
#endif

namespace {

using fsdp::dcp::CheckpointError;
constexpr int64_t kIn = 16, kHidden = 37, kOut = 8;
const std::string kFixture = FSDP_WEIGHTS_FIXTURE;

// The fixture's values (data/weights/README.md): element i of tensor k.
at::Tensor formula(int64_t k, std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  at::Tensor out = at::empty({n}, at::kDouble);
  auto* p = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>((7 * i + 13 * k) % 101 - 50) / 64.0;
  return out.to(dtype).reshape(shape);
}
// k of each tensor in the fixture (and in the HDF5 file this test writes).
const std::map<std::string, std::pair<int64_t, std::vector<int64_t>>>& expected_tensors() {
  static const std::map<std::string, std::pair<int64_t, std::vector<int64_t>>> t = {
      {"fc1.weight", {0, {kHidden, kIn}}},
      {"fc1.bias", {1, {kHidden}}},
      {"fc2.weight", {2, {kOut, kHidden}}},
      {"fc2.bias", {3, {kOut}}},
  };
  return t;
}

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  explicit MlpImpl(int64_t hidden = kHidden) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, kOut));
  }
};
TORCH_MODULE(Mlp);

// Where this rank's rows of a dim-`dim` sharded tensor are: torch.chunk's
// rule (ceil(n / parts) per part, the last ones short or empty).
std::pair<int64_t, int64_t> chunk_rows(int64_t n, int64_t parts, int64_t index) {
  const int64_t per = (n + parts - 1) / parts;
  const int64_t begin = std::min(n, index * per);
  return {begin, std::min(n, begin + per) - begin};
}

// The MLP in one layout: "plain" (no units), "fsdp" (Shard(0) over all
// ranks), "fsdp_dim1" (fc1.weight Shard(1)), "hsdp" (replicate 2 x shard
// w/2). Units: fc1, fc2 and the root.
struct Model {
  std::string layout;
  Mlp net{nullptr};
  int64_t shard_index = 0, shard_count = 1;
  std::vector<fsdp::FSDPModule> units;
};

Model build(const std::string& layout, int64_t hidden = kHidden,
            const std::function<void(MlpImpl&)>& extend = {}) {
  const int w = spmd::world_size(), r = spmd::rank();
  Model m;
  m.layout = layout;
  at::manual_seed(11);
  m.net = Mlp(hidden);
  if (extend) extend(*m.net);
  m.net->to(spmd::device());
  if (layout == "plain") return m;
  fsdp::FullyShardOptions o;
  const auto dev = spmd::device().type();
  if (layout == "hsdp") {
    o.mesh = fsdp::init_device_mesh(dev, {2, w / 2}, {"replicate", "shard"});
    m.shard_index = r % (w / 2);
    m.shard_count = w / 2;
  } else {
    o.mesh = fsdp::init_device_mesh(dev, {w});
    m.shard_index = r;
    m.shard_count = w;
  }
  if (layout == "fsdp_dim1") {
    o.shard_placement_fn = [](const std::string& name,
                              const at::Tensor&) -> std::optional<fsdp::ShardPlacementResult> {
      if (name.find("weight") != std::string::npos) return fsdp::Placement::Shard(1);
      return std::nullopt;
    };
  }
  fsdp::FullyShardOptions o2 = o;
  o2.shard_placement_fn = nullptr;  // fc2.weight's 37 columns do not split evenly
  m.units.push_back(fsdp::fully_shard(m.net->fc1.ptr(), o));
  m.units.push_back(fsdp::fully_shard(m.net->fc2.ptr(), o2));
  m.units.push_back(fsdp::fully_shard(m.net.ptr(), o2));
  return m;
}

std::vector<std::string> layouts() {
  std::vector<std::string> l = {"plain", "fsdp", "fsdp_dim1"};
  if (spmd::world_size() == 4) l.push_back("hsdp");
  return l;
}

// This rank's expected local values of fc1.weight, ... in `m`'s layout.
at::Tensor expected_local(const Model& m, const std::string& name) {
  const auto& [k, shape] = expected_tensors().at(name);
  at::Tensor full = formula(k, shape);
  if (m.layout == "plain") return full;
  const int64_t dim = m.layout == "fsdp_dim1" && name == "fc1.weight" ? 1 : 0;
  const int64_t n = shape[static_cast<size_t>(dim)];
  const auto [begin, len] = chunk_rows(n, m.shard_count, m.shard_index);
  return full.narrow(dim, begin, len);
}

// The module's tensors on the CPU (its local shards), by name.
std::map<std::string, at::Tensor> local_tensors(torch::nn::Module& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net.named_parameters()) out[p.key()] = p.value().detach().cpu().clone();
  for (const auto& b : net.named_buffers()) out[b.key()] = b.value().detach().cpu().clone();
  return out;
}

// The local shard of each managed parameter, from the units, by full name.
std::map<std::string, at::Tensor> unit_shards(const Model& m) {
  std::map<std::string, at::Tensor> out;
  const std::vector<std::string> prefix = {"fc1.", "fc2.", ""};
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (const auto& [name, dt] : m.units[u].sharded_parameters()) {
      out[prefix[u] + name] = dt.to_local().detach().to(at::kCPU);
    }
  }
  return out;
}

// Every local shard (and full_state_dict) equals the formula's rows.
void expect_formula(Model& m, const std::string& what) {
  const auto local = local_tensors(*m.net);
  const auto shards = unit_shards(m);
  for (const auto& [name, kt] : expected_tensors()) {
    const at::Tensor want = expected_local(m, name);
    const at::Tensor got = shards.count(name) ? shards.at(name) : local.at(name);
    BOOST_TEST(got.sizes() == want.sizes(), what << " " << name << ": local " << got.sizes()
                                                 << ", expected " << want.sizes());
    if (got.sizes() == want.sizes()) {
      BOOST_TEST(at::equal(got, want), what << " " << name << " differs");
    }
  }
  const std::vector<std::string> prefix = {"fc1.", "fc2.", ""};
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (const auto& [name, full] : m.units[u].full_state_dict()) {
      auto e = expected_tensors().find(prefix[u] + name);
      if (e == expected_tensors().end()) continue;  // a tensor the file lacks (strict = false)
      const auto& [k, shape] = e->second;
      BOOST_TEST(at::equal(full.detach().to(at::kCPU), formula(k, shape)),
                 what << " full_state_dict " << prefix[u] + name << " differs");
    }
  }
}

// Bytes of this rank's local pieces of the fixture's MLP tensors.
int64_t local_bytes(const Model& m) {
  int64_t n = 0;
  for (const auto& [name, kt] : expected_tensors()) n += expected_local(m, name).numel() * 4;
  return n;
}

// The safetensors header's size (8 + its length field), read here.
int64_t safetensors_header_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  return 8 + static_cast<int64_t>(n);
}

std::string scratch(const std::string& name) {
  return dcpt::fresh_dir(dcpt::matrix_root() + "-weights/" + name + "-np" +
                         std::to_string(spmd::world_size()));
}

// The same text on every rank (compared through a hash).
void expect_same_on_every_rank(const std::string& text, const std::string& what) {
  const double h = static_cast<double>(std::hash<std::string>{}(text) % 1000000007u);
  BOOST_TEST(raw_mpi::max_over_ranks(h) == -raw_mpi::max_over_ranks(-h),
             what << ": the ranks' messages differ; this rank's: " << text);
}

// `fn` must throw E on this rank (and so on every rank), with the words
// given and the same message everywhere, and leave `net` as it was.
template <typename E, typename Fn>
void expect_error(Fn fn, torch::nn::Module& net, const std::vector<std::string>& words,
                  const std::string& what, const std::function<void(const E&)>& more = {}) {
  const auto before = local_tensors(net);
  std::string msg = "(none)";
  bool typed = false;
  try {
    fn();
  } catch (const E& e) {
    typed = true;
    msg = e.what();
    if (more) more(e);
  } catch (const std::exception& e) {
    msg = std::string("other exception: ") + e.what();
  }
  BOOST_TEST(typed, what << ": expected the typed error; got " << msg);
  for (const auto& w : words) {
    BOOST_TEST(msg.find(w) != std::string::npos, what << ": '" << w << "' not in: " << msg);
  }
  expect_same_on_every_rank(msg, what);
  const auto after = local_tensors(net);
  for (const auto& [name, t] : before) {
    BOOST_TEST(at::equal(t, after.at(name)), what << ": " << name << " changed");
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_safetensors_into_shards) {  // [ours]
  const int64_t header = safetensors_header_bytes(kFixture);
  int64_t all_bytes = 0;  // the MLP's tensors, whole
  for (const auto& [name, kt] : expected_tensors()) {
    all_bytes += formula(kt.first, kt.second).numel() * 4;
  }
  for (const auto& layout : layouts()) {
    Model m = build(layout);
    const fsdp::LoadWeightsReport r = fsdp::load_weights(kFixture, *m.net);
    BOOST_TEST(r.format == "safetensors");
    BOOST_TEST(r.tensors_loaded == 4);
    BOOST_TEST(r.missing.empty());
    BOOST_TEST(r.unexpected == std::vector<std::string>{"half.weight"}, layout);
    expect_formula(m, "safetensors " + layout);
    const int64_t mine = local_bytes(m);
    BOOST_TEST(r.bytes_read >= mine,
               layout << ": read " << r.bytes_read << " < shard bytes " << mine);
    BOOST_TEST(r.bytes_read <= mine + header,
               layout << ": read " << r.bytes_read << " > shard bytes " << mine << " + header "
                      << header);
    if (layout != "plain" && spmd::world_size() >= 2) {
      BOOST_TEST(r.bytes_read - header < all_bytes,
                 layout << ": read " << r.bytes_read - header
                        << " data bytes, the whole tensors are " << all_bytes);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_float16_tensor_exact) {  // [ours]
  struct Holder : torch::nn::Module {
    at::Tensor weight;
    explicit Holder(at::ScalarType t) {
      weight = register_parameter("weight", at::zeros({5, 3}, t));
    }
  };
  auto ok = std::make_shared<Holder>(at::kHalf);
  fsdp::LoadWeightsOptions o;
  o.prefix = "half.";
  const auto r = fsdp::load_weights(kFixture, *ok, o);
  BOOST_TEST(r.tensors_loaded == 1);
  BOOST_TEST(at::equal(ok->weight, formula(4, {5, 3}, at::kHalf)));
  // No silent cast: float32 parameter, float16 in the file.
  auto bad = std::make_shared<Holder>(at::kFloat);
  expect_error<fsdp::DTypeError>([&] { fsdp::load_weights(kFixture, *bad, o); }, *bad,
                                 {"'weight'", "float16", "float32", kFixture}, "dtype mismatch");
}

BOOST_AUTO_TEST_CASE(test_hdf5_into_shards) {  // [ours]
  // Written with HDF5's C API here (independent of libfsdp's writers): the
  // MLP's tensors under group "model", plus a buffer `scale` that no unit
  // manages (read whole), float32 little-endian.
  const std::string dir = scratch("hdf5");
  const std::string path = dir + "/mlp.h5";
  const std::map<std::string, std::pair<int64_t, std::vector<int64_t>>> scale = {
      {"scale", {5, {kOut}}}};
  if (spmd::rank() == 0) {
    std::filesystem::create_directories(dir);
    hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t g = H5Gcreate2(f, "model", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    auto write = [&](const std::string& name, int64_t k, const std::vector<int64_t>& shape) {
      const at::Tensor v = formula(k, shape).contiguous();
      std::vector<hsize_t> dims(shape.begin(), shape.end());
      hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
      hid_t ds = H5Dcreate2(g, name.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT,
                            H5P_DEFAULT);
      H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data_ptr());
      H5Dclose(ds);
      H5Sclose(space);
    };
    for (const auto& [name, kt] : expected_tensors()) write(name, kt.first, kt.second);
    write("scale", 5, {kOut});
    write("unused", 6, {3});
    H5Gclose(g);
    H5Fclose(f);
  }
  raw_mpi::barrier();
  for (const auto& layout : layouts()) {
    Model m = build(layout, kHidden, [](MlpImpl& n) {
      n.register_buffer("scale", at::zeros({kOut}));
    });
    fsdp::LoadWeightsOptions o;
    o.prefix = "model/";
    const auto r = fsdp::load_weights(path, *m.net, o);
    BOOST_TEST(r.format == "hdf5");
    BOOST_TEST(r.tensors_loaded == 5);
    BOOST_TEST(r.unexpected == std::vector<std::string>{"unused"}, layout);
    expect_formula(m, "hdf5 " + layout);
    BOOST_TEST(at::equal(local_tensors(*m.net).at("scale"), formula(5, {kOut})), layout);
    const int64_t mine = local_bytes(m) + kOut * 4;  // + the buffer, whole
    BOOST_TEST(r.bytes_read == mine, layout << ": read " << r.bytes_read << ", pieces " << mine);
  }
}

BOOST_AUTO_TEST_CASE(test_dcp_into_other_layouts) {  // [ours]
  const std::string dir = scratch("dcp");
  dcpt::Built saved = dcpt::build("fsdp");
  dcpt::train_step(saved, 0);
  fsdp::dcp::save(dir, dcpt::state_of(saved));
  const auto want = dcpt::global_tensors(saved);
  for (const auto& layout : dcpt::layouts_for(spmd::world_size())) {
    dcpt::Built fresh = dcpt::build(layout, /*seed=*/77);  // other values, other layout
    fsdp::LoadWeightsOptions o;
    o.prefix = "model/";
    const auto r = fsdp::load_weights(dir, *fresh.net, o);  // the root: its newest step
    BOOST_TEST(r.format == "dcp");
    BOOST_TEST(r.missing.empty());
    // pp2: the other stage's tensors are in the checkpoint, not in this module.
    if (layout != "pp2") BOOST_TEST(r.unexpected.empty(), layout);
    BOOST_TEST(r.tensors_loaded == static_cast<int64_t>(local_tensors(*fresh.net).size()));
    const auto got = dcpt::global_tensors(fresh);
    int64_t compared = 0;
    for (const auto& [name, t] : got) {
      if (name.rfind("model/", 0) != 0) continue;  // optimizer state and table are not weights
      ++compared;
      BOOST_TEST(at::equal(t, want.at(name)), layout << ": " << name << " differs");
    }
    BOOST_TEST(compared > 0);
  }
}

#ifdef FSDP_CHECKPOINT_TOOL
// What `fsdp-checkpoint export` writes from a distributed checkpoint (HDF5
// with groups, safetensors), loaded into every layout of dcp_util.h: FSDP on
// dim 0 and 1, HSDP, TP + FSDP (StridedShard), pipeline stages, EP experts
// (3-D, Shard(0)), plain.
BOOST_AUTO_TEST_CASE(test_exported_files) {  // [ours]
  const std::string dir = scratch("export");
  dcpt::Built saved = dcpt::build("fsdp");
  dcpt::train_step(saved, 0);
  fsdp::dcp::save(dir + "/ckpt", dcpt::state_of(saved));
  const auto want = dcpt::global_tensors(saved);
  int rc = 0;
  if (spmd::rank() == 0) {
    for (const char* ext : {".h5", ".safetensors"}) {
      const std::string cmd = std::string(FSDP_CHECKPOINT_TOOL) + " export " + dir +
                              "/ckpt --only model/ --to " + dir + "/model" + ext + " > " + dir +
                              "/export" + ext + ".log 2>&1";
      rc = rc != 0 ? rc : std::system(cmd.c_str());
    }
  }
  BOOST_REQUIRE(raw_mpi::max_over_ranks(rc) == 0);
  for (const char* ext : {".h5", ".safetensors"}) {
    for (const auto& layout : dcpt::layouts_for(spmd::world_size())) {
      dcpt::Built fresh = dcpt::build(layout, /*seed=*/77);
      fsdp::LoadWeightsOptions o;
      o.prefix = "model/";
      const auto r = fsdp::load_weights(dir + "/model" + ext, *fresh.net, o);
      BOOST_TEST(r.format == (std::string(ext) == ".h5" ? "hdf5" : "safetensors"));
      if (layout != "pp2") BOOST_TEST(r.unexpected.empty(), ext << " " << layout);
      for (const auto& [name, t] : dcpt::global_tensors(fresh)) {
        if (name.rfind("model/", 0) != 0) continue;
        BOOST_TEST(at::equal(t, want.at(name)), ext << " " << layout << ": " << name << " differs");
      }
    }
  }
}
#endif

BOOST_AUTO_TEST_CASE(test_missing_tensor) {  // [ours]
  for (const auto& layout : layouts()) {
    auto extra = [](MlpImpl& n) { n.register_parameter("extra", at::full({3}, 2.0)); };
    Model m = build(layout, kHidden, extra);
    expect_error<fsdp::ArgumentError>(
        [&] { fsdp::load_weights(kFixture, *m.net); }, *m.net, {"'extra'", kFixture},
        "strict " + layout,
        [](const fsdp::ArgumentError& e) { BOOST_TEST(e.argument() == "path"); });
    fsdp::LoadWeightsOptions o;
    o.strict = false;
    const auto r = fsdp::load_weights(kFixture, *m.net, o);
    BOOST_TEST(r.missing == std::vector<std::string>{"extra"}, layout);
    BOOST_TEST(r.tensors_loaded == 4);
    expect_formula(m, "strict=false " + layout);
    for (const auto& [name, t] : local_tensors(*m.net)) {
      if (name == "extra") BOOST_TEST(at::all(t == 2.0).item<bool>(), layout << ": extra changed");
    }
  }
}

BOOST_AUTO_TEST_CASE(test_shape_mismatch) {  // [ours]
  for (const auto& layout : layouts()) {
    Model m = build(layout, 36);
    expect_error<fsdp::ShapeError>([&] { fsdp::load_weights(kFixture, *m.net); }, *m.net,
                                   {"'fc1.bias'", "[37]", "[36]", kFixture}, "shape " + layout);
  }
}

BOOST_AUTO_TEST_CASE(test_truncated_and_corrupt_files) {  // [ours]
  const std::string dir = scratch("broken");
  const std::string truncated = dir + "/truncated.safetensors";
  const std::string garbage = dir + "/garbage.safetensors";
  if (spmd::rank() == 0) {
    std::filesystem::create_directories(dir);
    std::ifstream in(kFixture, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto kept = static_cast<std::streamsize>(bytes.size() - 100);
    std::ofstream(truncated, std::ios::binary).write(bytes.data(), kept);
    const std::string text = "{\"fc1.weight\": nonsense";
    std::string g(8, '\0');
    g[0] = static_cast<char>(text.size());
    std::ofstream(garbage, std::ios::binary) << g << text;
  }
  raw_mpi::barrier();
  for (const auto& layout : layouts()) {
    Model m = build(layout);
    auto corrupt = [](const CheckpointError& e) {
      BOOST_TEST(fsdp::dcp::to_string(e.kind()) == "corrupt");
    };
    // The last 100 bytes held fc2.weight's end (and half.weight).
    expect_error<CheckpointError>([&] { fsdp::load_weights(truncated, *m.net); }, *m.net,
                                  {truncated, "truncated"}, "truncated " + layout, corrupt);
    expect_error<CheckpointError>([&] { fsdp::load_weights(garbage, *m.net); }, *m.net,
                                  {garbage, "JSON"}, "bad header " + layout, corrupt);
  }
}

// A safetensors file is untrusted input: headers that would make one
// tensor's bytes another's, point past the file, size an allocation beyond
// int64 or the format's header bound, or nest without end are refused
// before anything is read; a FIFO is refused without opening it (which
// would block). fc1.bias is 37 floats = 148 bytes.
BOOST_AUTO_TEST_CASE(test_untrusted_safetensors_headers) {  // [ours]
  const std::string dir = scratch("untrusted");
  // <dir>/<name>.safetensors: `header` then `data_bytes` zero bytes; with
  // `claimed` > 0, the length field says that and the file is sparse up to it.
  auto write = [&](const std::string& name, const std::string& header, int64_t data_bytes,
                   uint64_t claimed = 0) {
    const std::string path = dir + "/" + name + ".safetensors";
    if (spmd::rank() == 0) {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      uint64_t n = claimed ? claimed : header.size();
      for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
      out << header << std::string(static_cast<size_t>(data_bytes), '\0');
      out.close();
      if (claimed) std::filesystem::resize_file(path, 8 + claimed + 16);
    }
    return path;
  };
  const std::string bias = R"("fc1.bias": {"dtype": "F32", "shape": [37], "data_offsets": )";
  if (spmd::rank() == 0) std::filesystem::create_directories(dir);
  raw_mpi::barrier();
  const std::string overlap = write(
      "overlap", "{" + bias + R"([0, 148]}, "fc2.bias": {"dtype": "F32", "shape": [8], )"
                 R"("data_offsets": [100, 132]}})", 148);
  const std::string past_end = write("past-end", "{" + bias + "[4096, 4244]}}", 148);
  const std::string huge = write(
      "huge", "{" + bias + R"([0, 148]}, "x": {"dtype": "F32", "shape": [1099511627776, )"
              R"(1099511627776], "data_offsets": [148, 148]}})", 148);
  const std::string deep =
      write("deep", std::string(100000, '[') + std::string(100000, ']'), 0);
  // A header length of 150 MB in a (sparse) file long enough to hold it.
  const std::string long_header = write("long-header", "{}", 0, 150'000'000);
  const std::string fifo = dir + "/fifo.safetensors";
  if (spmd::rank() == 0) {
    std::filesystem::remove(fifo);
    BOOST_TEST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  }
  raw_mpi::barrier();
  Model m = build(spmd::world_size() > 1 ? "fsdp" : "plain");
  fsdp::LoadWeightsOptions lenient;
  lenient.strict = false;
  auto corrupt = [](const CheckpointError& e) {
    BOOST_TEST(fsdp::dcp::to_string(e.kind()) == "corrupt");
  };
  const std::vector<std::tuple<std::string, std::vector<std::string>, std::string>> cases = {
      {overlap, {"'fc2.bias'", "overlapping those of 'fc1.bias'", "[0, 148)"}, "overlap"},
      {past_end, {"'fc1.bias'", "the file ends at"}, "offsets past the end"},
      {huge, {"'x'", "more than 2^63 bytes"}, "2^80 elements"},
      {deep, {"nested more than 16 deep"}, "deep nesting"},
      {long_header, {"150000000 bytes", "safetensors allows 100000000"}, "header bound"},
  };
  for (const auto& [path, words, what] : cases) {
    std::vector<std::string> w = words;
    w.push_back(path);
    expect_error<CheckpointError>([&] { fsdp::load_weights(path, *m.net, lenient); }, *m.net, w,
                                  what, corrupt);
  }
  auto argument_path = [](const fsdp::ArgumentError& e) { BOOST_TEST(e.argument() == "path"); };
  expect_error<fsdp::ArgumentError>([&] { fsdp::load_weights(fifo, *m.net); }, *m.net,
                                    {fifo, "not a regular file"}, "a FIFO", argument_path);
}

BOOST_AUTO_TEST_CASE(test_path_errors) {  // [ours]
  Model m = build(spmd::world_size() > 1 ? "fsdp" : "plain");
  const std::string dir = scratch("paths");
  if (spmd::rank() == 0) std::filesystem::create_directories(dir);
  raw_mpi::barrier();
  auto argument_path = [](const fsdp::ArgumentError& e) { BOOST_TEST(e.argument() == "path"); };
  expect_error<fsdp::ArgumentError>(
      [&] { fsdp::load_weights(dir + "/no-such-file.safetensors", *m.net); }, *m.net,
      {"no-such-file.safetensors"}, "no such path", argument_path);
  expect_error<fsdp::ArgumentError>([&] { fsdp::load_weights(dir, *m.net); }, *m.net,
                                    {dir, "distributed checkpoint"}, "empty directory",
                                    argument_path);
}

// One rank failing alone (its prefix names nothing in the file) must stop
// every rank, and nothing is installed anywhere.
BOOST_AUTO_TEST_CASE(test_one_rank_fails_all_stop) {  // [ours]
  Model m = build(spmd::world_size() > 1 ? "fsdp" : "plain");
  const int last = spmd::world_size() - 1;
  fsdp::LoadWeightsOptions o;
  if (spmd::rank() == last) o.prefix = "nope/";
  std::vector<std::string> words = {"nope/"};
  if (spmd::world_size() > 1) words.push_back("rank " + std::to_string(last));
  expect_error<fsdp::ArgumentError>([&] { fsdp::load_weights(kFixture, *m.net, o); }, *m.net,
                                    words, "one rank fails");
}
