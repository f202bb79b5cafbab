// L0 [ours]: every bad input to the public API gets a typed error (issue 14):
// DeviceMesh, DTensor / placements, tensor parallel, pipeline, moe and
// activation checkpointing (fully_shard, FSDPModule and clip_grad are in
// test_bad_input_fully_shard.cpp). Part of the test_bad_input executable (np 2, gpu2).
//
// The checker and the count of cases by outcome: common/bad_input_util.h.
#include "bad_input_util.h"

namespace bad_input {

// ---------------------------------------------------------------------------
// DeviceMesh (shape, dim names, device strings and slicing by name are in
// test_comm_errors.cpp)

std::vector<Case> mesh_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  auto two_d = [] { return fsdp::init_device_mesh(dev_type(), {world(), 1}, {"dp", "tp"}); };
  std::vector<Case> cases = {
      expect<MeshError>(F, "init_device_mesh(kCUDA) without CUDA", "device_type",
                        [] { fsdp::init_device_mesh(c10::kCUDA, {world()}); }),
      expect<MeshError>(F, "init_device_mesh(\"cuda\") without CUDA", "device_type",
                        [] { fsdp::init_device_mesh("cuda", {world()}); }),
      expect<MeshError>(T, "unflatten(dim 2) of a 2-D mesh", "dim",
                        [two_d] { two_d().unflatten(2, {1}, {"x"}); }),
      expect<MeshError>(T, "unflatten(\"pp\") unknown dim", "dim",
                        [two_d] { two_d().unflatten("pp", {1}, {"x"}); }),
      expect<MeshError>(T, "unflatten with no sizes", "sizes",
                        [two_d] { two_d().unflatten(0, {}, {}); }),
      expect<MeshError>(T, "unflatten with a size 0", "sizes",
                        [two_d] { two_d().unflatten(0, {0, world()}, {"x", "y"}); }),
      expect<MeshError>(T, "unflatten sizes whose product is not the dim's", "sizes",
                        [two_d] { two_d().unflatten(0, {world(), 2}, {"x", "y"}); }),
      expect<MeshError>(T, "unflatten with fewer names than sizes", "names",
                        [two_d] { two_d().unflatten(0, {1, world()}, {"x"}); }),
      expect<MeshError>(T, "unflatten with an empty name", "names",
                        [two_d] { two_d().unflatten(0, {1, world()}, {"x", ""}); }),
      expect<MeshError>(T, "unflatten with a name another dim has", "names",
                        [two_d] { two_d().unflatten(0, {1, world()}, {"x", "tp"}); }),
      expect<MeshError>(T, "concatenate({})", "meshes", [] { fsdp::DeviceMesh::concatenate({}); }),
      expect<MeshError>(T, "concatenate slices of two roots", "meshes", [two_d] {
        const auto a = two_d();
        const auto b = fsdp::init_device_mesh(dev_type(), {world(), 1}, {"x", "y"});
        fsdp::DeviceMesh::concatenate({a["dp"], b["y"]});
      }),
      expect<MeshError>(T, "concatenate a dim twice", "meshes", [two_d] {
        const auto a = two_d();
        fsdp::DeviceMesh::concatenate({a["dp"], a["dp"]});
      }),
      expect<MeshError>(T, "dim_index(\"pp\")", "dim_name", [two_d] { two_d().dim_index("pp"); }),
      expect<MeshError>(T, "get_group(2) of a 2-D mesh", "dim", [two_d] { two_d().get_group(2); }),
      expect<MeshError>(T, "size(-1)", "dim", [two_d] { two_d().size(-1); }),
  };
  cases[0].needs_no_cuda = cases[1].needs_no_cuda = true;
  return cases;
}

// ---------------------------------------------------------------------------
// DTensor and placements

