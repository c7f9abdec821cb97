#include <catch2/catch.hpp>

#include <accel/errors.hpp>
#include <accel/parallel/pipeline_schedule.hpp>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

using namespace accel::pipeline;
using Catch::Matchers::Contains;

namespace {

// The compute actions of one stage as "F0 B0 ...".
std::string computes(const std::vector<Action>& list) {
  std::string out;
  for (const auto& a : list) {
    if (a.type == ActionType::Forward || a.type == ActionType::Backward)
      out += (out.empty() ? "" : " ") + std::string(a.type == ActionType::Forward ? "F" : "B") +
             std::to_string(a.micro_batch);
  }
  return out;
}

const std::vector<std::pair<int, int>> kShapes = {{2, 4}, {3, 6}, {4, 8}, {2, 1}, {3, 2}, {1, 5}, {4, 3}};

}  // namespace

TEST_CASE("pipeline: both schedules validate, simulate and have the textbook bubble") {
  for (const auto& [p, m] : kShapes) {
    for (const auto kind : {Schedule::GPipe, Schedule::OneFOneB}) {
      CAPTURE(p, m, to_string(kind));
      const auto schedule = make_schedule(kind, p, m);
      REQUIRE(schedule.size() == static_cast<std::size_t>(p));
      REQUIRE_NOTHROW(validate_schedule(schedule, p, m));
      const double expected = static_cast<double>(p - 1) / (m + p - 1);
      // Equal stages: (p - 1) / (m + p - 1) holds for both schedules, with any forward and backward costs.
      for (const SimCosts costs : {SimCosts{1, 2, 0}, SimCosts{1, 1, 0}, SimCosts{2, 3, 0}}) {
        const auto result = simulate(schedule, costs);
        REQUIRE(result.makespan == Approx((m + p - 1) * (costs.forward + costs.backward)));
        REQUIRE(result.bubble_fraction == Approx(expected).margin(1e-9));
        for (int s = 0; s < p; ++s) {
          const int peak = result.peak_in_flight[static_cast<std::size_t>(s)];
          if (kind == Schedule::GPipe) {
            REQUIRE(peak == m);
          } else {
            REQUIRE(peak == std::min(p - s, m));
          }
          REQUIRE(result.busy[static_cast<std::size_t>(s)] == Approx(m * (costs.forward + costs.backward)));
          REQUIRE(result.timeline[static_cast<std::size_t>(s)].size() == static_cast<std::size_t>(2 * m));
        }
      }
    }
  }
}

