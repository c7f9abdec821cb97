#pragma once
/// \file pipeline_schedule.hpp
/// The torch-free core of pipeline parallelism (as DeepSpeed's PipelineModule and PyTorch's
/// torch.distributed.pipelining): which layers each stage holds, and the list of actions each stage runs in a
/// training step. The interpreter executes one list per rank over c10d point-to-point operations.
///
/// Stage `s` receives activations from `s - 1` and sends them to `s + 1`; gradients flow the other way. The
/// rules an interpreter must follow for the lists to be deadlock-free:
///   - `Send*` is asynchronous (`isend`): it never blocks; the interpreter keeps the handle (and its tensor).
///   - `Recv*` blocks until the tensor has arrived (`recv`, or `irecv` and an immediate wait).
///   - Sends are waited on only at `WaitSends`, which waits on every handle the stage still holds; the
///     generated lists have one, as their last action. There the stage has issued all its sends, so no peer
///     can be blocked on it, and each wait ends once the peer reaches the matching receive. Waiting on each
///     send right after issuing it deadlocks 1F1B (seen with Gloo: stage 0 waits on its activation send while
///     stage 1 waits on its gradient send; the tests reproduce it). Handles whose `isCompleted()` is true may
///     be dropped earlier, which never blocks and frees their tensors.
///   - Messages between two stages are received in the order they are sent (NCCL ignores tags and matches
///     point-to-point operations in issue order); `validate_schedule` checks it. Under Gloo, tag =
///     micro-batch.
///
/// Errors: values that come from the user's configuration (stage and micro-batch counts, partitions, schedule
/// names) throw `ConfigError`; malformed action lists and deadlocks throw `UsageError`.

#include <cstdint>
#include <string>
#include <vector>