std::vector<Case> dtensor_cases() {
  const Outcome T = Outcome::Typed;
  auto local = [] { return at::zeros({2, 4}, opts()); };
  return {
      expect<ArgumentError>(T, "Placement::Partial(MAX)", "op",
                            [] { Placement::Partial(fsdp::ReduceOp::MAX); }),
      expect<ArgumentError>(T, "Placement::StridedShard(0, 0)", "split_factor",
                            [] { Placement::StridedShard(0, 0); }),
      expect<ArgumentError>(T, "from_local with two placements on a 1-D mesh", "placements",
                            [local] {
                              DTensor::from_local(local(), world_mesh(),
                                                  {Placement::Shard(0), Placement::Replicate()},
                                                  std::vector<int64_t>{2 * world(), 4});
                            }),
      expect<ArgumentError>(T, "from_local Shard(2) of a 2-D tensor", "placements", [local] {
        DTensor::from_local(local(), world_mesh(), {Placement::Shard(2)},
                            std::vector<int64_t>{2, 4 * world()});
      }),
      // Nothing inside: 3 counts fused pieces, and 2w rows do not cut into 3.
      expect<ShapeError>(T, "from_local StridedShard(0, 3) of 2w rows", "placements", [local] {
                              DTensor::from_local(local(), world_mesh(),
                                                  {Placement::StridedShard(0, 3)},
                                                  std::vector<int64_t>{2 * world(), 4});
                            }),
      expect<ArgumentError>(T, "from_local of an undefined tensor", "local", [] {
        DTensor::from_local(at::Tensor(), world_mesh(), {Placement::Replicate()});
      }),
      expect<ShapeError>(T, "from_local with a 1-D shape for a 2-D local", "shape", [local] {
        DTensor::from_local(local(), world_mesh(), {Placement::Shard(0)},
                            std::vector<int64_t>{2 * world()});
      }),
      expect<ShapeError>(T, "from_local whose local rows do not fit the given shape", "local",
                         [local] {
                           DTensor::from_local(local(), world_mesh(), {Placement::Shard(0)},
                                               std::vector<int64_t>{7 * world(), 4});
                         }),
      expect<ArgumentError>(T, "redistribute to two placements on a 1-D mesh", "placements",
                            [local] {
                              DTensor::from_local(local(), world_mesh(), {Placement::Shard(0)},
                                                  std::vector<int64_t>{2 * world(), 4})
                                  .redistribute({Placement::Replicate(), Placement::Replicate()});
                            }),
      expect<ArgumentError>(T, "distribute_tensor of an undefined tensor", "full", [] {
        fsdp::distribute_tensor(at::Tensor(), world_mesh(), {Placement::Replicate()});
      }),
      expect<ArgumentError>(T, "distribute_tensor with no placements", "placements", [local] {
        fsdp::distribute_tensor(local(), world_mesh(), {});
      }),
      expect<ArgumentError>(T, "redistribute_local with two grad placements", "grad_placements",
                            [local] {
                              fsdp::redistribute_local(
                                  local(), world_mesh(), {Placement::Replicate()},
                                  {Placement::Replicate()}, {2, 4},
                                  std::vector<Placement>{Placement::Replicate(),
                                                         Placement::Replicate()});
                            }),
  };
}

// ---------------------------------------------------------------------------
// tensor parallel

fsdp::DeviceMesh tp_mesh() { return world_mesh(); }

