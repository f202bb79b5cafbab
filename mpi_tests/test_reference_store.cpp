// The HDF5 reference store (reference/): round trip of every record field,
// atomic replacement, and the stale / missing reference errors the L3
// suites rely on ("stale reference for CASE: ... regenerate with ..."), and
// that the chunked-CE baselines run no libfsdp checkpoint.
#include "spmd.h"

#include <reference/case.h>
#include <reference/store.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <ftw.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <set>
#include <string>

namespace {

// A registered case with one thing changed: the global batch, the recorded
// parameters or the named norms. Each changes the config hash.
enum class Edit { GlobalBatch, Recorded, SubNorms };

class EditedCase : public ref::Case {
 public:
  EditedCase(std::unique_ptr<ref::Case> base, Edit edit) : base_(std::move(base)), edit_(edit) {}
  std::string name() const override { return base_->name(); }
  std::vector<std::string> plan_ids() const override { return base_->plan_ids(); }
  nlohmann::json config() const override {
    auto c = base_->config();
    if (edit_ == Edit::GlobalBatch) c["global_batch"] = c["global_batch"].get<int64_t>() * 2;
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override { return base_->build(); }
  std::vector<ref::Unit> shard(const std::shared_ptr<torch::nn::Module>& m,
                               const fsdp::FullyShardOptions& o) const override {
    return base_->shard(m, o);
  }
  ref::LocalLoss forward(const std::shared_ptr<torch::nn::Module>& m, int64_t step, int64_t rank,
                         int64_t world, ref::Layout layout) const override {
    return base_->forward(m, step, rank, world, layout);
  }
  std::vector<std::string> recorded() const override {
    auto r = base_->recorded();
    if (edit_ == Edit::Recorded) r.push_back("head.weight");
    return r;
  }
  std::map<std::string, std::vector<std::string>> sub_norms() const override {
    auto n = base_->sub_norms();
    if (edit_ == Edit::SubNorms) n["head"] = {"head."};
    return n;
  }

 private:
  std::unique_ptr<ref::Case> base_;
  Edit edit_;
};

// Names of every node in the autograd graph behind `t`.
std::set<std::string> graph_node_names(const at::Tensor& t) {
  std::set<std::string> names;
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    names.insert(n->name());
    for (const auto& edge : n->next_edges()) todo.push_back(edge.function.get());
  }
  return names;
}

ref::RunRecord sample_record() {
  ref::RunRecord r;
  for (int k = 0; k < 2; ++k) {
    ref::StepRecord s;
    s.loss = 1.25 + k;
    s.grad_norm = 0.5 / (k + 1);
    s.norms["vision"] = 0.125 * (k + 1);
    s.chunk_losses = {0.5 + k, 0.75 + k};
    s.unchunked_loss = 1.25 + k;
    s.grads["a.weight"] = at::arange(12, at::kFloat).view({3, 4}) * (k + 1);
    s.params["a.weight"] = at::randn({3, 4});
    r.steps.push_back(s);
  }
  return r;
}

// nftw, not std::filesystem::remove_all: pip's LibTorch 2.11 exports a
// remove_all of its own that crashed this suite on the H200 machine (a call
// through a null PLT entry), and binds before libstdc++'s.
void remove_tree(const std::string& dir) {
  ::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); },
      16, FTW_DEPTH | FTW_PHYS);
}

