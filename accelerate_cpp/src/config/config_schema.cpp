// The config schema: one row per YAML key (name, section, doc, reader, writer, equality, an example value).
// Everything else about keys (operator==, to_yaml, key lists, "did you mean", the docs table) is derived from
// these rows, so a key is written once.
#include "config/config_detail.hpp"
#include "config/fp8_config.hpp"

namespace accel::config_detail {

const ChoiceSet<std::string>& backend_choices() {
  static const ChoiceSet<std::string> kSet = [] {
    ChoiceSet<std::string> set;
    for (const BackendPart& part : backend_parts()) {
      set.choices.push_back({part.info.name.c_str(), part.info.name, true});
      for (const std::string& alias : part.info.aliases)
        set.choices.push_back({alias.c_str(), part.info.name, false});
    }
    set.unsupported = {"megatron_lm", "xla", "tpu"};
    return set;
  }();
  return kSet;
}

const ChoiceSet<MixedPrecision>& mixed_precision_choices() {
  static const ChoiceSet<MixedPrecision> kSet{{{"no", MixedPrecision::No, true},
                                               {"fp16", MixedPrecision::Fp16, true},
                                               {"bf16", MixedPrecision::Bf16, true},
                                               {"false", MixedPrecision::No, false}},
                                              {"fp8"}};
  return kSet;
}

const ChoiceSet<CommHook>& comm_hook_choices() {
  static const ChoiceSet<CommHook> kSet{{{"no", CommHook::No, true},
                                         {"fp16", CommHook::Fp16, true},
                                         {"bf16", CommHook::Bf16, true},
                                         {"power_sgd", CommHook::PowerSgd, true},
                                         {"false", CommHook::No, false}},
                                        {"batched_power_sgd"}};
  return kSet;
}

// distributed_type values map onto backends (each part lists its own); MULTI_CPU additionally implies
// use_cpu.
const ChoiceSet<std::string>& distributed_type_choices() {
  static const ChoiceSet<std::string> kSet = [] {
    ChoiceSet<std::string> set;
    for (const BackendPart& part : backend_parts()) {
      for (const std::string& type : part.info.distributed_types)
        set.choices.push_back({type.c_str(), type, true});
      for (const std::string& type : part.mapped_distributed_types)
        set.choices.push_back({type.c_str(), type, true});
    }
    set.choices.push_back({"false", "NO", false});
    set.unsupported = {"MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                       "MULTI_XPU", "MULTI_HPU", "XLA",        "TPU"};
    return set;
  }();
  return kSet;
}

const BackendPart* find_part(const std::string& name) {
  for (const BackendPart& part : backend_parts()) {
    if (part.info.name == name) return &part;
  }
  return nullptr;
}

namespace {

const Section kDynamo = "dynamo_config";
const Section kPipeline = "pipeline_config";
const Section kParallelism = "parallelism_config";

// parallelism_config as to_yaml writes it: nothing when tp_size is 1 (the data-parallel layout is the rest
// of the file), else the section with tp_size alone (the data-parallel ranks are the rest: num_processes /
// (tp_size x pipeline stages)). Starts with a newline: the section's keys go below its name.
std::string parallelism_section(const Config& c) {
  std::string out;
  if (c.tensor_parallel_size != 1)
    out += fmt::format("\n  parallelism_config_tp_size: {}", c.tensor_parallel_size);
  if (c.sequence_parallel_size != 1) {
    out += fmt::format("\n  parallelism_config_sp_size: {}\n  parallelism_config_sp_backend: deepspeed",
                       c.sequence_parallel_size);
  }
  if (c.context_parallel_size != 1)
    out += fmt::format("\n  parallelism_config_cp_size: {}", c.context_parallel_size);
  if (c.context_parallel_comm_strategy != "allgather")
    out += fmt::format("\n  parallelism_config_cp_comm_strategy: {}", c.context_parallel_comm_strategy);
  return out;
}

// dynamo_config: LibTorch has no torch.compile, so only "no dynamo" is accepted.
void check_dynamo_backend(const Reader& r, const Entry& e) {
  const std::string text = r.scalar(e, "'NO'");
  const std::string value = lower(text);
  if (value != "no" && value != "false") {
    r.fail_at(e,
              fmt::format("{}: '{}' is not supported by accelerate-cpp (LibTorch has no torch.compile); set "
                          "dynamo_backend: 'NO' or remove it",
                          e.path, text));
  }
}

std::vector<KeyRow> make_schema() {
  std::vector<KeyRow> rows;
  auto add = [&rows](KeyRow row) { rows.push_back(std::move(row)); };

  // --- top level ---
  {
    KeyRow r = setting(
        "config_version", kTop, "schema version of the file (missing means 1); this build reads 1 only",
        [](auto& c) -> auto& { return c.config_version; }, int_in(1, 1, "1"), write_int, "");
    r.read = nullptr;  // read before everything else (load_yaml)
    r.only_default = true;
    add(r);
  }
  {
    KeyRow r = setting(
        "compute_environment", kTop, "only LOCAL_MACHINE",
        [](auto& c) -> auto& { return c.compute_environment; }, text(), yaml_string, "");
    r.only_default = true;
    add(r);
  }
  {
    KeyRow r;
    r.name = "backend";
    const std::string names = join(listed_values(backend_choices()), " | ");
    r.doc = names + " (accelerate-cpp's shorthand for distributed_type; the two must agree)";
    r.comment = "# backend (" + join(listed_values(backend_choices()), "|") +
                ") is accelerate-cpp's shorthand for distributed_type: the two must agree (or delete one).";
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { rd.choice(e, backend_choices()); };
    r.write = [](const Config& c) { return yaml_string(c.backend); };
    r.equal = [](const Config& a, const Config& b) { return a.backend == b.backend; };
    r.example = "fsdp";
    add(r);
  }
  {
    KeyRow r;
    r.name = "distributed_type";
    r.doc = "Accelerate's " + join(listed_values(distributed_type_choices()), " | ") +
            " (MULTI_CPU implies use_cpu)";
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { rd.choice(e, distributed_type_choices()); };
    r.write = [](const Config& c) -> std::string {
      const BackendPart* part = find_part(c.backend);
      if (part == nullptr) return "'NO'";  // a backend a program registered itself
      if (part->distributed_type) return part->distributed_type(c);
      return yaml_string(part->info.distributed_types.at(0));
    };
    add(r);  // derived from backend and use_cpu: no setting of its own
  }
  {
    KeyRow r = setting(
        "use_cpu", kTop, "train on CPU (Gloo) even when a GPU is present",
        [](auto& c) -> auto& { return c.use_cpu; }, boolean(), write_bool, "true");
    add(r);
  }
  add(setting(
      "debug", kTop, "check every rank's shapes before each collective (a mismatch is an error, not a hang)",
      [](auto& c) -> auto& { return c.debug; }, boolean(), write_bool, "true"));
  add(setting(
      "log_with", kTop, "experiment trackers: tensorboard, csv, jsonl, all or a list such as tensorboard,csv",
      [](auto& c) -> auto& { return c.log_with; }, text(),
      [](const std::string& v) { return v.empty() ? std::string("null") : yaml_string(v); },
      "tensorboard,csv"));
  add(setting(
      "gpu_ids", kTop, "all, or a comma-separated list such as 0,1",
      [](auto& c) -> auto& { return c.gpu_ids; }, gpu_id_list(), yaml_string, "'0,1,2,3'"));
  add(setting(
      "num_processes", kTop, "total number of ranks across all machines",
      [](auto& c) -> auto& { return c.num_processes; }, positive_int(), write_int, "8"));
  add(setting(
      "num_machines", kTop, "number of nodes; num_processes must be a multiple of it",
      [](auto& c) -> auto& { return c.num_machines; }, positive_int(), write_int, "2"));
  add(setting(
      "machine_rank", kTop, "index of this node, 0..num_machines-1",
      [](auto& c) -> auto& { return c.machine_rank; },
      int_in(0, std::numeric_limits<int>::max(), kNonNegativeInt), write_int, "1"));
  {
    KeyRow r = setting(
        "main_process_ip", kTop, "address of machine 0 (needed when num_machines > 1)",
        [](auto& c) -> auto& { return c.main_process_ip; }, text(),
        [](const std::string& ip) { return ip.empty() ? std::string("null") : yaml_string(ip); },
        "192.168.1.10");
    add(r);
  }
  add(setting(
      "main_process_port", kTop, "rendezvous port on machine 0; 0 picks a free port",
      [](auto& c) -> auto& { return c.main_process_port; }, int_in(0, 65535, "a port number from 0 to 65535"),
      write_int, "0"));
  {
    KeyRow r = setting(
        "mixed_precision", kTop, "no | fp16 | bf16 (fp16 with dynamic loss scaling)",
        [](auto& c) -> auto& { return c.mixed_precision; }, choice(mixed_precision_choices),
        [](MixedPrecision m) { return "'" + to_string(m) + "'"; }, "bf16");
    // fp8 is refused once the whole file is read (resolve_fp8), naming the fp8_config recipe it asks for.
    r.read = [](Reader& rd, const Entry& e, Config& c, Pending&) {
      if (e.value.IsScalar() && lower(e.value.Scalar()) == "fp8") return;
      c.mixed_precision = rd.choice(e, mixed_precision_choices());
    };
    add(r);
  }
  add(fp8_config_row());
  {
    KeyRow r = setting(
        "gradient_accumulation_steps", kTop, "micro-steps (batches) per optimizer step",
        [](auto& c) -> auto& { return c.gradient_accumulation_steps; }, positive_int(), write_int, "4");
    add(r);
  }
  add(setting(
      "collective_timeout_seconds", kTop, "a collective that takes longer fails with a DistributedError",
      [](auto& c) -> auto& { return c.collective_timeout_seconds; },
      positive_number("a positive number of seconds"), write_number, "0.1"));
  add(setting(
      "seed", kTop, "seed of every rank's RNGs and of data shuffling (seed + epoch); null leaves RNGs alone",
      [](auto& c) -> auto& { return c.seed; },
      [](const Reader& r, const Entry& e) {
        return std::optional<std::uint64_t>(r.unsigned64(e, kNonNegativeInt));
      },
      [](const std::optional<std::uint64_t>& s) { return s ? std::to_string(*s) : std::string("null"); },
      "18446744073709551615"));
  add(setting(
      "even_batches", kTop, "complete the last round of batches by wrapping to the start of the epoch",
      [](auto& c) -> auto& { return c.even_batches; }, boolean(), write_bool, "false"));
  add(setting(
      "split_batches", kTop, "cut each global batch into num_processes slices",
      [](auto& c) -> auto& { return c.split_batches; }, boolean(), write_bool, "true"));
  add(setting(
      "ddp_bucket_cap_mb", kTop, "gradient all-reduce bucket size, in MiB",
      [](auto& c) -> auto& { return c.ddp_bucket_cap_mb; }, positive_number("a positive number of MiB"),
      write_number, "12.5"));
  add(setting(
      "ddp_first_bucket_cap_mb", kTop, "size of the first (latency-sensitive) bucket, in MiB",
      [](auto& c) -> auto& { return c.ddp_first_bucket_cap_mb; }, positive_number("a positive number of MiB"),
      write_number, "0.5"));
  add(setting(
      "ddp_find_unused_parameters", kTop, "reduce parameters that get no gradient in a step as zeros",
      [](auto& c) -> auto& { return c.ddp_find_unused_parameters; }, boolean(), write_bool, "true"));
  add(setting(
      "ddp_gradient_as_bucket_view", kTop,
      "DDP: each .grad is a slice of its all-reduce bucket (one copy of the gradients); false: two copies",
      [](auto& c) -> auto& { return c.ddp_gradient_as_bucket_view; }, boolean(), write_bool, "false"));
  add(setting(
      "ddp_broadcast_buffers", kTop,
      "after every sync step copy rank 0's buffers (BatchNorm statistics) to every rank; constant buffers "
      "(the 4-bit codes of `Linear4bit`, `accel::ConstantBuffers`) are left out",
      [](auto& c) -> auto& { return c.ddp_broadcast_buffers; }, boolean(), write_bool, "false"));
  add(setting(
      "ddp_comm_hook", kTop,
      "gradient compression on the wire: no | fp16 | bf16 (DDP all-reduce, ZeRO/FSDP reduce-scatter) | "
      "power_sgd (DDP)",
      [](auto& c) -> auto& { return c.ddp_comm_hook; }, choice(comm_hook_choices),
      [](CommHook h) { return "'" + to_string(h) + "'"; }, "fp16"));
  add(setting(
      "ddp_comm_powersgd_rank", kTop, "power_sgd: rank of each gradient matrix's approximation",
      [](auto& c) -> auto& { return c.ddp_comm_powersgd_rank; }, positive_int(), write_int, "2"));
  add(setting(
      "ddp_comm_powersgd_start_iter", kTop, "power_sgd: plain all-reduce steps before compression starts",
      [](auto& c) -> auto& { return c.ddp_comm_powersgd_start_iter; },
      int_in(0, std::numeric_limits<int>::max(), kNonNegativeInt), write_int, "10"));
  add(section_row(kPipeline, "pipeline settings", "pipeline parallelism (keys below)"));
  add(setting(
      "stages", kPipeline,
      "pipeline stages (1: no pipeline); num_processes must be a multiple: num_processes / stages "
      "data-parallel replicas",
      [](auto& c) -> auto& { return c.pipeline.stages; }, positive_int(), write_int, "8"));
  add(setting(
      "micro_batches", kPipeline, "micro-batches per optimizer step; 0: gradient_accumulation_steps",
      [](auto& c) -> auto& { return c.pipeline.micro_batches; },
      int_in(0, std::numeric_limits<int>::max(), kNonNegativeInt), write_int, "4"));
  add(setting(
      "schedule", kPipeline, "1f1b | gpipe", [](auto& c) -> auto& { return c.pipeline.schedule; },
      [](const Reader& r, const Entry& e) {
        const std::string text = r.scalar(e, "1f1b or gpipe");
        try {
          return pipeline::parse_schedule(text);
        } catch (const ConfigError&) {
          r.fail_at(e, fmt::format("{}: '{}' is not a pipeline schedule; allowed values: 1f1b, gpipe", e.path,
                                   text));
        }
        return pipeline::Schedule::OneFOneB;
      },
      [](pipeline::Schedule v) { return pipeline::to_string(v); }, "gpipe"));
  add(setting(
      "partition", kPipeline,
      "layers per stage: parameters | uniform | type:<regex> | boundaries such as 0,3,6",
      [](auto& c) -> auto& { return c.pipeline.partition; },
      [](const Reader& r, const Entry& e) {
        const std::string text = r.scalar(e, "parameters, uniform, type:<regex> or boundaries such as 0,3,6");
        try {
          pipeline::parse_partition(text);
        } catch (const ConfigError& error) {
          r.fail_at(e, fmt::format("{}: {}", e.path, error.what()));
        }
        return text;
      },
      [](const std::string& v) { return yaml_string(v); }, "uniform"));
  {
    // Accelerate 1.10+'s ParallelismConfig (parallelism_config.py): checked against the layout it describes
    // (resolve_parallelism in config_read.cpp). The data-parallel sizes are the layout the rest of the file
    // says; tp_size is a setting of its own, written alone when it is not 1 (read back, tp_size alone leaves
    // the data-parallel ranks to the rest: an extension of Accelerate's rule, which wants the product).
    KeyRow r = section_row(kParallelism, "parallelism settings",
                           "Accelerate's device mesh, checked against the layout (keys below)");
    r.opens.reset();
    r.write = [](const Config& c) { return parallelism_section(c); };
    add(r);
  }
  for (const auto& [name, doc] : std::vector<std::pair<const char*, const char*>>{
           {"parallelism_config_dp_replicate_size",
            "model replicas: num_processes under MULTI_CPU/MULTI_GPU (DDP); with dp_shard_size > 1 hybrid "
            "sharding (FSDP only: HYBRID_SHARD over groups of dp_shard_size ranks)"},
           {"parallelism_config_dp_shard_size",
            "ranks a model is sharded over: num_processes under FSDP or DEEPSPEED, or with "
            "dp_replicate_size > 1 each shard group's consecutive ranks (FSDP's hybrid sharding: "
            "fsdp_hybrid_shard_size)"},
           {"parallelism_config_cp_size",
            "ranks per context-parallel group (positions load-balanced in 2 x cp_size chunks; "
            "accel::llm::enable_context_parallel on sequence_parallel_group())"},
           {"parallelism_config_sp_size",
            "ranks per sequence-parallel group (DeepSpeed Ulysses: heads exchanged for positions by "
            "all-to-all; accel::llm::enable_sequence_parallel on sequence_parallel_group())"}}) {
    KeyRow r = ignored(name, kParallelism, doc);
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { positive_int()(rd, e); };  // see resolve
    add(r);
  }
  // Read (and checked: allgather or alltoall) with the sizes in resolve_parallelism.
  add(ignored(
      "parallelism_config_cp_comm_strategy", kParallelism,
      "how context parallelism moves keys and values: allgather (all-gathered per layer, Accelerate's "
      "default) or alltoall (ring attention: blocks passed point to point, merged by log-sum-exp)"));
  add(setting(
      "parallelism_config_tp_size", kParallelism,
      "ranks per tensor-parallel group (rank = replica x tp_size + tp rank), for programs whose layers "
      "are accel::tp layers built on tensor_parallel_group(); as "
      "AcceleratorOptions().tensor_parallel_size(n)",
      [](auto& c) -> auto& { return c.tensor_parallel_size; }, positive_int(), write_int, "2"));
  for (const char* name :
       {"parallelism_config_cp_backend", "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
        "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation"}) {
    add(ignored(name, kParallelism,
                "settings of cp_size/sp_size: sp_backend must be deepspeed (checked); the others are read "
                "without effect (accelerate-cpp pads each batch to a multiple of the group and attends "
                "with scaled_dot_product_attention)"));
  }
  {
    KeyRow r = section_row(kDynamo, "dynamo_*", "only dynamo_backend: 'NO' (LibTorch has no torch.compile)");
    r.opens.reset();  // nothing of it is written
    add(r);
  }
  {
    KeyRow r = ignored("dynamo_backend", kTop, "older Accelerate files: only 'NO'");
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { check_dynamo_backend(rd, e); };
    add(r);
  }
  {
    // Accelerate before mixed_precision existed (config_args.py process_config still converts it): true
    // means mixed_precision: fp16 when the file has no mixed_precision.
    KeyRow r =
        ignored("fp16", kTop, "older Accelerate files: true means mixed_precision: fp16 (when absent)");
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { rd.boolean(e); };  // see resolve
    add(r);
  }
  for (const char* name : {"main_training_function", "downcast_bf16", "enable_cpu_affinity", "rdzv_backend",
                           "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "tpu_name",
                           "tpu_zone", "tpu_vm", "commands", "command_file"}) {
    add(ignored(name, kTop, "Accelerate key without meaning here: accepted, ignored"));
  }

  // --- dynamo_config ---
  {
    KeyRow r = ignored("dynamo_backend", kDynamo, "only 'NO'");
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { check_dynamo_backend(rd, e); };
    add(r);
  }
  for (const char* name :
       {"dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation"})
    add(ignored(name, kDynamo, "accepted, ignored"));

  // --- the backends' own keys and sections ---
  for (const BackendPart& part : backend_parts()) {
    for (const KeyRow& row : part.rows)
      add(row);
  }
  return rows;
}

// "unknown key" with the most useful hint: a section the key belongs in, a close spelling, or the full
// list.
[[noreturn]] void unknown_key(const Reader& reader, const Entry& e, const Section& section) {
  auto contains = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  const std::string where = section == kTop ? std::string() : e.path.substr(0, e.path.rfind('.'));
  const auto& valid = key_names(section);
  std::string hint;
  std::optional<std::string> home;  // the backend section the key belongs in
  for (const BackendPart& part : backend_parts()) {
    if (!home && !part.info.section.empty() && contains(key_names(part.info.section), e.name)) {
      home = part.info.section;
    }
  }
  if (section == kTop && home) {
    hint = fmt::format(" (did you mean '{}.{}'? it belongs inside the {}: section)", *home, e.name, *home);
  } else if (section != kTop && contains(key_names(kTop), e.name)) {
    hint = fmt::format(" (it belongs at the top level, not inside {}:)", where);
  } else if (const std::optional<std::string> guess = closest(e.name, valid)) {
    hint = fmt::format(" (did you mean '{}'?)", join_path(where, *guess));
  } else {
    hint = fmt::format("; valid keys{}: {}", where.empty() ? std::string() : " in " + where, join(valid));
  }
  reader.fail_at(e, fmt::format("unknown key '{}'{}", e.path, hint));
}

}  // namespace

KeyRow section_row(const Section& section, const char* what, const char* doc) {
  KeyRow row;
  row.name = section;
  row.doc = doc;
  row.opens = section;
  row.read = [section, what](Reader& r, const Entry& e, Config& c, Pending& p) {
    dispatch(r, section_entries(r, e, what), section, c, p);
  };
  return row;
}

const std::vector<KeyRow>& schema() {
  static const std::vector<KeyRow> kRows = make_schema();
  return kRows;
}

std::vector<const KeyRow*> rows_of(const Section& section) {
  std::vector<const KeyRow*> out;
  for (const auto& row : schema()) {
    if (row.section == section) out.push_back(&row);
  }
  return out;
}

const std::vector<std::string>& key_names(const Section& section) {
  static const std::map<Section, std::vector<std::string>> kNames = [] {
    std::map<Section, std::vector<std::string>> out;
    for (const auto& row : schema())
      out[row.section].push_back(row.name);
    return out;
  }();
  static const std::vector<std::string> kNone;
  const auto it = kNames.find(section);
  return it == kNames.end() ? kNone : it->second;
}

bool section_in_use(const Config& c, const Section& section) {
  if (section == kPipeline) return c.pipeline != PipelineConfig{};
  for (const BackendPart& part : backend_parts()) {
    if (part.info.section == section && part.section_in_use) return part.section_in_use(c);
  }
  return false;
}

void dispatch(Reader& reader, const std::vector<Entry>& entries, const Section& section, Config& config,
              Pending& pending) {
  const auto rows = rows_of(section);
  for (const Entry& e : entries) {
    const auto row =
        std::find_if(rows.begin(), rows.end(), [&](const KeyRow* r) { return r->name == e.name; });
    if (row == rows.end()) {
      // A real key of some Accelerate version that accelerate-cpp does not support: said so, never "did you
      // mean".
      if (const UnsupportedKey* unsupported = find_unsupported(kAccelerateYaml, e.path)) {
        if (asks_nothing(*unsupported, e.value)) continue;
        if (unsupported->refused) reader.fail_at(e, unsupported_message(*unsupported));
        config.notices.push_back(location(reader.source(), e.line) + unsupported_message(*unsupported));
        continue;
      }
      unknown_key(reader, e, section);
    }
    if (e.value.IsNull()) continue;  // `key:` or `key: null` keeps the default, as Accelerate writes it
    if ((*row)->read) (*row)->read(reader, e, config, pending);
    pending.seen.insert_or_assign(e.path, e);
  }
}

}  // namespace accel::config_detail
