// Pipeline schedules (GPipe, 1F1B), their validation and simulation, and layer partitioning. Torch-free.
#include <accel/errors.hpp>
#include <accel/parallel/pipeline_schedule.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <numeric>
#include <optional>
#include <regex>
#include <tuple>

namespace accel::pipeline {
namespace {

std::string lower(std::string s) {
  for (char& c : s)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return {};
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

const char* name_of(ActionType type) {
  switch (type) {
    case ActionType::Forward:
      return "Forward";
    case ActionType::Backward:
      return "Backward";
    case ActionType::SendActivation:
      return "SendActivation";
    case ActionType::RecvActivation:
      return "RecvActivation";
    case ActionType::SendGrad:
      return "SendGrad";
    case ActionType::RecvGrad:
      return "RecvGrad";
    case ActionType::WaitSends:
      return "WaitSends";
  }
  return "?";
}

bool is_send(ActionType t) {
  return t == ActionType::SendActivation || t == ActionType::SendGrad;
}
bool is_recv(ActionType t) {
  return t == ActionType::RecvActivation || t == ActionType::RecvGrad;
}
bool is_compute(ActionType t) {
  return t == ActionType::Forward || t == ActionType::Backward;
}

/// The peer an action of `stage` must name: activations go up, gradients down; -1 for the rest.
int expected_peer(ActionType t, int stage) {
  if (t == ActionType::SendActivation || t == ActionType::RecvGrad) return stage + 1;
  if (t == ActionType::RecvActivation || t == ActionType::SendGrad) return stage - 1;
  return -1;
}

/// The compute action a send or receive belongs to.
ActionType compute_of(ActionType t) {
  return t == ActionType::SendActivation || t == ActionType::RecvActivation ? ActionType::Forward
                                                                            : ActionType::Backward;
}

void check_stage_count(int stages) {
  if (stages < 1) throw ConfigError(fmt::format("pipeline: {} stages is not valid; use 1 or more", stages));
}

void check_counts(int stages, int micro_batches) {
  check_stage_count(stages);
  if (micro_batches < 1) {
    throw ConfigError(
        fmt::format("pipeline: {} micro-batches is not valid; use 1 or more (at least the number of stages "
                    "keeps the bubble small)",
                    micro_batches));
  }
}

void add_forward(std::vector<Action>& out, int stage, int stages, int mb) {
  if (stage > 0) out.push_back({ActionType::RecvActivation, mb, stage - 1});
  out.push_back({ActionType::Forward, mb, -1});
  if (stage < stages - 1) out.push_back({ActionType::SendActivation, mb, stage + 1});
}

void add_backward(std::vector<Action>& out, int stage, int stages, int mb) {
  if (stage < stages - 1) out.push_back({ActionType::RecvGrad, mb, stage + 1});
  out.push_back({ActionType::Backward, mb, -1});
  if (stage > 0) out.push_back({ActionType::SendGrad, mb, stage - 1});
}

std::string join(const std::vector<int>& values) {
  return fmt::format("{}", fmt::join(values, ","));
}

void check_stages(int layers, int stages) {
  check_stage_count(stages);
  if (layers < stages) {
    throw ConfigError(
        fmt::format("pipeline: {} stages need at least {} layers, the model has {}; use fewer stages", stages,
                    stages, layers));
  }
}

// Checks that stages `from` -> `to` exchange the same micro-batches in the same order.
void check_channel(int from, int to, const std::vector<int>& sent, const std::vector<int>& received) {
  const char* what = to == from + 1 ? "activation" : "gradient";
  for (const int mb : sent) {
    if (std::find(received.begin(), received.end(), mb) == received.end()) {
      throw UsageError(fmt::format(
          "pipeline schedule: stage {} sends the {} of micro-batch {} to stage {}, which never receives it; "
          "add the matching receive",
          from, what, mb, to));
    }
  }
  for (const int mb : received) {
    if (std::find(sent.begin(), sent.end(), mb) == sent.end()) {
      throw UsageError(
          fmt::format("pipeline schedule: stage {} receives the {} of micro-batch {} from stage {}, which "
                      "never sends it; add the matching send",
                      to, what, mb, from));
    }
  }
  if (sent != received) {
    throw UsageError(fmt::format(
        "pipeline schedule: stage {} sends {}s to stage {} in micro-batch order {} but stage {} "
        "receives them in order {}; use the same order (NCCL matches point-to-point messages in issue order)",
        from, what, to, join(sent), to, join(received)));
  }
}

}  // namespace

Schedule parse_schedule(const std::string& name) {
  const auto key = lower(trim(name));
  if (key == "gpipe") return Schedule::GPipe;
  if (key == "1f1b") return Schedule::OneFOneB;
  throw ConfigError(fmt::format("pipeline: unknown schedule '{}'; choose gpipe or 1f1b", name));
}

std::string to_string(Schedule schedule) {
  return schedule == Schedule::GPipe ? "gpipe" : "1f1b";
}

std::string to_string(const Action& a) {
  if (a.type == ActionType::WaitSends) return name_of(a.type);
  if (is_compute(a.type)) return fmt::format("{}(micro-batch {})", name_of(a.type), a.micro_batch);
  return fmt::format("{}(micro-batch {}, {} stage {})", name_of(a.type), a.micro_batch,
                     is_send(a.type) ? "to" : "from", a.peer_stage);
}

StageSchedule make_schedule(Schedule schedule, int stages, int micro_batches) {
  check_counts(stages, micro_batches);
  StageSchedule out(static_cast<std::size_t>(stages));
  for (int s = 0; s < stages; ++s) {
    auto& list = out[static_cast<std::size_t>(s)];
    if (schedule == Schedule::GPipe) {
      for (int mb = 0; mb < micro_batches; ++mb)
        add_forward(list, s, stages, mb);
      for (int mb = 0; mb < micro_batches; ++mb)
        add_backward(list, s, stages, mb);
    } else {
      const int warmup = std::min(stages - s - 1, micro_batches);
      int f = 0, b = 0;
      while (f < warmup)
        add_forward(list, s, stages, f++);
      while (f < micro_batches) {
        add_forward(list, s, stages, f++);
        add_backward(list, s, stages, b++);
      }
      while (b < micro_batches)
        add_backward(list, s, stages, b++);
    }
    list.push_back({ActionType::WaitSends, -1, -1});
  }
  return out;
}

StageSchedule make_forward_only_schedule(int stages, int micro_batches) {
  check_counts(stages, micro_batches);
  StageSchedule out(static_cast<std::size_t>(stages));
  for (int s = 0; s < stages; ++s) {
    auto& list = out[static_cast<std::size_t>(s)];
    for (int mb = 0; mb < micro_batches; ++mb)
      add_forward(list, s, stages, mb);
    list.push_back({ActionType::WaitSends, -1, -1});
  }
  return out;
}

namespace {

// (type, micro-batch) -> index in the list
using Positions = std::map<std::pair<ActionType, int>, std::size_t>;
// (from, to) -> micro-batches: sent, received
using Channels = std::map<std::pair<int, int>, std::pair<std::vector<int>, std::vector<int>>>;

// Checks each action of stage `s` on its own, records the messages it sends and receives in `channels`, and
// returns where each (type, micro-batch) is in the list.
Positions check_stage_actions(const std::vector<Action>& list, int s, int stages, int micro_batches,
                              Channels& channels) {
  Positions at;
  std::optional<std::size_t> last_send, last_wait;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.type == ActionType::WaitSends) {
      last_wait = i;
      continue;
    }
    const auto where = fmt::format("pipeline schedule: stage {}, action {} {}", s, i, to_string(a));
    if (a.micro_batch < 0 || a.micro_batch >= micro_batches) {
      throw UsageError(fmt::format("{}: micro-batch out of range; use 0 to {}", where, micro_batches - 1));
    }
    const int peer = expected_peer(a.type, s);
    if (a.peer_stage != peer || (!is_compute(a.type) && (peer < 0 || peer >= stages))) {
      throw UsageError(is_compute(a.type)
                           ? fmt::format("{}: Forward and Backward have no peer; use -1", where)
                       : peer < 0 || peer >= stages
                           ? fmt::format("{}: stage {} of {} has no stage {} to exchange with; remove it",
                                         where, s, stages, peer)
                           : fmt::format("{}: the peer must be stage {}", where, peer));
    }
    if (!at.emplace(std::pair{a.type, a.micro_batch}, i).second) {
      throw UsageError(fmt::format("{}: duplicated (first at action {}); keep one", where,
                                   at.at({a.type, a.micro_batch})));
    }
    if (is_send(a.type)) {
      last_send = i;
      channels[{s, peer}].first.push_back(a.micro_batch);
    } else if (is_recv(a.type)) {
      channels[{peer, s}].second.push_back(a.micro_batch);
    }
  }
  if (last_send && (!last_wait || *last_wait < *last_send)) {
    throw UsageError(fmt::format(
        "pipeline schedule: stage {}, action {} {} is never waited on; end the list with WaitSends", s,
        *last_send, to_string(list[*last_send])));
  }
  return at;
}

// What each micro-batch needs on stage `s`: its Forward (and Backward, in order, unless forward-only), each
// compute action's receive before it and send after it, and a compute action for every transfer.
void check_stage_dependencies(const Positions& at, int s, int stages, int micro_batches, bool with_backward) {
  const auto find = [&](ActionType t, int mb) -> std::optional<std::size_t> {
    const auto it = at.find({t, mb});
    return it == at.end() ? std::nullopt : std::optional<std::size_t>(it->second);
  };
  // A compute action needs its receive before it and its send after it.
  const auto need = [&](ActionType compute, int mb, std::size_t pos, ActionType transfer, bool before) {
    const int peer = expected_peer(transfer, s);
    const auto t = find(transfer, mb);
    if (peer < 0 || peer >= stages || (t && (*t < pos) == before)) return;
    throw UsageError(fmt::format("pipeline schedule: stage {}, {} (action {}) needs {} {} it", s,
                                 to_string({compute, mb, -1}), pos, to_string({transfer, mb, peer}),
                                 before ? "before" : "after"));
  };
  for (int mb = 0; mb < micro_batches; ++mb) {
    const auto fwd = find(ActionType::Forward, mb), bwd = find(ActionType::Backward, mb);
    if (!fwd)
      throw UsageError(fmt::format("pipeline schedule: stage {} has no Forward of micro-batch {}", s, mb));
    if (with_backward && !bwd) {
      throw UsageError(fmt::format("pipeline schedule: stage {} has no Backward of micro-batch {}", s, mb));
    }
    if (!with_backward && bwd) {
      throw UsageError(fmt::format(
          "pipeline schedule: stage {} runs a Backward of micro-batch {} in a forward-only schedule", s, mb));
    }
    if (bwd && *bwd < *fwd) {
      throw UsageError(fmt::format(
          "pipeline schedule: stage {} runs the Backward of micro-batch {} (action {}) before its Forward "
          "(action {})",
          s, mb, *bwd, *fwd));
    }
    need(ActionType::Forward, mb, *fwd, ActionType::RecvActivation, true);
    need(ActionType::Forward, mb, *fwd, ActionType::SendActivation, false);
    if (bwd) {
      need(ActionType::Backward, mb, *bwd, ActionType::RecvGrad, true);
      need(ActionType::Backward, mb, *bwd, ActionType::SendGrad, false);
    }
  }
  for (const auto& [key, pos] : at) {
    if (!is_compute(key.first) && !find(compute_of(key.first), key.second)) {
      throw UsageError(fmt::format("pipeline schedule: stage {}, action {} {} belongs to no {}", s, pos,
                                   to_string({key.first, key.second, expected_peer(key.first, s)}),
                                   name_of(compute_of(key.first))));
    }
  }
}

}  // namespace