std::string scratch_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("fsdp-ref-store-" + std::to_string(::getpid()) + "-" + std::to_string(spmd::rank()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_reference_round_trip) {  // [ours]
  auto c = ref::make_case("multimodal");
  const std::string dir = scratch_dir();
  const std::string path = ref::reference_path(dir, "cpu", c->name());
  const ref::RunRecord rec = sample_record();
  ref::write_reference(path, *c, rec);
  ref::write_reference(path, *c, rec);  // replacing an existing file works
  const ref::StoredReference back = ref::read_reference(path, *c);
  BOOST_TEST(back.config_hash == ref::config_hash(*c));
  BOOST_TEST(back.config_json == ref::stored_config(*c).dump());
  BOOST_REQUIRE_EQUAL(back.record.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    const auto& a = rec.steps[k];
    const auto& b = back.record.steps[k];
    BOOST_TEST(a.loss == b.loss);
    BOOST_TEST(a.grad_norm == b.grad_norm);
    BOOST_TEST(a.norms == b.norms);
    BOOST_TEST(a.chunk_losses == b.chunk_losses);
    BOOST_REQUIRE(b.unchunked_loss.has_value());
    BOOST_TEST(*a.unchunked_loss == *b.unchunked_loss);
    BOOST_TEST(at::equal(a.grads.at("a.weight"), b.grads.at("a.weight")));
    BOOST_TEST(at::equal(a.params.at("a.weight"), b.params.at("a.weight")));
  }
  // No temporary files left behind by the atomic write.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/cpu")) files += e.is_regular_file();
  BOOST_TEST(files == 1);
  remove_tree(dir);
}

BOOST_AUTO_TEST_CASE(test_stale_reference_is_reported) {  // [ours]
  auto c = ref::make_case("vit");
  const std::string dir = scratch_dir();
  const std::string path = ref::reference_path(dir, "cpu", c->name());
  ref::write_reference(path, *c, sample_record());
  // A reference recorded for fewer tensors or norms than the case now
  // compares is stale too, not compared over fewer names.
  for (Edit edit : {Edit::GlobalBatch, Edit::Recorded, Edit::SubNorms}) {
    EditedCase edited(ref::make_case("vit"), edit);
    BOOST_TEST(ref::config_hash(edited) != ref::config_hash(*c));
    try {
      ref::read_reference(path, edited);
      BOOST_FAIL("a reference with another config hash was accepted");
    } catch (const ref::StaleReference& e) {
      const std::string msg = e.what();
      BOOST_TEST(msg.find("stale reference for vit") != std::string::npos, msg);
      BOOST_TEST(msg.find("regenerate-references") != std::string::npos, msg);
      BOOST_TEST(msg.find("--case vit") != std::string::npos, msg);
    }
  }
  try {
    ref::read_reference(ref::reference_path(dir, "cpu", "nowhere"), *c);
    BOOST_FAIL("a missing reference was accepted");
  } catch (const ref::StaleReference& e) {
    BOOST_TEST(std::string(e.what()).find("missing reference for vit") != std::string::npos, e.what());
  }
  remove_tree(dir);
}

BOOST_AUTO_TEST_CASE(test_committed_references_are_current) {  // [ours]
  // Every registered case has a committed reference matching its config.
  for (const auto& name : ref::case_names()) {
    auto c = ref::make_case(name);
    const std::string path = ref::reference_path(ref::default_reference_dir(), "cpu", name);
    BOOST_CHECK_NO_THROW(ref::read_reference(path, *c));
  }
  BOOST_CHECK_THROW(ref::make_case("no_such_case"), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(test_chunked_ce_baselines_run_no_libfsdp_checkpoint) {  // [ours]
  // Plan rule 1: the single card and DDP compute the chunks in a plain loop;
  // only the FSDP layout recomputes them through fsdp::checkpoint. Both give
  // the unchunked loss and the same chunk values.
  auto c = ref::make_case("chunked_ce");
  auto model = c->build();
  const ref::LocalLoss plain = c->forward(model, 0, 0, 4, ref::Layout::Single);
  const ref::LocalLoss ddp = c->forward(model, 0, 0, 4, ref::Layout::DDP);
  const ref::LocalLoss recomputed = c->forward(model, 0, 0, 4, ref::Layout::FSDP);
  const std::string checkpoint_node = "fsdp::ActivationCheckpointBackward";
  BOOST_TEST(graph_node_names(plain.loss).count(checkpoint_node) == 0u);
  BOOST_TEST(graph_node_names(ddp.loss).count(checkpoint_node) == 0u);
  BOOST_TEST(graph_node_names(recomputed.loss).count(checkpoint_node) == 1u);
  BOOST_REQUIRE(plain.unchunked_loss.defined());
  BOOST_TEST(!plain.unchunked_loss.requires_grad());
  BOOST_TEST(plain.chunk_losses.numel() >= 1);
  BOOST_TEST(at::equal(plain.chunk_losses, recomputed.chunk_losses));
}
