// Tests of accel::Config: defaults, Accelerate compatibility, round trips and the exact text of every error.

#include "accel/config/config.hpp"
#include "accel/config/deepspeed_trainer.hpp"
#include "accel/monitor/memory.hpp"
#include "build_paths.hpp"
#include "config/text_distance.hpp"
#include "temp_dir.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace {

std::string data_file(const std::string& name) {
  return accel::test::test_data_dir() + "/config/" + name;
}

std::string template_file(const std::string& name) {
  return accel::test::config_template_dir() + "/" + name;
}

// The ConfigError thrown by loading `path`; fails the test when nothing is thrown.
accel::ConfigError load_error(const std::string& path) {
  try {
    accel::Config::load_file(path);
  } catch (const accel::ConfigError& e) {
    return e;
  }
  FAIL("expected a ConfigError from " << path);
  throw;  // unreachable: FAIL throws
}

accel::ConfigError string_error(const std::string& yaml) {
  try {
    accel::Config::load_string(yaml, "inline.yaml");
  } catch (const accel::ConfigError& e) {
    return e;
  }
  FAIL("expected a ConfigError from:\n" << yaml);
  throw;
}

// Loads a bad file from tests/fixtures/config and returns its message with the path prefix removed, so that
// the expectations below read like what a user sees for `accel-launch launch --config_file <name>`.
std::string bad_file_message(const std::string& name) {
  const std::string path = data_file(name);
  const std::string message = load_error(path).what();
  REQUIRE(message.rfind(path, 0) == 0);
  return name + message.substr(path.size());
}