void validate_schedule(const StageSchedule& schedule, int stages, int micro_batches, bool with_backward) {
  check_counts(stages, micro_batches);
  if (schedule.size() != static_cast<std::size_t>(stages)) {
    throw UsageError(fmt::format("pipeline schedule: {} action lists for {} stages; give one list per stage",
                                 schedule.size(), stages));
  }
  // First each action on its own and the messages between stages, then what each micro-batch needs.
  Channels channels;
  std::vector<Positions> positions;
  for (int s = 0; s < stages; ++s)
    positions.push_back(
        check_stage_actions(schedule[static_cast<std::size_t>(s)], s, stages, micro_batches, channels));
  for (const auto& [ends, messages] : channels)
    check_channel(ends.first, ends.second, messages.first, messages.second);

  for (int s = 0; s < stages; ++s)
    check_stage_dependencies(positions[static_cast<std::size_t>(s)], s, stages, micro_batches, with_backward);
}

namespace {

void check_simulated_peers(const StageSchedule& schedule) {
  const int stages = static_cast<int>(schedule.size());
  for (int s = 0; s < stages; ++s) {
    for (const Action& a : schedule[static_cast<std::size_t>(s)]) {
      if ((is_send(a.type) || is_recv(a.type)) && (a.peer_stage < 0 || a.peer_stage >= stages)) {
        throw UsageError(fmt::format("pipeline simulation: stage {}, {}: no such stage among {}", s,
                                     to_string(a), stages));
      }
    }
  }
}

// The state of a simulated run: each stage's clock, next action and unwaited sends, and the messages.
class Simulation {
 public:
  Simulation(const StageSchedule& schedule, SimCosts costs)
      : schedule_(schedule),
        costs_(costs),
        outstanding_(schedule.size()),
        next_(schedule.size(), 0),
        clock_(schedule.size(), 0),
        in_flight_(schedule.size(), 0) {
    r_.busy.assign(schedule.size(), 0);
    r_.peak_in_flight.assign(schedule.size(), 0);
    r_.timeline.resize(schedule.size());
  }

