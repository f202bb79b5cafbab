// Pipeline schedules as data (fsdp/pipeline.h) [ours]: the action notation,
// check_schedule finding broken schedules, argument errors of
// build_schedule, and bubble fractions. Part of the test_pipeline_schedule executable (np 1, gpu1;
// labels L2, pp).
#include "pipeline_schedule_util.h"

// ---- notation ---------------------------------------------------------------

BOOST_AUTO_TEST_CASE(test_action_to_string) {  // [ours]
  const std::vector<std::pair<Action, std::string>> cases = {
      {{ActionType::Forward, 0, 1}, "0F1"},
      {{ActionType::Backward, 1, 0}, "1B0"},
      {{ActionType::SendForward, 0, 0}, "0SEND_F0"},
      {{ActionType::RecvForward, 1, 0}, "1RECV_F0"},
      {{ActionType::SendBackward, 1, 0}, "1SEND_B0"},
      {{ActionType::RecvBackward, 0, 0}, "0RECV_B0"},
      {{ActionType::Unshard, 0, -1}, "0UNSHARD"},
      {{ActionType::ReduceGrad, 1, -1}, "1REDUCE_GRAD"},
      {{ActionType::Forward, 12, 10}, "12F10"},
      {{ActionType::RecvBackward, 7, 31}, "7RECV_B31"},
  };
  for (const auto& [a, want] : cases) BOOST_TEST(pp::to_string(a) == want);
}

BOOST_AUTO_TEST_CASE(test_stage_rank_is_looped) {  // [ours]
  BOOST_TEST(pp::stage_rank(0, 1) == 0);
  BOOST_TEST(pp::stage_rank(5, 1) == 0);
  BOOST_TEST(pp::stage_rank(0, 2) == 0);
  BOOST_TEST(pp::stage_rank(1, 2) == 1);
  BOOST_TEST(pp::stage_rank(2, 2) == 0);
  BOOST_TEST(pp::stage_rank(3, 2) == 1);
  BOOST_TEST(pp::stage_rank(7, 4) == 3);
  BOOST_TEST(pp::stage_rank(8, 4) == 0);
  BOOST_TEST(pp::stage_rank(10, 3) == 1);
}

BOOST_AUTO_TEST_CASE(test_parse_schedule_kind) {  // [ours]
  BOOST_TEST((pp::parse_schedule_kind("gpipe") == ScheduleKind::GPipe));
  BOOST_TEST((pp::parse_schedule_kind("1f1b") == ScheduleKind::OneFOneB));
  BOOST_TEST((pp::parse_schedule_kind("interleaved") == ScheduleKind::Interleaved1F1B));
  for (ScheduleKind k :
       {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B}) {
    const std::string name = pp::to_string(k);
    BOOST_TEST(!name.empty());
    BOOST_TEST((pp::parse_schedule_kind(name) == k), "to_string form '" << name << "'");
  }
  BOOST_TEST(pp::to_string(ScheduleKind::GPipe) != pp::to_string(ScheduleKind::OneFOneB));
  for (const std::string& bad : std::vector<std::string>{"zerobubble", "", "1f1b "}) {
    const std::string msg = l1::expect_error<fsdp::ArgumentError>(
        [&] { pp::parse_schedule_kind(bad); }, "schedule", "parse_schedule_kind('" + bad + "')");
    if (!bad.empty()) {
      BOOST_TEST(msg.find(bad) != std::string::npos, "message does not quote the name: " << msg);
    }
  }
}

// ---- check_schedule finds broken schedules ---------------------------------