// Whether one of the config's notices contains `text`.
bool has_notice(const accel::Config& c, const std::string& text) {
  for (const auto& n : c.notices) {
    if (n.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("config: defaults", "[config]") {
  const accel::Config c;
  CHECK(c.config_version == 1);
  CHECK(c.compute_environment == "LOCAL_MACHINE");
  CHECK(c.backend == "local");
  CHECK_FALSE(c.use_cpu);
  CHECK_FALSE(c.debug);
  CHECK(c.gpu_ids == "all");
  CHECK(c.num_processes == 1);
  CHECK(c.num_machines == 1);
  CHECK(c.machine_rank == 0);
  CHECK(c.main_process_ip.empty());
  CHECK(c.main_process_port == 29500);
  CHECK(c.mixed_precision == accel::MixedPrecision::No);
  CHECK(c.gradient_accumulation_steps == 1);
  CHECK(c.collective_timeout_seconds == 1800);
  CHECK_FALSE(c.seed.has_value());
  CHECK(c.even_batches);
  CHECK_FALSE(c.split_batches);
  CHECK(c.ddp_bucket_cap_mb == 25);
  CHECK(c.ddp_first_bucket_cap_mb == 1);
  CHECK_FALSE(c.ddp_find_unused_parameters);
  CHECK(c.fsdp.sharding_strategy == accel::ShardingStrategy::FullShard);
  CHECK(c.fsdp.reshard_after_forward());
  CHECK(c.zero.stage == 2);
  CHECK(c.zero.reduce_bucket_size == 500000000u);
  CHECK(c.source.empty());
  CHECK_NOTHROW(c.validate());
}

TEST_CASE("config: empty input means defaults", "[config]") {
  const accel::Config from_file = accel::Config::load_file(data_file("empty.yaml"));
  CHECK(from_file == accel::Config{});
  CHECK(from_file.source == data_file("empty.yaml"));
  CHECK(accel::Config::load_string("") == accel::Config{});
  CHECK(accel::Config::load_string("---\n").source == "<string>");
}

TEST_CASE("config: real Accelerate multi-GPU file loads", "[config]") {
  const accel::Config c = accel::Config::load_file(template_file("accelerate_multi_gpu.yaml"));
  CHECK(c.num_processes == 2);
  CHECK(c.backend == "ddp");
  CHECK(c.mixed_precision == accel::MixedPrecision::Fp16);
  CHECK_FALSE(c.use_cpu);
  CHECK(c.gpu_ids == "all");
  CHECK(c.num_machines == 1);
  CHECK(c.machine_rank == 0);
}

TEST_CASE("config: annotated local template loads as the defaults", "[config]") {
  accel::Config c = accel::Config::load_file(template_file("local.yaml"));
  CHECK(c == accel::Config{});
}

TEST_CASE("config: fsdp section parsed", "[config]") {
  const accel::Config c = accel::Config::load_file(data_file("accelerate_fsdp.yaml"));
  CHECK(c.backend == "fsdp");
  CHECK(c.num_processes == 4);
  CHECK(c.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK(c.fsdp.sharding_strategy == accel::ShardingStrategy::ShardGradOp);  // Accelerate's numeric form 2
  CHECK_FALSE(c.fsdp.reshard_after_forward());
  CHECK(c.fsdp.auto_wrap_policy == accel::AutoWrapPolicy::TransformerBasedWrap);
  CHECK(c.fsdp.transformer_layer_cls_to_wrap == "TransformerBlock");
  CHECK(c.fsdp.backward_prefetch == accel::BackwardPrefetch::BackwardPost);  // older key name
  CHECK(c.fsdp.forward_prefetch);
  CHECK(c.fsdp.offload_params);
  CHECK(c.fsdp.state_dict_type == accel::StateDictType::ShardedStateDict);
  CHECK(c.fsdp.activation_checkpointing);
  CHECK(c.fsdp.min_num_params == 1000000);
  CHECK(c.fsdp.version == 2);
  CHECK(c.fsdp.cpu_ram_efficient_loading);
  CHECK(c.fsdp.sync_module_states);
  CHECK(c.fsdp.use_orig_params);
}

TEST_CASE("config: fsdp_reshard_after_forward maps onto the sharding strategy", "[config]") {
  const accel::Config c = accel::Config::load_string(
      "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_reshard_after_forward: false\n");
  CHECK(c.fsdp.sharding_strategy == accel::ShardingStrategy::ShardGradOp);
  const accel::Config d = accel::Config::load_string("fsdp_config:\n  fsdp_sharding_strategy: 3\n");
  CHECK(d.fsdp.sharding_strategy == accel::ShardingStrategy::NoShard);
}

TEST_CASE(
    "config: fsdp_reshard_after_forward takes FSDP1's strategy names, as `accelerate config` writes them",
    "[config]") {
  auto load = [](const std::string& fsdp) {
    return accel::Config::load_string("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n" + fsdp,
                                      "fsdp.yaml");
  };
  auto error = [](const std::string& fsdp) {
    try {
      accel::Config::load_string("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n" + fsdp,
                                 "fsdp.yaml");
    } catch (const accel::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  // utils/dataclasses.py (FullyShardedDataParallelPlugin): with fsdp_version 1 the value is a
  // ShardingStrategy name (upper-cased) or its number.
  CHECK(load("  fsdp_version: 1\n  fsdp_reshard_after_forward: FULL_SHARD\n").fsdp.sharding_strategy ==
        accel::ShardingStrategy::FullShard);
  CHECK(load("  fsdp_version: 1\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n").fsdp.sharding_strategy ==
        accel::ShardingStrategy::ShardGradOp);
  CHECK(load("  fsdp_reshard_after_forward: no_shard\n").fsdp.sharding_strategy ==
        accel::ShardingStrategy::NoShard);
  CHECK(load("  fsdp_reshard_after_forward: 2\n").fsdp.sharding_strategy ==
        accel::ShardingStrategy::ShardGradOp);
  // FSDP2's booleans as before.
  CHECK(load("  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n").fsdp.sharding_strategy ==
        accel::ShardingStrategy::FullShard);
  // Agreeing with fsdp_sharding_strategy is fine; disagreeing names both lines.
  CHECK(load("  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n")
            .fsdp.sharding_strategy == accel::ShardingStrategy::ShardGradOp);
  CHECK(
      error("  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_reshard_after_forward: NO_SHARD\n") ==
      "fsdp.yaml:5: fsdp_config.fsdp_reshard_after_forward: 'NO_SHARD' disagrees with fsdp_sharding_strategy "
      "'FULL_SHARD' (line 4); both name the sharding strategy: make them agree or remove one");
  // The hybrid strategies (sharded inside a machine, replicated across machines), by name or number; a typo
  // gets the nearest spelling.
  CHECK(load("  fsdp_reshard_after_forward: HYBRID_SHARD\n").fsdp.sharding_strategy ==
        accel::ShardingStrategy::HybridShard);
  for (const char* zero2 : {"HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2", "5"}) {
    CHECK(load(std::string("  fsdp_sharding_strategy: ") + zero2 + "\n").fsdp.sharding_strategy ==
          accel::ShardingStrategy::HybridShardZero2);
  }
  CHECK(load("  fsdp_sharding_strategy: 4\n").fsdp.reshard_after_forward());
  CHECK(load("  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_reshard_after_forward: true\n").fsdp.hybrid());
  CHECK_THAT(error("  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_reshard_after_forward: false\n"),
             Catch::Contains("disagrees with fsdp_sharding_strategy 'HYBRID_SHARD'"));
  CHECK(error("  fsdp_reshard_after_forward: FULL_SHRD\n") ==
        "fsdp.yaml:4: fsdp_config.fsdp_reshard_after_forward: invalid value 'FULL_SHRD' (did you mean "
        "'FULL_SHARD'?); allowed values: true, false, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
        "HYBRID_SHARD_ZERO2");
  // Accelerate's launcher always passes fsdp_sharding_strategy (default FULL_SHARD), which FSDP1 prefers
  // (accelerator.py: `sharding_strategy or reshard_after_forward`): where that differs, a notice says so.
  const auto grad_op = load("  fsdp_version: 1\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n");
  CHECK(has_notice(grad_op,
                   "fsdp_config.fsdp_reshard_after_forward: 'SHARD_GRAD_OP' means SHARD_GRAD_OP here; "
                   "Accelerate's launcher would run FULL_SHARD with this FSDP1 file"));
  CHECK_FALSE(
      has_notice(load("  fsdp_version: 1\n  fsdp_reshard_after_forward: FULL_SHARD\n"), "fsdp_config"));
  CHECK_FALSE(has_notice(load("  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"), "fsdp_config"));
  // The written file says the strategy with fsdp_sharding_strategy and reads back equal.
  CHECK(accel::Config::load_string(grad_op.to_yaml()) == grad_op);
}

TEST_CASE("config: TRANSFORMER_BASED_WRAP without a class list takes the block class from the model",
          "[config]") {
  // What `accelerate config` writes when a Hugging Face model's _no_split_modules should decide (17 of 28
  // real FSDP files): the config cannot know the model, so it is accepted and FULL_SHARD picks the model's
  // repeated block type at prepare (tested in backend_parts_test.cpp).
  const std::string yaml =
      "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_auto_wrap_policy: "
      "TRANSFORMER_BASED_WRAP\n";
  const auto c = accel::Config::load_string(yaml);
  CHECK(c.fsdp.auto_wrap_policy == accel::AutoWrapPolicy::TransformerBasedWrap);
  CHECK(c.fsdp.transformer_layer_cls_to_wrap.empty());
  CHECK(accel::Config::load_string(c.to_yaml()) == c);
  const auto named = accel::Config::load_string(yaml + "  fsdp_transformer_layer_cls_to_wrap: Block\n");
  CHECK(named.fsdp.transformer_layer_cls_to_wrap == "Block");
}

TEST_CASE("config: deepspeed section parsed", "[config]") {
  const accel::Config c = accel::Config::load_file(data_file("accelerate_deepspeed.yaml"));
  CHECK(c.backend == "zero");
  CHECK(c.num_processes == 8);
  CHECK(c.num_machines == 2);
  CHECK(c.machine_rank == 1);
  CHECK(c.main_process_ip == "10.0.0.1");
  CHECK(c.main_process_port == 29501);
  CHECK(c.mixed_precision == accel::MixedPrecision::No);
  CHECK(c.gradient_accumulation_steps == 8);  // from deepspeed_config
  CHECK(c.zero.stage == 3);
  CHECK(c.zero.offload_optimizer_device == accel::OffloadDevice::Cpu);
  CHECK(c.zero.offload_param_device == accel::OffloadDevice::Cpu);
  CHECK(c.zero.gradient_clipping == 1.0);
  CHECK(c.zero.zero3_init_flag);
  CHECK(c.zero.zero3_save_16bit_model);
  CHECK(c.zero.reduce_bucket_size == 500000000u);  // written as 5e8
  CHECK(c.zero.allgather_bucket_size == 200000000u);
  CHECK(c.zero.stage3_prefetch_bucket_size == 50000000u);  // written as 5.0e+7
  CHECK(c.zero.activation_checkpointing);
}

TEST_CASE("config: accelerate-cpp keys parsed", "[config]") {
  const accel::Config c = accel::Config::load_file(data_file("ours.yaml"));
  CHECK(c.backend == "ddp");
  CHECK(c.use_cpu);
  CHECK(c.num_processes == 2);
  CHECK(c.mixed_precision == accel::MixedPrecision::No);  // YAML false
  CHECK(c.collective_timeout_seconds == 60.5);
  REQUIRE(c.seed.has_value());
  CHECK(*c.seed == 1234u);
  CHECK_FALSE(c.even_batches);
  CHECK(c.split_batches);
  CHECK(c.ddp_bucket_cap_mb == 50);
  CHECK(c.ddp_first_bucket_cap_mb == 2.5);
  CHECK(c.ddp_find_unused_parameters);
  CHECK(c.main_process_ip.empty());  // null keeps the default
  // Bucket caps the engines could not turn into bytes (issue 30's 1.8e19 MiB) are refused.
  CHECK_THROWS_WITH(accel::Config::load_string("ddp_bucket_cap_mb: 1.8e19\n", "caps.yaml"),
                    Catch::Contains("caps.yaml") && Catch::Contains("ddp_bucket_cap_mb") &&
                        Catch::Contains("at most 1048576 (1 TiB)"));
  CHECK_THROWS_WITH(accel::Config::load_string("ddp_first_bucket_cap_mb: 2e6\n", "caps.yaml"),
                    Catch::Contains("at most 1048576 (1 TiB)"));
  CHECK(accel::Config::load_string("ddp_bucket_cap_mb: 1048576\n", "caps.yaml").ddp_bucket_cap_mb == 1048576);
}

TEST_CASE("config: backend and distributed_type", "[config]") {
  auto backend_of = [](const std::string& yaml) { return accel::Config::load_string(yaml).backend; };
  CHECK(backend_of("distributed_type: 'NO'\n") == "local");
  CHECK(backend_of("distributed_type: NO\n") == "local");
  CHECK(backend_of("distributed_type: MULTI_GPU\nnum_processes: 2\n") == "ddp");
  CHECK(backend_of("distributed_type: FSDP\n") == "fsdp");
  CHECK(backend_of("distributed_type: DEEPSPEED\n") == "zero");
  CHECK(backend_of("backend: zero\ndistributed_type: DEEPSPEED\n") == "zero");
  CHECK(backend_of("backend: FSDP\n") == "fsdp");
  const accel::Config cpu = accel::Config::load_string("distributed_type: MULTI_CPU\nnum_processes: 2\n");
  CHECK(cpu.backend == "ddp");
  CHECK(cpu.use_cpu);  // MULTI_CPU implies use_cpu

  const accel::ConfigError e = string_error("backend: zero\ndistributed_type: FSDP\n");
  CHECK(std::string(e.what()) ==
        "inline.yaml:1: backend: 'zero' disagrees with distributed_type 'FSDP' (line 2), which means backend "
        "fsdp; "
        "make them agree or remove one of them");
  CHECK(e.line() == 1);
  CHECK(e.key() == "backend");
  CHECK(e.file() == "inline.yaml");
}

TEST_CASE("config: mixed precision values", "[config]") {
  using accel::MixedPrecision;
  auto mode_of = [](const std::string& yaml) { return accel::Config::load_string(yaml).mixed_precision; };
  CHECK(mode_of("mixed_precision: no\n") == MixedPrecision::No);
  CHECK(mode_of("mixed_precision: 'no'\n") == MixedPrecision::No);
  CHECK(mode_of("mixed_precision: false\n") == MixedPrecision::No);
  CHECK(mode_of("mixed_precision: fp16\n") == MixedPrecision::Fp16);
  CHECK(mode_of("mixed_precision: BF16\n") == MixedPrecision::Bf16);
  CHECK(mode_of("mixed_precision:\n") == MixedPrecision::No);
}

TEST_CASE("config: pipeline_config section", "[config]") {
  const auto c = accel::Config::load_string(
      "backend: ddp\nnum_processes: 2\npipeline_config:\n  stages: 2\n  micro_batches: 4\n  schedule: "
      "GPipe\n  partition: "
      "'0,3,6'\n");
  CHECK(c.pipeline.stages == 2);
  CHECK(c.pipeline.micro_batches == 4);
  CHECK(c.pipeline.schedule == accel::pipeline::Schedule::GPipe);
  CHECK(c.pipeline.partition == "0,3,6");
  CHECK(accel::Config::load_string(c.to_yaml()) == c);
  CHECK(accel::Config{}.pipeline.schedule == accel::pipeline::Schedule::OneFOneB);
  CHECK(std::string(string_error("pipeline_config:\n  schedule: zigzag\n").what()) ==
        "inline.yaml:2: pipeline_config.schedule: 'zigzag' is not a pipeline schedule; allowed values: 1f1b, "
        "gpipe");
  CHECK(string_error("pipeline_config:\n  partition: zigzag\n").key() == "pipeline_config.partition");
  CHECK(accel::Config::load_string("backend: ddp\nnum_processes: 4\npipeline_config:\n  stages: 2\n")
            .pipeline.stages == 2);  // 2 stages x 2 data-parallel replicas
  CHECK(std::string(string_error("backend: ddp\nnum_processes: 3\npipeline_config:\n  stages: 2\n").what())
            .find("pipeline_config.stages (2) must divide num_processes (3)") != std::string::npos);
  CHECK(string_error("pipeline_config:\n  stagez: 2\n").key() == "pipeline_config.stagez");
}

TEST_CASE("config: ddp_comm_hook values", "[config]") {
  using accel::CommHook;
  auto hook_of = [](const std::string& yaml) { return accel::Config::load_string(yaml).ddp_comm_hook; };
  CHECK(hook_of("") == CommHook::No);
  CHECK(hook_of("ddp_comm_hook: no\n") == CommHook::No);
  CHECK(hook_of("ddp_comm_hook: FP16\n") == CommHook::Fp16);
  CHECK(hook_of("ddp_comm_hook: bf16\n") == CommHook::Bf16);
  accel::Config c;
  c.ddp_comm_hook = CommHook::Bf16;
  CHECK(accel::Config::load_string(c.to_yaml()) == c);
  CHECK(hook_of("ddp_comm_hook: power_sgd\n") == CommHook::PowerSgd);
  const auto psgd = accel::Config::load_string(
      "ddp_comm_hook: power_sgd\nddp_comm_powersgd_rank: 4\nddp_comm_powersgd_start_iter: 0\n");
  CHECK(psgd.ddp_comm_powersgd_rank == 4);
  CHECK(psgd.ddp_comm_powersgd_start_iter == 0);
  CHECK(accel::Config::load_string(psgd.to_yaml()) == psgd);
  CHECK(string_error("ddp_comm_powersgd_rank: 0\n").key() == "ddp_comm_powersgd_rank");
  CHECK(
      std::string(string_error("ddp_comm_hook: batched_power_sgd\n").what()) ==
      "inline.yaml:1: ddp_comm_hook: 'batched_power_sgd' is not supported by accelerate-cpp; allowed values: "
      "no, fp16, bf16, power_sgd");
  CHECK(string_error("ddp_comm_hook: fp32\n").key() == "ddp_comm_hook");
}

TEST_CASE("config: accepted Accelerate keys without meaning here", "[config]") {
  // Accelerate writes these with their "off" values; they load, leave every setting as it was, and the keys
  // beside them still mean what they say.
  const accel::Config c = accel::Config::load_string(
      "dynamo_config: {}\ndynamo_backend: 'NO'\nmegatron_lm_config: {}\ntpu_name: null\ntpu_zone: null\n"
      "commands: null\ncommand_file: null\nmain_process_port: 0\ngradient_accumulation_steps: 4\n");
  CHECK(c.main_process_port == 0);
  CHECK(c.gradient_accumulation_steps == 4);
  accel::Config expected;
  expected.main_process_port = 0;
  expected.gradient_accumulation_steps = 4;
  CHECK(c.to_yaml() == expected.to_yaml());
  const accel::Config d =
      accel::Config::load_string("dynamo_config:\n  dynamo_backend: NO\n  dynamo_mode: default\n");
  CHECK(d.to_yaml() == accel::Config().to_yaml());
}

TEST_CASE("config: round trip through to_yaml", "[config]") {
  accel::Config c;
  c.backend = "fsdp";
  c.num_processes = 8;
  c.num_machines = 2;
  c.machine_rank = 1;
  c.main_process_ip = "192.168.1.10";
  c.main_process_port = 0;
  c.gpu_ids = "0,1,2,3";
  c.mixed_precision = accel::MixedPrecision::Bf16;
  c.gradient_accumulation_steps = 4;
  c.collective_timeout_seconds = 0.1;
  c.seed = 18446744073709551615ull;
  c.even_batches = false;
  c.split_batches = true;
  c.ddp_bucket_cap_mb = 12.5;
  c.debug = true;
  c.fsdp.sharding_strategy = accel::ShardingStrategy::NoShard;
  c.fsdp.auto_wrap_policy = accel::AutoWrapPolicy::TransformerBasedWrap;
  c.fsdp.transformer_layer_cls_to_wrap = "Block, it's";
  c.fsdp.backward_prefetch = accel::BackwardPrefetch::NoPrefetch;
  c.fsdp.version = 2;
  c.zero.stage = 3;
  c.zero.offload_param_device = accel::OffloadDevice::Cpu;
  c.zero.gradient_clipping = 0.5;
  c.zero.reduce_bucket_size = 123;

  const accel::Config back = accel::Config::load_string(c.to_yaml(), "roundtrip");
  CHECK(back == c);
  CHECK(back.source == "roundtrip");
  CHECK(back.to_yaml() == c.to_yaml());

  for (const char* name : {"accelerate_fsdp.yaml", "accelerate_deepspeed.yaml", "ours.yaml", "empty.yaml"}) {
    const accel::Config loaded = accel::Config::load_file(data_file(name));
    CHECK(accel::Config::load_string(loaded.to_yaml()) == loaded);
  }
  const accel::Config multi_gpu = accel::Config::load_file(template_file("accelerate_multi_gpu.yaml"));
  const std::string yaml = multi_gpu.to_yaml();
  CHECK(yaml.find("distributed_type: MULTI_GPU\n") != std::string::npos);
  CHECK(yaml.find("mixed_precision: 'fp16'\n") != std::string::npos);
  CHECK(accel::Config::load_string(yaml) == multi_gpu);
}

TEST_CASE("config: save_file creates parent directories", "[config]") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("accel_config_test_" + std::to_string(::getpid()));
  const std::string path = (dir / "nested" / "deeper" / "config.yaml").string();
  accel::Config c;
  c.backend = "zero";
  c.num_processes = 2;
  c.save_file(path);
  const accel::Config back = accel::Config::load_file(path);
  CHECK(back == c);
  CHECK(back.source == path);
  std::filesystem::remove_all(dir);
}

TEST_CASE("config: validate checks cross-field rules", "[config]") {
  accel::Config c;
  c.backend = "ddp";
  c.num_processes = 2;
  c.num_machines = 2;
  c.machine_rank = 2;
  try {
    c.validate();
    FAIL("validate() accepted machine_rank == num_machines");
  } catch (const accel::ConfigError& e) {
    CHECK(std::string(e.what()) ==
          "machine_rank (2) must be less than num_machines (2); set machine_rank to 0..1");
    CHECK(e.line() == 0);
    CHECK(e.key() == "machine_rank");
  }
  c.source = "bad.yaml";
  try {
    c.validate();
    FAIL("validate() accepted machine_rank == num_machines");
  } catch (const accel::ConfigError& e) {
    CHECK(std::string(e.what()) ==
          "bad.yaml: machine_rank (2) must be less than num_machines (2); set machine_rank to 0..1");
  }
  c.machine_rank = 0;
  CHECK_NOTHROW(c.validate());

  accel::Config port;
  port.main_process_port = 70000;
  CHECK_THROWS_WITH(port.validate(), "main_process_port (70000) must be in 0..65535 (0 picks a free port)");
  accel::Config steps;
  steps.gradient_accumulation_steps = 0;
  CHECK_THROWS_WITH(steps.validate(), "gradient_accumulation_steps (0) must be at least 1");
  accel::Config none;
  none.num_processes = 0;
  CHECK_THROWS_WITH(none.validate(), "num_processes (0) must be at least 1");
  accel::Config multiple;
  multiple.backend = "ddp";
  multiple.num_machines = 4;
  multiple.num_processes = 6;
  CHECK_THROWS_WITH(
      multiple.validate(),
      "num_processes (6) must be a multiple of num_machines (4), as it counts the processes of all "
      "machines; set num_processes to 4 or 8");
  accel::Config version;
  version.config_version = 3;
  CHECK_THROWS_AS(version.validate(), accel::ConfigError);
  // A timeout of centuries bounds nothing: a week at most (issue 49).
  accel::Config week;
  week.collective_timeout_seconds = 7 * 24 * 3600;
  CHECK_NOTHROW(week.validate());
  accel::Config centuries;
  centuries.collective_timeout_seconds = 3.2e9;
  CHECK_THROWS_WITH(
      centuries.validate(),
      "collective_timeout_seconds (3200000000) is more than 7 days (604800 s): a rank stuck in a "
      "collective would hang the job that long before anything is reported; use at most 604800 "
      "(the default, 1800, is PyTorch's 30 minutes)");
  try {
    accel::Config::load_string("num_processes: 1\ncollective_timeout_seconds: 1e10\n", "slow.yaml");
    FAIL("a timeout of 300 years was accepted");
  } catch (const accel::ConfigError& e) {
    CHECK(e.line() == 2);
    CHECK(e.key() == "collective_timeout_seconds");
    CHECK_THAT(e.what(), Catch::StartsWith("slow.yaml:2: collective_timeout_seconds (10000000000) is more "
                                           "than 7 days (604800 s)"));
  }
}

TEST_CASE("config: to_string and parse functions", "[config]") {
  CHECK(accel::to_string(accel::MixedPrecision::Bf16) == "bf16");
  CHECK(accel::to_string(accel::ShardingStrategy::ShardGradOp) == "SHARD_GRAD_OP");
  CHECK(accel::to_string(accel::AutoWrapPolicy::PerChildWrap) == "PER_CHILD_WRAP");
  CHECK(accel::to_string(accel::OffloadDevice::Cpu) == "cpu");
  CHECK(accel::parse_backend("ddp") == "ddp");
  CHECK(accel::parse_backend("FSDP") == "fsdp");
  CHECK(accel::parse_backend("deepspeed") == "zero");
  CHECK(accel::parse_mixed_precision("fp16") == accel::MixedPrecision::Fp16);
  CHECK_THROWS_WITH(
      accel::parse_backend("dpp"),
      "backend: invalid value 'dpp' (did you mean 'ddp'?); allowed values: local, ddp, fsdp, zero");

  // The backends describe themselves (backends/<name>/<name>_config.cpp); nothing in the config core names
  // one, so these facts come from the backend folders.
  std::vector<std::string> names;
  for (const accel::BackendInfo& info : accel::config_backends())
    names.push_back(info.name);
  CHECK(names == std::vector<std::string>{"local", "ddp", "fsdp", "zero"});
  REQUIRE(accel::find_backend("zero") != nullptr);
  CHECK(accel::find_backend("zero")->section == "deepspeed_config");
  CHECK(accel::find_backend("zero")->aliases == std::vector<std::string>{"deepspeed"});
  CHECK(accel::find_backend("fsdp")->section == "fsdp_config");
  CHECK(accel::find_backend("ddp")->distributed_types == std::vector<std::string>{"MULTI_CPU", "MULTI_GPU"});
  CHECK(accel::find_backend("local")->max_processes == 1);
  CHECK(accel::find_backend("deepspeed") == nullptr);  // canonical names only
  CHECK(static_cast<bool>(accel::find_backend("fsdp")->ask_settings));
  CHECK_FALSE(static_cast<bool>(accel::find_backend("ddp")->ask_settings));
  CHECK(accel::backend_for_processes("local", 1) == "local");
  CHECK(accel::backend_for_processes("local", 4) == "ddp");
  CHECK(accel::backend_for_processes("zero", 4) == "zero");
  CHECK(accel::backend_for_processes("my_own", 4) == "my_own");  // a backend a program registered itself
  CHECK_THROWS_WITH(
      accel::parse_mixed_precision("fp8"),
      "mixed_precision: 'fp8' is not supported by accelerate-cpp; allowed values: no, fp16, bf16");
}

TEST_CASE("config: missing file", "[config]") {
  const std::string path = data_file("does_not_exist.yaml");
  const accel::ConfigError e = load_error(path);
  CHECK(std::string(e.what()) == "cannot open config file '" + path +
                                     "': No such file or directory; create one with 'accel-launch config'");
  CHECK(e.file() == path);
  CHECK(e.line() == 0);
}

// A named pipe no process writes to blocked load_file for ever (opening a FIFO for reading waits for a
// writer; the launcher hung in it: tests/fault/launcher_campaign.sh); now it is an error naming it. A pipe
// with a writer (`--config_file <(cat x.yaml)`, here /dev/fd/N of a pipe) is read to its end.
TEST_CASE("config: a FIFO nobody writes to is refused, a pipe with a writer is read", "[config]") {
  const auto dir = std::filesystem::temp_directory_path() / ("accel-fifo-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string fifo = (dir / "config.yaml").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(accel::Config::load_file(fifo),
                    "cannot open config file '" + fifo +
                        "': it is a FIFO (named pipe) that no process writes to; pass the file itself");
  std::filesystem::remove_all(dir);
  int ends[2];
  REQUIRE(::pipe(ends) == 0);
  const std::string text = "backend: ddp\nnum_processes: 3\nuse_cpu: true\n";
  REQUIRE(::write(ends[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  ::close(ends[1]);
  const auto c = accel::Config::load_file("/dev/fd/" + std::to_string(ends[0]));
  ::close(ends[0]);
  CHECK(c.num_processes == 3);
  // An anonymous pipe already at its end (`<(true)`) is an empty file, as an empty regular file is.
  REQUIRE(::pipe(ends) == 0);
  ::close(ends[1]);
  const auto empty = accel::Config::load_file("/dev/fd/" + std::to_string(ends[0]));
  ::close(ends[0]);
  CHECK(empty == accel::Config::load_string("", "empty.yaml"));
}

// Reads grow their buffer as the file fills it (they used to zero the whole 16 MiB bound first): a file and a
// pipe larger than the first buffer (64 KiB) are read whole, and one byte over the bound is refused.
TEST_CASE("config: files and pipes past the first read buffer are read whole, the bound still holds",
          "[config]") {
  const accel::test::TempDir dir;
  const std::string path = dir.file("large.yaml");
  const std::string padding = "# " + std::string(300000, 'x') + "\n";
  const std::string text = padding + "backend: ddp\nnum_processes: 3\nuse_cpu: true\n";
  std::ofstream(path) << text;
  CHECK(accel::Config::load_file(path).num_processes == 3);
  int ends[2];
  REQUIRE(::pipe(ends) == 0);
  std::thread writer([&] {
    for (std::size_t at = 0; at < text.size();) {
      const ssize_t n = ::write(ends[1], text.data() + at, text.size() - at);
      if (n <= 0) break;
      at += static_cast<std::size_t>(n);
    }
    ::close(ends[1]);
  });
  const auto piped = accel::Config::load_file("/dev/fd/" + std::to_string(ends[0]));
  writer.join();
  ::close(ends[0]);
  CHECK(piped.num_processes == 3);
  std::ofstream(path) << "# " << std::string((std::size_t{16} << 20) - 2, 'x');  // 16 MiB exactly
  CHECK_NOTHROW(accel::Config::load_file(path));
  std::ofstream(path, std::ios::app) << 'x';
  CHECK_THROWS_WITH(accel::Config::load_file(path), Catch::Contains("is larger than 16 MiB"));
}

TEST_CASE("config: error location accessors", "[config]") {
  const accel::ConfigError e = load_error(data_file("fsdp_unknown_key.yaml"));
  CHECK(e.file() == data_file("fsdp_unknown_key.yaml"));
  CHECK(e.line() == 4);
  CHECK(e.key() == "fsdp_config.fsdp_sharding_stratgy");
  const accel::ConfigError m = load_error(data_file("machine_rank.yaml"));
  CHECK(m.line() == 4);
  CHECK(m.key() == "machine_rank");
  const accel::ConfigError s = load_error(data_file("syntax_error.yaml"));
  CHECK(s.line() == 3);
  CHECK(s.key().empty());
}

TEST_CASE("config: bad files give exact messages", "[config]") {
  // Each file in tests/fixtures/config has exactly one problem; the message must name file, line, key and the
  // fix.
  CHECK(bad_file_message("unknown_key.yaml") ==
        "unknown_key.yaml:3: unknown key 'mixed_precison' (did you mean 'mixed_precision'?)");
  CHECK(bad_file_message("invalid_mixed_precision.yaml") ==
        "invalid_mixed_precision.yaml:2: mixed_precision: invalid value 'fp32'; allowed values: no, fp16, "
        "bf16");
  CHECK(bad_file_message("bad_integer.yaml") ==
        "bad_integer.yaml:4: num_processes: expected a positive integer, got 'two'");
  CHECK(bad_file_message("machine_rank.yaml") ==
        "machine_rank.yaml:4: machine_rank (2) must be less than num_machines (2); set machine_rank to 0..1");
  CHECK(bad_file_message("syntax_error.yaml") ==
        "syntax_error.yaml:3: YAML syntax error: illegal map value (column 8); check the indentation and "
        "quoting "
        "on this line and the one above");
  // Encodings yaml-cpp would misread: a NUL byte made a file decode as UTF-16 and load as all defaults.
  CHECK_THROWS_WITH(
      accel::Config::load_string(std::string("\0num_processes: 2\nbackend: ddp\n", 30), "nul.yaml"),
      Catch::Contains("nul.yaml:1: the file holds a NUL byte (byte 0)") &&
          Catch::Contains("save it as UTF-8 text"));
  CHECK_THROWS_WITH(accel::Config::load_string(std::string("num_processes: 2\n\0", 18), "late.yaml"),
                    Catch::Contains("late.yaml:2: the file holds a NUL byte (byte 17)"));
  CHECK_THROWS_WITH(accel::Config::load_string("\xFF\xFEn\0u\0m\0", "utf16.yaml"),
                    Catch::Contains("utf16.yaml:1: the file is UTF-16 encoded"));
  // Reads are bounded: /dev/zero is refused after 16 MiB, not read until memory runs out.
  CHECK_THROWS_WITH(accel::Config::load_file("/dev/zero"),
                    Catch::Contains("config file '/dev/zero' is larger than 16 MiB"));
  // A file that is just "," made yaml-cpp 0.7's LoadAll loop forever, allocating (320 MB/s): now a syntax
  // error after a bounded count of empty documents.
  for (const char* text : {",", "\n,\n", ",,,"}) {
    INFO("text '" << text << "'");
    CHECK_THROWS_WITH(accel::Config::load_string(text),
                      Catch::Contains("YAML syntax error: the parser makes no progress here") &&
                          Catch::Contains("a stray character such as ','"));
  }
  CHECK(bad_file_message("not_mapping.yaml") ==
        "not_mapping.yaml:1: expected a mapping of 'key: value' lines at the top level, got a sequence; see "
        "config_templates/local.yaml for an example");
  CHECK(bad_file_message("duplicate_key.yaml") ==
        "duplicate_key.yaml:3: duplicate key 'num_processes' (first set on line 1); keep only one of them");
  CHECK(bad_file_message("fsdp_unknown_key.yaml") ==
        "fsdp_unknown_key.yaml:4: unknown key 'fsdp_config.fsdp_sharding_stratgy' (did you mean "
        "'fsdp_config.fsdp_sharding_strategy'?)");
  CHECK(bad_file_message("misplaced_fsdp_key.yaml") ==
        "misplaced_fsdp_key.yaml:3: unknown key 'fsdp_offload_params' (did you mean "
        "'fsdp_config.fsdp_offload_params'? it belongs inside the fsdp_config: section)");
  CHECK(
      bad_file_message("backend_mismatch.yaml") ==
      "backend_mismatch.yaml:1: backend: 'fsdp' disagrees with distributed_type 'MULTI_GPU' (line 3), which "
      "means backend ddp; make them agree or remove one of them");
  CHECK(bad_file_message("non_string_key.yaml") ==
        "non_string_key.yaml:2: keys must be plain names such as 'num_processes', got a sequence as a key");
  CHECK(bad_file_message("dynamo.yaml") ==
        "dynamo.yaml:3: dynamo_config.dynamo_backend: 'INDUCTOR' is not supported by accelerate-cpp "
        "(LibTorch has "
        "no torch.compile); set dynamo_backend: 'NO' or remove it");
  CHECK(bad_file_message("wrong_type.yaml") ==
        "wrong_type.yaml:1: num_processes: expected a positive integer, got a mapping");
  CHECK(
      bad_file_message("nvme.yaml") ==
      "nvme.yaml:5: deepspeed_config.offload_optimizer_device: nvme needs offload_optimizer_nvme_path (in a "
      "DeepSpeed JSON file: offload_optimizer.nvme_path), a directory on a fast local disk for the optimizer "
      "state's files");
  CHECK(
      bad_file_message("config_version.yaml") ==
      "config_version.yaml:1: config_version: this build of accelerate-cpp reads config_version 1 only, got "
      "'2'; upgrade accelerate-cpp or write a new file with 'accel-launch config'");
  CHECK(
      bad_file_message("fp8.yaml") ==
      "fp8.yaml:1: mixed_precision: fp8 (torchao's float8 training (Accelerate picks torchao first when no "
      "backend is named): tensor-wise scales, E4M3 forward, E5M2 gradients) is not supported by "
      "accelerate-cpp yet: fp8 training needs an fp8 matmul (LibTorch's torch._scaled_mm, on CUDA GPUs of "
      "compute capability 8.9 or newer); a CPU has none, and accelerate-cpp's CUDA fp8 path is not built yet "
      "(its scaling arithmetic is: accel/precision/fp8_scaling.hpp). Use mixed_precision: bf16");
  CHECK(bad_file_message("bad_bool.yaml") == "bad_bool.yaml:1: debug: expected true or false, got 'maybe'");
  CHECK(bad_file_message("bad_port.yaml") ==
        "bad_port.yaml:1: main_process_port: expected a port number from 0 to 65535, got '70000'");
  CHECK(bad_file_message("not_multiple.yaml") ==
        "not_multiple.yaml:3: num_processes (3) must be a multiple of num_machines (2), as it counts the "
        "processes of all machines; set num_processes to 2 or 4");
  CHECK(
      bad_file_message("local_multi_process.yaml") ==
      "local_multi_process.yaml:2: num_processes (2) needs a distributed backend, but the backend is "
      "local; set distributed_type: MULTI_CPU | MULTI_GPU | FSDP | DEEPSPEED (or backend: one of ddp, fsdp, "
      "zero), or num_processes: 1");
  CHECK(bad_file_message("reshard_conflict.yaml") ==
        "reshard_conflict.yaml:5: fsdp_config.fsdp_reshard_after_forward: false disagrees with "
        "fsdp_sharding_strategy 'FULL_SHARD' (line 4); reshard_after_forward true means FULL_SHARD and false "
        "means SHARD_GRAD_OP: make them agree or remove one");
  CHECK(bad_file_message("accumulation_conflict.yaml") ==
        "accumulation_conflict.yaml:5: deepspeed_config.gradient_accumulation_steps: 4 disagrees with "
        "gradient_accumulation_steps 2 (line 1); make them agree or remove one of them");
  CHECK(bad_file_message("section_not_mapping.yaml") ==
        "section_not_mapping.yaml:1: fsdp_config: expected a mapping of fsdp_* keys (or {}), got 'yes'");
  CHECK(
      bad_file_message("two_documents.yaml") ==
      "two_documents.yaml:3: a second YAML document starts here; a config file holds exactly one (remove the "
      "'---' line and what follows, or merge the two)");
  CHECK(bad_file_message("unsupported_distributed_type.yaml") ==
        "unsupported_distributed_type.yaml:1: distributed_type: 'XLA' is not supported by accelerate-cpp; "
        "allowed values: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, MEGATRON_LM");
  CHECK(bad_file_message("distributed_type_typo.yaml") ==
        "distributed_type_typo.yaml:1: distributed_type: invalid value 'MULTI_GPUS' (did you mean "
        "'MULTI_GPU'?); "
        "allowed values: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, MEGATRON_LM");
  CHECK(bad_file_message("deepspeed_unknown_key.yaml") ==
        "deepspeed_unknown_key.yaml:4: unknown key 'deepspeed_config.offload_device'; valid keys in "
        "deepspeed_config: zero_stage, offload_optimizer_device, offload_optimizer_nvme_path, "
        "offload_param_device, offload_param_nvme_path, "
        "gradient_accumulation_steps, gradient_clipping, zero3_init_flag, zero3_save_16bit_model, "
        "reduce_bucket_size, overlap_comm, allgather_bucket_size, sub_group_size, zero_hpz_partition_size, "
        "stage3_prefetch_bucket_size, "
        "activation_checkpointing, vocab_parallel_lm_head, fp16_loss_scale, fp16_initial_scale_power, "
        "fp16_loss_scale_window, "
        "fp16_hysteresis, fp16_consecutive_hysteresis, fp16_min_loss_scale, deepspeed_trainer_keys, "
        "deepspeed_multinode_launcher, "
        "deepspeed_config_file");
  CHECK(bad_file_message("sagemaker.yaml") ==
        "sagemaker.yaml:1: compute_environment: 'AMAZON_SAGEMAKER' is not supported by accelerate-cpp (it "
        "starts "
        "the ranks on this machine and its peers, not on a cloud service such as SageMaker); allowed values: "
        "LOCAL_MACHINE");
  CHECK(bad_file_message("bad_bucket_size.yaml") ==
        "bad_bucket_size.yaml:3: deepspeed_config.reduce_bucket_size: expected a non-negative number of "
        "bytes (such as 500000000 or 5e8) or auto, got '5.5e-3'");
  CHECK(bad_file_message("multi_cpu_use_cpu.yaml") ==
        "multi_cpu_use_cpu.yaml:2: use_cpu: false contradicts distributed_type 'MULTI_CPU' (line 1); set "
        "use_cpu: "
        "true, or distributed_type: MULTI_GPU to train on GPUs");
  CHECK(bad_file_message("bad_timeout.yaml") ==
        "bad_timeout.yaml:1: collective_timeout_seconds: expected a positive number of seconds, got '-5'");
}

TEST_CASE("config: the full message keeps the path exactly as passed", "[config]") {
  const std::string path = data_file("unknown_key.yaml");
  const accel::ConfigError e = load_error(path);
  REQUIRE(e.what() == path + ":3: unknown key 'mixed_precison' (did you mean 'mixed_precision'?)");
  CHECK(e.line() == 3);
  CHECK(e.key() == "mixed_precison");
  CHECK(e.file() == path);
}

// Accelerate's Megatron-LM files (MegatronLMPlugin's defaults for absent keys) run as tensor parallelism, a
// pipeline and the zero backend at stage 0 (Megatron's DDP) or 1 (its distributed optimizer).
TEST_CASE("config: MEGATRON_LM files map onto tensor parallelism, the pipeline and zero stage 0 or 1",
          "[config]") {
  const auto megatron = [](const std::string& section) {
    return accel::Config::load_string(
        "distributed_type: MEGATRON_LM\nnum_processes: 8\nmegatron_lm_config:\n" + section, "m.yaml");
  };
  // What `accelerate config` writes for tp 2, pp 2, 4 micro-batches.
  const accel::Config full = megatron(
      "  megatron_lm_gradient_clipping: 0.5\n  megatron_lm_num_micro_batches: 4\n  megatron_lm_pp_degree: 2\n"
      "  megatron_lm_recompute_activations: true\n  megatron_lm_sequence_parallelism: false\n"
      "  megatron_lm_tp_degree: 2\n  megatron_lm_use_distributed_optimizer: true\n");
  CHECK(full.backend == "zero");
  CHECK(full.zero.stage == 1);
  CHECK(full.tensor_parallel_size == 2);
  CHECK(full.pipeline.stages == 2);
  CHECK(full.pipeline.micro_batches == 4);
  CHECK(full.zero.gradient_clipping == 0.5);
  CHECK(full.zero.activation_checkpointing);
  CHECK(full.zero.fp16_initial_scale_power == 32);  // Megatron-LM's --initial-loss-scale 2^32
  // Written back as what runs, and read back the same.
  CHECK(accel::Config::load_string(full.to_yaml()) == full);
  // The plugin's defaults: degrees 1, clipping 1.0 (said), DDP, no recomputation.
  const accel::Config plain = megatron("  megatron_lm_recompute_activations: false\n");
  CHECK(plain.backend == "zero");
  CHECK(plain.zero.stage == 0);
  CHECK(plain.tensor_parallel_size == 1);
  CHECK(plain.pipeline.stages == 1);
  CHECK(plain.zero.gradient_clipping == 1.0);
  CHECK_FALSE(plain.zero.activation_checkpointing);
  const auto noticed = [](const accel::Config& c, const std::string& part) {
    return std::any_of(c.notices.begin(), c.notices.end(),
                       [&](const std::string& n) { return n.find(part) != std::string::npos; });
  };
  CHECK(noticed(plain,
                "megatron_lm_gradient_clipping is not set: gradients are clipped to a global norm of 1.0"));
  CHECK(noticed(full, "megatron_lm_recompute_activations: true recomputes"));
  // Refused, naming the key and what to do.
  const auto error = [](const std::string& text) {
    try {
      accel::Config::load_string(text, "m.yaml");
    } catch (const accel::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n"
                   "  megatron_lm_sequence_parallelism: true\n"),
             Catch::StartsWith("m.yaml:4: megatron_lm_config.megatron_lm_sequence_parallelism: true asks for "
                               "Megatron-LM's sequence parallelism") &&
                 Catch::Contains("not supported by accelerate-cpp; set it to false"));
  CHECK_THAT(
      error("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_num_micro_batches: 4\n"),
      Catch::StartsWith("m.yaml:3: megatron_lm_config.megatron_lm_num_micro_batches: 4 without a pipeline") &&
          Catch::Contains("that is gradient_accumulation_steps: 4 (a step of 4 x your batch): set it"));
  CHECK_THAT(
      error("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degree: 0\n"),
      Catch::StartsWith("m.yaml:3: megatron_lm_config.megatron_lm_tp_degree: expected a positive integer"));
  CHECK_THAT(error("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degre: 2\n"),
             Catch::Contains("did you mean 'megatron_lm_config.megatron_lm_tp_degree'"));
  CHECK_THAT(
      error("distributed_type: MEGATRON_LM\nnum_processes: 4\nparallelism_config:\n"
            "  parallelism_config_tp_size: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n"),
      Catch::Contains("with distributed_type: MEGATRON_LM (line 1) the layout is megatron_lm_config's") &&
          Catch::Contains("remove parallelism_config.parallelism_config_tp_size"));
  // With a pipeline the micro-batches are megatron_lm_num_micro_batches; a different accumulation beside them
  // is refused, naming the key to set.
  CHECK_THAT(error("distributed_type: MEGATRON_LM\nnum_processes: 2\ngradient_accumulation_steps: 4\n"
                   "megatron_lm_config:\n  megatron_lm_pp_degree: 2\n"),
             Catch::StartsWith("m.yaml:3: gradient_accumulation_steps: 4 with a Megatron-LM pipeline") &&
                 Catch::Contains("set that to 4 and remove gradient_accumulation_steps"));
  CHECK(megatron("  megatron_lm_pp_degree: 2\n").pipeline.micro_batches == 1);
  CHECK_THAT(error("distributed_type: MEGATRON_LM\nnum_processes: 2\npipeline_config:\n  stages: 2\n"
                   "megatron_lm_config:\n  megatron_lm_pp_degree: 2\n"),
             Catch::Contains("the layout is megatron_lm_config's") &&
                 Catch::Contains("remove pipeline_config.stages"));
  // Accelerate 1.13's further keys: refused where they change the layout or what is computed, noticed where
  // they concern Megatron-LM's own models or speed.
  CHECK_THAT(
      error("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_context_parallel_size: 2\n"),
      Catch::Contains("megatron_lm_config.megatron_lm_context_parallel_size is not supported by "
                      "accelerate-cpp"));
  CHECK(megatron("  megatron_lm_context_parallel_size: 1\n").backend == "zero");
  CHECK(noticed(megatron("  megatron_lm_attention_dropout: 0.1\n"),
                "megatron_lm_config.megatron_lm_attention_dropout"));
  // deepspeed_config beside it is ignored, as Accelerate ignores it under MEGATRON_LM, and said so.
  const accel::Config with_ds = accel::Config::load_string(
      "distributed_type: MEGATRON_LM\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
      "megatron_lm_config:\n  megatron_lm_tp_degree: 2\n",
      "m.yaml");
  CHECK(with_ds.zero.stage == 0);
  CHECK(noticed(with_ds,
                "m.yaml:4: deepspeed_config.zero_stage: ignored, as Accelerate ignores it under "
                "distributed_type: MEGATRON_LM"));
  // Under another distributed_type the section is ignored, as Accelerate ignores it, and said so.
  const accel::Config other = accel::Config::load_string(
      "distributed_type: MULTI_CPU\nnum_processes: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n",
      "m.yaml");
  CHECK(other.backend == "ddp");
  CHECK(other.tensor_parallel_size == 1);
  CHECK(noticed(other,
                "m.yaml:4: megatron_lm_config.megatron_lm_tp_degree: ignored, as Accelerate ignores it"));
  // An empty section (what `accelerate config` writes for every other type) says nothing.
  CHECK(accel::Config::load_string("distributed_type: MULTI_CPU\nnum_processes: 2\nmegatron_lm_config: {}\n")
            .notices.empty());
}

TEST_CASE("config: inline errors", "[config]") {
  CHECK(std::string(string_error("Num_Processes: 2\n").what()) ==
        "inline.yaml:1: unknown key 'Num_Processes' (did you mean 'num_processes'?)");
  CHECK(std::string(string_error("fsdp_config:\n  num_processes: 2\n").what()) ==
        "inline.yaml:2: unknown key 'fsdp_config.num_processes' (it belongs at the top level, not inside "
        "fsdp_config:)");
  CHECK(std::string(string_error("zero_stage: 3\n").what()) ==
        "inline.yaml:1: unknown key 'zero_stage' (did you mean 'deepspeed_config.zero_stage'? it belongs "
        "inside "
        "the deepspeed_config: section)");
  CHECK(std::string(string_error("hello\n").what()) ==
        "inline.yaml:1: expected a mapping of 'key: value' lines at the top level, got 'hello'; see "
        "config_templates/local.yaml for an example");
  CHECK(
      std::string(string_error("gpu_ids: [0, 1]\n").what()) ==
      "inline.yaml:1: gpu_ids: expected all, or GPU indices separated by commas such as 0,1, got a sequence");
  // Explicit YAML tags: YAML's own scalar types read as usual, anything else (Accelerate's safe_load decodes
  // !!binary as base64 bytes) is refused rather than read as its text.
  CHECK(accel::Config::load_string(
            "distributed_type: MULTI_CPU\nnum_processes: !!int 2\nmixed_precision: !!str bf16\n")
            .num_processes == 2);
  CHECK(
      std::string(string_error("mixed_precision: !!binary bm8=\n").what()) ==
      "inline.yaml:1: mixed_precision: the YAML tag '!!binary' is not supported by accelerate-cpp (a setting "
      "is plain text, a number, true/false or null; Accelerate's loader would not read it as that text "
      "either); write the value without the tag");
  CHECK_THAT(std::string(string_error("fsdp_config:\n  fsdp_version: !custom 2\n").what()),
             Catch::StartsWith("inline.yaml:2: fsdp_config.fsdp_version: the YAML tag '!custom' is not "
                               "supported"));
}

TEST_CASE("config: every key of the schema set to a non-default value survives save and load", "[config]") {
  // One file that sets every setting of the schema to its example (a valid non-default value): a key added
  // to the schema without reader, writer or equality, or with a writer that loses it, fails here.
  std::string top;
  std::map<std::string, std::string> sections;  // section -> its lines
  const std::vector<std::string> only_default = {"config_version", "compute_environment"};
  std::vector<accel::ConfigKeyInfo> settings;
  for (const auto& key : accel::config_keys()) {
    if (!key.setting) continue;
    if (key.example.empty()) {
      INFO(key.path << " is a setting without an example value");
      CHECK(std::find(only_default.begin(), only_default.end(), key.path) != only_default.end());
      continue;
    }
    settings.push_back(key);
    const auto dot = key.path.find('.');
    const std::string name = dot == std::string::npos ? key.path : key.path.substr(dot + 1);
    const std::string line = name + ": " + key.example + "\n";
    if (dot != std::string::npos) {
      sections[key.path.substr(0, dot)] += "  " + line;
    } else {
      top += line;
    }
  }
  REQUIRE(settings.size() > 40);
  std::string yaml = top;
  for (const auto& [section, lines] : sections)
    yaml += section + ":\n" + lines;
  INFO("the file:\n" << yaml);
  const accel::Config loaded = accel::Config::load_string(yaml, "every_key.yaml");
  CHECK(loaded != accel::Config{});
  // The value to_yaml writes for `path` ("key: value" in its section).
  auto written = [](const std::string& text, const std::string& path) {
    const auto dot = path.find('.');
    std::string needle;
    std::size_t from = 0;
    if (dot == std::string::npos) {
      needle = "\n" + path + ": ";
    } else {
      from = text.find("\n" + path.substr(0, dot) + ":\n");
      needle = "\n  " + path.substr(dot + 1) + ": ";
    }
    const auto at = from == std::string::npos ? std::string::npos : text.find(needle, from);
    if (at == std::string::npos) return std::string("<missing>");
    const auto begin = at + needle.size();
    return text.substr(begin, text.find('\n', begin) - begin);
  };
  const std::string saved = loaded.to_yaml();
  for (const auto& key : settings) {
    INFO(key.path << ": example " << key.example << ", default " << key.default_value);
    CHECK(written(saved, key.path) != "<missing>");
    CHECK(written(saved, key.path) != key.default_value);  // the example took effect
  }
  const accel::Config back = accel::Config::load_string(saved, "every_key_saved.yaml");
  CHECK(back == loaded);
  CHECK(back.to_yaml() == saved);
  // Equality is derived from the same rows: the file without any one key gives a config that differs. Keys
  // that others depend on make the rest invalid when removed (each such error is expected).
  const std::vector<std::string> needed_by_others = {"backend", "num_processes", "num_machines",
                                                     "fsdp_config.fsdp_sharding_strategy"};
  for (const auto& key : settings) {
    INFO("without " << key.path);
    const auto dot = key.path.find('.');
    const std::string name = dot == std::string::npos ? key.path : key.path.substr(dot + 1);
    const std::string line = (dot == std::string::npos ? "" : "  ") + name + ": " + key.example + "\n";
    std::string without = "\n" + yaml;
    const auto at = without.find("\n" + line);
    REQUIRE(at != std::string::npos);
    without.erase(at + 1, line.size());
    if (std::find(needed_by_others.begin(), needed_by_others.end(), key.path) != needed_by_others.end()) {
      CHECK_THROWS_AS(accel::Config::load_string(without), accel::ConfigError);
    } else {
      CHECK(accel::Config::load_string(without) != loaded);
    }
  }
}

namespace {

// A YAML config (DEEPSPEED, 2 processes) next to a DeepSpeed JSON in a fresh directory.
class DeepSpeedFiles {
 public:
  DeepSpeedFiles() {
    static int serial = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("accel-ds-test-" + std::to_string(::getpid()) + "-" + std::to_string(serial++));
    std::filesystem::create_directories(dir_);
  }
  ~DeepSpeedFiles() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const auto path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }
  // The YAML naming `json` (a path, or a name relative to the YAML), plus extra top-level and section lines.
  std::string yaml(const std::string& json, const std::string& top = "", const std::string& section = "",
                   int processes = 2) const {
    return write("accelerate.yaml",
                 "distributed_type: DEEPSPEED\nnum_processes: " + std::to_string(processes) + "\n" + top +
                     "deepspeed_config:\n  deepspeed_config_file: " + json + "\n" + section);
  }

 private:
  std::filesystem::path dir_;
};

std::string fixture(const std::string& name) {
  return data_file("deepspeed/" + name);
}

}  // namespace

TEST_CASE("config: a DeepSpeed JSON file with \"auto\" values (Hugging Face's ZeRO-2 example)", "[config]") {
  DeepSpeedFiles files;
  const auto c = accel::Config::load_file(
      files.yaml(fixture("hf_zero2_auto.json"), "mixed_precision: bf16\ngradient_accumulation_steps: 4\n"));
  CHECK(c.backend == "zero");
  CHECK(c.zero.stage == 2);
  CHECK(c.zero.offload_optimizer_device == accel::OffloadDevice::Cpu);
  CHECK(c.zero.reduce_bucket_size == 200000000);
  CHECK(c.zero.allgather_bucket_size == 200000000);
  CHECK(c.zero.overlap_comm);
  CHECK(c.zero.gradient_clipping == 1.0);                   // "auto" is Accelerate's 1.0
  CHECK(c.gradient_accumulation_steps == 4);                // "auto" follows the YAML
  CHECK(c.mixed_precision == accel::MixedPrecision::Bf16);  // fp16/bf16 "auto" follow the YAML
  CHECK(c.zero.config_file == fixture("hf_zero2_auto.json"));
  // Keys that map to nothing are listed, never dropped silently; the optimizer and scheduler blocks are kept
  // for accel::Trainer, which builds them as Hugging Face's Trainer has DeepSpeed build them.
  CHECK(has_notice(c, "optimizer AdamW, scheduler WarmupLR: accel::Trainer builds them"));
  CHECK(c.zero.trainer_keys.find("\"scheduler\":{\"params\":{\"warmup_max_lr\":\"auto\"") !=
        std::string::npos);
  CHECK(c.zero.gradient_clipping_auto);
  CHECK(has_notice(c, "steps_per_print"));
  CHECK(has_notice(c, "wall_clock_breakdown"));
  // The resolved settings are the config: written and read back without the JSON file.
  const auto back = accel::Config::load_string(c.to_yaml());
  CHECK(back == c);
  CHECK(back.to_yaml().find("deepspeed_config_file") == std::string::npos);
  // ...and its gradient_clipping "auto" stays "auto" in that copy (the one accel-launch hands the ranks), so
  // that accel::Trainer fills it with max_grad_norm as HF's Trainer does: a written 1 would read as a
  // setting.
  CHECK(c.to_yaml().find("  gradient_clipping: auto\n") != std::string::npos);
  CHECK(back.zero.gradient_clipping_auto);
  CHECK(back.zero.trainer_keys ==
        c.zero.trainer_keys);  // what accel::Trainer fills and checks, for the ranks
}

TEST_CASE("config: a DeepSpeed JSON's optimizer and scheduler blocks of other types are refused, naming them",
          "[config]") {
  DeepSpeedFiles files;
  const auto load = [&](const std::string& blocks) {
    return accel::Config::load_file(
        files.yaml(files.write("ds.json", "{\"zero_optimization\": {\"stage\": 2}, " + blocks + "}")));
  };
  CHECK_THROWS_WITH(
      load("\"optimizer\": {\"type\": \"OneBitLamb\", \"params\": {}}"),
      Catch::Contains("optimizer.type 'OneBitLamb' is not supported") && Catch::Contains("\"AdamW\""));
  for (const char* type : {"OneCycle", "LRRangeTest", "StepLR"})
    CHECK_THROWS_WITH(load(std::string("\"scheduler\": {\"type\": \"") + type + "\"}"),
                      Catch::Contains(std::string("scheduler.type '") + type + "' is not supported") &&
                          Catch::Contains("WarmupCosineLR"));
  CHECK_THROWS_WITH(load("\"optimizer\": {\"params\": {}}"), Catch::Contains("\"type\""));
  // DeepSpeed lowercases the optimizer's name.
  CHECK(load("\"optimizer\": {\"type\": \"adam\"}").zero.trainer_keys ==
        "{\"optimizer\":{\"type\":\"adam\"}}");
  // Parameters DeepSpeed's Adam would refuse, refused when the Trainer builds the block.
  const auto build = [&](const std::string& blocks) {
    return accel::deepspeed_trainer_config(load(blocks), {}, /*throw_on_mismatch=*/false);
  };
  CHECK_THROWS_WITH(build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"max_grad_norm\": 1.0}}"),
                    Catch::Contains("gradient_clipping"));
  CHECK_THROWS_WITH(build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"betass\": [0.9, 0.99]}}"),
                    Catch::Contains("did you mean 'betas'"));
  // bias_correction: read (DeepSpeed's default true; a null is false, as FusedAdam tests it for truth);
  // torch.optim's Adam has no such parameter.
  CHECK(build("\"optimizer\": {\"type\": \"Adam\"}").optimizer->bias_correction);
  CHECK_FALSE(build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"bias_correction\": false}}")
                  .optimizer->bias_correction);
  CHECK_FALSE(build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"bias_correction\": null}}")
                  .optimizer->bias_correction);
  CHECK(build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"bias_correction\": true}}")
            .optimizer->bias_correction);
  // A number is its truth, as DeepSpeed tests these switches; text is refused (Python reads "false" as true).
  CHECK_FALSE(build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"bias_correction\": 0}}")
                  .optimizer->bias_correction);
  CHECK(build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"bias_correction\": 1}}")
            .optimizer->bias_correction);
  CHECK_THROWS_WITH(
      build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"bias_correction\": \"false\"}}"),
      Catch::Contains("expected true or false"));
  CHECK_THROWS_WITH(
      build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"torch_adam\": true, \"bias_correction\": "
            "false}}"),
      Catch::Contains("torch_adam") && Catch::Contains("TypeError"));
  CHECK_THROWS_WITH(build("\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {}}"),
                    Catch::Contains("total_num_steps"));
  CHECK_THROWS_WITH(build("\"scheduler\": {\"type\": \"WarmupLR\", \"params\": {\"warmup_num_steps\": 0}}"),
                    Catch::Contains("positive"));
  // "Adam" is AdamW unless adam_w_mode is false (DeepSpeed's engine); torch_adam's AdamW decays by 0.01.
  CHECK(build("\"optimizer\": {\"type\": \"Adam\"}").optimizer->adamw_mode);
  CHECK_FALSE(build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"adam_w_mode\": false}}")
                  .optimizer->adamw_mode);
  // engine.py pops adam_w_mode with default True: a null is None, falsy: Adam with L2 (it was AdamW here).
  CHECK_FALSE(build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"adam_w_mode\": null}}")
                  .optimizer->adamw_mode);
  CHECK_FALSE(
      build("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"adam_w_mode\": 0}}").optimizer->adamw_mode);
  CHECK(build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"adam_w_mode\": false}}")
            .optimizer->adamw_mode);
  CHECK(build("\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"torch_adam\": true}}")
            .optimizer->weight_decay == 0.01);
  CHECK(build("\"optimizer\": {\"type\": \"AdamW\"}").optimizer->weight_decay == 0.0);
  CHECK(build("\"scheduler\": {\"type\": \"WarmupLR\"}").scheduler->log_warmup);  // DeepSpeed's default
}

