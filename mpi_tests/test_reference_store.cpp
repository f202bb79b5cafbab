// The HDF5 reference store (reference/): round trip of every record field,
// atomic replacement, and the stale / missing reference errors the L3
// suites rely on ("stale reference for CASE: ... regenerate with ...").
#include "spmd.h"

#include <reference/case.h>
#include <reference/store.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <string>

namespace {

// A registered case whose config differs by one field: its hash differs.
class EditedCase : public ref::Case {
 public:
  explicit EditedCase(std::unique_ptr<ref::Case> base) : base_(std::move(base)) {}
  std::string name() const override { return base_->name(); }
  std::vector<std::string> plan_ids() const override { return base_->plan_ids(); }
  nlohmann::json config() const override {
    auto c = base_->config();
    c["global_batch"] = c["global_batch"].get<int64_t>() * 2;
    return c;
  }
  std::shared_ptr<torch::nn::Module> build() const override { return base_->build(); }
  std::vector<ref::Unit> shard(const std::shared_ptr<torch::nn::Module>& m,
                               const fsdp::FullyShardOptions& o) const override {
    return base_->shard(m, o);
  }
  ref::LocalLoss forward(const std::shared_ptr<torch::nn::Module>& m, int64_t step, int64_t rank,
                         int64_t world) const override {
    return base_->forward(m, step, rank, world);
  }
  std::vector<std::string> recorded() const override { return base_->recorded(); }

 private:
  std::unique_ptr<ref::Case> base_;
};

ref::RunRecord sample_record() {
  ref::RunRecord r;
  for (int k = 0; k < 2; ++k) {
    ref::StepRecord s;
    s.loss = 1.25 + k;
    s.grad_norm = 0.5 / (k + 1);
    s.norms["vision"] = 0.125 * (k + 1);
    s.chunk_losses = {0.5 + k, 0.75 + k};
    s.grads["a.weight"] = at::arange(12, at::kFloat).view({3, 4}) * (k + 1);
    s.params["a.weight"] = at::randn({3, 4});
    r.steps.push_back(s);
  }
  return r;
}

std::string scratch_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("fsdp-ref-store-" + std::to_string(::getpid()) + "-" + std::to_string(spmd::rank()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

}  // namespace

BOOST_AUTO_TEST_CASE(test_reference_round_trip) {
  auto c = ref::make_case("multimodal");
  const std::string dir = scratch_dir();
  const std::string path = ref::reference_path(dir, "cpu", c->name());
  const ref::RunRecord rec = sample_record();
  ref::write_reference(path, *c, rec);
  ref::write_reference(path, *c, rec);  // replacing an existing file works
  const ref::StoredReference back = ref::read_reference(path, *c);
  BOOST_TEST(back.config_hash == ref::config_hash(*c));
  BOOST_TEST(back.config_json == c->config().dump());
  BOOST_REQUIRE_EQUAL(back.record.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    const auto& a = rec.steps[k];
    const auto& b = back.record.steps[k];
    BOOST_TEST(a.loss == b.loss);
    BOOST_TEST(a.grad_norm == b.grad_norm);
    BOOST_TEST(a.norms == b.norms);
    BOOST_TEST(a.chunk_losses == b.chunk_losses);
    BOOST_TEST(at::equal(a.grads.at("a.weight"), b.grads.at("a.weight")));
    BOOST_TEST(at::equal(a.params.at("a.weight"), b.params.at("a.weight")));
  }
  // No temporary files left behind by the atomic write.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/cpu")) files += e.is_regular_file();
  BOOST_TEST(files == 1);
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(test_stale_reference_is_reported) {
  auto c = ref::make_case("vit");
  const std::string dir = scratch_dir();
  const std::string path = ref::reference_path(dir, "cpu", c->name());
  ref::write_reference(path, *c, sample_record());
  EditedCase edited(ref::make_case("vit"));
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
  try {
    ref::read_reference(ref::reference_path(dir, "cpu", "nowhere"), *c);
    BOOST_FAIL("a missing reference was accepted");
  } catch (const ref::StaleReference& e) {
    BOOST_TEST(std::string(e.what()).find("missing reference for vit") != std::string::npos, e.what());
  }
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(test_committed_references_are_current) {
  // Every registered case has a committed reference matching its config.
  for (const auto& name : ref::case_names()) {
    auto c = ref::make_case(name);
    const std::string path = ref::reference_path(ref::default_reference_dir(), "cpu", name);
    BOOST_CHECK_NO_THROW(ref::read_reference(path, *c));
  }
  BOOST_CHECK_THROW(ref::make_case("no_such_case"), std::invalid_argument);
}
