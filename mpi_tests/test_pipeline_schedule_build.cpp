// Pipeline schedules as data (fsdp/pipeline.h) [ours]: build_schedule against
// literal tables derived by hand for small cases and against
// reference_schedule (common/pipeline_schedule_util.h), an independent
// implementation of the simulation, itself checked against the hand tables
// before it is trusted for the sweep over (kind, pp, v, n). Part of the test_pipeline_schedule
// executable (np 1, gpu1; labels L2, pp).
#include "pipeline_schedule_util.h"

namespace {

struct HandCase {
  const char* label;
  ScheduleKind kind;
  int pp_size, v, n;
  const std::vector<std::vector<std::string>>* table;
};

const std::vector<HandCase> kHandCases = {
    {"GPipe pp 2 n 2", ScheduleKind::GPipe, 2, 1, 2, &kGPipe2x2},
    {"1F1B pp 2 n 4", ScheduleKind::OneFOneB, 2, 1, 4, &k1F1B2x4},
    {"Interleaved pp 2 v 2 n 2", ScheduleKind::Interleaved1F1B, 2, 2, 2, &kInterleaved2x2x2},
    {"Interleaved pp 1 v 2 n 1", ScheduleKind::Interleaved1F1B, 1, 2, 1, &kInterleaved1x2x1},
};

// Every valid (kind, pp, v, n) with pp <= 4, v <= 3 (interleaved), n <= 8.
struct Config {
  ScheduleKind kind;
  int pp_size, v, n;
};

std::vector<Config> sweep() {
  std::vector<Config> out;
  for (int p = 1; p <= 4; ++p) {
    for (int n = 1; n <= 8; ++n) {
      out.push_back({ScheduleKind::GPipe, p, 1, n});
      if (n >= p) out.push_back({ScheduleKind::OneFOneB, p, 1, n});
      if (n >= p && n % p == 0) {
        for (int v = 1; v <= 3; ++v) out.push_back({ScheduleKind::Interleaved1F1B, p, v, n});
      }
    }
  }
  return out;
}

std::string config_label(const Config& c) {
  std::ostringstream os;
  os << kind_name(c.kind) << " pp " << c.pp_size << " v " << c.v << " n " << c.n;
  return os.str();
}

}  // namespace

// ---- exact schedules --------------------------------------------------------

// The test's own simulator reproduces every hand-derived table (so a slip
// in either shows here, before the sweep relies on the simulator).
BOOST_AUTO_TEST_CASE(test_reference_simulator_matches_hand_tables) {  // [ours]
  for (const HandCase& c : kHandCases) {
    BOOST_TEST_CONTEXT(c.label) {
      const std::string diff =
          schedule_difference(reference_schedule(c.kind, c.pp_size, c.v, c.n), parse_table(*c.table));
      BOOST_TEST(diff.empty(), diff);
    }
  }
}

BOOST_AUTO_TEST_CASE(test_build_schedule_hand_derived) {  // [ours]
  for (const HandCase& c : kHandCases) {
    BOOST_TEST_CONTEXT(c.label) {
      const Schedule want = parse_table(*c.table);
      const Schedule got = pp::build_schedule(c.kind, c.pp_size, c.v, c.n);
      const std::string diff = schedule_difference(got, want);
      BOOST_TEST(diff.empty(), diff);
      // The hand tables are valid schedules.
      const std::string why = pp::check_schedule(want, c.pp_size, c.pp_size * c.v, c.n);
      BOOST_TEST(why.empty(), "check_schedule rejects the hand table: " << why);
    }
  }
}

// Every valid configuration: passes check_schedule; every F and B of every
// (stage, microbatch) exactly once, on the stage's rank; all ranks the same
// slot count; each rank's F/B sequence is its compute order; and the slots
// equal the reference simulation's.
BOOST_AUTO_TEST_CASE(test_build_schedule_sweep) {  // [ours]
  const std::vector<Config> configs = sweep();
  BOOST_TEST(configs.size() > 80u);
  for (const Config& c : configs) {
    BOOST_TEST_CONTEXT(config_label(c)) {
      const int S = c.pp_size * c.v;
      Schedule got;
      try {
        got = pp::build_schedule(c.kind, c.pp_size, c.v, c.n);
      } catch (const std::exception& e) {
        BOOST_ERROR("build_schedule threw: " << e.what());
        continue;
      }
      BOOST_TEST_REQUIRE(got.size() == static_cast<size_t>(c.pp_size));
      const std::string why = pp::check_schedule(got, c.pp_size, S, c.n);
      BOOST_TEST(why.empty(), "check_schedule: " << why);

      std::map<std::tuple<int, int, int>, int> seen;  // (F=0/B=1, stage, mb) -> count
      for (int r = 0; r < c.pp_size; ++r) {
        BOOST_TEST(got[r].size() == got[0].size(), "rank " << r << " slot count");
        std::vector<Action> fb;
        for (const Slot& slot : got[r]) {
          for (const Action& a : slot.compute) {
            if (!is_fb(a)) continue;
            fb.push_back(a);
            ++seen[{a.type == ActionType::Backward ? 1 : 0, a.stage, a.microbatch}];
            BOOST_TEST(pp::stage_rank(a.stage, c.pp_size) == r,
                       spell(a) << " runs on rank " << r);
            BOOST_TEST(a.stage % c.pp_size == r, spell(a) << " runs on rank " << r);
          }
        }
        const std::vector<Action> order = compute_order(c.kind, c.pp_size, c.v, c.n, r);
        BOOST_TEST((fb == order), "rank " << r << " runs [" << spell(fb) << "], order is ["
                                        << spell(order) << "]");
      }
      BOOST_TEST(seen.size() == static_cast<size_t>(2 * S * c.n), "distinct F/B actions");
      for (int fb = 0; fb < 2; ++fb) {
        for (int s = 0; s < S; ++s) {
          for (int m = 0; m < c.n; ++m) {
            const auto it = seen.find({fb, s, m});
            const int count = it == seen.end() ? 0 : it->second;
            BOOST_TEST(count == 1, (fb ? "B" : "F") << " of stage " << s << " mb " << m
                                                    << " runs " << count << " times");
          }
        }
      }
      const std::string diff =
          schedule_difference(got, reference_schedule(c.kind, c.pp_size, c.v, c.n));
      BOOST_TEST(diff.empty(), diff);
    }
  }
}