BOOST_AUTO_TEST_CASE(test_check_schedule_detects_violations) {  // [ours]
  const int pp_size = 2, S = 2, n = 4;
  const Schedule good = parse_table(k1F1B2x4);
  BOOST_TEST_REQUIRE(pp::check_schedule(good, pp_size, S, n).empty());
  auto find = [](std::vector<Action>& list, const std::string& token) {
    const Action a = parse_action(token);
    const auto it = std::find(list.begin(), list.end(), a);
    BOOST_TEST_REQUIRE((it != list.end()), "mutation: " << token << " is not there");
    return it;
  };
  struct Mutation {
    std::string label;
    std::function<void(Schedule&)> apply;
    std::vector<std::string> named;  // the message names at least one
  };
  const std::vector<Mutation> mutations = {
      {"a RECV removed (its SEND is unmatched)",
       [&](Schedule& s) { s[1][1].comm.erase(find(s[1][1].comm, "1RECV_F0")); },
       {"0SEND_F0", "1RECV_F0", "1F0"}},
      {"a SEND moved to the next slot",
       [&](Schedule& s) {
         s[0][2].comm.erase(find(s[0][2].comm, "0SEND_F1"));
         s[0][3].comm.push_back(parse_action("0SEND_F1"));
       },
       {"0SEND_F1", "1RECV_F1"}},
      {"a RECV for the wrong microbatch",
       [&](Schedule& s) { *find(s[1][5].comm, "1RECV_F2") = parse_action("1RECV_F3"); },
       {"0SEND_F2", "1RECV_F3", "1RECV_F2"}},
      {"a duplicated F",
       [&](Schedule& s) { s[0][8].compute.push_back(parse_action("0F2")); },
       {"0F2"}},
      {"a missing B",
       [&](Schedule& s) { s[1][4].compute.erase(find(s[1][4].compute, "1B1")); },
       {"1B1", "1REDUCE_GRAD"}},
      {"a B before its F",
       [&](Schedule& s) { std::swap(s[1][1].compute, s[1][2].compute); },
       {"1B0", "1F0"}},
      {"a B before its gradient arrived",
       [&](Schedule& s) {
         s[0][3].compute.erase(find(s[0][3].compute, "0B0"));
         s[0][2].compute.push_back(parse_action("0B0"));
       },
       {"0B0", "0RECV_B0"}},
      {"an F before its activation arrived",
       [&](Schedule& s) {
         s[1][7].compute.erase(find(s[1][7].compute, "1F3"));
         s[1][6].compute.push_back(parse_action("1F3"));
       },
       {"1F3", "1RECV_F3"}},
      {"an F on the wrong rank",
       [&](Schedule& s) {
         s[1][7].compute.erase(find(s[1][7].compute, "1F3"));
         s[0][8].compute.push_back(parse_action("1F3"));
       },
       {"1F3"}},
      {"a REDUCE_GRAD before the last B",
       [&](Schedule& s) {
         s[0][9].compute = parse_actions("0REDUCE_GRAD 0B3");
       },
       {"0REDUCE_GRAD", "0B3"}},
      {"a REDUCE_GRAD a slot early",
       [&](Schedule& s) {
         s[1][8].compute = parse_actions("1B3");
         s[1][7].compute.push_back(parse_action("1REDUCE_GRAD"));
       },
       {"1REDUCE_GRAD", "1B3"}},
  };
  for (const Mutation& mu : mutations) {
    BOOST_TEST_CONTEXT(mu.label) {
      Schedule bad = good;
      mu.apply(bad);
      const std::string msg = pp::check_schedule(bad, pp_size, S, n);
      BOOST_TEST(!msg.empty(), "check_schedule accepted it");
      if (!msg.empty()) {
        std::string words;
        for (const auto& w : mu.named) words += " " + w;
        BOOST_TEST(names_any(msg, mu.named), "message '" << msg << "' names none of" << words);
      }
    }
  }
}

// ---- argument errors --------------------------------------------------------