TEST_CASE("pipeline: action order of GPipe and 1F1B") {
  const auto gpipe = make_schedule(Schedule::GPipe, 2, 2);
  REQUIRE(gpipe[0] == std::vector<Action>{{ActionType::Forward, 0, -1},
                                          {ActionType::SendActivation, 0, 1},
                                          {ActionType::Forward, 1, -1},
                                          {ActionType::SendActivation, 1, 1},
                                          {ActionType::RecvGrad, 0, 1},
                                          {ActionType::Backward, 0, -1},
                                          {ActionType::RecvGrad, 1, 1},
                                          {ActionType::Backward, 1, -1},
                                          {ActionType::WaitSends, -1, -1}});
  REQUIRE(computes(gpipe[1]) == "F0 F1 B0 B1");
  REQUIRE(to_string(gpipe[1][0]) == "RecvActivation(micro-batch 0, from stage 0)");

  const auto ofob = make_schedule(Schedule::OneFOneB, 4, 6);
  REQUIRE(computes(ofob[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  REQUIRE(computes(ofob[2]) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  REQUIRE(computes(ofob[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  REQUIRE(computes(make_schedule(Schedule::OneFOneB, 4, 2)[0]) == "F0 F1 B0 B1");
}

TEST_CASE("pipeline: waiting on every send at once deadlocks 1F1B but not GPipe") {
  const auto synchronous = [](StageSchedule schedule) {
    for (auto& list : schedule) {
      for (auto it = list.begin(); it != list.end(); ++it) {
        if (it->type == ActionType::SendActivation || it->type == ActionType::SendGrad)
          it = list.insert(it + 1, {ActionType::WaitSends, -1, -1});
      }
    }
    return schedule;
  };
  REQUIRE_NOTHROW(simulate(synchronous(make_schedule(Schedule::GPipe, 3, 4))));
  const auto ofob = synchronous(make_schedule(Schedule::OneFOneB, 2, 4));
  REQUIRE_NOTHROW(validate_schedule(ofob, 2, 4));
  REQUIRE_THROWS_AS(simulate(ofob), accel::UsageError);
  REQUIRE_THROWS_WITH(simulate(ofob), Contains("deadlocks") &&
                                          Contains("stage 0 waits at action 5 WaitSends (stage 1 has not "
                                                   "received the activation of micro-batch 1)") &&
                                          Contains("stage 1 waits at action 4 WaitSends"));
}

TEST_CASE("pipeline: every stage receiving first is reported as a deadlock naming the stages") {
  auto schedule = make_schedule(Schedule::OneFOneB, 2, 3);
  auto& first = schedule[0];
  const auto recv = std::find(first.begin(), first.end(), Action{ActionType::RecvGrad, 0, 1});
  std::rotate(first.begin(), recv, recv + 1);
  REQUIRE_THROWS_WITH(simulate(schedule),
                      Contains("stage 0 waits at action 0 RecvGrad(micro-batch 0, from stage 1)") &&
                          Contains("stage 1 waits at action 0 RecvActivation(micro-batch 0, from stage 0)"));
}

TEST_CASE("pipeline: communication cost and timeline") {
  const auto result = simulate(make_schedule(Schedule::GPipe, 2, 1), SimCosts{1, 2, 0.5});
  REQUIRE(result.makespan == Approx(7));  // F 1, transfer 0.5, F 1, B 2, transfer 0.5, B 2
  REQUIRE(result.timeline[1][0].start == Approx(1.5));
  REQUIRE(result.timeline[0][1].type == ActionType::Backward);
  REQUIRE(result.timeline[0][1].start == Approx(5));
}

TEST_CASE("pipeline: validate_schedule names what is wrong") {
  auto missing = make_schedule(Schedule::OneFOneB, 3, 4);
  missing[2].erase(std::find(missing[2].begin(), missing[2].end(), Action{ActionType::Backward, 3, -1}));
  REQUIRE_THROWS_WITH(validate_schedule(missing, 3, 4), Contains("stage 2 has no Backward of micro-batch 3"));

  auto unmatched = make_schedule(Schedule::GPipe, 3, 2);
  unmatched[2].erase(
      std::find(unmatched[2].begin(), unmatched[2].end(), Action{ActionType::RecvActivation, 1, 1}));
  REQUIRE_THROWS_WITH(
      validate_schedule(unmatched, 3, 2),
      "pipeline schedule: stage 1 sends the activation of micro-batch 1 to stage 2, which never "
      "receives it; add the matching receive");

  auto reordered = make_schedule(Schedule::GPipe, 2, 2);
  std::swap(reordered[1][4], reordered[1][6]);  // stage 1 runs Backward 1, SendGrad 1, Backward 0, SendGrad 0
  std::swap(reordered[1][5], reordered[1][7]);
  REQUIRE_THROWS_WITH(validate_schedule(reordered, 2, 2),
                      Contains("in micro-batch order 1,0") && Contains("receives them in order 0,1"));

  auto early = make_schedule(Schedule::GPipe, 1, 2);
  std::swap(early[0][0], early[0][2]);
  REQUIRE_THROWS_WITH(validate_schedule(early, 1, 2),
                      Contains("stage 0 runs the Backward of micro-batch 0 (action 0) before its Forward"));

  auto unwaited = make_schedule(Schedule::GPipe, 2, 2);
  unwaited[0].pop_back();
  REQUIRE_THROWS_WITH(validate_schedule(unwaited, 2, 2), Contains("never waited on"));

  auto duplicated = make_schedule(Schedule::GPipe, 2, 2);
  duplicated[0].insert(duplicated[0].begin(), {ActionType::Forward, 0, -1});
  REQUIRE_THROWS_WITH(validate_schedule(duplicated, 2, 2),
                      Contains("stage 0, action 1 Forward(micro-batch 0): "
                               "duplicated"));
  REQUIRE_THROWS_WITH(validate_schedule(make_schedule(Schedule::GPipe, 2, 2), 3, 2),
                      Contains("2 action lists for 3 stages"));
}

TEST_CASE("pipeline: the forward-only schedule has no backward") {
  const auto schedule = make_forward_only_schedule(3, 4);
  for (const auto& list : schedule) {
    for (const auto& a : list) {
      REQUIRE(a.type != ActionType::Backward);
      REQUIRE(a.type != ActionType::SendGrad);
      REQUIRE(a.type != ActionType::RecvGrad);
    }
  }
  REQUIRE_NOTHROW(validate_schedule(schedule, 3, 4, false));
  REQUIRE_THROWS_WITH(validate_schedule(schedule, 3, 4),
                      Contains("stage 0 has no Backward of micro-batch 0"));
  REQUIRE_THROWS_WITH(validate_schedule(make_schedule(Schedule::GPipe, 3, 4), 3, 4, false),
                      Contains("forward-only"));
  REQUIRE(simulate(schedule).makespan == Approx(6));
}

TEST_CASE("pipeline: parse_schedule and counts") {
  REQUIRE(parse_schedule("GPipe") == Schedule::GPipe);
  REQUIRE(parse_schedule("1F1B") == Schedule::OneFOneB);
  REQUIRE(to_string(Schedule::OneFOneB) == "1f1b");
  REQUIRE_THROWS_AS(parse_schedule("interleaved"), accel::ConfigError);
  REQUIRE_THROWS_WITH(parse_schedule("interleaved"),
                      "pipeline: unknown schedule 'interleaved'; choose gpipe or 1f1b");
  REQUIRE_THROWS_WITH(make_schedule(Schedule::GPipe, 0, 4), Contains("0 stages is not valid"));
  REQUIRE_THROWS_WITH(make_schedule(Schedule::GPipe, 2, 0), Contains("0 micro-batches is not valid"));
}

TEST_CASE("pipeline: uniform partition gives the first stages the extra layers") {
  REQUIRE(partition_uniform(10, 3) == std::vector<int>{0, 4, 7, 10});
  REQUIRE(partition_uniform(9, 3) == std::vector<int>{0, 3, 6, 9});
  REQUIRE(partition_uniform(2, 2) == std::vector<int>{0, 1, 2});
  REQUIRE_THROWS_WITH(partition_uniform(2, 3),
                      "pipeline: 3 stages need at least 3 layers, the model has 2; use fewer stages");
  REQUIRE_THROWS_AS(partition_uniform(4, 0), accel::ConfigError);
}

TEST_CASE("pipeline: balanced partition is optimal") {
  REQUIRE(partition_balanced({1, 1, 1, 1, 10}, 2) == std::vector<int>{0, 4, 5});
  // Greedy filling up to the mean (3.5) gives {2} {2, 3}, heaviest 5; the optimum {2, 2} {3} has 4.
  REQUIRE(partition_balanced({2, 2, 3}, 2) == std::vector<int>{0, 2, 3});
  REQUIRE(partition_balanced({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3) == std::vector<int>{0, 5, 7, 9});
  // Every stage gets a layer, even the empty ones, and ties go to the earlier stages.
  REQUIRE(partition_balanced({0, 0, 0, 0}, 3) == std::vector<int>{0, 2, 3, 4});
  REQUIRE(partition_balanced({5, 1, 1, 1, 1, 1}, 2) == std::vector<int>{0, 1, 6});
  REQUIRE_THROWS_AS(partition_balanced({1, -1}, 2), accel::UsageError);
  REQUIRE_THROWS_WITH(partition_balanced({1}, 2), Contains("2 stages need at least 2 layers"));
}

TEST_CASE("pipeline: partition by layer type balances the matching layers") {
  const std::vector<std::string> types = {"Embedding", "Linear", "ReLU",   "Linear",
                                          "ReLU",      "Linear", "Linear", "LayerNorm"};
  REQUIRE(partition_by_type(types, "linear", 2) == std::vector<int>{0, 5, 8});
  REQUIRE(partition_by_type(types, "^(Linear|Embedding)$", 3) == std::vector<int>{0, 3, 6, 8});
  REQUIRE_THROWS_WITH(
      partition_by_type(types, "Conv", 2),
      "pipeline: partition type:Conv matches none of the layer types (Embedding, Linear, ReLU, "
      "LayerNorm); name one of them");
  REQUIRE_THROWS_WITH(partition_by_type(types, "(", 2), Contains("not a valid regular expression"));
}

TEST_CASE("pipeline: explicit partitions and parse_partition") {
  REQUIRE(partition_explicit({0, 3, 6}, 6, 2) == std::vector<int>{0, 3, 6});
  REQUIRE_THROWS_WITH(partition_explicit({0, 3, 6}, 6, 3),
                      "pipeline: partition 0,3,6 has 3 boundaries; 3 stages need 4, from 0 to 6");
  REQUIRE_THROWS_WITH(partition_explicit({0, 3, 5}, 6, 2), Contains("must start at 0 and end at 6"));
  REQUIRE_THROWS_WITH(partition_explicit({0, 4, 4, 6}, 6, 3), Contains("leaves stage 1 without layers"));

  REQUIRE(parse_partition("Parameters").kind == PartitionMethod::Kind::Parameters);
  REQUIRE(parse_partition("uniform").kind == PartitionMethod::Kind::Uniform);
  const auto type = parse_partition("type:Linear");
  REQUIRE(type.kind == PartitionMethod::Kind::Type);
  REQUIRE(type.type_regex == "Linear");
  const auto bounds = parse_partition("0, 3,6");
  REQUIRE(bounds.kind == PartitionMethod::Kind::Explicit);
  REQUIRE(bounds.boundaries == std::vector<int>{0, 3, 6});
  for (const char* bad : {"type:", "0,,3", "0,-3", "balanced", ""})
    REQUIRE_THROWS_WITH(parse_partition(bad), Contains("is not parameters, uniform, type:<regex>"));

  const std::vector<std::int64_t> params = {10, 10, 10, 30};
  const std::vector<std::string> types = {"Linear", "Linear", "Linear", "Head"};
  REQUIRE(partition(parse_partition("parameters"), params, types, 2) == std::vector<int>{0, 3, 4});
  REQUIRE(partition(parse_partition("uniform"), params, types, 2) == std::vector<int>{0, 2, 4});
  REQUIRE(partition(parse_partition("type:linear"), params, types, 2) == std::vector<int>{0, 2, 4});
  REQUIRE(partition(parse_partition("0,1,4"), params, types, 2) == std::vector<int>{0, 1, 4});
  REQUIRE_THROWS_AS(partition(parse_partition("uniform"), params, {"Linear"}, 2), accel::UsageError);
}