std::vector<Case> tp_cases() {
  const Outcome T = Outcome::Typed;
  namespace tp = fsdp::tp;
  return {
      expect<ShapeError>(T, "ColumnParallelLinear out_features 2w+1", "out_features",
                         [] { tp::ColumnParallelLinear(8, 2 * world() + 1, tp_mesh()); }),
      expect<ShapeError>(T, "ColumnParallelLinear fused_pieces 3 over out_features 4w",
                         "out_features", [] {
                           tp::ColumnParallelOptions o;
                           o.fused_pieces = 3;
                           tp::ColumnParallelLinear(8, 4 * world(), tp_mesh(), o);
                         }),
      expect<ShapeError>(T, "RowParallelLinear in_features 2w+1", "in_features",
                         [] { tp::RowParallelLinear(2 * world() + 1, 8, tp_mesh()); }),
      expect<ShapeError>(T, "VocabParallelEmbedding num_embeddings 2w+1", "num_embeddings",
                         [] { tp::VocabParallelEmbedding(2 * world() + 1, 4, tp_mesh()); }),
      expect<MeshError>(T, "ColumnParallelLinear on a 2-D mesh", "tp", [] {
        tp::ColumnParallelLinear(8, 8, fsdp::init_device_mesh(dev_type(), {world(), 1}));
      }),
      expect<ShapeError>(T, "local_size(\"heads\", 2w+1)", "heads",
                         [] { tp::local_size("heads", 2 * world() + 1, tp_mesh()); }),
      expect<ShapeError>(T, "ColumnParallelLinear::load_full with a transposed weight", "weight",
                         [] {
                           tp::ColumnParallelLinear l(8, 2 * world(), tp_mesh());
                           l->to(spmd::device());
                           l->load_full(at::zeros({8, 2 * world()}, opts()),
                                        at::zeros({2 * world()}, opts()));
                         }),
      expect<ArgumentError>(T, "VocabParallelEmbedding ids >= num_embeddings", "ids", [] {
        tp::VocabParallelEmbedding e(2 * world(), 4, tp_mesh());
        e->to(spmd::device());
        e(at::full({3}, 2 * world(), opts(at::kLong)));
      }),
  };
}

// ---------------------------------------------------------------------------
// pipeline

std::vector<Case> pipeline_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  namespace pp = fsdp::pp;
  auto stage = [](std::shared_ptr<torch::nn::Module> m, int index, int n, fsdp::DeviceMesh mesh) {
    pp::PipelineStage(std::move(m), [](const at::Tensor& x) { return x; }, index, n,
                      std::move(mesh));
  };
  auto module = [] { return std::make_shared<torch::nn::Module>(); };
  return {
      expect<ArgumentError>(T, "build_schedule with pp_size 0", "pp_size",
                            [] { pp::build_schedule(pp::ScheduleKind::OneFOneB, 0, 1, 4); }),
      expect<ArgumentError>(T, "build_schedule GPipe with 2 stages per rank", "stages_per_rank",
                            [] { pp::build_schedule(pp::ScheduleKind::GPipe, 2, 2, 4); }),
      expect<ArgumentError>(T, "build_schedule 1F1B with fewer microbatches than ranks",
                            "n_microbatches",
                            [] { pp::build_schedule(pp::ScheduleKind::OneFOneB, 2, 1, 1); }),
      expect<ArgumentError>(T, "build_schedule interleaved with 3 microbatches on 2 ranks",
                            "n_microbatches", [] {
                              pp::build_schedule(pp::ScheduleKind::Interleaved1F1B, 2, 2, 3);
                            }),
      expect<ArgumentError>(T, "PipelineStage with a null module", "module",
                            [stage] { stage(nullptr, 0, static_cast<int>(world()), world_mesh()); }),
      expect<ArgumentError>(T, "PipelineStage with stage_index = num_stages", "stage_index",
                            [stage, module] {
                              stage(module(), static_cast<int>(world()),
                                    static_cast<int>(world()), world_mesh());
                            }),
      expect<ArgumentError>(T, "PipelineStage with num_stages 0", "num_stages",
                            [stage, module] { stage(module(), 0, 0, world_mesh()); }),
      expect<ArgumentError>(T, "PipelineStage on a 2-D mesh", "pp_mesh", [stage, module] {
        stage(module(), 0, static_cast<int>(world()),
              fsdp::init_device_mesh(dev_type(), {world(), 1}));
      }),
      expect<ArgumentError>(T, "Schedule with no stages", "stages", [] {
        pp::Schedule(std::vector<pp::PipelineStage>{}, pp::ScheduleKind::GPipe, 2, pp::LossSpec{});
      }),
      // The message did not quote 'schedule'.
      expect<ArgumentError>(F, "parse_schedule_kind(\"zigzag\")", "schedule",
                            [] { pp::parse_schedule_kind("zigzag"); }),
  };
}

// ---------------------------------------------------------------------------
// mixture of experts