TEST_CASE("config: the real-corpus DeepSpeed files with Adam and bias_correction false are read with it",
          "[config]") {
  // DeepSpeed's own bsz24 configs (tests/data/real_configs): "Adam" (AdamW logic, adam_w_mode's default)
  // without bias correction, on the 8 ranks their train_batch_size 24 = 3 x 8 implies.
  std::size_t read = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(accel::test::tests_dir() + "/data/real_configs/deepspeed")) {
    const auto name = entry.path().filename().string();
    if (name.find("bsz24") == std::string::npos) continue;
    INFO(name);
    const auto config = accel::Config::load_string(
        "distributed_type: DEEPSPEED\nuse_cpu: true\nnum_processes: 8\ndeepspeed_config:\n  "
        "deepspeed_config_file: " +
            entry.path().string() + "\n",
        "ds.yaml");
    accel::DeepSpeedTrainerArgs args;
    args.world_size = 8;
    args.per_device_train_batch_size = 3;
    const auto ds = accel::deepspeed_trainer_config(config, args, /*throw_on_mismatch=*/false);
    REQUIRE(ds.optimizer);
    CHECK_FALSE(ds.optimizer->bias_correction);
    CHECK(ds.optimizer->adamw_mode);
    CHECK(ds.optimizer->lr == 3e-05);
    ++read;
  }
  CHECK(read == 5);
}

