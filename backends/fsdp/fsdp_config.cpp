// The fsdp backend's side of the config (torch-free; compiled into accel_config): the `fsdp_config:` section
// (Accelerate's fsdp_* keys), FSDP2's fsdp_reshard_after_forward, its checks and its questions.
#include "config/config_detail.hpp"

namespace accel {
namespace config_detail {
namespace {

const Section kFsdpSection = "fsdp_config";

const ChoiceSet<ShardingStrategy>& sharding_choices() {
  static const ChoiceSet<ShardingStrategy> kSet{
      {{"FULL_SHARD", ShardingStrategy::FullShard, true},
       {"SHARD_GRAD_OP", ShardingStrategy::ShardGradOp, true},
       {"NO_SHARD", ShardingStrategy::NoShard, true},
       {"HYBRID_SHARD", ShardingStrategy::HybridShard, true},
       {"HYBRID_SHARD_ZERO2", ShardingStrategy::HybridShardZero2, true},
       {"_HYBRID_SHARD_ZERO2", ShardingStrategy::HybridShardZero2, false},  // PyTorch's enum member name
       {"1", ShardingStrategy::FullShard, false},
       {"2", ShardingStrategy::ShardGradOp, false},
       {"3", ShardingStrategy::NoShard, false},
       {"4", ShardingStrategy::HybridShard, false},
       {"5", ShardingStrategy::HybridShardZero2, false}},
      {}};
  return kSet;
}

bool is_bool_spelling(const std::string& text) {
  for (const char* b : {"true", "yes", "on", "y", "false", "no", "off", "n"}) {
    if (lower(text) == b) return true;
  }
  return false;
}

// fsdp_reshard_after_forward names the sharding strategy too: FSDP2's booleans (true FULL_SHARD, false
// SHARD_GRAD_OP) or, as current `accelerate config` writes it for FSDP1, a ShardingStrategy name or number
// (Accelerate's FullyShardedDataParallelPlugin upper-cases the name, or reads the digit as the enum value).
const ChoiceSet<ShardingStrategy>& reshard_choices() {
  static const ChoiceSet<ShardingStrategy> kSet = [] {
    ChoiceSet<ShardingStrategy> set;
    set.choices = {{"true", ShardingStrategy::FullShard, true},
                   {"false", ShardingStrategy::ShardGradOp, true}};
    for (const char* yes : {"yes", "on", "y"})
      set.choices.push_back({yes, ShardingStrategy::FullShard, false});
    for (const char* no : {"no", "off", "n"})
      set.choices.push_back({no, ShardingStrategy::ShardGradOp, false});
    for (const Choice<ShardingStrategy>& c : sharding_choices().choices)
      set.choices.push_back(c);
    set.unsupported = sharding_choices().unsupported;
    return set;
  }();
  return kSet;
}

const ChoiceSet<AutoWrapPolicy>& wrap_choices() {
  static const ChoiceSet<AutoWrapPolicy> kSet{
      {{"TRANSFORMER_BASED_WRAP", AutoWrapPolicy::TransformerBasedWrap, true},
       {"SIZE_BASED_WRAP", AutoWrapPolicy::SizeBasedWrap, true},
       {"NO_WRAP", AutoWrapPolicy::NoWrap, true},
       {"PER_CHILD_WRAP", AutoWrapPolicy::PerChildWrap, true}},
      {}};
  return kSet;
}

const ChoiceSet<BackwardPrefetch>& prefetch_choices() {
  static const ChoiceSet<BackwardPrefetch> kSet{{{"BACKWARD_PRE", BackwardPrefetch::BackwardPre, true},
                                                 {"BACKWARD_POST", BackwardPrefetch::BackwardPost, true},
                                                 {"NO_PREFETCH", BackwardPrefetch::NoPrefetch, true}},
                                                {}};
  return kSet;
}

const ChoiceSet<StateDictType>& state_dict_choices() {
  static const ChoiceSet<StateDictType> kSet{{{"FULL_STATE_DICT", StateDictType::FullStateDict, true},
                                              {"SHARDED_STATE_DICT", StateDictType::ShardedStateDict, true}},
                                             {"LOCAL_STATE_DICT"}};
  return kSet;
}

std::vector<KeyRow> fsdp_rows() {
  std::vector<KeyRow> rows;
  rows.push_back(section_row(kFsdpSection, "fsdp_*", "settings of the fsdp backend (keys below)"));
  {
    KeyRow r = setting(
        "fsdp_sharding_strategy", kFsdpSection,
        "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2 (or Accelerate's 1-5); "
        "the hybrid ones shard over each machine's ranks (or fsdp_hybrid_shard_size ranks) and replicate "
        "across them",
        [](auto& c) -> auto& { return c.fsdp.sharding_strategy; }, choice(sharding_choices),
        write_enum<ShardingStrategy>, "HYBRID_SHARD_ZERO2");
    rows.push_back(r);
  }
  {
    KeyRow r;
    r.name = "fsdp_reshard_after_forward";
    r.section = kFsdpSection;
    r.doc =
        "the strategy by another name: FSDP2's true (FULL_SHARD) or false (SHARD_GRAD_OP), or FSDP1's "
        "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD (what accelerate config writes)";
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) {
      rd.choice(e, reshard_choices());  // see resolve
    };
    rows.push_back(r);
  }
  rows.push_back(setting(
      "fsdp_auto_wrap_policy", kFsdpSection,
      "TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP | PER_CHILD_WRAP (how the model is cut into "
      "units)",
      [](auto& c) -> auto& { return c.fsdp.auto_wrap_policy; }, choice(wrap_choices),
      write_enum<AutoWrapPolicy>, "TRANSFORMER_BASED_WRAP"));
  rows.push_back(setting(
      "fsdp_min_num_params", kFsdpSection, "minimum parameters per unit for SIZE_BASED_WRAP",
      [](auto& c) -> auto& { return c.fsdp.min_num_params; },
      [](const Reader& r, const Entry& e) {
        return static_cast<std::int64_t>(
            std::min<std::uint64_t>(r.count(e, 0, kNonNegativeInt),
                                    static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())));
      },
      write_int, "1000"));
  rows.push_back(setting(
      "fsdp_transformer_layer_cls_to_wrap", kFsdpSection,
      "comma-separated module names (Module::name()) for TRANSFORMER_BASED_WRAP; empty: the model's repeated "
      "block type, found at prepare",
      [](auto& c) -> auto& { return c.fsdp.transformer_layer_cls_to_wrap; }, text(),
      [](const std::string& s) { return s.empty() ? std::string("null") : yaml_string(s); },
      "'Block, it''s'"));
  rows.push_back(setting(
      "fsdp_backward_prefetch", kFsdpSection, "BACKWARD_PRE | BACKWARD_POST | NO_PREFETCH",
      [](auto& c) -> auto& { return c.fsdp.backward_prefetch; }, choice(prefetch_choices),
      write_enum<BackwardPrefetch>, "NO_PREFETCH"));
  {
    KeyRow r = ignored("fsdp_backward_prefetch_policy", kFsdpSection,
                       "older Accelerate name of fsdp_backward_prefetch");
    r.read = [](Reader& rd, const Entry& e, Config& c, Pending&) {
      c.fsdp.backward_prefetch = rd.choice(e, prefetch_choices());
    };
    rows.push_back(r);
  }
  rows.push_back(setting(
      "fsdp_forward_prefetch", kFsdpSection, "gather the next unit during forward",
      [](auto& c) -> auto& { return c.fsdp.forward_prefetch; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "fsdp_offload_params", kFsdpSection, "keep sharded parameters and optimizer state on CPU",
      [](auto& c) -> auto& { return c.fsdp.offload_params; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "fsdp_state_dict_type", kFsdpSection, "FULL_STATE_DICT | SHARDED_STATE_DICT",
      [](auto& c) -> auto& { return c.fsdp.state_dict_type; }, choice(state_dict_choices),
      write_enum<StateDictType>, "SHARDED_STATE_DICT"));
  rows.push_back(setting(
      "fsdp_activation_checkpointing", kFsdpSection, "recompute each unit's activations in backward",
      [](auto& c) -> auto& { return c.fsdp.activation_checkpointing; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "fsdp_version", kFsdpSection, "1 or 2 (both run the same implementation)",
      [](auto& c) -> auto& { return c.fsdp.version; }, int_in(1, 2, "1 or 2"), write_int, "2"));
  rows.push_back(setting(
      "fsdp_cpu_ram_efficient_loading", kFsdpSection,
      "FULL_SHARD: a model built empty is loaded by each rank's slices (load_model)",
      [](auto& c) -> auto& { return c.fsdp.cpu_ram_efficient_loading; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "fsdp_sync_module_states", kFsdpSection, "broadcast rank 0's parameters and buffers at prepare",
      [](auto& c) -> auto& { return c.fsdp.sync_module_states; }, boolean(), write_bool, "false"));
  rows.push_back(setting(
      "fsdp_use_orig_params", kFsdpSection,
      "accepted for Accelerate; the user's parameters always stay usable",
      [](auto& c) -> auto& { return c.fsdp.use_orig_params; }, boolean(), write_bool, "false"));
  rows.push_back(setting(
      "fsdp_hybrid_shard_size", kFsdpSection,
      "accelerate-cpp's: ranks per shard group under the hybrid strategies, consecutive ranks (0: one "
      "machine's); parallelism_config's dp_shard_size sets it",
      [](auto& c) -> auto& { return c.fsdp.hybrid_shard_size; },
      int_in(0, std::numeric_limits<int>::max(), "0 or a number of ranks"), write_int, "4"));

  return rows;
}

// fsdp_reshard_after_forward names the strategy too (FSDP2's boolean or FSDP1's strategy name): with
// fsdp_sharding_strategy the two must agree (a boolean says nothing about NO_SHARD, so any boolean agrees
// with it).
void resolve_fsdp(const Reader& r, Config& c, const Pending& p) {
  const Entry* reshard = p.find(kFsdpSection + ".fsdp_reshard_after_forward");
  if (reshard == nullptr) return;
  const ShardingStrategy implied = r.choice(*reshard, reshard_choices());
  const std::string text = reshard->value.Scalar();
  const bool boolean = is_bool_spelling(text);
  const Entry* strategy = p.find(kFsdpSection + ".fsdp_sharding_strategy");
  if (strategy) {
    if (boolean && c.fsdp.sharding_strategy != ShardingStrategy::NoShard &&
        c.fsdp.reshard_after_forward() != (implied == ShardingStrategy::FullShard)) {
      r.fail_at(
          *reshard,
          fmt::format("{}: {} disagrees with fsdp_sharding_strategy '{}' (line {}); reshard_after_forward "
                      "true means FULL_SHARD and false means SHARD_GRAD_OP: make them agree or remove one",
                      reshard->path, yaml_bool(implied == ShardingStrategy::FullShard),
                      strategy->value.Scalar(), strategy->line));
    }
    if (!boolean && c.fsdp.sharding_strategy != implied) {
      r.fail_at(*reshard,
                fmt::format("{}: '{}' disagrees with fsdp_sharding_strategy '{}' (line {}); both name the "
                            "sharding strategy: make them agree or remove one",
                            reshard->path, text, strategy->value.Scalar(), strategy->line));
    }
    return;
  }
  c.fsdp.sharding_strategy = implied;
  // What Accelerate itself would run differs: its launcher always exports fsdp_sharding_strategy (default
  // FULL_SHARD; commands/launch.py, utils/launch.py), the FSDP1 plugin reads that one, and accelerator.py
  // passes `sharding_strategy or reshard_after_forward` to FSDP, so FSDP1 never sees this key.
  if (c.backend == "fsdp" && c.fsdp.version == 1 && implied != ShardingStrategy::FullShard) {
    c.notices.push_back(fmt::format(
        "{}: '{}' means {} here; Accelerate's launcher would run FULL_SHARD with this FSDP1 file (it always "
        "passes fsdp_sharding_strategy, default FULL_SHARD, which FSDP1 prefers); add "
        "fsdp_sharding_strategy: "
        "{} to have both run the same",
        reshard->path, text, to_string(implied), to_string(implied)));
  }
}

void validate_fsdp(const Config& c, const FailKey& fail_key) {
  const FsdpConfig& f = c.fsdp;
  if (f.min_num_params < 0) {
    fail_key("fsdp_config.fsdp_min_num_params",
             fmt::format("fsdp_config.fsdp_min_num_params ({}) must not be negative", f.min_num_params));
  }
  if (f.version != 1 && f.version != 2) {
    fail_key("fsdp_config.fsdp_version",
             fmt::format("fsdp_config.fsdp_version ({}) must be 1 or 2", f.version));
  }
  if (f.hybrid_shard_size < 0) {
    fail_key(
        "fsdp_config.fsdp_hybrid_shard_size",
        fmt::format("fsdp_config.fsdp_hybrid_shard_size ({}) must not be negative", f.hybrid_shard_size));
  }
  if (f.hybrid_shard_size > 0 && !f.hybrid()) {
    fail_key("fsdp_config.fsdp_hybrid_shard_size",
             fmt::format("fsdp_config.fsdp_hybrid_shard_size {} needs fsdp_sharding_strategy HYBRID_SHARD or "
                         "HYBRID_SHARD_ZERO2 (it is {}): set one of them, or remove fsdp_hybrid_shard_size",
                         f.hybrid_shard_size, to_string(f.sharding_strategy)));
  }
  if (f.hybrid_shard_size > 0 && c.num_processes > 1 && c.num_processes % f.hybrid_shard_size != 0) {
    fail_key("fsdp_config.fsdp_hybrid_shard_size",
             fmt::format("fsdp_config.fsdp_hybrid_shard_size {} does not divide num_processes {}: the ranks "
                         "form shard groups of that size; choose a divisor",
                         f.hybrid_shard_size, c.num_processes));
  }
  // TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap is valid (what `accelerate config`
  // writes when a Hugging Face model's _no_split_modules should decide): the config cannot see the model;
  // FULL_SHARD wraps the model's repeated block type at prepare (backends/common/unit_plan.hpp,
  // repeated_block_class), or stops naming the model's types.
}

void ask_fsdp(Questions& q, Config& config) {
  FsdpConfig& fsdp = config.fsdp;
  fsdp.sharding_strategy =
      std::vector<ShardingStrategy>{ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                    ShardingStrategy::NoShard, ShardingStrategy::HybridShard,
                                    ShardingStrategy::HybridShardZero2}[q.ask_choice(
          "What should be your FSDP sharding strategy?",
          {{"FULL_SHARD", "shard parameters, gradients and optimizer state (like ZeRO-3)"},
           {"SHARD_GRAD_OP", "shard gradients and optimizer state (like ZeRO-2)"},
           {"NO_SHARD", "shard nothing (like DDP)"},
           {"HYBRID_SHARD", "FULL_SHARD inside each machine, a replica per machine"},
           {"HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP inside each machine, a replica per machine"}},
          0)];
  fsdp.auto_wrap_policy =
      std::vector<AutoWrapPolicy>{AutoWrapPolicy::TransformerBasedWrap, AutoWrapPolicy::SizeBasedWrap,
                                  AutoWrapPolicy::NoWrap, AutoWrapPolicy::PerChildWrap}[q.ask_choice(
          "What should be your FSDP auto wrap policy?",
          {{"TRANSFORMER_BASED_WRAP", "one unit per module whose name() is in a list"},
           {"SIZE_BASED_WRAP", "units of at least a minimum number of parameters"},
           {"NO_WRAP", "the whole model is one unit"},
           {"PER_CHILD_WRAP", "one unit per direct child module"}},
          3)];
  if (fsdp.auto_wrap_policy == AutoWrapPolicy::TransformerBasedWrap) {
    // Accelerate asks "Do you want to use the model's `_no_split_modules` to wrap" first; LibTorch modules
    // have none, so the empty list means the model's repeated block type, found at prepare.
    const bool from_model = q.ask_bool(
        "Do you want to wrap the block type the model repeats in a ModuleList or Sequential, found at "
        "prepare "
        "(Accelerate's question about the model's _no_split_modules)?",
        false);
    if (!from_model) {
      fsdp.transformer_layer_cls_to_wrap = q.ask_text(
          "Which modules should be wrapped (comma-separated Module::name() values, e.g. TransformerBlock)?",
          std::nullopt);
    }
  }
  if (fsdp.auto_wrap_policy == AutoWrapPolicy::SizeBasedWrap) {
    fsdp.min_num_params = q.ask_int64("What should be the minimum number of parameters of an FSDP unit?",
                                      fsdp.min_num_params, 0, std::numeric_limits<int64_t>::max());
  }
  fsdp.offload_params =
      q.ask_bool("Do you want to offload sharded parameters and optimizer state to CPU?", false);
  fsdp.activation_checkpointing = q.ask_bool("Do you want to use activation checkpointing?", false);
}

}  // namespace

BackendPart fsdp_config_part() {
  BackendPart part;
  part.info.name = "fsdp";
  part.info.summary = "fully sharded data parallel (FSDP)";
  part.info.distributed_types = {"FSDP"};
  part.info.section = kFsdpSection;
  part.info.ask_settings = ask_fsdp;
  // The fact sheet: what each sharding strategy shards, written once.
  part.info.sharding = [](const Config& c) {
    BackendCapabilities s;
    s.shards_optimizer_state = s.shards_gradients = c.fsdp.sharding_strategy != ShardingStrategy::NoShard;
    s.shards_parameters = c.fsdp.reshard_after_forward();
    s.shards_per_machine = c.fsdp.hybrid();
    return s;
  };
  part.info.layout_setting = [](const Config& c) { return to_string(c.fsdp.sharding_strategy); };
  for (const ShardingStrategy s :
       {ShardingStrategy::NoShard, ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard,
        ShardingStrategy::HybridShard, ShardingStrategy::HybridShardZero2}) {
    part.info.layouts.push_back(
        {"fsdp_sharding_strategy", to_string(s), [s](Config& c) { c.fsdp.sharding_strategy = s; }});
  }
  part.rows = fsdp_rows();
  part.unsupported = {
      {kAccelerateYaml, kFsdpSection + ".fsdp_ignored_modules", true, AsksNothingWhen::Empty, "",
       "FSDP leaves the modules it names (a regex matched against module names, Accelerate 1.10+) unsharded "
       "and out of its gradient reduction, so each rank trains its own copy of them",
       "remove it: accelerate-cpp shards and reduces every parameter of the prepared model (freeze what "
       "should not train)"}};
  part.section_in_use = [](const Config& c) { return c.backend == "fsdp" || c.fsdp != FsdpConfig{}; };
  part.resolve = resolve_fsdp;
  part.validate = validate_fsdp;
  part.estimate_config = [](const MemoryEstimateInput& in, Config& c) {
    const std::optional<ShardingStrategy> strategy =
        match_choice(sharding_choices(), in.fsdp_sharding_strategy);
    if (!strategy) {
      throw ConfigError(
          fmt::format("estimate-memory: fsdp_sharding_strategy '{}' is not available (FULL_SHARD, "
                      "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2)",
                      in.fsdp_sharding_strategy),
          {}, 0, "fsdp_sharding_strategy");
    }
    c.fsdp.sharding_strategy = *strategy;
  };
  return part;
}

}  // namespace config_detail

std::string to_string(ShardingStrategy strategy) {
  return config_detail::canonical_text(config_detail::sharding_choices(), strategy);
}
std::string to_string(AutoWrapPolicy policy) {
  return config_detail::canonical_text(config_detail::wrap_choices(), policy);
}
std::string to_string(BackwardPrefetch prefetch) {
  return config_detail::canonical_text(config_detail::prefetch_choices(), prefetch);
}
std::string to_string(StateDictType type) {
  return config_detail::canonical_text(config_detail::state_dict_choices(), type);
}

bool operator==(const FsdpConfig& a, const FsdpConfig& b) {
  Config x, y;
  x.fsdp = a;
  y.fsdp = b;
  return config_detail::agree(x, y, config_detail::kFsdpSection);
}

}  // namespace accel
