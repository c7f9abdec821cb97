// Accelerate's Megatron-LM files (see megatron_lm.hpp). Sources: Accelerate's commands/config/cluster.py
// (what `accelerate config` writes: megatron_lm_tp_degree, _sequence_parallelism when tp > 1, _pp_degree,
// _num_micro_batches when pp > 1, _recompute_activations, _use_distributed_optimizer, _gradient_clipping),
// commands/launch.py (each key becomes a MEGATRON_LM_* variable) and utils/dataclasses.py MegatronLMPlugin
// (the defaults when a key is absent: degrees 1, 1 micro-batch, clipping 1.0, the three flags false).
#include "megatron_lm.hpp"

namespace accel::config_detail {
namespace {

std::string key(const char* name) {
  return kMegatronLmSection + "." + name;
}

// The section's keys the file sets, in file order, as "path" strings.
std::vector<std::string> keys_under(const Pending& p, const std::string& section) {
  std::vector<std::pair<int, std::string>> found;
  for (const auto& [path, entry] : p.seen) {
    if (path.rfind(section + ".", 0) == 0) found.emplace_back(entry.line, path);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found)
    out.push_back(std::move(f.second));
  return out;
}

}  // namespace

std::vector<KeyRow> megatron_lm_rows() {
  std::vector<KeyRow> rows;
  KeyRow opener = section_row(kMegatronLmSection, "Megatron-LM",
                              "Accelerate's Megatron-LM plugin (distributed_type: MEGATRON_LM): mapped onto "
                              "tensor parallelism, a pipeline and the zero backend (keys below)");
  opener.opens.reset();  // never written: to_yaml writes what it maps to
  rows.push_back(opener);
  const auto add = [&rows](const char* name, const char* doc, auto check) {
    KeyRow row = ignored(name, kMegatronLmSection, doc);
    row.read = [check](Reader& rd, const Entry& e, Config&, Pending&) { check(rd, e); };  // see resolve
    rows.push_back(std::move(row));
  };
  add("megatron_lm_tp_degree",
      "ranks per tensor-parallel group: parallelism_config_tp_size (accel::tp layers; default 1)",
      positive_int());
  add("megatron_lm_pp_degree", "pipeline stages: pipeline_config.stages (prepare_pipeline; default 1)",
      positive_int());
  add("megatron_lm_num_micro_batches",
      "micro-batches per step with pp_degree > 1: pipeline_config.micro_batches (default 1)", positive_int());
  add("megatron_lm_sequence_parallelism", "false only: Megatron-LM's sequence parallelism is not supported",
      boolean());
  add("megatron_lm_recompute_activations",
      "true: activation checkpointing of the model's Sequential blocks (deepspeed_config "
      "activation_checkpointing)",
      boolean());
  add("megatron_lm_use_distributed_optimizer",
      "true: optimizer state sharded over the data-parallel ranks (zero_stage 1); false: zero_stage 0 (DDP)",
      boolean());
  add("megatron_lm_gradient_clipping",
      "global gradient norm clipped to on every step, 0: off (deepspeed_config gradient_clipping; default "
      "1.0)",
      [](const Reader& r, const Entry& e) { return r.number(e, 0, true, "0 (off) or a positive number"); });
  return rows;
}

std::vector<UnsupportedKey> megatron_lm_unsupported() {
  std::vector<UnsupportedKey> rows;
  const auto row = [&rows](const char* name, bool refused, AsksNothingWhen when, const char* neutral,
                           const char* what, const char* instead) {
    rows.push_back({kAccelerateYaml, key(name), refused, when, neutral, what, instead});
  };
  const auto refused_unless = [&row](const char* name, const char* neutral, const char* what) {
    row(name, true, AsksNothingWhen::Value, neutral, what,
        fmt::format(
            "remove it (or set {}): accelerate-cpp maps only tp_degree, pp_degree, num_micro_batches, "
            "use_distributed_optimizer, gradient_clipping and recompute_activations",
            neutral)
            .c_str());
  };
  // Sources: Accelerate 1.13's commands/launch.py and utils/launch.py (the MEGATRON_LM_* variables).
  refused_unless("megatron_lm_context_parallel_size", "1", "context parallelism: sequences split over ranks");
  refused_unless("megatron_lm_expert_model_parallel_size", "1", "mixture-of-experts layers split over ranks");
  refused_unless("megatron_lm_expert_tensor_parallel_size", "1",
                 "tensor parallelism inside mixture-of-experts layers");
  refused_unless("megatron_lm_use_custom_fsdp", "false", "Megatron-LM's own FSDP instead of its DDP");
  refused_unless("megatron_lm_no_load_optim", "false",
                 "resuming without the optimizer state (load_state always restores it)");
  refused_unless("megatron_lm_use_precision_aware_optimizer", "false",
                 "an optimizer keeping its state in lower precision");
  refused_unless("megatron_lm_optimizer_cpu_offload", "false",
                 "the optimizer step on the CPU (here: deepspeed_config offload_optimizer_device: cpu)");
  row("megatron_lm_decoder_last_pipeline_num_layers", true, AsksNothingWhen::Empty, "",
      "how many layers the last pipeline stage gets",
      "remove it: accelerate-cpp cuts the stages by parameters (pipeline_config.partition in a YAML without "
      "megatron_lm_config)");
  const char* model_knob =
      "ignored: it configures Megatron-LM's own models and loss; here the model and the "
      "loss are your program's";
  for (const char* name : {"megatron_lm_attention_dropout", "megatron_lm_hidden_dropout",
                           "megatron_lm_attention_softmax_in_fp32",
                           "megatron_lm_use_rotary_position_embeddings", "megatron_lm_attention_backend",
                           "megatron_lm_eod_mask_loss", "megatron_lm_calculate_per_token_loss"}) {
    row(name, false, AsksNothingWhen::Never, "",
        "a setting of Megatron-LM's GPT/BERT/T5 models or their loss", model_knob);
  }
  const char* speed_knob = "ignored: it changes Megatron-LM's memory or speed, not what is computed";
  row("megatron_lm_recompute_granularity", false, AsksNothingWhen::Never, "",
      "which activations Megatron-LM recomputes (selective or full)", speed_knob);
  row("megatron_lm_recompute_method", false, AsksNothingWhen::Never, "",
      "how Megatron-LM groups the recomputed layers", speed_knob);
  row("megatron_lm_recompute_num_layers", false, AsksNothingWhen::Never, "",
      "how many layers Megatron-LM recomputes", speed_knob);
  row("megatron_lm_overlap_cpu_optimizer_d2h_h2d", false, AsksNothingWhen::Never, "",
      "overlapping the copies of a CPU-offloaded optimizer", speed_knob);
  row("megatron_lm_no_save_optim", false, AsksNothingWhen::Never, "",
      "checkpoints without the optimizer state",
      "ignored: save_state always writes the optimizer state (a checkpoint that resumes exactly)");
  return rows;
}

bool is_megatron_lm(const Reader& r, const Pending& p) {
  const Entry* type = p.find("distributed_type");
  return type != nullptr && r.choice(*type, distributed_type_choices()) == "MEGATRON_LM";
}

void resolve_megatron_lm(const Reader& r, Config& c, const Pending& p) {
  const std::vector<std::string> set = keys_under(p, kMegatronLmSection);
  if (!is_megatron_lm(r, p)) {
    // Accelerate's launcher passes megatron_lm_config on only for MEGATRON_LM.
    if (!set.empty()) {
      c.notices.push_back(
          fmt::format("{}{}: ignored, as Accelerate ignores it: distributed_type is not "
                      "MEGATRON_LM (the backend is {})",
                      location(r.source(), p.find(set.front())->line), join(set), c.backend));
    }
    return;
  }
  const Entry* type = p.find("distributed_type");
  // The layout is the megatron section's: a second description of it would have to agree key by key.
  std::vector<std::string> layout = keys_under(p, "parallelism_config");
  for (const char* other : {"pipeline_config.stages", "pipeline_config.micro_batches"}) {
    if (p.find(other) != nullptr) layout.push_back(other);
  }
  if (!layout.empty()) {
    const Entry& e = *p.find(layout.front());
    r.fail_at(e, fmt::format("{}: with distributed_type: MEGATRON_LM (line {}) the layout is "
                             "megatron_lm_config's (megatron_lm_tp_degree, _pp_degree, _num_micro_batches); "
                             "remove {}",
                             e.path, type->line, join(layout)));
  }
  // Accelerate reads deepspeed_config only under DEEPSPEED.
  if (const std::vector<std::string> ds = keys_under(p, "deepspeed_config"); !ds.empty()) {
    c.notices.push_back(
        fmt::format("{}{}: ignored, as Accelerate ignores it under distributed_type: MEGATRON_LM",
                    location(r.source(), p.find(ds.front())->line), join(ds)));
  }
  const auto integer = [&](const char* name) {
    const Entry* e = p.find(key(name));
    return e ? static_cast<int>(r.integer(*e, 1, std::numeric_limits<int>::max(), kPositiveInt)) : 1;
  };
  const auto flag = [&](const char* name) {
    const Entry* e = p.find(key(name));
    return e != nullptr && r.boolean(*e);
  };
  const int tp = integer("megatron_lm_tp_degree");
  const int pp = integer("megatron_lm_pp_degree");
  const int micro = integer("megatron_lm_num_micro_batches");
  if (flag("megatron_lm_sequence_parallelism")) {
    const Entry& e = *p.find(key("megatron_lm_sequence_parallelism"));
    if (tp > 1) {
      r.fail_at(e,
                fmt::format("{}: true asks for Megatron-LM's sequence parallelism (LayerNorm and dropout "
                            "activations split along the sequence over the tensor-parallel group), which is "
                            "not supported by accelerate-cpp; set it to false (tensor parallelism alone "
                            "computes the same, with more activation memory)",
                            e.path));
    }
    // Megatron-LM turns it off itself without tensor parallelism.
    c.notices.push_back(
        fmt::format("{}{}: true has no effect with megatron_lm_tp_degree 1 (Megatron-LM turns it "
                    "off too)",
                    location(r.source(), e.line), e.path));
  }
  if (pp == 1 && micro > 1) {
    const Entry& e = *p.find(key("megatron_lm_num_micro_batches"));
    r.fail_at(e, fmt::format("{}: {} without a pipeline (megatron_lm_pp_degree 1): Accelerate's Megatron-LM "
                             "plugin then reads {} batches of your loader per step and accumulates their "
                             "gradients; here that is gradient_accumulation_steps: {} (a step of {} x your "
                             "batch): set it and remove this key",
                             e.path, micro, micro, micro, micro));
  }
  // With a pipeline the micro-batches are the pipeline's; an accumulation beside them would be a second,
  // different count (the Trainer refuses the two apart, a hand-written pipeline_step reads micro_batches).
  const Entry* micro_entry = p.find(key("megatron_lm_num_micro_batches"));
  if (const Entry* gas = p.find("gradient_accumulation_steps");
      pp > 1 && gas != nullptr && c.gradient_accumulation_steps > 1 &&
      (micro_entry == nullptr || c.gradient_accumulation_steps != micro)) {
    r.fail_at(*gas,
              fmt::format("gradient_accumulation_steps: {} with a Megatron-LM pipeline "
                          "(megatron_lm_pp_degree {}): its micro-batches are megatron_lm_num_micro_batches "
                          "({}); set that to {} and remove gradient_accumulation_steps",
                          c.gradient_accumulation_steps, pp,
                          micro_entry == nullptr ? std::string("not set: 1") : std::to_string(micro),
                          c.gradient_accumulation_steps));
  }
  c.zero = ZeroConfig{};
  // Megatron's distributed optimizer shards the optimizer state over the data-parallel ranks and still
  // reduces every gradient once per step: zero stage 1. Without it, Megatron's DDP: stage 0.
  c.zero.stage = flag("megatron_lm_use_distributed_optimizer") ? 1 : 0;
  c.tensor_parallel_size = tp;
  c.pipeline.stages = pp;
  if (pp > 1) {
    c.pipeline.micro_batches = micro;
    // Accelerate's Megatron-LM plugin rebuilds the loader to yield batch_size x num_micro_batches rows and
    // cuts each into micro-batches of batch_size; pipeline_step cuts the batch it is given.
    c.notices.push_back(fmt::format(
        "megatron_lm_config: a pipeline step runs {} micro-batches: pipeline_step cuts the batch you give it "
        "into {}, where Accelerate's Megatron-LM plugin has the loader yield {} x your batch size and cuts "
        "that; give pipeline_step {} x your micro-batch rows to step as there (accel::Trainer reads "
        "per_device_train_batch_size x {} rows a step, as Accelerate does)",
        micro, micro, micro, micro, micro));
  }
  if (const Entry* e = p.find(key("megatron_lm_gradient_clipping"))) {
    c.zero.gradient_clipping = r.number(*e, 0, true, "0 (off) or a positive number");
  } else {
    c.zero.gradient_clipping = 1.0;
    c.notices.push_back(
        "megatron_lm_config.megatron_lm_gradient_clipping is not set: gradients are clipped to a global norm "
        "of 1.0 on every step, Accelerate's Megatron-LM default; set it to 0 to turn clipping off");
  }
  if (flag("megatron_lm_recompute_activations")) {
    c.zero.activation_checkpointing = true;
    c.notices.push_back(
        "megatron_lm_config.megatron_lm_recompute_activations: true recomputes the activations of each "
        "Sequential block of the model (or of each pipeline stage) in backward, where Megatron-LM recomputes "
        "only the attention core; the results are the same, memory and time are not, except that a "
        "BatchNorm in a recomputed block updates its running statistics twice (as PyTorch's checkpoint "
        "does)");
  }
  // Accelerate's plugin replaces the program's optimizer with Megatron-LM's (get_megatron_optimizer).
  c.notices.push_back(
      "distributed_type: MEGATRON_LM: your program's own optimizer and parameter groups step as written; "
      "Accelerate's Megatron-LM plugin builds Megatron-LM's optimizer instead (no weight decay on biases and "
      "1-D parameters)");
  // Megatron-LM's loss scaler under fp16 (--initial-loss-scale 2^32, window 1000, hysteresis 2, min 1):
  // DeepSpeed's dynamic scaler with these settings halves and doubles on the same steps.
  c.zero.fp16_initial_scale_power = 32;
}

}  // namespace accel::config_detail