TEST_CASE("config: NVMe offload of the optimizer state, from the YAML and from a DeepSpeed JSON file",
          "[config]") {
  const auto yaml = accel::Config::load_string(
      "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
      "  offload_optimizer_device: nvme\n  offload_optimizer_nvme_path: /local_nvme\n");
  CHECK(yaml.zero.offload_optimizer_device == accel::OffloadDevice::Nvme);
  CHECK(yaml.zero.offload_optimizer_nvme_path == "/local_nvme");
  CHECK(yaml.zero.offload_optimizer_pipeline_read);  // ours: on (results are the same either way)
  // Written back and read again: the same settings.
  CHECK(accel::Config::load_string(yaml.to_yaml()) == yaml);
  // DeepSpeed's keys and defaults (buffer_count 4, no pipelining unless asked).
  DeepSpeedFiles files;
  const auto path = files.write("nvme.json",
                                "{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": "
                                "\"nvme\", \"nvme_path\": \"/local_nvme\", \"buffer_count\": 6, "
                                "\"pipeline_read\": true, \"pin_memory\": true}}}");
  const auto json = accel::Config::load_file(files.yaml(path));
  CHECK(json.zero.offload_optimizer_device == accel::OffloadDevice::Nvme);
  CHECK(json.zero.offload_optimizer_nvme_path == "/local_nvme");
  CHECK(json.zero.offload_optimizer_buffer_count == 6);
  CHECK(json.zero.offload_optimizer_pipeline_read);
  CHECK_FALSE(json.zero.offload_optimizer_pipeline_write);
  CHECK(has_notice(json, "offload_optimizer.pin_memory"));
}

TEST_CASE("config: NVMe offload of the parameters (stage 3), from the YAML and from a DeepSpeed JSON file",
          "[config]") {
  const auto yaml = accel::Config::load_string(
      "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
      "  offload_param_device: nvme\n  offload_param_nvme_path: /local_nvme\n");
  CHECK(yaml.zero.offload_param_device == accel::OffloadDevice::Nvme);
  CHECK(yaml.zero.offload_param_nvme_path == "/local_nvme");
  CHECK(yaml.zero.offload_param_buffer_count == 5);
  CHECK(accel::Config::load_string(yaml.to_yaml()) == yaml);
  // Without the directory, or below stage 3: an error naming the key and the way on.
  CHECK_THROWS_WITH(
      accel::Config::load_string("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"
                                 "  offload_param_device: nvme\n"),
      Catch::Contains("offload_param_device: nvme needs offload_param_nvme_path"));
  DeepSpeedFiles files;
  const auto path = files.write("param_nvme.json",
                                "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": "
                                "\"nvme\", \"nvme_path\": \"/local_nvme\", \"buffer_count\": 3, "
                                "\"buffer_size\": 1e8, \"max_in_cpu\": 1e9}}}");
  const auto json = accel::Config::load_file(files.yaml(path));
  CHECK(json.zero.offload_param_device == accel::OffloadDevice::Nvme);
  CHECK(json.zero.offload_param_nvme_path == "/local_nvme");
  CHECK(json.zero.offload_param_buffer_count == 3);
  CHECK(has_notice(json, "offload_param.buffer_size"));
  CHECK(has_notice(json, "offload_param.max_in_cpu"));
  const auto no_path = files.write("param_nvme_no_path.json",
                                   "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": "
                                   "\"nvme\"}}}");
  CHECK_THROWS_WITH(
      accel::Config::load_file(files.yaml(no_path)),
      Catch::Contains("needs offload_param_nvme_path (in a DeepSpeed JSON file: offload_param.nvme_path)") &&
          Catch::Contains("(read from the DeepSpeed config file " + no_path +
                          ": zero_optimization.offload_param.device)"));
  // A mapped value refused by the checks names the JSON file and key that set it, not only the YAML file.
  const auto stage0 =
      files.write("optimizer_offload_stage0.json",
                  "{\"zero_optimization\": {\"stage\": 0, \"offload_optimizer\": {\"device\": "
                  "\"cpu\"}}}");
  CHECK_THROWS_WITH(accel::Config::load_file(files.yaml(stage0)),
                    Catch::Contains("needs zero_stage 1, 2 or 3, but zero_stage is 0") &&
                        Catch::Contains("(read from the DeepSpeed config file " + stage0 +
                                        ": zero_optimization.offload_optimizer.device)"));
  // Below stage 3 DeepSpeed ignores offload_param: a notice, not an error, even without a path.
  const auto stage2 = files.write("param_nvme_stage2.json",
                                  "{\"zero_optimization\": {\"stage\": 2, \"offload_param\": {\"device\": "
                                  "\"nvme\"}}}");
  const auto two = accel::Config::load_file(files.yaml(stage2));
  CHECK(two.zero.offload_param_device == accel::OffloadDevice::None);
  std::string two_notices;
  for (const auto& n : two.notices)
    two_notices += n + "\n";
  CHECK_THAT(two_notices, Catch::Contains("nvme has no effect at zero_stage 2"));
}