BOOST_AUTO_TEST_CASE(test_build_schedule_argument_errors) {  // [ours]
  using K = ScheduleKind;
  struct Bad {
    K kind;
    int pp_size, v, n;
    std::string argument, label;
  };
  const std::vector<Bad> cases = {
      {K::GPipe, 2, 1, 0, "n_microbatches", "GPipe n 0"},
      {K::OneFOneB, 2, 1, -1, "n_microbatches", "1F1B n -1"},
      {K::Interleaved1F1B, 2, 2, 0, "n_microbatches", "interleaved n 0"},
      {K::GPipe, 0, 1, 2, "pp_size", "GPipe pp 0"},
      {K::OneFOneB, -2, 1, 4, "pp_size", "1F1B pp -2"},
      {K::Interleaved1F1B, 0, 2, 4, "pp_size", "interleaved pp 0"},
      {K::OneFOneB, 2, 2, 4, "stages_per_rank", "1F1B v 2"},
      {K::GPipe, 2, 2, 4, "stages_per_rank", "GPipe v 2"},
      {K::GPipe, 2, 0, 4, "stages_per_rank", "GPipe v 0"},
      {K::Interleaved1F1B, 2, 0, 4, "stages_per_rank", "interleaved v 0"},
      {K::Interleaved1F1B, 2, 2, 3, "n_microbatches", "interleaved n 3 with pp 2"},
      {K::Interleaved1F1B, 2, 2, 6 + 1, "n_microbatches", "interleaved n 7 with pp 2"},
      {K::Interleaved1F1B, 4, 2, 2, "n_microbatches", "interleaved n 2 < pp 4"},
      {K::OneFOneB, 4, 1, 2, "n_microbatches", "1F1B n 2 < pp 4"},
      {K::OneFOneB, 3, 1, 1, "n_microbatches", "1F1B n 1 < pp 3"},
  };
  for (const Bad& b : cases) {
    l1::expect_error<fsdp::ArgumentError>(
        [&] { pp::build_schedule(b.kind, b.pp_size, b.v, b.n); }, b.argument, b.label);
  }
  // The boundaries are accepted: GPipe needs no n >= pp, 1F1B n == pp.
  BOOST_CHECK_NO_THROW(pp::build_schedule(K::GPipe, 4, 1, 1));
  BOOST_CHECK_NO_THROW(pp::build_schedule(K::OneFOneB, 4, 1, 4));
  BOOST_CHECK_NO_THROW(pp::build_schedule(K::Interleaved1F1B, 3, 3, 3));
}

// ---- bubbles ---------------------------------------------------------------

// Idle compute slots (no F/B; F and B take one slot each). GPipe's lockstep
// bubble is known in closed form: stage s forwards microbatch m in tick
// s + m and its backwards start once stage S-1's first B has come back, so
// a step takes 2 (n + pp - 1) slots and each rank idles 2 (pp - 1) of them.
// 1F1B idles no more than GPipe; interleaving (more, smaller stages per
// rank) idles a smaller fraction of the step: its bubble is still 2 (pp - 1)
// slots, but of chunks 1/v the size.
BOOST_AUTO_TEST_CASE(test_bubble_fractions) {  // [ours]
  auto fractions = [](const Schedule& s) {
    std::vector<double> f;
    for (const auto& slots : s) f.push_back(static_cast<double>(idle_slots(slots)) / slots.size());
    return f;
  };
  {
    const int P = 4, n = 8;
    const Schedule gpipe = pp::build_schedule(ScheduleKind::GPipe, P, 1, n);
    const Schedule ofob = pp::build_schedule(ScheduleKind::OneFOneB, P, 1, n);
    BOOST_TEST_REQUIRE(gpipe.size() == static_cast<size_t>(P));
    BOOST_TEST_REQUIRE(ofob.size() == static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      BOOST_TEST(gpipe[r].size() == static_cast<size_t>(2 * (n + P - 1)), "GPipe rank " << r);
      BOOST_TEST(idle_slots(gpipe[r]) == 2 * (P - 1), "GPipe rank " << r);
      BOOST_TEST(idle_slots(ofob[r]) <= idle_slots(gpipe[r]), "1F1B rank " << r);
      // 1F1B's step is as long as GPipe's (it saves memory, not time).
      BOOST_TEST(ofob[r].size() == static_cast<size_t>(2 * (n + P - 1)), "1F1B rank " << r);
    }
  }
  {
    const int P = 2, n = 8;
    const Schedule ofob = pp::build_schedule(ScheduleKind::OneFOneB, P, 1, n);
    const Schedule inter = pp::build_schedule(ScheduleKind::Interleaved1F1B, P, 2, n);
    BOOST_TEST_REQUIRE(ofob.size() == static_cast<size_t>(P));
    BOOST_TEST_REQUIRE(inter.size() == static_cast<size_t>(P));
    const std::vector<double> f1 = fractions(ofob), fi = fractions(inter);
    for (int r = 0; r < P; ++r) {
      // 2 v n work slots plus a bubble of 2 (pp - 1) slots of one (smaller)
      // chunk each, against 2 (pp - 1) slots of a whole stage for 1F1B.
      BOOST_TEST(inter[r].size() == static_cast<size_t>(2 * 2 * n + 2 * (P - 1)), "rank " << r);
      BOOST_TEST(idle_slots(inter[r]) == 2 * (P - 1), "rank " << r);
      BOOST_TEST(fi[r] < f1[r], "rank " << r << ": interleaved idles " << fi[r]
                                        << " of its slots, 1F1B " << f1[r]);
    }
  }
}