namespace accel::pipeline {

/// The order of forwards and backwards within a step. With equal stages both idle for the same fraction of
/// the step, (stages - 1) / (micro_batches + stages - 1); stage s holds the activations of up to
/// `micro_batches` micro-batches under GPipe, min(stages - s, micro_batches) under 1F1B.
enum class Schedule {
  GPipe,    ///< all forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)
  OneFOneB  ///< PipeDream-flush: warm-up forwards, one forward one backward, cool-down backwards
};

/// "gpipe" or "1f1b", any case.
Schedule parse_schedule(const std::string& name);
std::string to_string(Schedule schedule);

enum class ActionType {
  Forward,         ///< run the stage on micro-batch `micro_batch` (input received, or from data on stage 0)
  Backward,        ///< backward of that micro-batch's forward (from the loss on the last stage)
  SendActivation,  ///< isend the forward's output to `peer_stage` (s + 1)
  RecvActivation,  ///< blocking receive of the forward's input from `peer_stage` (s - 1)
  SendGrad,        ///< isend the gradient of the forward's input to `peer_stage` (s - 1)
  RecvGrad,        ///< blocking receive of the gradient of the forward's output from `peer_stage` (s + 1)
  WaitSends        ///< wait on every send this stage issued and has not waited on yet
};

struct Action {
  ActionType type;
  int micro_batch = -1;  ///< -1 for WaitSends
  int peer_stage = -1;   ///< the stage sent to or received from; -1 for Forward, Backward, WaitSends
  bool operator==(const Action& other) const {
    return type == other.type && micro_batch == other.micro_batch && peer_stage == other.peer_stage;
  }
};

/// "RecvGrad(micro-batch 3, from stage 2)", for messages and logs.
std::string to_string(const Action& action);

/// One action list per stage, index = stage.
using StageSchedule = std::vector<std::vector<Action>>;

/// The training step of `stages` stages over `micro_batches` micro-batches. Around each compute action:
/// RecvActivation (stage > 0), Forward, SendActivation (not last); RecvGrad (not last), Backward, SendGrad
/// (stage > 0). 1F1B stage s runs min(stages - s - 1, m) warm-up forwards. Every list ends with WaitSends.
StageSchedule make_schedule(Schedule schedule, int stages, int micro_batches);

/// Forwards only (evaluation): RecvActivation, Forward, SendActivation per micro-batch, then WaitSends.
StageSchedule make_forward_only_schedule(int stages, int micro_batches);

/// Throws UsageError naming the stage, micro-batch and action when: the list count is not `stages`; a
/// micro-batch or peer is out of range; an action is duplicated; a Forward (or, with `with_backward`, a
/// Backward) is missing, or a Backward appears without `with_backward`; a Backward precedes its Forward; a
/// compute action lacks its receive before it or its send after it; a send has no matching receive or the
/// other way round, or two stages exchange messages in different orders; a send is not followed by
/// WaitSends. Counts below 1 throw ConfigError. Deadlocks are found by `simulate`, not here.
void validate_schedule(const StageSchedule& schedule, int stages, int micro_batches,
                       bool with_backward = true);

/// Time units of the simulator.
struct SimCosts {
  double forward = 1;
  double backward = 2;
  double comm = 0;  ///< from a send's issue (or the receive's post, if later) to the data's arrival
};

/// One compute action of the simulated timeline.
struct TimelineEntry {
  ActionType type;
  int micro_batch;
  double start;
  double end;
};

struct SimulationResult {
  double makespan = 0;              ///< when the last stage finishes
  std::vector<double> busy;         ///< per stage, time spent in Forward and Backward
  double bubble_fraction = 0;       ///< 1 - sum(busy) / (stages * makespan)
  std::vector<int> peak_in_flight;  ///< per stage, most micro-batches forwarded and not yet backwarded
  std::vector<std::vector<TimelineEntry>> timeline;  ///< per stage, compute actions in order
};

/// Runs the lists in one process, every stage in order from time 0: compute takes its cost; a send takes no
/// time; a receive waits until its matching send was issued plus `costs.comm`; WaitSends waits until every
/// send's receive was posted plus `costs.comm`. Throws UsageError naming each blocked stage and the action it
/// waits on when no stage can go on but some have not finished (a deadlock on real ranks).
SimulationResult simulate(const StageSchedule& schedule, SimCosts costs = {});

// ---- partitioning: stage boundaries of size stages + 1, from 0 to layers; stage s holds [b[s], b[s+1]) ----

/// Layer counts differ by at most one, the first stages taking the extra layers (DeepSpeed's "uniform"):
/// 10 layers on 3 stages give {0, 4, 7, 10}.
std::vector<int> partition_uniform(int layers, int stages);

/// The contiguous partition into non-empty stages that minimises the heaviest stage's total weight (optimal;
/// DeepSpeed's "parameters" with parameter counts as weights). Of the optimal partitions, earlier stages take
/// as many layers as the bound allows. Weights must not be negative.
std::vector<int> partition_balanced(const std::vector<std::int64_t>& weights, int stages);

/// DeepSpeed's "type:<regex>": balances the number of layers whose type name matches `regex` (searched,
/// case-insensitive, as Python's re.search) and gives every stage at least one layer.
std::vector<int> partition_by_type(const std::vector<std::string>& layer_type_names, const std::string& regex,
                                   int stages);

/// Checks user-given boundaries: stages + 1 entries, first 0, last `layers`, strictly increasing.
std::vector<int> partition_explicit(std::vector<int> boundaries, int layers, int stages);

/// The `partition` value of the configuration.
struct PartitionMethod {
  enum class Kind { Parameters, Uniform, Type, Explicit };
  Kind kind = Kind::Parameters;
  std::string type_regex;       ///< Kind::Type
  std::vector<int> boundaries;  ///< Kind::Explicit
};

/// "parameters" | "uniform" (any case) | "type:<regex>" | comma-separated boundaries such as "0,3,6".
PartitionMethod parse_partition(const std::string& value);

/// The boundaries `method` gives for a model whose layers have `parameter_counts` and `layer_type_names`
/// (both one entry per layer).
std::vector<int> partition(const PartitionMethod& method, const std::vector<std::int64_t>& parameter_counts,
                           const std::vector<std::string>& layer_type_names, int stages);

}  // namespace accel::pipeline