TEST_CASE("config: a DeepSpeed JSON file with ZeRO-3 offload, batch sizes and unknown keys", "[config]") {
  DeepSpeedFiles files;
  const auto c = accel::Config::load_file(files.yaml(fixture("zero3_offload.json")));
  CHECK(c.zero.stage == 3);
  CHECK(c.zero.offload_optimizer_device == accel::OffloadDevice::Cpu);
  CHECK(c.zero.offload_param_device == accel::OffloadDevice::Cpu);
  CHECK(c.zero.zero3_save_16bit_model);
  CHECK(c.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK(c.gradient_accumulation_steps == 4);
  // "auto" bucket sizes are derived from the model at prepare (hidden_size², as Accelerate does), and they
  // survive the YAML the launcher hands the ranks.
  CHECK_FALSE(c.zero.reduce_bucket_size.has_value());
  CHECK_FALSE(c.zero.stage3_prefetch_bucket_size.has_value());
  CHECK_FALSE(has_notice(c, "reduce_bucket_size"));
  CHECK(c.to_yaml().find("reduce_bucket_size: auto") != std::string::npos);
  CHECK(accel::Config::load_string(c.to_yaml()) == c);
  CHECK(has_notice(c, "unknown top-level key(s) ignored: some_future_key"));
  CHECK(has_notice(c, "stage3_max_live_parameters"));
  CHECK(c.zero.sub_group_size == 1000000000u);       // read (stages 1-2 use it) ...
  CHECK(has_notice(c, "sub_group_size (stage 3)"));  // ... and reported as no effect in stage 3
  CHECK(has_notice(c, "train_micro_batch_size_per_gpu is 4"));
  // 32 = 4 x 4 x 2 ranks; on 4 ranks the same file is inconsistent, with DeepSpeed's meaning.
  const std::string message = load_error(files.yaml(fixture("zero3_offload.json"), "", "", 4)).what();
  CHECK_THAT(message, Catch::Contains("train_batch_size 32 is not train_micro_batch_size_per_gpu 4 x "
                                      "gradient_accumulation_steps 4 x world size 4 (= 64)"));
  CHECK_THAT(message, Catch::StartsWith(fixture("zero3_offload.json") + ":"));
}

TEST_CASE("config: a DeepSpeed JSON's fp16 loss-scaler settings are followed when fp16 is in effect",
          "[config]") {
  DeepSpeedFiles files;
  // Hugging Face's ZeRO-2 example: fp16.enabled "auto" follows mixed_precision (Accelerate's
  // set_mixed_precision fills it); its scaler settings then reach DeepSpeed's loss scaler, and ours.
  const auto fp16 =
      accel::Config::load_file(files.yaml(fixture("hf_zero2_auto.json"), "mixed_precision: fp16\n"));
  CHECK(fp16.mixed_precision == accel::MixedPrecision::Fp16);
  CHECK_FALSE(has_notice(fp16, "fp16."));  // every setting of its fp16 block is followed
  const accel::LossScaling hf = accel::loss_scaling_of(fp16);
  CHECK(hf.dynamic);
  CHECK(hf.deepspeed_schedule);
  CHECK(hf.init_scale == 65536.0);
  CHECK(hf.growth_interval == 1000);
  CHECK(hf.hysteresis == 2);
  CHECK_FALSE(hf.consecutive_hysteresis);
  CHECK(hf.min_scale == 1.0);
  // fp16.enabled true: the file's values, DeepSpeed's defaults for what the block leaves out; a static scale.
  const auto explicit_fp16 = accel::Config::load_file(files.yaml(
      files.write("ds.json",
                  "{\"fp16\": {\"enabled\": true, \"loss_scale\": 128, \"initial_scale_power\": 12, "
                  "\"hysteresis\": 4, \"consecutive_hysteresis\": true, \"auto_cast\": true}, "
                  "\"zero_optimization\": {\"stage\": 2}}")));
  CHECK(explicit_fp16.zero.fp16_loss_scale == 128);
  CHECK(explicit_fp16.zero.fp16_initial_scale_power == 12);
  CHECK(explicit_fp16.zero.fp16_hysteresis == 4);
  CHECK(explicit_fp16.zero.fp16_consecutive_hysteresis);
  CHECK(explicit_fp16.zero.fp16_loss_scale_window == 1000);  // DeepSpeed's default
  const accel::LossScaling fixed = accel::loss_scaling_of(explicit_fp16);
  CHECK_FALSE(fixed.dynamic);
  CHECK(fixed.init_scale == 128);
  // What is still not followed is named, with the reason.
  CHECK(has_notice(
      explicit_fp16,
      "ds.json: fp16 is in effect (fp16.enabled true) and these settings of DeepSpeed's fp16 differ "
      "from accelerate-cpp's (fp16 autocast over fp32 parameters, with DeepSpeed's loss scaler as "
      "the block sets it): fp16.auto_cast true (ours: false, inputs are not cast: autocast runs "
      "each op in fp16 from fp32 parameters)"));
  CHECK_FALSE(has_notice(explicit_fp16, "loss_scale"));
  // The settings survive to_yaml (accel-launch hands ranks the config as YAML).
  const auto back = accel::Config::load_string(explicit_fp16.to_yaml());
  CHECK(back.zero == explicit_fp16.zero);
  // A YAML DeepSpeed section in fp16 runs DeepSpeed's defaults, as Accelerate's plugin does; DDP keeps
  // PyTorch's GradScaler.
  const auto yaml_zero = accel::Config::load_string(
      "distributed_type: DEEPSPEED\nmixed_precision: fp16\ndeepspeed_config:\n  zero_stage: 2\n");
  CHECK(accel::loss_scaling_of(yaml_zero).hysteresis == 2);
  CHECK(accel::loss_scaling_of(yaml_zero).growth_interval == 1000);
  const auto ddp =
      accel::Config::load_string("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\n");
  CHECK_FALSE(accel::loss_scaling_of(ddp).deepspeed_schedule);
  CHECK(accel::loss_scaling_of(ddp).growth_interval == 2000);
  CHECK(accel::loss_scaling_of(ddp).hysteresis == 1);
  // bf16 resolves the same file's fp16 block to disabled (as DeepSpeed gets it): its settings are not read.
  const auto bf16 =
      accel::Config::load_file(files.yaml(fixture("hf_zero2_auto.json"), "mixed_precision: bf16\n"));
  CHECK_FALSE(has_notice(bf16, "fp16."));
  // Values DeepSpeed refuses are refused, naming file and key.
  auto refused = [&](const std::string& block) {
    return std::string(
        load_error(files.yaml(files.write("bad.json", "{\"fp16\": {\"enabled\": true, " + block +
                                                          "}, \"zero_optimization\": {\"stage\": 2}}")))
            .what());
  };
  CHECK_THAT(refused("\"loss_scale\": -1"),
             Catch::Contains("bad.json") && Catch::Contains("fp16.loss_scale"));
  CHECK_THAT(refused("\"loss_scale\": true"), Catch::Contains("fp16.loss_scale"));
  CHECK_THAT(refused("\"hysteresis\": 0"), Catch::Contains("fp16.hysteresis: expected a positive integer"));
  CHECK_THAT(refused("\"loss_scale_window\": 2.5"), Catch::Contains("fp16.loss_scale_window"));
  CHECK_THAT(refused("\"min_loss_scale\": 0"), Catch::Contains("fp16.min_loss_scale"));
  CHECK_THAT(refused("\"initial_scale_power\": \"auto\""), Catch::Contains("fp16.initial_scale_power"));
  // bf16 settings get their own reasons (not the fp16 scaler's); check_grad_overflow is DeepSpeed's default
  // true since 0.19.3.
  const auto bf16_block = accel::Config::load_file(
      files.yaml(files.write("ds.json",
                             "{\"bf16\": {\"enabled\": true, \"bf16_master_weights_and_grads\": true}, "
                             "\"zero_optimization\": {\"stage\": 2}}")));
  CHECK(has_notice(
      bf16_block,
      "ds.json: bf16 is in effect (bf16.enabled true) and these settings of DeepSpeed's bf16 differ "
      "from accelerate-cpp's (bf16 autocast, parameters, gradients and optimizer state in fp32): "
      "bf16.check_grad_overflow true (DeepSpeed's default since 0.19.3; ours: false, a step whose "
      "gradients hold inf or NaN is taken), bf16.bf16_master_weights_and_grads true (ours: false, "
      "fp32 master weights and gradients)"));
  CHECK_FALSE(has_notice(bf16_block, "loss scaler is dynamic"));
  // DeepSpeed's old spelling "bfloat16" (read when "bf16" is absent) enables bf16 too.
  const auto old_name = accel::Config::load_file(files.yaml(
      files.write("ds.json", "{\"bfloat16\": {\"enabled\": true}, \"zero_optimization\": {\"stage\": 2}}")));
  CHECK(old_name.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK_FALSE(has_notice(old_name, "unknown top-level key"));
}

TEST_CASE("config: what Accelerate and DeepSpeed ignore in real files loads, with a notice saying so",
          "[config]") {
  // offload_param at zero_stage 2: DeepSpeed builds stages 0-2 without it (engine.py), so it has no effect.
  const auto stage2 =
      accel::Config::load_file(accel::test::test_data_dir() + "/config/offload_param_stage2.yaml");
  CHECK(stage2.zero.offload_param_device == accel::OffloadDevice::None);
  CHECK(has_notice(stage2,
                   "deepspeed_config.offload_param_device cpu has no effect at zero_stage 2: DeepSpeed "
                   "offloads parameters in stage 3 only"));
  // distributed_type: NO with num_processes 8 (trl's single_gpu.yaml): accelerate launch runs one process.
  const auto single = accel::Config::load_string(
      "distributed_type: 'NO'\nnum_processes: 8\nmixed_precision: bf16\n", "single_gpu.yaml");
  CHECK(single.num_processes == 1);
  CHECK(single.backend == "local");
  CHECK(has_notice(single,
                   "single_gpu.yaml:2: num_processes: 8 has no effect with distributed_type: NO (line 1)"));
  // Without distributed_type the count is ours to read: a local backend on 2 processes is still an error.
  CHECK_THROWS_WITH(accel::Config::load_string("num_processes: 2\n"),
                    Catch::Contains("num_processes (2) needs a distributed backend"));
  // deepspeed_config.gradient_accumulation_steps: auto (rhymes-ai/Aria's files) follows the top-level value.
  const auto gas = accel::Config::load_string(
      "distributed_type: DEEPSPEED\ngradient_accumulation_steps: 4\ndeepspeed_config:\n"
      "  gradient_accumulation_steps: auto\n  zero_stage: 2\n");
  CHECK(gas.gradient_accumulation_steps == 4);
  CHECK(gas.zero.gradient_clipping == 1.0);  // absent: Accelerate's 1.0
  const auto clip_auto = accel::Config::load_string(
      "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: auto\n  zero_stage: 2\n");
  CHECK(clip_auto.zero.gradient_clipping == 1.0);  // auto: filled as Accelerate fills it
  CHECK(has_notice(clip_auto,
                   "deepspeed_config.gradient_clipping is auto: gradients are clipped to a global norm "
                   "of 1.0"));
  CHECK(accel::Config::load_string(
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: "
            "auto\n")
            .gradient_accumulation_steps == 1);
  // A SageMaker file is refused for its compute environment first, before its duplicate key.
  CHECK_THROWS_WITH(
      accel::Config::load_string("compute_environment: AMAZON_SAGEMAKER\ndebug: false\ndebug: false\n",
                                 "sm.yaml"),
      Catch::StartsWith(
          "sm.yaml:1: compute_environment: 'AMAZON_SAGEMAKER' is not supported by accelerate-cpp"));
}

TEST_CASE("config: real keys of other Accelerate and DeepSpeed versions are said to be not supported",
          "[config]") {
  const std::string ddp = "distributed_type: MULTI_GPU\nnum_processes: 2\n";
  auto message = [](const std::string& yaml) { return std::string(string_error(yaml).what()); };
  // Accelerate's newer (or removed) sections: "not supported", what they do there, what to use instead.
  CHECK(accel::Config::load_string(ddp + "parallelism_config: {}\n").notices.empty());  // asks for nothing
  CHECK_THAT(
      message(ddp + "ipex_config:\n  ipex: true\n"),
      Catch::StartsWith("inline.yaml:3: ipex_config is not supported by accelerate-cpp: Intel Extension "
                        "for PyTorch"));
  CHECK(accel::Config::load_string(ddp + "ipex_config:\n  ipex: false\n  use_xpu: false\n").notices.empty());
  CHECK_THAT(message("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_ignored_modules: "
                     "'vision_tower.*'\n"),
             Catch::StartsWith("inline.yaml:4: fsdp_config.fsdp_ignored_modules is not supported by "
                               "accelerate-cpp: FSDP leaves the modules"));
  // Launcher-side keys cannot change what the ranks compute: accepted with a notice that says so.
  const auto mpirun = accel::Config::load_string(
      "distributed_type: MULTI_CPU\nnum_processes: 2\nmpirun_config:\n  mpirun_hostfile: ~/hostfile\n",
      "inline.yaml");
  CHECK(has_notice(mpirun, "inline.yaml:3: mpirun_config is not supported by accelerate-cpp: "));
  CHECK(has_notice(mpirun, "; ignored: accel-launch starts the ranks itself"));
  const auto ds = accel::Config::load_string(
      "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
      "  gradient_clipping: 1.0\n  seq_parallel_communication_data_type: bf16\n  deepspeed_hostfile: "
      "/job/hostfile\n",
      "inline.yaml");
  CHECK(has_notice(ds,
                   "deepspeed_config.seq_parallel_communication_data_type is not supported by "
                   "accelerate-cpp: "));
  CHECK(has_notice(ds, "deepspeed_config.deepspeed_hostfile is not supported by accelerate-cpp: "));
  CHECK(ds.zero.stage == 3);
  // Older Accelerate: fp16: true meant mixed_precision: fp16 (config_args.py process_config), tpu_vm is TPU
  // set-up only.
  CHECK(accel::Config::load_string("fp16: true\n").mixed_precision == accel::MixedPrecision::Fp16);
  CHECK(accel::Config::load_string("fp16: true\nmixed_precision: bf16\n").mixed_precision ==
        accel::MixedPrecision::Bf16);
  CHECK(accel::Config::load_string("fp16: false\n").mixed_precision == accel::MixedPrecision::No);
  CHECK_NOTHROW(accel::Config::load_string("tpu_vm: null\n"));
  // Real typos keep their hint.
  CHECK_THAT(message(ddp + "parallelism_confg:\n  x: 1\n"),
             Catch::Contains("unknown key 'parallelism_confg'"));
  CHECK_THAT(message("distributed_type: FSDP\nfsdp_config:\n  fsdp_ignored_module: x\n"),
             Catch::Contains("unknown key 'fsdp_config.fsdp_ignored_module'"));

  // DeepSpeed JSON.
  DeepSpeedFiles files;
  auto json_error = [&](const std::string& json) {
    return std::string(load_error(files.yaml(files.write("ds.json", json))).what());
  };
  auto json_load = [&](const std::string& json) {
    return accel::Config::load_file(files.yaml(files.write("ds.json", json)));
  };
  CHECK_THAT(
      json_error("{\"zero_optimization\": {\"stage\": 2,\n \"zenflow\": {\"topk_ratio\": 0.05}}}"),
      Catch::Contains("ds.json:2: zero_optimization.zenflow is not supported by accelerate-cpp: ZenFlow") &&
          !Catch::Contains("did you mean"));
  CHECK_NOTHROW(json_load("{\"zero_optimization\": {\"stage\": 2, \"zenflow\": null}}"));
  CHECK_NOTHROW(json_load("{\"torch_autocast\": {\"enabled\": false}}"));
  CHECK_THAT(json_error("{\"gradient_allreduce_op\": \"sum\"}"),
             Catch::Contains("gradient_allreduce_op is not supported by accelerate-cpp: "));
  CHECK_NOTHROW(json_load("{\"gradient_allreduce_op\": \"mean\"}"));
  // DeepSpeed AutoTP: autotp_size is the tensor-parallel size (0 and 1: off), with ZeRO stages 0-2; a custom
  // partition plan and stage 3 are refused; parallelism_config_tp_size in the YAML must agree.
  CHECK(json_load("{\"tensor_parallel\": {\"autotp_size\": 2}}").tensor_parallel_size == 2);
  CHECK(json_load("{\"tensor_parallel\": {\"autotp_size\": 0}}").tensor_parallel_size == 1);
  CHECK(json_load("{\"tensor_parallel\": {\"enabled\": false, \"autotp_size\": 2}}").tensor_parallel_size ==
        1);
  CHECK(json_load("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": false}}")
            .tensor_parallel_size == 2);
  // vocab_parallel_lm_head (DeepSpeed's default false; null: from the model's tp_plan, false for these
  // families): the head split over the vocabulary (accel::llm::tensor_parallel_options reads it); it survives
  // the resolved YAML the launcher hands the ranks. vocab_parallel_ce_backend: "torch" or "liger" (no Liger
  // kernel here: a notice), "liger" only with a vocabulary-parallel head, as DeepSpeed's engine checks.
  {
    const auto vp =
        json_load("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": true}}");
    CHECK(vp.tensor_parallel_size == 2);
    CHECK(vp.zero.vocab_parallel_lm_head);
    const auto again = accel::Config::load_string(vp.to_yaml());
    CHECK(again.zero.vocab_parallel_lm_head);
    CHECK(again == vp);
    CHECK_FALSE(json_load("{\"tensor_parallel\": {\"autotp_size\": 2}}").zero.vocab_parallel_lm_head);
    CHECK_FALSE(json_load("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": null}}")
                    .zero.vocab_parallel_lm_head);
    CHECK_FALSE(json_load("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": false}}")
                    .zero.vocab_parallel_lm_head);
    // Read before zero_optimization, which must keep it.
    CHECK(json_load("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": true},\n"
                    "\"zero_optimization\": {\"stage\": 1}}")
              .zero.vocab_parallel_lm_head);
    CHECK_THAT(json_error("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": \"yes\"}}"),
               Catch::Contains("tensor_parallel.vocab_parallel_lm_head: expected true or false"));
    const auto torch_ce = json_load(
        "{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": true, "
        "\"vocab_parallel_ce_backend\": \"torch\"}}");
    CHECK(torch_ce.zero.vocab_parallel_lm_head);
    const auto liger = json_load(
        "{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": true, "
        "\"vocab_parallel_ce_backend\": \"liger\"}}");
    CHECK(liger.zero.vocab_parallel_lm_head);
    bool noticed = false;
    for (const auto& n : liger.notices)
      noticed =
          noticed || n.find("vocab_parallel_ce_backend \"liger\" (no Liger kernel") != std::string::npos;
    CHECK(noticed);
    CHECK_THAT(
        json_error("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_ce_backend\": \"liger\"}}"),
        Catch::Contains("tensor_parallel.vocab_parallel_ce_backend: \"liger\" needs "
                        "tensor_parallel.vocab_parallel_lm_head: true"));
    CHECK_THAT(json_error("{\"tensor_parallel\": {\"autotp_size\": 2, \"vocab_parallel_lm_head\": true, "
                          "\"vocab_parallel_ce_backend\": \"apex\"}}"),
               Catch::Contains("tensor_parallel.vocab_parallel_ce_backend: expected \"torch\" or \"liger\""));
  }
  CHECK_THAT(
      json_error("{\"zero_optimization\": {\"stage\": 3},\n \"tensor_parallel\": {\"autotp_size\": 2}}"),
      Catch::Contains("ds.json:2: tensor_parallel.autotp_size 2 with zero_optimization.stage 3"));
  CHECK_THAT(json_error("{\"tensor_parallel\": {\"autotp_size\": 2, \"partition_config\": {}}}"),
             Catch::Contains("tensor_parallel.partition_config is not supported by accelerate-cpp"));
  CHECK_THAT(
      std::string(load_error(files.yaml(files.write("ds.json", "{\"tensor_parallel\": {\"autotp_size\": 2}}"),
                                        "parallelism_config:\n  parallelism_config_tp_size: 4\n", "", 4))
                      .what()),
      Catch::Contains("parallelism_config.parallelism_config_tp_size: 4 disagrees with") &&
          Catch::Contains("(tensor_parallel.autotp_size): 2"));
  CHECK_THAT(json_error("{\"amp\": {\"enabled\": true, \"opt_level\": \"O1\"}}"),
             Catch::Contains("amp is not supported by accelerate-cpp: "));
  // Real keys of newer DeepSpeed releases that change nothing here are accepted (listed as no effect).
  const auto newer = json_load(
      "{\"zero_optimization\": {\"stage\": 3, \"stage3_module_granularity_threshold\": 0, "
      "\"stage3_allgather_sequential\": false, \"leaf_module\": {\"classes\": []}, \"offload_optimizer\": "
      "{\"device\": \"cpu\", \"super_offload\": false, \"cpuadam_cores_perc\": 0.8}}}");
  CHECK(has_notice(newer, "stage3_module_granularity_threshold"));
  CHECK_THAT(json_error("{\"zero_optimization\": {\"stage\": 2, \"zenflw\": {}}}"),
             Catch::Contains("unknown key 'zero_optimization.zenflw'"));

  // The table behind these messages, for docs/config_keys.md.
  std::vector<std::string> listed;
  for (const auto& key : accel::unsupported_config_keys()) {
    INFO(key.file << " " << key.path);
    CHECK_FALSE(key.what.empty());
    CHECK_FALSE(key.instead.empty());
    listed.push_back(key.file + " " + key.path);
  }
  for (const char* expected : {"Accelerate YAML mpirun_config", "Accelerate YAML ipex_config",
                               "Accelerate YAML fsdp_config.fsdp_ignored_modules",
                               "Accelerate YAML deepspeed_config.seq_parallel_communication_data_type",
                               "DeepSpeed JSON zero_optimization.zenflow", "DeepSpeed JSON aio"}) {
    INFO(expected);
    CHECK(std::find(listed.begin(), listed.end(), expected) != listed.end());
  }
}

TEST_CASE("config: ZeRO++ hpZ (zero_hpz_partition_size) is read on stage 3, said to have no effect below",
          "[config]") {
  DeepSpeedFiles files;
  const auto on = accel::Config::load_file(files.yaml(
      files.write("hpz.json", "{\"zero_optimization\": {\"stage\": 3, \"zero_hpz_partition_size\": 2}}")));
  CHECK(on.zero.hpz_partition_size == 2);
  // The resolved YAML (what accel-launch hands the ranks) keeps it.
  CHECK(accel::Config::load_string(on.to_yaml()).zero.hpz_partition_size == 2);
  CHECK(accel::Config::load_file(files.yaml(files.write("off.json",
                                                        "{\"zero_optimization\": {\"stage\": 3, "
                                                        "\"zero_hpz_partition_size\": 0}}")))
            .zero.hpz_partition_size == 1);  // 0 and 1 are off, as in DeepSpeed
  const auto stage2 = accel::Config::load_file(files.yaml(
      files.write("hpz2.json", "{\"zero_optimization\": {\"stage\": 2, \"zero_hpz_partition_size\": 8}}")));
  CHECK(stage2.zero.hpz_partition_size == 1);
  std::string notices;
  for (const auto& n : stage2.notices)
    notices += n + "\n";
  CHECK_THAT(notices, Catch::Contains("zero_hpz_partition_size (stage 2; hpZ is stage 3's)"));
  CHECK_THAT(
      std::string(string_error("distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n"
                               "  zero_stage: 2\n  zero_hpz_partition_size: 2\n")
                      .what()),
      Catch::Contains("deepspeed_config.zero_hpz_partition_size 2 (ZeRO++ hpZ) keeps secondary copies of "
                      "stage 3's sharded parameters, but zero_stage is 2"));
}

