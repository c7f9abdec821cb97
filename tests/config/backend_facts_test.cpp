// The backends' fact sheets (config.hpp: BackendInfo::sharding, layout_setting, layouts), torch-free: what
// each setting shards, written once, and the advice built from them.
#include <accel/config/config.hpp>

#include <catch2/catch.hpp>

#include "build_paths.hpp"

#include <string>

namespace {

accel::Config zero(int stage) {
  accel::Config c;
  c.backend = "zero";
  c.zero.stage = stage;
  return c;
}

accel::Config fsdp(accel::ShardingStrategy s) {
  accel::Config c;
  c.backend = "fsdp";
  c.fsdp.sharding_strategy = s;
  return c;
}

bool same(const accel::BackendCapabilities& a, const accel::BackendCapabilities& b) {
  return a.shards_optimizer_state == b.shards_optimizer_state && a.shards_gradients == b.shards_gradients &&
         a.shards_parameters == b.shards_parameters &&
         a.communicates_on_micro_steps == b.communicates_on_micro_steps;
}

accel::BackendCapabilities caps(bool state, bool grads, bool params, bool micro) {
  accel::BackendCapabilities c;
  c.shards_optimizer_state = state;
  c.shards_gradients = grads;
  c.shards_parameters = params;
  c.communicates_on_micro_steps = micro;
  return c;
}

}  // namespace

TEST_CASE("backend facts: what each ZeRO stage and FSDP strategy shards (DeepSpeed's ZeroStageEnum)") {
  using accel::ShardingStrategy;
  CHECK(same(accel::sharding_of(zero(0)), caps(false, false, false, false)));
  CHECK(same(accel::sharding_of(zero(1)), caps(true, false, false, false)));
  CHECK(same(accel::sharding_of(zero(2)), caps(true, true, false, false)));
  CHECK(same(accel::sharding_of(zero(3)), caps(true, true, true, true)));
  CHECK(same(accel::sharding_of(fsdp(ShardingStrategy::NoShard)), caps(false, false, false, false)));
  CHECK(same(accel::sharding_of(fsdp(ShardingStrategy::ShardGradOp)), caps(true, true, false, false)));
  // FSDP reduces gradients only on sync steps (no_sync accumulation), unlike ZeRO-3.
  CHECK(same(accel::sharding_of(fsdp(ShardingStrategy::FullShard)), caps(true, true, true, false)));
  accel::Config ddp;
  ddp.backend = "ddp";
  CHECK(same(accel::sharding_of(ddp), caps(false, false, false, false)));
  CHECK(same(accel::sharding_of(accel::Config()), caps(false, false, false, false)));  // local
}

TEST_CASE("backend facts: a layout is named by its backend and deciding setting") {
  CHECK(accel::describe_layout(zero(2)) == "zero (zero_stage 2)");
  CHECK(accel::describe_layout(fsdp(accel::ShardingStrategy::FullShard)) == "fsdp (FULL_SHARD)");
  accel::Config ddp;
  ddp.backend = "ddp";
  CHECK(accel::describe_layout(ddp) == "ddp");
}

TEST_CASE("backend facts: advice lists every layout that meets the condition, from the fact sheets") {
  using accel::BackendCapabilities;
  const auto whole_gradients = [](const BackendCapabilities& c) {
    return !c.shards_gradients && !c.shards_parameters;
  };
  CHECK(accel::layouts_where(whole_gradients) ==
        "backend: ddp, fsdp with fsdp_sharding_strategy: NO_SHARD, or zero with zero_stage: 0 or 1");
  CHECK(accel::layouts_where(whole_gradients, accel::LayoutSpelling::Flags) ==
        "--backend ddp, fsdp with --fsdp_sharding_strategy NO_SHARD, or zero with --zero_stage 0 or 1");
  CHECK(accel::layouts_where([](const BackendCapabilities& c) { return !c.shards_optimizer_state; }) ==
        "backend: ddp, fsdp with fsdp_sharding_strategy: NO_SHARD, or zero with zero_stage: 0");
  CHECK(accel::layouts_where([](const BackendCapabilities& c) { return c.shards_parameters; }) ==
        "backend: fsdp with fsdp_sharding_strategy: FULL_SHARD or HYBRID_SHARD, or zero with zero_stage: 3");
  // A new layout (the hybrid strategies) enters the advice from its fact sheet alone.
  CHECK(accel::layouts_where([](const BackendCapabilities& c) { return c.shards_per_machine; }) ==
        "backend: fsdp with fsdp_sharding_strategy: HYBRID_SHARD or HYBRID_SHARD_ZERO2");
  // Nothing qualifies: said so rather than an empty list.
  CHECK(accel::layouts_where([](const BackendCapabilities&) { return false; }) == "backend: (none)");
}

// Issue 49: a user swapping backends by editing the file must see where clipping, precision and accumulation
// come from (accel-launch env prints Config::origins); the ZeRO templates write their clipping out.
TEST_CASE("origins: clipping, precision and accumulation name the file line or whose default applied") {
  const accel::Config yaml_default = accel::Config::load_string(
      "backend: zero\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n", "a.yaml");
  CHECK(accel::automatic_gradient_clipping(yaml_default) == 1.0);
  CHECK(yaml_default.origins.at("gradient_clipping") ==
        "Accelerate's default for a deepspeed_config section (absent: filled with 1.0)");
  CHECK(yaml_default.origins.at("mixed_precision") == "default: 'no', as Accelerate's");
  CHECK(yaml_default.origins.at("gradient_accumulation_steps") == "default: 1, as Accelerate's");

  const accel::Config written = accel::Config::load_string(
      "backend: zero\nmixed_precision: bf16\ngradient_accumulation_steps: 4\nnum_processes: 2\n"
      "deepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 0.5\n",
      "b.yaml");
  CHECK(accel::automatic_gradient_clipping(written) == 0.5);
  CHECK(written.origins.at("gradient_clipping") == "b.yaml:7: deepspeed_config.gradient_clipping");
  CHECK(written.origins.at("mixed_precision") == "b.yaml:2: mixed_precision");
  CHECK(written.origins.at("gradient_accumulation_steps") == "b.yaml:3: gradient_accumulation_steps");

  const accel::Config ddp = accel::Config::load_string("backend: ddp\nnum_processes: 2\n", "c.yaml");
  CHECK(accel::automatic_gradient_clipping(ddp) == 0.0);
  CHECK(ddp.origins.count("gradient_clipping") == 0);
}

TEST_CASE("origins: every ZeRO template clips explicitly, on the line that says so") {
  for (const char* name : {"zero_stage1.yaml", "zero_stage2.yaml", "zero_stage3.yaml"}) {
    INFO(name);
    const std::string path = accel::test::config_template_dir() + "/" + name;
    const accel::Config c = accel::Config::load_file(path);
    CHECK(accel::automatic_gradient_clipping(c) == 1.0);
    CHECK(c.origins.at("gradient_clipping").rfind(path + ":", 0) == 0);
    CHECK(c.origins.at("gradient_clipping").find(": deepspeed_config.gradient_clipping") !=
          std::string::npos);
  }
}