  // Runs every stage as far as it can go.
  void run() {
    for (bool progress = true; progress;) {
      progress = false;
      for (std::size_t s = 0; s < schedule_.size(); ++s) {
        for (; next_[s] < schedule_[s].size() && step(s, schedule_[s][next_[s]]); ++next_[s])
          progress = true;
      }
    }
  }

  void throw_if_blocked() const {
    std::vector<std::string> blocked;
    for (std::size_t s = 0; s < schedule_.size(); ++s) {
      if (next_[s] >= schedule_[s].size()) continue;
      blocked.push_back(
          fmt::format("stage {} waits at action {} {}", s, next_[s], to_string(schedule_[s][next_[s]])));
      for (const auto& [from, to, mb] : outstanding_[s]) {
        if (posted_.count({from, to, mb}) == 0) {
          blocked.back() += fmt::format(" (stage {} has not received the {} of micro-batch {})", to,
                                        to == from + 1 ? "activation" : "gradient", mb);
          break;
        }
      }
    }
    if (!blocked.empty()) {
      throw UsageError(fmt::format(
          "pipeline schedule deadlocks: {}; every receive needs its send issued earlier by the peer, and "
          "WaitSends needs every receive posted",
          fmt::join(blocked, "; ")));
    }
  }

  SimulationResult result() {
    const int stages = static_cast<int>(schedule_.size());
    r_.makespan = stages == 0 ? 0 : *std::max_element(clock_.begin(), clock_.end());
    const double busy = std::accumulate(r_.busy.begin(), r_.busy.end(), 0.0);
    r_.bubble_fraction = r_.makespan > 0 ? 1 - busy / (stages * r_.makespan) : 0;
    return r_;
  }