std::vector<Case> moe_cases() {
  const Outcome T = Outcome::Typed, F = Outcome::Fixed;
  namespace moe = fsdp::moe;
  return {
      expect<ArgumentError>(T, "TopKRouter with 0 experts", "num_experts",
                            [] { moe::TopKRouter(8, 0, 1); }),
      expect<ArgumentError>(T, "TopKRouter top_k 5 of 4 experts", "top_k",
                            [] { moe::TopKRouter(8, 4, 5); }),
      expect<ArgumentError>(T, "TopKRouter dim 0", "dim", [] { moe::TopKRouter(0, 4, 1); }),
      expect<ArgumentError>(T, "TopKRouter route_scale 0", "options", [] {
        moe::RouterOptions o;
        o.route_scale = 0;
        moe::TopKRouter(8, 4, 1, o);
      }),
      expect<ArgumentError>(T, "TokenDispatcher 2w+1 experts over ep of w ranks", "num_experts",
                            [] { moe::TokenDispatcher(2 * world() + 1, world_mesh()); }),
      expect<ArgumentError>(T, "expert_options data_parallel_size 0", "data_parallel_size", [] {
        moe::GroupedExperts e(4, 8, 2 * world(), world_mesh());
        moe::expert_options(*e, base_options(), world_mesh(), 0.0);
      }),
      // These two named their argument without quoting it (and the margin
      // blamed 'top_k' for a bad 'scores' shape).
      expect<ArgumentError>(F, "routing_margin top_k 0", "top_k",
                            [] { moe::routing_margin(at::rand({3, 4}), 0); }),
      expect<ShapeError>(F, "routing_margin of 1-D scores", "scores",
                         [] { moe::routing_margin(at::rand({4}), 1); }),
      expect<ShapeError>(F, "GroupedExperts::forward counts not summing to the rows", "counts", [] {
        moe::GroupedExperts e(4, 8, 2);
        e->forward(at::zeros({3, 4}), {1, 1});
      }),
  };
}

// ---------------------------------------------------------------------------
// activation checkpointing

std::vector<Case> checkpoint_cases() {
  const Outcome T = Outcome::Typed;
  return {
      expect<ArgumentError>(T, "checkpoint with an empty fn", "fn", [] {
        fsdp::activation_checkpoint(fsdp::ActivationCheckpointFunction(), std::vector<at::Tensor>{at::zeros({2}, opts())},
                         std::vector<at::Tensor>{});
      }),
      expect<ArgumentError>(T, "checkpoint with an undefined input", "inputs", [] {
        fsdp::activation_checkpoint(
            fsdp::ActivationCheckpointFunction([](const std::vector<at::Tensor>& in) { return in[0]; }),
            std::vector<at::Tensor>{at::Tensor()}, std::vector<at::Tensor>{});
      }),
      expect<ArgumentError>(T, "activation_checkpoint_module(nullptr)", "module",
                            [] { fsdp::activation_checkpoint_module(nullptr); }),
      expect<ArgumentError>(T, "apply_activation_checkpointing with a null root", "root", [] {
        fsdp::apply_activation_checkpointing(
            nullptr, [](const std::string&, const torch::nn::Module&) {
              return std::optional<fsdp::ActivationCheckpointOptions>();
            });
      }),
      expect<ArgumentError>(T, "activation_checkpoint_every_nth(0)", "n", [] {
        fsdp::activation_checkpoint_every_nth(0, [](const torch::nn::Module&) { return true; });
      }),
  };
}

}  // namespace bad_input

using namespace bad_input;

BOOST_AUTO_TEST_CASE(test_device_mesh_bad_input) { run_cases(mesh_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_dtensor_bad_input) { run_cases(dtensor_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_tensor_parallel_bad_input) { run_cases(tp_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_pipeline_bad_input) { run_cases(pipeline_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_moe_bad_input) { run_cases(moe_cases()); }  // [ours]
BOOST_AUTO_TEST_CASE(test_activation_checkpointing_bad_input) { run_cases(checkpoint_cases()); }  // [ours]