TEST_CASE("config: parallelism_config is checked against the layout the file describes, as Accelerate does",
          "[config]") {
  auto message = [](const std::string& yaml) { return std::string(string_error(yaml).what()); };
  auto mesh = [](const std::string& sizes) { return "parallelism_config:\n" + sizes; };
  const std::string fsdp = "distributed_type: FSDP\nnum_processes: 2\n";
  const std::string zero =
      "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n";
  const std::string ddp = "distributed_type: MULTI_CPU\nnum_processes: 2\n";
  // Every rank one shard (TRL's fsdp2_sharding_2gpus.yaml) or one replica: what the file says without it, so
  // the config equals the file without the section.
  const std::string shard_all = mesh(
      "  parallelism_config_dp_replicate_size: 1\n  parallelism_config_dp_shard_size: 2\n"
      "  parallelism_config_tp_size: 1\n  parallelism_config_cp_size: 1\n"
      "  parallelism_config_cp_backend: torch\n");
  CHECK(accel::Config::load_string(fsdp + shard_all) == accel::Config::load_string(fsdp));
  CHECK(accel::Config::load_string(zero + shard_all) == accel::Config::load_string(zero));
  CHECK(accel::Config::load_string(ddp + mesh("  parallelism_config_dp_replicate_size: 2\n")) ==
        accel::Config::load_string(ddp));
  CHECK(accel::Config::load_string(fsdp + mesh("  parallelism_config_dp_shard_size: 1\n")) ==
        accel::Config::load_string(fsdp));  // total 1: Accelerate replicates over every process
  // What accelerate-cpp does not run from a config file: refused, naming the key and what to set.
  // Sequence (DeepSpeed Ulysses) and context parallelism (issue 52): the group sizes, written back by
  // to_yaml.
  const auto cp = accel::Config::load_string(fsdp + mesh("  parallelism_config_cp_size: 2\n"), "inline.yaml");
  CHECK(cp.context_parallel_size == 2);
  CHECK(accel::Config::load_string(cp.to_yaml(), "resolved.yaml").context_parallel_size == 2);
  // cp_comm_strategy (Accelerate's TorchContextParallelConfig): allgather by default, alltoall the ring;
  // anything else refused naming the key and both values.
  CHECK(cp.context_parallel_comm_strategy == "allgather");
  const auto ring = accel::Config::load_string(
      fsdp + mesh("  parallelism_config_cp_size: 2\n  parallelism_config_cp_comm_strategy: alltoall\n"),
      "inline.yaml");
  CHECK(ring.context_parallel_comm_strategy == "alltoall");
  CHECK(accel::Config::load_string(ring.to_yaml(), "resolved.yaml").context_parallel_comm_strategy ==
        "alltoall");
  CHECK(message(
            fsdp +
            mesh("  parallelism_config_cp_size: 2\n  parallelism_config_cp_comm_strategy: alltogather\n")) ==
        "inline.yaml:5: parallelism_config.parallelism_config_cp_comm_strategy: invalid value 'alltogather' "
        "(did you mean 'allgather'?); allowed values: allgather (K/V all-gathered, the default), alltoall "
        "(ring attention)");
  const auto sp = accel::Config::load_string(
      zero + mesh("  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"),
      "inline.yaml");
  CHECK(sp.sequence_parallel_size == 2);
  CHECK(accel::Config::load_string(sp.to_yaml(), "resolved.yaml").sequence_parallel_size == 2);
  CHECK_THAT(
      message(zero + mesh("  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: torch\n")),
      Catch::StartsWith("inline.yaml:7: parallelism_config.parallelism_config_sp_backend: 'torch' is not a "
                        "sequence-parallel backend"));
  CHECK_THAT(message(zero + mesh("  parallelism_config_sp_size: 2\n  parallelism_config_tp_size: 2\n")),
             Catch::Contains("together with tensor parallelism is not supported"));
  CHECK_THAT(message(fsdp + mesh("  parallelism_config_cp_size: 2\n  parallelism_config_sp_size: 2\n")),
             Catch::Contains("mutually exclusive"));
  CHECK(message(fsdp + mesh("  parallelism_config_dp_shard_size: 4\n")) ==
        "inline.yaml:4: parallelism_config: dp_replicate_size 1 x dp_shard_size 4 x tp_size 1 x cp_size 1 x "
        "sp_size 1 = 4 does not match num_processes 2 (Accelerate refuses this too); adjust the sizes");
  // Hybrid sharding (HSDP): FSDP's HYBRID_SHARD, whose shard groups are dp_shard_size consecutive ranks (the
  // machines on 2 x 2; pairs of ranks on one machine of 4, as Accelerate's device mesh lays them out).
  const std::string four = "distributed_type: FSDP\nnum_processes: 4\n";
  const std::string two_by_two =
      mesh("  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n");
  const auto hsdp = [&](const std::string& text) { return accel::Config::load_string(text, "inline.yaml"); };
  CHECK(hsdp(four + "num_machines: 2\n" + two_by_two).fsdp.sharding_strategy ==
        accel::ShardingStrategy::HybridShard);
  CHECK(hsdp(four + "num_machines: 2\n" + two_by_two).fsdp.hybrid_shard_size == 2);
  CHECK(hsdp(four + "num_machines: 2\nfsdp_config:\n  fsdp_reshard_after_forward: false\n" + two_by_two)
            .fsdp.sharding_strategy == accel::ShardingStrategy::HybridShardZero2);
  const auto one_machine = hsdp(four + two_by_two);
  CHECK(one_machine.fsdp.sharding_strategy == accel::ShardingStrategy::HybridShard);
  CHECK(one_machine.fsdp.hybrid_shard_size == 2);
  // The resolved config (what accel-launch hands the ranks) keeps the groups.
  CHECK(accel::Config::load_string(one_machine.to_yaml(), "resolved.yaml").fsdp.hybrid_shard_size == 2);
  CHECK(message(four + "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_hybrid_shard_size: 4\n" +
                two_by_two) ==
        "inline.yaml:8: parallelism_config.parallelism_config_dp_shard_size: 2 disagrees with "
        "fsdp_config.fsdp_hybrid_shard_size 4: both size the shard groups; make them agree or remove one");
  CHECK(message(four + "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_hybrid_shard_size: 2\n") ==
        "inline.yaml:5: fsdp_config.fsdp_hybrid_shard_size 2 needs fsdp_sharding_strategy HYBRID_SHARD or "
        "HYBRID_SHARD_ZERO2 (it is FULL_SHARD): set one of them, or remove fsdp_hybrid_shard_size");
  CHECK(
      message(four + "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_hybrid_shard_size: 3\n") ==
      "inline.yaml:5: fsdp_config.fsdp_hybrid_shard_size 3 does not divide num_processes 4: the ranks form "
      "shard groups of that size; choose a divisor");
  // tp_size: tensor-parallel groups of tp_size consecutive ranks for a program built on accel::tp layers (as
  // AcceleratorOptions().tensor_parallel_size), beside the data-parallel layout of the rest of the file;
  // written back (with nothing when it is 1) and read back the same.
  const auto tp_only = hsdp(fsdp + mesh("  parallelism_config_tp_size: 2\n"));
  CHECK(tp_only.tensor_parallel_size == 2);
  CHECK(tp_only != hsdp(fsdp));
  CHECK_THAT(tp_only.to_yaml(), Catch::Contains("\nparallelism_config:\n  parallelism_config_tp_size: 2\n"));
  CHECK(accel::Config::load_string(tp_only.to_yaml(), "resolved.yaml") == tp_only);
  CHECK_THAT(hsdp(fsdp).to_yaml(), !Catch::Contains("parallelism_config"));
  const auto tp_by_shard =
      hsdp(four + mesh("  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"));
  CHECK(tp_by_shard.tensor_parallel_size == 2);
  CHECK(tp_by_shard.fsdp.sharding_strategy == hsdp(four).fsdp.sharding_strategy);  // sharded over 2, no HSDP
  CHECK(message(four + mesh("  parallelism_config_dp_shard_size: 4\n  parallelism_config_tp_size: 2\n")) ==
        "inline.yaml:4: parallelism_config: dp_replicate_size 1 x dp_shard_size 4 x tp_size 2 x cp_size 1 x "
        "sp_size 1 = 8 does not match num_processes 4 (Accelerate refuses this too); adjust the sizes");
  // 2 x 2 x 2 on 8 (Accelerate's tp_hsdp example): hybrid sharding over each data-parallel group of 4.
  const auto hsdp_tp =
      hsdp("distributed_type: FSDP\nnum_processes: 8\n" +
           mesh("  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
                "  parallelism_config_tp_size: 2\n"));
  CHECK(hsdp_tp.tensor_parallel_size == 2);
  CHECK(hsdp_tp.fsdp.sharding_strategy == accel::ShardingStrategy::HybridShard);
  CHECK(hsdp_tp.fsdp.hybrid_shard_size == 2);
  CHECK(accel::Config::load_string(hsdp_tp.to_yaml(), "resolved.yaml") == hsdp_tp);
  CHECK_THAT(message("distributed_type: DEEPSPEED\nnum_processes: 4\nnum_machines: 2\n" + two_by_two),
             Catch::Contains("which accelerate-cpp runs with distributed_type: FSDP"));
  CHECK(message(ddp + mesh("  parallelism_config_dp_shard_size: 2\n")) ==
        "inline.yaml:4: parallelism_config.parallelism_config_dp_shard_size: 2 asks for sharded data "
        "parallelism: set distributed_type: FSDP or DEEPSPEED, or dp_shard_size: 1");
  CHECK_THAT(
      message(fsdp + mesh("  parallelism_config_dp_replicate_size: 2\n")),
      Catch::Contains("keeps a whole replica on every rank, which is fsdp_sharding_strategy: NO_SHARD"));
  CHECK_THAT(message(zero + mesh("  parallelism_config_dp_replicate_size: 2\n")),
             Catch::Contains("which is zero_stage: 0"));
  CHECK(
      message(fsdp + mesh("  parallelism_config_dp_shard_size: 0\n")) ==
      "inline.yaml:4: parallelism_config.parallelism_config_dp_shard_size: expected a positive integer, got "
      "'0'");
  CHECK_THAT(message(fsdp + mesh("  parallelism_config_dp_shard_sise: 2\n")),
             Catch::Contains("did you mean"));
}

TEST_CASE("config: DeepSpeed JSON defaults, a relative path, and the missing batch size derived",
          "[config]") {
  DeepSpeedFiles files;
  std::ifstream in(fixture("zero1_minimal.json"));
  std::stringstream text;
  text << in.rdbuf();
  files.write("ds.json", text.str());
  const auto c = accel::Config::load_file(files.yaml("ds.json"));  // next to the YAML
  CHECK(c.zero.stage == 1);
  CHECK_FALSE(c.zero.overlap_comm);        // DeepSpeed's default below stage 3
  CHECK(c.zero.gradient_clipping == 0.0);  // absent: off
  CHECK(c.zero.reduce_bucket_size == 500000000);
  CHECK(has_notice(c, "train_micro_batch_size_per_gpu is 8"));  // 16 / (1 x 2 ranks)
}

TEST_CASE("config: DeepSpeed JSON errors name the file, the key and the fix", "[config]") {
  DeepSpeedFiles files;
  auto error_of = [&](const std::string& json, const std::string& top = "", const std::string& section = "") {
    const auto path = files.write("ds.json", json);
    return std::string(load_error(files.yaml(path, top, section)).what());
  };
  CHECK_THAT(error_of("{\"zero_optimization\": {\"stage\": 2, \"stage\": 3}}"),
             Catch::Contains("duplicate key 'zero_optimization.stage'"));
  CHECK_THAT(
      error_of("{\"zero_optimization\": {\"stage\": 2,\n \"reduce_bucket_sise\": 5}}"),
      Catch::Contains("ds.json:2: unknown key 'zero_optimization.reduce_bucket_sise' in DeepSpeed config") &&
          Catch::Contains("(did you mean 'reduce_bucket_size'?)"));
  CHECK_THAT(error_of("{\"zero_optimization\": {\"offload_param\": {\"devic\": \"cpu\"}}}"),
             Catch::Contains("(did you mean 'device'?)"));
  CHECK_THAT(error_of("{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\"}}}"),
             Catch::Contains("offload_param_device: nvme needs offload_param_nvme_path"));
  CHECK_THAT(
      error_of("{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\"}}}"),
      Catch::Contains("offload_optimizer.nvme_path: device \"nvme\" needs the directory"));
  CHECK_THAT(error_of("{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", "
                      "\"nvme_path\": \"/x\", \"buffer_count\": 1}}}"),
             Catch::Contains("offload_optimizer.buffer_count: expected 2 to 1024 sub-group buffers, got 1"));
  CHECK_THAT(error_of("{\"bf16\": {\"enabled\": true}}", "mixed_precision: fp16\n"),
             Catch::Contains("enables bf16 but the config's mixed_precision is 'fp16'"));
  CHECK_THAT(error_of("{\"gradient_accumulation_steps\": 4}", "gradient_accumulation_steps: 2\n"),
             Catch::Contains(
                 "gradient_accumulation_steps 4 disagrees with the config's gradient_accumulation_steps 2"));
  // Range-checked before narrowing: 2^32 wrapped to 0 and divided by zero (SIGFPE); a product past 2^64
  // wrapped and compared wrongly.
  CHECK_THAT(
      error_of("{\"gradient_accumulation_steps\": 4294967296}"),
      Catch::Contains("ds.json") &&
          Catch::Contains("gradient_accumulation_steps 4294967296 is out of range: at most 2147483647"));
  CHECK_THAT(
      error_of(
          "{\"train_micro_batch_size_per_gpu\": 18446744073709551615, \"gradient_accumulation_steps\": 2}"),
      Catch::Contains("train_micro_batch_size_per_gpu 18446744073709551615 is out of range"));
  // Batches of 0 samples, given or derived, as DeepSpeed's _batch_assertion refuses them (issue 49).
  CHECK_THAT(
      error_of("{\n  \"train_micro_batch_size_per_gpu\": 0\n}"),
      Catch::Contains("ds.json:2: train_micro_batch_size_per_gpu is 0: it has to be greater than 0, as "
                      "DeepSpeed requires; set the samples per rank and micro-step, or \"auto\""));
  CHECK_THAT(error_of("{\"train_batch_size\": 0}"),
             Catch::Contains("ds.json:1: train_batch_size is 0: it has to be greater than 0, as DeepSpeed "
                             "requires; set the samples of one optimizer step over all ranks, or \"auto\""));
  CHECK_THAT(error_of("{\"train_batch_size\": 0, \"train_micro_batch_size_per_gpu\": 0}"),
             Catch::Contains("train_batch_size is 0: it has to be greater than 0"));
  CHECK_THAT(error_of("{}", "", "  zero_stage: 3\n"),
             Catch::Contains("deepspeed_config.zero_stage must not be set here"));
  CHECK_THAT(error_of("{\"zero_optimization\": [1]"), Catch::Contains("not valid JSON"));
  CHECK_THAT(std::string(load_error(files.yaml("/dev/zero")).what()),
             Catch::Contains("the DeepSpeed config '/dev/zero' is larger than 16 MiB"));
  CHECK_THAT(std::string(load_error(files.yaml(files.write("x", "") + ".missing")).what()),
             Catch::Contains("cannot open the DeepSpeed config"));
  // A DeepSpeed file under another distributed_type is ignored, as Accelerate ignores deepspeed_config then
  // (its own test config validate_launch_cmd.yaml has one with distributed_type: NO).
  const auto ddp = accel::Config::load_file(
      files.write("ddp.yaml",
                  "distributed_type: MULTI_GPU\nnum_processes: 2\ndeepspeed_config:\n"
                  "  deepspeed_config_file: path/to/be/ignored\n"));
  CHECK(ddp.backend == "ddp");
  CHECK(has_notice(ddp,
                   "ddp.yaml:4: deepspeed_config.deepspeed_config_file: ignored, as Accelerate ignores it: "
                   "the backend is ddp, not zero"));
  // Comments are fine; unknown top-level keys are a notice, not an error.
  CHECK_NOTHROW(accel::Config::load_file(files.yaml(files.write("ok.json", "// a comment\n{\"x\": 1}"))));
  // ... unless it is one edit or so from a block this reader knows: a misspelled zero_optimization would
  // leave the run at the defaults (zero stage 0), silently.
  CHECK_THAT(error_of("{\n  \"zero_optimisation\": {\"stage\": 2}\n}"),
             Catch::Contains("ds.json:2: unknown top-level key 'zero_optimisation' (did you mean "
                             "'zero_optimization'?)"));
  // A NUL byte (UTF-16, a binary file) is named; the reader used to stop there and load what came before.
  CHECK_THAT(error_of(std::string("{\"zero_optimization\": {\"stage\": 2}}\n\0{\"x\": 3}", 45)),
             Catch::Contains("ds.json:2: the file holds a NUL byte (byte 36)"));
  // Nesting far deeper than a config: an error, not a crash in the reader's recursion.
  CHECK_THAT(error_of("{\"gradient_clipping\": " + std::string(100000, '[') + std::string(100000, ']') + "}"),
             Catch::Contains("ds.json:1: values nested more than 64 deep"));
  // Brackets inside strings do not count.
  CHECK_NOTHROW(accel::Config::load_file(
      files.yaml(files.write("brackets.json", "{\"x\": \"" + std::string(100, '[') + "\\\"\", \"y\": 1}"))));
}

TEST_CASE("estimate_memory: a frozen LoRA or QLoRA base adds its bytes only", "[config]") {
  accel::MemoryEstimateInput in;
  in.num_parameters = 8388608;  // LoRA r 16 on q and v of a 7B Llama: 32 x 2 x (16 x 4096 x 2)
  in.frozen_parameters = 7000000000;
  const auto adapters = 16ULL * 8388608;  // fp32 weights, gradients, two Adam moments
  CHECK(accel::estimate_memory(in).total() == 2ULL * 7000000000 + adapters);  // bf16 base (the default)
  in.frozen_dtype = "4bit";  // QLoRA: measured 0.5159 bytes per base parameter (quant4bit_test)
  CHECK(accel::estimate_memory(in).total() == 3611300000ULL + adapters);
  CHECK(accel::estimate_memory(in).gradients == 4ULL * 8388608);  // the frozen base has none
  // examples/trainer/finetune's qlora base: 266,240 weights in 4 bits, measured 137,348 bytes.
  in.num_parameters = 0;
  in.frozen_parameters = 266240;
  CHECK(accel::estimate_memory(in).parameters == Approx(137348).epsilon(0.001));
  in.frozen_dtype = "int8";
  CHECK_THROWS_WITH(accel::estimate_memory(in), Catch::Contains("frozen_dtype 'int8' is not one of"));
}

TEST_CASE("estimate_memory: ZeRO-3 and FULL_SHARD shard a frozen base over the ranks, as DeepSpeed does",
          "[config]") {
  accel::MemoryEstimateInput in;
  in.num_parameters = 8388608;
  in.frozen_parameters = 7000000000;  // bf16: 2 bytes each
  in.num_processes = 4;
  in.backend = "zero";
  in.zero_stage = 3;
  // The frozen base's bytes on one rank: the estimate with it less the one without.
  const auto frozen_share = [&in] {
    auto without = in;
    without.frozen_parameters = 0;
    return accel::estimate_memory(in).parameters - accel::estimate_memory(without).parameters;
  };
  // DeepSpeed's ZeRO-3 (estimate_zero3_model_states_mem_needs) and FSDP: every parameter, frozen ones too,
  // 1/N.
  CHECK(frozen_share() == 2ULL * 7000000000 / 4);
  in.backend = "fsdp";
  in.fsdp_sharding_strategy = "FULL_SHARD";
  CHECK(frozen_share() == 2ULL * 7000000000 / 4);
  in.fsdp_sharding_strategy = "HYBRID_SHARD";  // over each machine's 2 ranks
  in.num_machines = 2;
  CHECK(frozen_share() == 2ULL * 7000000000 / 2);
  // Stage 2 and a 4-bit base (buffers, not parameters) keep it whole on every rank.
  in.num_machines = 1;
  in.backend = "zero";
  in.zero_stage = 2;
  CHECK(frozen_share() == 2ULL * 7000000000);
  in.zero_stage = 3;
  in.frozen_dtype = "4bit";
  CHECK(frozen_share() == 3611300000ULL);
  // Parameter shards on NVMe: the frozen shards go to the files with the others.
  in.frozen_dtype = "bf16";
  in.offload_param = "nvme";
  in.largest_unit_parameters = 1000000;
  auto without = in;
  without.frozen_parameters = 0;
  CHECK(accel::estimate_memory(in).nvme_parameters ==
        accel::estimate_memory(without).nvme_parameters + 2ULL * 7000000000 / 4);
  CHECK(accel::estimate_memory(in).parameters == accel::estimate_memory(without).parameters);
}