 private:
  using Message = std::tuple<int, int, int>;  // from, to, micro-batch

  // Runs `a` on stage `s`; false when it must wait. Times depend only on each stage's own earlier actions and
  // its messages, so the order in which stages are visited does not change them.
  bool step(std::size_t s, const Action& a) {
    double& now = clock_[s];
    switch (a.type) {
      case ActionType::Forward:
      case ActionType::Backward: {
        const bool forward = a.type == ActionType::Forward;
        const double cost = forward ? costs_.forward : costs_.backward;
        r_.timeline[s].push_back({a.type, a.micro_batch, now, now + cost});
        r_.busy[s] += cost;
        now += cost;
        in_flight_[s] = forward ? in_flight_[s] + 1 : std::max(0, in_flight_[s] - 1);
        r_.peak_in_flight[s] = std::max(r_.peak_in_flight[s], in_flight_[s]);
        return true;
      }
      case ActionType::SendActivation:
      case ActionType::SendGrad: {
        const Message m{static_cast<int>(s), a.peer_stage, a.micro_batch};
        issued_[m] = now;
        outstanding_[s].push_back(m);
        return true;
      }
      case ActionType::RecvActivation:
      case ActionType::RecvGrad: {
        const Message m{a.peer_stage, static_cast<int>(s), a.micro_batch};
        posted_.emplace(m, now);
        const auto it = issued_.find(m);
        if (it == issued_.end()) return false;
        now = std::max(now, it->second + costs_.comm);
        return true;
      }
      case ActionType::WaitSends: {
        double done = now;
        for (const Message& m : outstanding_[s]) {
          const auto it = posted_.find(m);
          if (it == posted_.end()) return false;
          done = std::max(done, std::max(issued_.at(m), it->second) + costs_.comm);
        }
        outstanding_[s].clear();
        now = done;
        return true;
      }
    }
    return false;
  }

