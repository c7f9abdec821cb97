#pragma once
// The harness shared by the multi-process test scenarios (dist_worker.cpp, real_loops.cpp): the backend row
// under test, the config it maps to, and a check macro that counts failures (the worker exits non-zero).

#include <accel/accelerator.hpp>

#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "test_support.hpp"

namespace dist {

extern int failures;
/// The conformance row: local | ddp | zero1 | zero2 | zero2_no_overlap | zero3 | fsdp_full_shard |
/// fsdp_grad_op | fsdp_no_shard.
extern std::string backend_variant;
/// Whether the row shards parameters at rest (stage 3, FULL_SHARD).
bool params_sharded();
/// The config of the row, as a user's YAML would give it.
accel::Config cpu_config(accel::MixedPrecision mp = accel::MixedPrecision::No, int accumulation = 1);
bool close(const torch::Tensor& a, const torch::Tensor& b, double tol);
/// Scenarios from real training loops (several models, frozen teacher, hand-written accumulation, ...).
std::map<std::string, std::function<void()>> real_loop_scenarios();

}  // namespace dist

#define CHECK_THAT(cond, ...)                                                                          \
  do {                                                                                                 \
    if (!(cond)) {                                                                                     \
      std::ostringstream os_;                                                                          \
      os_ << __VA_ARGS__;                                                                              \
      std::cerr << "CHECK FAILED at line " << __LINE__ << ": " #cond " -- " << os_.str() << std::endl; \
      ++dist::failures;                                                                                \
    }                                                                                                  \
  } while (0)