TEST_CASE("estimate_memory: NVMe offload moves the optimizer state to disk but its sub-group buffers",
          "[config]") {
  accel::MemoryEstimateInput in;
  in.num_parameters = 100663296;
  in.num_processes = 2;
  in.backend = "zero";
  in.zero_stage = 3;
  const auto memory = accel::estimate_memory(in);
  in.offload_optimizer = "nvme";
  in.sub_group_size = 4194304;
  const auto nvme = accel::estimate_memory(in);
  CHECK(nvme.nvme == memory.optimizer_state);  // Adam's two moments of this rank's shard, on disk
  CHECK(nvme.optimizer_state == 4ULL * 2 * 4 * (4194304 / 2));  // 4 buffers of one sub-group's slice
  CHECK(nvme.parameters == memory.parameters);
  CHECK(nvme.gradients == memory.gradients);
  CHECK(nvme.total() == memory.total() - memory.optimizer_state + nvme.optimizer_state);
  in.zero_stage = 0;
  CHECK_THROWS_WITH(accel::estimate_memory(in),
                    Catch::Contains("needs --backend zero with --zero_stage 1, 2 or 3"));
}

TEST_CASE("estimate_memory: NVMe offload of the parameters keeps a few unit shards in memory", "[config]") {
  accel::MemoryEstimateInput in;
  in.num_parameters = 100663296;
  in.num_processes = 2;
  in.backend = "zero";
  in.zero_stage = 3;
  const auto memory = accel::estimate_memory(in);
  in.offload_param = "nvme";
  in.param_nvme_buffer_count = 3;
  in.largest_unit_parameters = 4194304;  // one Linear(2048, 2048)
  const auto nvme = accel::estimate_memory(in);
  CHECK(nvme.nvme_parameters == memory.parameters);    // this rank's shards, on disk
  CHECK(nvme.parameters == 3ULL * 4 * (4194304 / 2));  // 3 buffers of one unit's shard
  CHECK(nvme.gradients == memory.gradients);
  CHECK(nvme.optimizer_state == memory.optimizer_state);
  // While training: the unit computing, the one prefetched and the unit's whole gradient (fp32).
  CHECK(nvme.gathered == 3ULL * 4 * 4194304);
  CHECK(nvme.peak() == nvme.total() + nvme.gathered);
  CHECK_THAT(nvme.to_string(),
             Catch::Contains("while training, units gathered at once (not in total): 48.000 "
                             "MiB\npeak while training, activations aside: "));
  in.largest_unit_parameters = 0;  // unknown: counted whole, and no gathered units estimated
  CHECK(accel::estimate_memory(in).parameters == memory.parameters);
  CHECK(accel::estimate_memory(in).gathered == 0);
  // Layouts that do not shard parameters gather nothing; FULL_SHARD gathers as stage 3 does.
  in.largest_unit_parameters = 4194304;
  in.offload_param = "none";
  in.zero_stage = 2;
  CHECK(accel::estimate_memory(in).gathered == 0);
  in.backend = "fsdp";
  in.fsdp_sharding_strategy = "FULL_SHARD";
  CHECK(accel::estimate_memory(in).gathered == 3ULL * 4 * 4194304);
  in.backend = "zero";
  in.offload_param = "nvme";
  in.zero_stage = 2;
  CHECK_THROWS_WITH(accel::estimate_memory(in),
                    Catch::Contains("offload_param nvme needs --backend zero with --zero_stage 3"));
}

TEST_CASE("estimate_memory: a frozen base's gathered units have no gradient buffer", "[config]") {
  accel::MemoryEstimateInput in;
  in.num_parameters = 2000000;  // LoRA adapters, the trainable part
  in.num_processes = 2;
  in.backend = "zero";
  in.zero_stage = 3;
  in.largest_unit_parameters = 136134656;  // Qwen2.5-0.5B's tied embedding, one unit
  in.frozen_parameters = 166000000;
  in.frozen_dtype = "fp32";
  // The unit computing and the one prefetched, in the base's dtype, and a gradient buffer of at most the
  // trainable parameters (full_shard_backend's frozen flats are never reduced).
  CHECK(accel::estimate_memory(in).gathered == 2ULL * 4 * 136134656 + 4ULL * 2000000);
  in.frozen_dtype = "bf16";
  CHECK(accel::estimate_memory(in).gathered == 2ULL * 2 * 136134656 + 4ULL * 2000000);
  // A 4-bit base is never sharded nor gathered: only the trainable parameters are.
  in.frozen_dtype = "4bit";
  CHECK(accel::estimate_memory(in).gathered == 3ULL * 4 * 2000000);
  // Without a frozen base the unit's whole gradient is held too (unchanged); FULL_SHARD gathers as stage 3.
  in.frozen_parameters = 0;
  CHECK(accel::estimate_memory(in).gathered == 3ULL * 4 * 136134656);
  in.frozen_parameters = 166000000;
  in.frozen_dtype = "fp32";
  in.backend = "fsdp";
  in.fsdp_sharding_strategy = "FULL_SHARD";
  CHECK(accel::estimate_memory(in).gathered == 2ULL * 4 * 136134656 + 4ULL * 2000000);
  in.fsdp_sharding_strategy = "SHARD_GRAD_OP";  // parameters whole: nothing gathered
  CHECK(accel::estimate_memory(in).gathered == 0);
}

TEST_CASE("estimate_memory: each backend's config part gives its layout", "[config]") {
  accel::MemoryEstimateInput in;
  in.num_parameters = 1000;
  in.num_processes = 4;
  in.optimizer = "adam";
  auto total = [&](const std::string& backend) {
    in.backend = backend;
    return accel::estimate_memory(in).total();
  };
  const auto whole = total("ddp");
  CHECK(whole == 4 * 1000 * 4);  // parameters, gradients, two Adam moments
  CHECK(total("local") == whole);
  in.zero_stage = 0;
  CHECK(total("zero") == whole);
  in.zero_stage = 2;
  CHECK(total("zero") == 4 * (1000 + 250) + 4 * 250 + 4 * 250 * 2);
  in.zero_stage = 3;
  CHECK(total("zero") == 4 * 250 * 4);
  in.fsdp_sharding_strategy = "FULL_SHARD";
  CHECK(total("fsdp") == 4 * 250 * 4);
  in.fsdp_sharding_strategy = "NO_SHARD";
  CHECK(total("fsdp") == whole);
  // Hybrid sharding: sharded over one machine's ranks (4 processes on 2 machines: halves).
  in.fsdp_sharding_strategy = "HYBRID_SHARD";
  CHECK(total("fsdp") == 4 * 250 * 4);  // one machine
  in.num_machines = 2;
  CHECK(total("fsdp") == 4 * 500 * 4);
  in.fsdp_sharding_strategy = "HYBRID_SHARD_ZERO2";
  CHECK(total("fsdp") == 4 * (1000 + 500) + 4 * 500 + 4 * 500 * 2);
  in.num_machines = 3;
  CHECK_THROWS_WITH(total("fsdp"), Catch::Contains("num_machines (3) must be at least 1 and divide"));
  in.num_machines = 1;
  // Shard groups of 2 ranks on one machine (fsdp_hybrid_shard_size, parallelism_config's dp_shard_size).
  in.hybrid_shard_size = 2;
  CHECK(total("fsdp") == 4 * (1000 + 500) + 4 * 500 + 4 * 500 * 2);
  in.hybrid_shard_size = 3;
  CHECK_THROWS_WITH(total("fsdp"), Catch::Contains("hybrid_shard_size (3) must be 0 (one machine's ranks) or "
                                                   "divide the data-parallel ranks (4)"));
  in.hybrid_shard_size = 0;
  in.fsdp_sharding_strategy = "HYBRID";
  CHECK_THROWS_WITH(total("fsdp"), Catch::Contains("fsdp_sharding_strategy 'HYBRID' is not available"));
  in.zero_stage = 4;
  CHECK_THROWS_WITH(total("zero"), Catch::Contains("zero_stage 4 is not available"));
  CHECK_THROWS_WITH(total("megatron"),
                    "estimate-memory: unknown backend 'megatron'; allowed: local, ddp, fsdp, zero");
}

TEST_CASE("estimate_memory: a pipeline splits the state by stage and bounds the activations", "[config]") {
  accel::MemoryEstimateInput in;
  in.num_processes = 4;
  in.pipeline_stages = 2;  // 2 data-parallel ranks per stage
  in.optimizer = "adam";
  // Without layers: 1/p of the parameters per stage, the first stages taking the remainder.
  in.num_parameters = 1001;
  auto stages = accel::estimate_pipeline_memory(in);
  REQUIRE(stages.size() == 2);
  CHECK((stages[0].num_parameters == 501 && stages[1].num_parameters == 500));
  CHECK(stages[0].state.total() == 4 * 501 * 4);  // ddp: whole state of the stage on each of its ranks
  CHECK((stages[0].live_micro_batches == 2 && stages[1].live_micro_batches == 1));  // 1F1B: p - s
  CHECK(stages[0].activation_bytes == 0);
  CHECK(accel::estimate_memory(in).total() == stages[0].state.total());  // the heaviest stage
  // ZeRO-1 shards each stage's optimizer state over the stage's 2 data-parallel ranks.
  in.backend = "zero";
  in.zero_stage = 1;
  CHECK(accel::estimate_pipeline_memory(in)[1].state.optimizer_state == 4 * 250 * 2);

  // Layers: the balanced partition of their parameter counts; activations spread evenly over the layers.
  in.backend = "ddp";
  in.num_parameters = 0;  // taken from the layers
  in.layer_parameters = {100, 0, 300, 0, 200, 400};
  in.micro_batches = 8;
  in.activation_bytes = 6000;
  stages = accel::estimate_pipeline_memory(in);
  CHECK((stages[0].first_layer == 0 && stages[0].end_layer == 5 && stages[1].first_layer == 5 &&
         stages[1].end_layer == 6));
  CHECK((stages[0].num_parameters == 600 && stages[1].num_parameters == 400));
  CHECK((stages[0].activation_bytes == 2 * 5000 && stages[1].activation_bytes == 1 * 1000));
  in.pipeline_schedule = "gpipe";  // every micro-batch
  stages = accel::estimate_pipeline_memory(in);
  CHECK((stages[0].live_micro_batches == 8 && stages[0].activation_bytes == 8 * 5000));
  in.pipeline_schedule = "1f1b";
  in.micro_batches = 1;  // min(p - s, m)
  CHECK(accel::estimate_pipeline_memory(in)[0].live_micro_batches == 1);
  in.partition = "uniform";
  CHECK(accel::estimate_pipeline_memory(in)[0].num_parameters == 400);
  in.partition = "0,2,6";
  CHECK(accel::estimate_pipeline_memory(in)[1].num_parameters == 900);

  auto error = [&](const std::function<void(accel::MemoryEstimateInput&)>& change) {
    auto bad = in;
    change(bad);
    try {
      accel::estimate_pipeline_memory(bad);
    } catch (const accel::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error([](auto& b) { b.partition = "type:Linear"; }),
             Catch::Contains("needs the layers' type names"));
  CHECK_THAT(error([](auto& b) { b.num_parameters = 5; }),
             Catch::Contains("the layer parameter counts add up to 1000, but num_parameters is 5"));
  CHECK_THAT(error([](auto& b) { b.pipeline_stages = 3; }),
             Catch::Contains("pipeline_stages (3) must be at least 1 and divide num_processes (4)"));
  CHECK_THAT(error([](auto& b) { b.pipeline_schedule = "zigzag"; }),
             Catch::Contains("pipeline_schedule 'zigzag' is not one of 1f1b, gpipe"));
  CHECK_THAT(error([](auto& b) { b.layer_parameters = {5}; }),
             Catch::Contains("1 layer(s) cannot fill 2 pipeline stages"));
  CHECK_THAT(error([](auto& b) {
               b.backend = "zero";
               b.zero_stage = 2;
             }),
             Catch::Contains("backend zero (zero_stage 2) shards gradients or parameters"));
  CHECK_THAT(error([](auto& b) {
               b.backend = "fsdp";
               b.fsdp_sharding_strategy = "FULL_SHARD";
             }),
             Catch::Contains("backend fsdp (FULL_SHARD) shards gradients or parameters"));
  CHECK(error([](auto& b) {
          b.backend = "fsdp";
          b.fsdp_sharding_strategy = "NO_SHARD";
        }) == "no error");
  CHECK(error([](auto& b) {
          b.backend = "zero";
          b.zero_stage = 1;
        }) == "no error");
  // The words come from each backend's config part (the summary line of accel-launch estimate-memory).
  accel::MemoryEstimateInput words;
  words.backend = "zero";
  words.zero_stage = 3;
  CHECK(accel::describe_backend(words) == "zero (zero_stage 3)");
  words.backend = "fsdp";
  words.fsdp_sharding_strategy = "shard_grad_op";
  CHECK(accel::describe_backend(words) == "fsdp (SHARD_GRAD_OP)");
  words.backend = "ddp";
  CHECK(accel::describe_backend(words) == "ddp");
}

TEST_CASE(
    "config: deepspeed_config.sub_group_size is read and written back; 0 is one parameter per sub-group",
    "[config]") {
  const auto c = accel::Config::load_string(
      "backend: zero\nuse_cpu: true\ndeepspeed_config:\n  zero_stage: 1\n  sub_group_size: 2e6\n");
  CHECK(c.zero.sub_group_size == 2000000u);
  CHECK(accel::Config::load_string(c.to_yaml()) == c);
  // DeepSpeed accepts 0 (ge=0): every parameter closes its own sub-group (stage3.py _create_fp16_sub_groups).
  const auto zero = accel::Config::load_string(
      "backend: zero\nuse_cpu: true\ndeepspeed_config:\n  zero_stage: 2\n  sub_group_size: 0\n");
  CHECK(zero.zero.sub_group_size == 0u);
  CHECK(accel::Config::load_string(zero.to_yaml()) == zero);
  CHECK_THROWS_WITH(
      accel::Config::load_string("backend: zero\nuse_cpu: true\ndeepspeed_config:\n  sub_group_size: -1\n"),
      Catch::Contains("deepspeed_config.sub_group_size") &&
          Catch::Contains(
              "a non-negative number of elements (such as 4000000 or 4e6; 0: one parameter each)"));
}

TEST_CASE("config: DeepSpeed JSON zeros and \"auto\" values are read as DeepSpeed and Accelerate read them",
          "[config]") {
  DeepSpeedFiles files;
  auto load = [&](const std::string& zero_optimization, const std::string& top = "") {
    return accel::Config::load_file(files.yaml(
        files.write("ds.json", "{" + top + "\"zero_optimization\": {" + zero_optimization + "}}")));
  };
  // Accelerate's ZeRO-3 templates: "auto" is filled from zero3_save_16bit_model, false unless set (with a
  // JSON file Accelerate refuses it in the YAML), as accelerator.py's config_kwargs do.
  const auto save_auto = load("\"stage\": 3, \"stage3_gather_16bit_weights_on_model_save\": \"auto\"");
  CHECK_FALSE(save_auto.zero.zero3_save_16bit_model);
  CHECK_FALSE(
      load("\"stage\": 3, \"gather_16bit_weights_on_model_save\": \"auto\"").zero.zero3_save_16bit_model);
  CHECK(
      load("\"stage\": 3, \"stage3_gather_16bit_weights_on_model_save\": true").zero.zero3_save_16bit_model);
  // sub_group_size 0 (axolotl): one parameter per sub-group, accepted as DeepSpeed's schema accepts it
  // (ge=0), with a notice saying what it costs; stage 3 does not use it here.
  const auto sub0 = load("\"stage\": 2, \"sub_group_size\": 0");
  CHECK(sub0.zero.sub_group_size == 0u);
  CHECK(has_notice(sub0,
                   "zero_optimization.sub_group_size is 0: every parameter is an optimizer sub-group of its "
                   "own (DeepSpeed accepts 0 too), so the optimizer steps one parameter at a time, each with "
                   "its own master slice: slow with many small parameters; the default is 4000000 elements"));
  CHECK_FALSE(has_notice(load("\"stage\": 3, \"sub_group_size\": 0"), "sub_group_size is 0"));
  CHECK(has_notice(
      accel::Config::load_string("backend: zero\ndeepspeed_config:\n  zero_stage: 1\n  sub_group_size: 0\n"),
      "deepspeed_config.sub_group_size is 0: every parameter is an optimizer sub-group"));
  // stage3_prefetch_bucket_size 0 (transformers' tests): DeepSpeed prefetches nothing; the engine's prefetch
  // is off for 0.
  const auto prefetch0 = load("\"stage\": 3, \"stage3_prefetch_bucket_size\": 0, \"reduce_bucket_size\": 0");
  REQUIRE(prefetch0.zero.stage3_prefetch_bucket_size.has_value());
  CHECK(*prefetch0.zero.stage3_prefetch_bucket_size == 0u);
  CHECK(accel::Config::load_string(prefetch0.to_yaml()) == prefetch0);
  // reduce_bucket_size 0: DeepSpeed reduces each parameter's gradient on its own; stage 2's buckets do the
  // same with 0 (one parameter each), stage 3 reduces whole units whatever the size.
  REQUIRE(prefetch0.zero.reduce_bucket_size.has_value());
  CHECK(*prefetch0.zero.reduce_bucket_size == 0u);
  const auto reduce0 = load("\"stage\": 2, \"reduce_bucket_size\": 0");
  REQUIRE(reduce0.zero.reduce_bucket_size.has_value());
  CHECK(*reduce0.zero.reduce_bucket_size == 0u);
  CHECK(accel::Config::load_string(reduce0.to_yaml()) == reduce0);
  CHECK_FALSE(has_notice(reduce0, "reduce_bucket_size"));
  // Stage 1 reduce-scatters whole flat gradients in chunks and has no per-parameter mode: chunks of about one
  // weight matrix ("auto", hidden_size²), said in a notice.
  const auto stage1 = load("\"stage\": 1, \"reduce_bucket_size\": 0");
  CHECK_FALSE(stage1.zero.reduce_bucket_size.has_value());
  CHECK(has_notice(stage1,
                   "zero_optimization.reduce_bucket_size is 0: DeepSpeed reduces each parameter's "
                   "gradient on its own; accelerate-cpp's stage 1 reduce-scatters the flat gradients "
                   "after backward in chunks, here of about one weight matrix (hidden_size² elements, "
                   "as \"auto\"); results are the same"));
  // allgather_bucket_size has no effect here; 0 is accepted as DeepSpeed's schema accepts it.
  CHECK(load("\"stage\": 3, \"allgather_bucket_size\": 0").zero.allgather_bucket_size == 0u);
  // "auto" for the keys Accelerate fills from its DeepSpeed plugin: the stage (2) and the offload devices
  // (none).
  const auto stage_auto = load(
      "\"stage\": \"auto\", \"offload_optimizer\": {\"device\": \"auto\"}, \"offload_param\": {\"device\": "
      "\"auto\"}");
  CHECK(stage_auto.zero.stage == 2);
  CHECK(stage_auto.zero.offload_optimizer_device == accel::OffloadDevice::None);
  CHECK(stage_auto.zero.offload_param_device == accel::OffloadDevice::None);
  // Negative sizes stay errors.
  CHECK_THROWS_WITH(load("\"reduce_bucket_size\": -1"),
                    Catch::Contains("zero_optimization.reduce_bucket_size: expected a non-negative integer"));
  // The same zeros are accepted in the YAML (the launcher hands the ranks the resolved YAML).
  const auto yaml0 = accel::Config::load_string(
      "backend: zero\ndeepspeed_config:\n  zero_stage: 3\n  reduce_bucket_size: 0\n"
      "  stage3_prefetch_bucket_size: 0\n  allgather_bucket_size: 0\n");
  CHECK(yaml0.zero.reduce_bucket_size == std::optional<std::uint64_t>(0));
  CHECK(yaml0.zero.stage3_prefetch_bucket_size == std::optional<std::uint64_t>(0));
  CHECK(yaml0.zero.allgather_bucket_size == 0u);
  CHECK_FALSE(has_notice(yaml0, "bucket_size"));
  const auto yaml_stage1 = accel::Config::load_string(
      "backend: zero\ndeepspeed_config:\n  zero_stage: 1\n  reduce_bucket_size: 0\n  gradient_clipping: 0\n");
  CHECK_FALSE(yaml_stage1.zero.reduce_bucket_size.has_value());
  CHECK(has_notice(yaml_stage1,
                   "deepspeed_config.reduce_bucket_size is 0: DeepSpeed reduces each parameter's"));
}

TEST_CASE("config: a YAML DeepSpeed section without gradient_clipping clips at 1.0, as Accelerate fills it",
          "[config]") {
  // Accelerate's DeepSpeedPlugin leaves the absent key "auto" and fills it with 1.0 at prepare.
  const auto absent = accel::Config::load_string("backend: zero\ndeepspeed_config:\n  zero_stage: 2\n");
  CHECK(absent.zero.gradient_clipping == 1.0);
  CHECK(accel::automatic_gradient_clipping(absent) == 1.0);
  CHECK(has_notice(absent, "gradient_clipping is not set: gradients are clipped to a global norm of 1.0"));
  // Said in the file: kept, and nothing to say.
  const auto off = accel::Config::load_string(
      "backend: zero\ndeepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 0\n");
  CHECK(off.zero.gradient_clipping == 0.0);
  CHECK(accel::automatic_gradient_clipping(off) == 0.0);
  CHECK_FALSE(has_notice(off, "gradient_clipping"));
  const auto half = accel::Config::load_string(
      "backend: zero\ndeepspeed_config:\n  zero_stage: 3\n  gradient_clipping: 0.5\n");
  CHECK(accel::automatic_gradient_clipping(half) == 0.5);
  // Another backend does not clip by itself, whatever the (unused) DeepSpeed section says.
  const auto ddp = accel::Config::load_string("backend: ddp\n");
  CHECK(ddp.zero.gradient_clipping == 0.0);
  CHECK(accel::automatic_gradient_clipping(ddp) == 0.0);
  // The round trip writes the value, so the written file clips as the read one did: an absent or auto value
  // as auto (accel::Trainer fills that with max_grad_norm, as HF's Trainer does), a number as the number.
  CHECK(accel::Config::load_string(absent.to_yaml()).zero.gradient_clipping == 1.0);
  CHECK(accel::Config::load_string(absent.to_yaml()).zero.gradient_clipping_auto);
  CHECK(half.to_yaml().find("  gradient_clipping: 0.5\n") != std::string::npos);
  CHECK(off.to_yaml().find("  gradient_clipping: 0\n") != std::string::npos);
}

// Accelerate reads its files with PyYAML (YAML 1.1): "017" is octal 15, "0x1F" 31, "0b101" 5, "1_000" 1000,
// "1:30" (base 60) 90; "08" is no integer there. Read otherwise, a file would mean something else here.
TEST_CASE("config: integers are read as Accelerate's YAML 1.1 loader reads them", "[config]") {
  auto steps = [](const std::string& value) {
    return accel::Config::load_string("gradient_accumulation_steps: " + value + "\n", "ints.yaml")
        .gradient_accumulation_steps;
  };
  CHECK(steps("017") == 15);
  CHECK(steps("0x1F") == 31);
  CHECK(steps("0b101") == 5);
  CHECK(steps("1_000") == 1000);
  CHECK(steps("1:30") == 90);
  CHECK(steps("+12") == 12);
  CHECK_THROWS_WITH(steps("08"), Catch::Contains("ints.yaml") && Catch::Contains("got '08'"));
  CHECK_THROWS_WITH(steps("1:75"), Catch::Contains("got '1:75'"));
  CHECK(*accel::Config::load_string("seed: 017\n", "ints.yaml").seed == 15);
  CHECK_THROWS_WITH(accel::Config::load_string("seed: 0o17\n", "ints.yaml"), Catch::Contains("got '0o17'"));
  CHECK(accel::Config::load_string("ddp_bucket_cap_mb: 010\n", "ints.yaml").ddp_bucket_cap_mb == 8);
}

namespace {

// The whole optimal-string-alignment table, as text_distance.cpp computed it before it kept three rows and
// stopped at a limit: the reference the bounded version must agree with.
std::size_t full_table_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i)
    d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j)
    d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] =
          std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