  const StageSchedule& schedule_;
  const SimCosts costs_;
  std::map<Message, double> issued_, posted_;
  std::vector<std::vector<Message>> outstanding_;
  std::vector<std::size_t> next_;
  std::vector<double> clock_;
  std::vector<int> in_flight_;
  SimulationResult r_;
};

}  // namespace

SimulationResult simulate(const StageSchedule& schedule, SimCosts costs) {
  check_simulated_peers(schedule);
  Simulation simulation(schedule, costs);
  simulation.run();
  simulation.throw_if_blocked();
  return simulation.result();
}

std::vector<int> partition_uniform(int layers, int stages) {
  check_stages(layers, stages);
  std::vector<int> b{0};
  for (int s = 0; s < stages; ++s)
    b.push_back(b.back() + layers / stages + (s < layers % stages ? 1 : 0));
  return b;
}

std::vector<int> partition_balanced(const std::vector<std::int64_t>& weights, int stages) {
  const int layers = static_cast<int>(weights.size());
  check_stages(layers, stages);
  for (int i = 0; i < layers; ++i) {
    if (weights[static_cast<std::size_t>(i)] < 0) {
      throw UsageError(fmt::format("pipeline: layer {} has weight {}; weights must be 0 or more", i,
                                   weights[static_cast<std::size_t>(i)]));
    }
  }
  // The fewest contiguous stages whose weights stay within `bound` (a layer never exceeds it).
  const auto stages_needed = [&](std::int64_t bound) {
    int count = 1;
    std::int64_t sum = 0;
    for (const auto w : weights) {
      if (sum + w > bound) {
        ++count;
        sum = 0;
      }
      sum += w;
    }
    return count;
  };
  // Binary search on the heaviest stage: fewer stages than `stages` can always be split further.
  std::int64_t lo = *std::max_element(weights.begin(), weights.end());
  std::int64_t hi = std::accumulate(weights.begin(), weights.end(), std::int64_t{0});
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (stages_needed(mid) <= stages) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  // Each stage takes as many layers as fit under the bound, leaving one for every later stage; the rest
  // then always fits (either greedily within the bound, or one layer per stage).
  std::vector<int> b{0};
  for (int s = 0; s < stages - 1; ++s) {
    const int last = layers - (stages - s - 1);
    int end = b.back();
    for (std::int64_t sum = 0; end < last && sum + weights[static_cast<std::size_t>(end)] <= lo; ++end)
      sum += weights[static_cast<std::size_t>(end)];
    b.push_back(end);
  }
  b.push_back(layers);
  return b;
}

