#pragma once
// The harness shared by the multi-process test scenarios (dist_worker.cpp, real_loops.cpp): the backend row
// under test, the config it maps to, and CHECK_MSG, a Catch2 assertion with a message built only on failure.
// Each worker process runs its scenario as one Catch2 test case (scenario_main.hpp), so a failed check
// is reported by Catch2 with file, line and message, and the rank exits non-zero.

#include <accel/accelerator/accelerator.hpp>

#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "test_support.hpp"

namespace dist {

/// The conformance row: local | ddp | zero1 | zero2 | zero2_no_overlap | zero3 | fsdp_full_shard |
/// fsdp_grad_op | fsdp_no_shard.
extern std::string backend_variant;
/// Whether the row shards parameters at rest (stage 3, FULL_SHARD).
bool params_sharded();
/// The row without its "_nvme" suffix (the zero rows with offload_optimizer_device: nvme): "zero3_nvme" ->
/// "zero3".
std::string base_variant();
/// Whether the row offloads the optimizer state to NVMe (its files under the temporary directory).
bool nvme_variant();
/// The config of the row, as a user's YAML would give it: on CPU ranks, or GPU ranks with
/// ACCEL_TEST_DEVICE=cuda.
accel::Config cpu_config(accel::MixedPrecision mp = accel::MixedPrecision::No, int accumulation = 1);
bool close(const torch::Tensor& a, const torch::Tensor& b, double tol);
/// Scenarios from real training loops (several models, frozen teacher, hand-written accumulation, ...).
std::map<std::string, std::function<void()>> real_loop_scenarios();
/// accel::Trainer on the row: equal to the hand-written loop, resume, best/rotation, early stop, NaN losses.
std::map<std::string, std::function<void()>> trainer_scenarios();
/// The language-model scenarios (llm_loops.cpp): `llm`, a tiny tied-embedding Qwen2 trained on padded
/// batches, N ranks equal to one process (losses per step and weights); `llm_pipeline`, its pipeline stages.
std::map<std::string, std::function<void()>> llm_scenarios();

}  // namespace dist

// Checks `cond` (evaluated once); on failure Catch2 records it with `#cond -- message` and the scenario goes
// on, as CHECK does. The message (stream syntax) is built only when the check fails.
#define CHECK_MSG(cond, ...)                 \
  do {                                       \
    if (cond) {                              \
      SUCCEED();                             \
    } else {                                 \
      std::ostringstream os_;                \
      os_ << __VA_ARGS__;                    \
      FAIL_CHECK(#cond " -- " << os_.str()); \
    }                                        \
  } while (0)