TEST_CASE("did-you-mean: the edit distance equals the full table's, and a limit answers limit + 1 above it") {
  CHECK(accel::detail::edit_distance("mixed_precison", "mixed_precision") == 1);
  CHECK(accel::detail::edit_distance("Zero_Stage", "zero_stage") == 0);
  CHECK(accel::detail::edit_distance("Zero_Stage", "zero_stage", /*case_sensitive=*/true) == 2);
  CHECK(accel::detail::edit_distance("ab", "ba") == 1);
  std::mt19937 rng(20261128);
  const std::string alphabet = "abc_";
  auto random_word = [&](std::size_t max_len) {
    std::string s(std::uniform_int_distribution<std::size_t>(0, max_len)(rng), 'a');
    for (char& c : s)
      c = alphabet[std::uniform_int_distribution<std::size_t>(0, alphabet.size() - 1)(rng)];
    return s;
  };
  for (int trial = 0; trial < 3000; ++trial) {
    const std::string a = random_word(9), b = random_word(9);
    const std::size_t exact = full_table_distance(a, b);
    INFO("a='" << a << "' b='" << b << "' exact " << exact);
    REQUIRE(accel::detail::edit_distance(a, b, true) == exact);
    for (std::size_t limit = 0; limit <= 10; ++limit)
      REQUIRE(accel::detail::edit_distance(a, b, true, limit) == std::min(exact, limit + 1));
  }
  // What the parser fuzzer feeds it: a mutated key of 200,000 characters against every known key.
  const std::string huge(200000, 'z');
  CHECK(accel::detail::edit_distance(huge, "zero_optimization", false, 5) == 6);
  CHECK_FALSE(accel::detail::closest(huge, {"zero_optimization", "train_batch_size"}).has_value());
}

// DeepSpeed 0.17.2+'s torch_autocast block (runtime/config.py, runtime/torch_autocast.py): autocast in
// `dtype` over fp32 parameters is accelerate-cpp's mixed precision; the rest is refused or noticed by name.
TEST_CASE("a DeepSpeed JSON's torch_autocast sets mixed precision from its dtype, as DeepSpeed autocasts") {
  DeepSpeedFiles files;
  auto load = [&](const std::string& json, const std::string& top = "") {
    return accel::Config::load_file(files.yaml(files.write("ds.json", json), top));
  };
  auto error = [&](const std::string& json, const std::string& top = "") {
    return std::string(load_error(files.yaml(files.write("ds.json", json), top)).what());
  };
  const std::string json = files.write("ds.json", "");
  const auto bf16 = load("{\"torch_autocast\": {\"enabled\": true, \"dtype\": \"torch.bfloat16\"}}");
  CHECK(bf16.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK(bf16.origins.at("mixed_precision") == json + " (torch_autocast.dtype)");
  // DeepSpeed's default module list, whose gradients it reduces in bf16 (ours: fp32).
  CHECK(has_notice(bf16,
                   "torch_autocast.lower_precision_safe_modules (torch.nn.modules.linear.Linear, "
                   "torch.nn.modules.conv.Conv1d, torch.nn.modules.conv.Conv2d, "
                   "torch.nn.modules.conv.Conv3d): DeepSpeed reduces"));
  const auto fp16 = load(
      "{\"torch_autocast\": {\"enabled\": true, \"dtype\": \"half\", \"lower_precision_safe_modules\": "
      "[\"torch.nn.Linear\"], \"cache\": 1}}");
  CHECK(fp16.mixed_precision == accel::MixedPrecision::Fp16);
  CHECK(has_notice(fp16, "torch_autocast.lower_precision_safe_modules (torch.nn.Linear): DeepSpeed reduces"));
  CHECK(has_notice(fp16,
                   "torch_autocast.dtype torch.float16: DeepSpeed scales the loss with "
                   "torch.amp.GradScaler"));
  CHECK(has_notice(fp16, "unknown key(s) ignored (DeepSpeed ignores them too): torch_autocast.cache"));
  CHECK(load("{\"torch_autocast\": {\"enabled\": true, \"dtype\": \"float\"}}").mixed_precision ==
        accel::MixedPrecision::No);
  // The bf16 block beside it (DeepSpeedExamples' bf16_master_weight) agrees: both say bf16.
  const auto both = load(
      "{\"bf16\": {\"enabled\": true}, \"torch_autocast\": {\"enabled\": true, \"dtype\": "
      "\"bfloat16\"}}");
  CHECK(both.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK(both.origins.at("mixed_precision") == json + " (torch_autocast.dtype, bf16.enabled)");
  // Disabled: the dtype and modules are still checked (DeepSpeed reads them either way), nothing set.
  CHECK(load("{\"torch_autocast\": {\"dtype\": \"fp16\"}}").mixed_precision == accel::MixedPrecision::No);
  CHECK_THAT(error("{\"torch_autocast\": {\"enabled\": false, \"dtype\": \"float8\"}}"),
             Catch::Contains("ds.json:1: torch_autocast.dtype: \"float8\" is not a dtype DeepSpeed knows (it "
                             "refuses it too); use one of \"torch.float16\", \"fp16\""));
  CHECK_THAT(
      error("{\"torch_autocast\": {\"enabled\": true,\n \"lower_precision_safe_modules\": "
            "\"torch.nn.Linear\", \"dtype\": \"bf16\"}}"),
      Catch::Contains("ds.json:2: torch_autocast.lower_precision_safe_modules: expected a list of class "
                      "names such as [\"torch.nn.Linear\"], got \"torch.nn.Linear\""));
  CHECK_THAT(error("{\"torch_autocast\": {\"enabled\": true}}"),
             Catch::Contains("torch_autocast has no dtype: DeepSpeed then autocasts in torch's default for "
                             "the device (float16 on CUDA, bfloat16 on CPU)") &&
                 Catch::Contains("set \"dtype\": \"bfloat16\""));
  CHECK_THAT(error("{\"torch_autocast\": {\"enabled\": true, \"dtype\": \"int8\"}}"),
             Catch::Contains("torch_autocast.dtype torch.int8: torch.autocast has no int8 mode"));
  CHECK_THAT(error("{\"torch_autocast\": {\"enabled\": \"auto\", \"dtype\": \"bf16\"}}"),
             Catch::Contains("torch_autocast.enabled: expected true or false, got \"auto\""));
  CHECK_THAT(error("{\"torch_autocast\": [true]}"),
             Catch::Contains("torch_autocast: expected an object such as {\"enabled\": true"));
  CHECK_THAT(error("{\"fp16\": {\"enabled\": true}, \"torch_autocast\": {\"enabled\": true, \"dtype\": "
                   "\"bf16\"}}"),
             Catch::Contains("torch_autocast.dtype torch.bfloat16 contradicts fp16.enabled"));
  // "auto" follows the YAML's mixed_precision, as Accelerate fills it.
  CHECK_THAT(error("{\"bf16\": {\"enabled\": \"auto\"}, \"torch_autocast\": {\"enabled\": true, \"dtype\": "
                   "\"fp16\"}}",
                   "mixed_precision: bf16\n"),
             Catch::Contains("torch_autocast.dtype torch.float16 contradicts bf16.enabled"));
  CHECK_THAT(
      error("{\"torch_autocast\": {\"enabled\": true, \"dtype\": \"fp16\"}}", "mixed_precision: bf16\n"),
      Catch::Contains("autocasts in torch.float16 (torch_autocast.dtype) but the config's "
                      "mixed_precision is 'bf16'") &&
          Catch::Contains("make them agree"));
  CHECK(load("{\"torch_autocast\": {\"enabled\": true, \"dtype\": \"fp16\"}}", "mixed_precision: fp16\n")
            .mixed_precision == accel::MixedPrecision::Fp16);
}

// Accelerate's fp8_config, checked as Accelerate's launcher and recipe classes check it (commands/launch.py
// --fp8_*, utils/dataclasses.py TERecipeKwargs / MSAMPRecipeKwargs / AORecipeKwargs; Transformer Engine's
// DelayedScaling asserts), then mixed_precision: fp8 refused with the recipe it asked for.
TEST_CASE("config: fp8_config is checked as Accelerate checks it, and mixed_precision: fp8 refused by name",
          "[config]") {
  auto message = [](const std::string& yaml) { return std::string(string_error(yaml).what()); };
  const std::string te =
      "mixed_precision: fp8\nfp8_config:\n  backend: te\n  fp8_format: e4m3\n  amax_history_len: 16\n"
      "  amax_compute_algo: MAX\n  margin: 1\n  interval: 1\n  override_linear_precision: (false, false, "
      "true)\n"
      "  use_autocast_during_eval: false\n";
  CHECK_THAT(
      message(te),
      Catch::StartsWith("inline.yaml:1: mixed_precision: fp8 (backend TE (Transformer Engine's delayed "
                        "scaling: fp8_format e4m3, amax_history_len 16, amax_compute_algo MAX, margin 1)) "
                        "is not supported by accelerate-cpp yet: fp8 training needs an fp8 matmul") &&
          Catch::Contains("a CPU has none") && Catch::EndsWith("Use mixed_precision: bf16"));
  CHECK_THAT(message("fp8_config:\n  backend: AO\nmixed_precision: fp8\n"),
             Catch::StartsWith("inline.yaml:3: mixed_precision: fp8 (backend AO (torchao's float8 training"));
  CHECK_THAT(message("fp8_config: {backend: MSAMP, opt_level: O1}\nmixed_precision: FP8\n"),
             Catch::Contains("mixed_precision: fp8 (backend MSAMP (MS-AMP, opt_level O1))"));
  // Bad values and keys are named before the refusal, wherever mixed_precision stands.
  CHECK(message("mixed_precision: fp8\nfp8_config:\n  backend: XLA\n") ==
        "inline.yaml:3: fp8_config.backend: invalid value 'XLA'; allowed values: AO, TE, MSAMP (Accelerate "
        "refuses it too)");
  CHECK(
      message("mixed_precision: fp8\nfp8_config:\n  fp8_format: HYBRD\n") ==
      "inline.yaml:3: fp8_config.fp8_format: invalid value 'HYBRD' (did you mean 'HYBRID'?); allowed values: "
      "HYBRID, E4M3, E5M2 (Accelerate refuses it too)");
  CHECK_THAT(message("mixed_precision: fp8\nfp8_config:\n  amax_compute_algo: mean\n"),
             Catch::Contains("fp8_config.amax_compute_algo: invalid value 'mean'; allowed values: max, "
                             "most_recent"));
  CHECK(message("mixed_precision: fp8\nfp8_config:\n  amax_history_len: 0\n") ==
        "inline.yaml:3: fp8_config.amax_history_len: expected a positive integer, got '0'");
  CHECK(message("mixed_precision: fp8\nfp8_config:\n  margin: -1\n") ==
        "inline.yaml:3: fp8_config.margin: expected a non-negative integer, got '-1'");
  CHECK(message("mixed_precision: fp8\nfp8_config:\n  amax_history_lenght: 8\n") ==
        "inline.yaml:3: unknown key 'fp8_config.amax_history_lenght' (did you mean 'amax_history_len'?); the "
        "fp8_config keys are backend, fp8_format, amax_history_len, amax_compute_algo, margin, interval, "
        "override_linear_precision, use_autocast_during_eval, use_mxfp8_block_scaling, opt_level, "
        "enable_fsdp_float8_all_gather, pad_inner_dim");
  CHECK(message("mixed_precision: fp8\nfp8_config:\n  backend: TE\n  fp8_format: E5M2\n") ==
        "inline.yaml:4: fp8_config.fp8_format: E5M2 with backend TE: Transformer Engine refuses pure E5M2 "
        "training (\"Pure E5M2 training is not supported.\"); use HYBRID (E4M3 forward, E5M2 gradients) or "
        "E4M3");
  CHECK_THAT(
      message("mixed_precision: fp8\nfp8_config:\n  override_linear_precision: [true, false, false]\n"),
      Catch::Contains("fp8_config.override_linear_precision: Transformer Engine runs only the wgrad GEMM "
                      "in higher precision"));
  CHECK_THAT(message("mixed_precision: fp8\nfp8_config:\n  override_linear_precision: [false, false]\n"),
             Catch::Contains("fp8_config.override_linear_precision: expected three booleans (fprop, dgrad, "
                             "wgrad)"));
  CHECK_THAT(message("mixed_precision: fp8\nfp8_config:\n  pad_inner_dim: maybe\n"),
             Catch::Contains("fp8_config.pad_inner_dim: expected true or false, got 'maybe'"));
  // Without mixed_precision: fp8 the section is read (and checked) but has no effect, as in Accelerate.
  const auto bf16 = accel::Config::load_string(
      "mixed_precision: bf16\nfp8_config:\n  backend: TE\n  amax_history_length: 1024\n  opt_level: O1\n",
      "inline.yaml");
  CHECK(bf16.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK(has_notice(bf16, "inline.yaml:2: fp8_config has no effect without mixed_precision: fp8"));
  CHECK(has_notice(bf16,
                   "inline.yaml:4: fp8_config.amax_history_length: `accelerate config` writes this key, "
                   "but no Accelerate recipe reads it (they read amax_history_len)"));
  CHECK(has_notice(bf16,
                   "inline.yaml:5: fp8_config.opt_level: read only by the MSAMP recipe; no effect with "
                   "backend TE"));
  CHECK_NOTHROW(accel::Config::load_string("fp8_config: {}\n"));
  CHECK(accel::Config::load_string("fp8_config: {}\n").notices.empty());
  // Other values of mixed_precision keep their message.
  CHECK(message("mixed_precision: fp4\n") ==
        "inline.yaml:1: mixed_precision: invalid value 'fp4'; allowed values: no, fp16, bf16");
}