std::vector<int> partition_by_type(const std::vector<std::string>& layer_type_names, const std::string& regex,
                                   int stages) {
  std::regex re;
  try {
    re = std::regex(regex, std::regex::ECMAScript | std::regex::icase);
  } catch (const std::regex_error& e) {
    throw ConfigError(
        fmt::format("pipeline: partition type:{} is not a valid regular expression ({}); fix it or name a "
                    "layer type such as type:Linear",
                    regex, e.what()));
  }
  std::vector<std::int64_t> weights;
  std::vector<std::string> types;
  for (const auto& name : layer_type_names) {
    weights.push_back(std::regex_search(name, re) ? 1 : 0);
    if (std::find(types.begin(), types.end(), name) == types.end()) types.push_back(name);
  }
  if (std::find(weights.begin(), weights.end(), 1) == weights.end()) {
    throw ConfigError(
        fmt::format("pipeline: partition type:{} matches none of the layer types ({}); name one of them",
                    regex, fmt::join(types, ", ")));
  }
  return partition_balanced(weights, stages);
}

std::vector<int> partition_explicit(std::vector<int> boundaries, int layers, int stages) {
  check_stages(layers, stages);
  const auto given = join(boundaries);
  if (boundaries.size() != static_cast<std::size_t>(stages) + 1) {
    throw ConfigError(fmt::format("pipeline: partition {} has {} boundaries; {} stages need {}, from 0 to {}",
                                  given, boundaries.size(), stages, stages + 1, layers));
  }
  if (boundaries.front() != 0 || boundaries.back() != layers) {
    throw ConfigError(fmt::format(
        "pipeline: partition {} must start at 0 and end at {}, the model's layer count", given, layers));
  }
  for (int s = 0; s < stages; ++s) {
    if (boundaries[static_cast<std::size_t>(s) + 1] <= boundaries[static_cast<std::size_t>(s)]) {
      throw ConfigError(fmt::format(
          "pipeline: partition {} leaves stage {} without layers; boundaries must increase strictly", given,
          s));
    }
  }
  return boundaries;
}

PartitionMethod parse_partition(const std::string& value) {
  const auto text = trim(value);
  const auto key = lower(text);
  PartitionMethod m;
  if (key == "parameters") return m;
  if (key == "uniform") {
    m.kind = PartitionMethod::Kind::Uniform;
    return m;
  }
  const auto fail = [&] {
    return ConfigError(
        fmt::format("pipeline: partition '{}' is not parameters, uniform, type:<regex> or comma-separated "
                    "layer boundaries such as 0,3,6",
                    value));
  };
  if (key.rfind("type:", 0) == 0) {
    m.kind = PartitionMethod::Kind::Type;
    m.type_regex = trim(text.substr(5));
    if (m.type_regex.empty()) throw fail();
    return m;
  }
  m.kind = PartitionMethod::Kind::Explicit;
  std::size_t start = 0;
  while (true) {
    const auto comma = text.find(',', start);
    const auto item =
        trim(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 9) {
      throw fail();
    }
    m.boundaries.push_back(std::stoi(item));
    if (comma == std::string::npos) return m;
    start = comma + 1;
  }
}

std::vector<int> partition(const PartitionMethod& method, const std::vector<std::int64_t>& parameter_counts,
                           const std::vector<std::string>& layer_type_names, int stages) {
  if (parameter_counts.size() != layer_type_names.size()) {
    throw UsageError(
        fmt::format("pipeline: {} parameter counts but {} layer types; give one of each per layer",
                    parameter_counts.size(), layer_type_names.size()));
  }
  const int layers = static_cast<int>(parameter_counts.size());
  switch (method.kind) {
    case PartitionMethod::Kind::Parameters:
      return partition_balanced(parameter_counts, stages);
    case PartitionMethod::Kind::Uniform:
      return partition_uniform(layers, stages);
    case PartitionMethod::Kind::Type:
      return partition_by_type(layer_type_names, method.type_regex, stages);
    case PartitionMethod::Kind::Explicit:
      return partition_explicit(method.boundaries, layers, stages);
  }
  return {};
}

}  // namespace accel::pipeline
