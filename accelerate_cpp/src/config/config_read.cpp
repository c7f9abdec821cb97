// Reading accel::Config from YAML: the file, its single document, the config version, then every key through
// the schema's rows, the values that depend on each other, and validation.
#include "config/config_detail.hpp"
#include "config/fp8_config.hpp"
#include "config/message_text.hpp"
#include "config/small_file.hpp"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace accel {
namespace config_detail {

std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return fmt::format("'{}'", node.Scalar());
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a mapping";
    default:
      return "nothing";
  }
}

namespace {

// The backend whose part lists `type` (a canonical distributed_type value).
std::string backend_of_distributed_type(const std::string& type) {
  for (const BackendPart& part : backend_parts()) {
    for (const std::string& t : part.info.distributed_types) {
      if (t == type) return part.info.name;
    }
    for (const std::string& t : part.mapped_distributed_types) {
      if (t == type) return part.info.name;
    }
  }
  return "local";
}

// parallelism_config (Accelerate 1.10+'s ParallelismConfig, parallelism_config.py): the mesh sizes must
// multiply to the number of processes (Accelerate's _validate_accelerator; times pipeline_config.stages, a
// key of ours), and describe a layout this library runs from the rest of the file: every data-parallel rank
// one replica (DDP) or one shard (FSDP, ZeRO), tp_size ranks of a tensor-parallel group side by side (the
// innermost dimension of Accelerate's mesh too). tp_size alone leaves the data-parallel ranks to the rest
// (num_processes / (tp_size x stages), checked by the Accelerator). Anything else is refused, naming what to
// set.
void resolve_parallelism(const Reader& r, Config& c, const Pending& p) {
  struct Size {
    const char* name;
    const Entry* entry = nullptr;
    std::int64_t value = 1;
  };
  Size replicate{"dp_replicate_size"}, shard{"dp_shard_size"}, tp{"tp_size"}, cp{"cp_size"}, sp{"sp_size"};
  const Entry* first = nullptr;
  for (Size* s : {&replicate, &shard, &tp, &cp, &sp}) {
    s->entry = p.find(fmt::format("parallelism_config.parallelism_config_{}", s->name));
    if (s->entry == nullptr) continue;
    s->value = r.integer(*s->entry, 1, std::numeric_limits<int>::max(), kPositiveInt);
    if (first == nullptr || s->entry->line < first->line) first = s->entry;
  }
  // Accelerate's TorchContextParallelConfig: "allgather" (its default) or "alltoall" (the ring).
  if (const Entry* strategy = p.find("parallelism_config.parallelism_config_cp_comm_strategy");
      strategy != nullptr) {
    const std::string value = r.scalar(*strategy, "allgather or alltoall");
    if (value != "allgather" && value != "alltoall") {
      const std::vector<std::string> allowed = {"allgather", "alltoall"};
      const std::optional<std::string> guess = closest(value, allowed);
      r.fail_at(*strategy,
                fmt::format("{}: invalid value '{}'{}; allowed values: allgather (K/V all-gathered, "
                            "the default), alltoall (ring attention)",
                            strategy->path, value,
                            guess ? fmt::format(" (did you mean '{}'?)", *guess) : std::string()));
    }
    c.context_parallel_comm_strategy = value;
  }
  if (first == nullptr) return;
  const auto refuse = [&r](const Size& s, const std::string& why) {
    r.fail_at(*s.entry, fmt::format("{}: {} {}", s.entry->path, s.value, why));
  };
  if (cp.value > 1 && sp.value > 1) {
    refuse(cp, fmt::format("with sp_size {}: context and sequence parallelism are mutually exclusive (as in "
                           "Accelerate); set one of them to 1",
                           sp.value));
  }
  if ((cp.value > 1 || sp.value > 1) && tp.value > 1) {
    refuse(tp, fmt::format("with {} {}: sequence or context parallelism together with tensor parallelism is "
                           "not supported by accelerate-cpp; set tp_size: 1 or {}: 1",
                           cp.value > 1 ? "cp_size" : "sp_size", std::max(cp.value, sp.value),
                           cp.value > 1 ? "cp_size" : "sp_size"));
  }
  if (sp.value > 1) {
    // Accelerate's ALST: sp_backend "deepspeed" (its only value) runs DeepSpeed's Ulysses.
    if (const Entry* backend = p.find("parallelism_config.parallelism_config_sp_backend");
        backend != nullptr) {
      const std::string value = r.scalar(*backend, "deepspeed");
      if (value != "deepspeed") {
        r.fail_at(*backend, fmt::format("{}: '{}' is not a sequence-parallel backend; Accelerate's and "
                                        "accelerate-cpp's only one is deepspeed (Ulysses)",
                                        backend->path, value));
      }
    }
  }
  c.sequence_parallel_size = static_cast<int>(sp.value);
  c.context_parallel_size = static_cast<int>(cp.value);
  // A DeepSpeed JSON's tensor_parallel.autotp_size (read before) and tp_size here must agree.
  if (const auto json = c.origins.find("tensor_parallel_size"); json != c.origins.end()) {
    if (tp.entry == nullptr) tp.value = c.tensor_parallel_size;
    if (tp.value != c.tensor_parallel_size)
      refuse(tp, fmt::format("disagrees with {}: {}; make them equal or remove one", json->second,
                             c.tensor_parallel_size));
  }
  c.tensor_parallel_size = static_cast<int>(tp.value);
  const std::int64_t data = replicate.value * shard.value;
  // Accelerate then replicates over every process: what the file says without it.
  if (data == 1) return;
  const std::int64_t stages = std::max(1, c.pipeline.stages);
  if (data * tp.value * cp.value * sp.value * stages != c.num_processes) {
    r.fail_at(
        *first,
        fmt::format("parallelism_config: dp_replicate_size {} x dp_shard_size {} x tp_size {} x cp_size {} "
                    "x sp_size {}{} = {} does not match num_processes {} (Accelerate refuses this too); "
                    "adjust the sizes",
                    replicate.value, shard.value, tp.value, cp.value, sp.value,
                    stages > 1 ? fmt::format(" x pipeline_config.stages {}", stages) : std::string(),
                    data * tp.value * cp.value * sp.value * stages, c.num_processes));
  }
  const bool sharded_backend = c.backend == "fsdp" || c.backend == "zero";
  if (replicate.value > 1 && shard.value > 1) {
    // Hybrid sharding (HSDP): what fsdp's HYBRID_SHARD / HYBRID_SHARD_ZERO2 run. Accelerate's FSDP2 builds a
    // device mesh (dp_replicate, dp_shard) over the ranks in that order (parallelism_config.py, _get_mesh),
    // so each shard group is dp_shard_size consecutive ranks: fsdp_hybrid_shard_size. With tp_size the mesh
    // is (dp_replicate, dp_shard, tp): the groups are consecutive ranks of each data-parallel group.
    if (c.backend != "fsdp") {
      refuse(
          replicate,
          fmt::format("with dp_shard_size {} asks for hybrid sharding (HSDP), which accelerate-cpp runs with "
                      "distributed_type: FSDP (fsdp_sharding_strategy: HYBRID_SHARD); use that, or set "
                      "dp_replicate_size: 1 and dp_shard_size: {} to shard over every rank",
                      shard.value, data));
    } else if (c.fsdp.sharding_strategy == ShardingStrategy::NoShard) {
      refuse(shard,
             "asks for hybrid sharding, but fsdp_sharding_strategy is NO_SHARD (nothing sharded); "
             "set fsdp_sharding_strategy: HYBRID_SHARD, or dp_shard_size: 1");
    } else if (c.fsdp.hybrid_shard_size > 0 && c.fsdp.hybrid_shard_size != shard.value) {
      refuse(shard, fmt::format("disagrees with fsdp_config.fsdp_hybrid_shard_size {}: both size the shard "
                                "groups; make them agree or remove one",
                                c.fsdp.hybrid_shard_size));
    } else {
      // As Accelerate's FSDP2 runs it: sharded as the strategy says inside each shard group.
      if (!c.fsdp.hybrid()) {
        c.fsdp.sharding_strategy = c.fsdp.reshard_after_forward() ? ShardingStrategy::HybridShard
                                                                  : ShardingStrategy::HybridShardZero2;
      }
      c.fsdp.hybrid_shard_size = static_cast<int>(shard.value);
    }
    return;
  }
  if (shard.value > 1 && !sharded_backend) {
    refuse(shard,
           "asks for sharded data parallelism: set distributed_type: FSDP or DEEPSPEED, or "
           "dp_shard_size: 1");
  }
  if (replicate.value > 1 && sharded_backend) {
    refuse(replicate,
           fmt::format("with dp_shard_size 1 keeps a whole replica on every rank, which is {}; set that and "
                       "remove parallelism_config, or shard over every rank with dp_replicate_size: 1 and "
                       "dp_shard_size: {}",
                       c.backend == "fsdp" ? "fsdp_sharding_strategy: NO_SHARD" : "zero_stage: 0", data));
  }
}

}  // namespace

namespace {

// c.origins[key]: the first of `paths` the file set ("FILE:LINE (path)"), else `fallback`.
void record_origin(const Reader& r, const Pending& p, Config& c, const std::string& key,
                   std::initializer_list<const char*> paths, const std::string& fallback) {
  for (const char* path : paths) {
    if (const Entry* e = p.find(path)) {
      c.origins[key] = fmt::format("{}{}", location(r.source(), e->line), path);
      return;
    }
  }
  c.origins[key] = fallback;
}

}  // namespace

void resolve(const Reader& r, Config& c, const Pending& p) {
  const Entry* backend = p.find("backend");
  const Entry* distributed_type = p.find("distributed_type");
  if (distributed_type) {
    const std::string type = r.choice(*distributed_type, distributed_type_choices());
    const std::string implied = backend_of_distributed_type(type);
    if (backend && r.choice(*backend, backend_choices()) != implied) {
      r.fail_at(*backend, fmt::format("backend: '{}' disagrees with distributed_type '{}' (line {}), which "
                                      "means backend {}; make them agree or remove one of them",
                                      backend->value.Scalar(), distributed_type->value.Scalar(),
                                      distributed_type->line, implied));
    }
    c.backend = implied;
    if (type == "MULTI_CPU") {
      if (const Entry* use_cpu = p.find("use_cpu"); use_cpu && !c.use_cpu) {
        r.fail_at(*use_cpu, fmt::format("use_cpu: false contradicts distributed_type 'MULTI_CPU' (line {}); "
                                        "set use_cpu: true, or distributed_type: MULTI_GPU to train on GPUs",
                                        distributed_type->line));
      }
      c.use_cpu = true;
    }
  } else if (backend) {
    c.backend = r.choice(*backend, backend_choices());
  }
  // distributed_type: NO with num_processes > 1 (a "single GPU" file with a leftover count): accelerate
  // launch starts one process for it (it starts several only for the multi-process types), and so does
  // accel-launch.
  if (distributed_type && !backend && c.backend == "local" && c.num_processes > 1) {
    if (const Entry* n = p.find("num_processes")) {
      c.notices.push_back(fmt::format(
          "{}num_processes: {} has no effect with distributed_type: NO (line {}): one process runs, as "
          "accelerate launch runs one for this file; set distributed_type: MULTI_GPU or MULTI_CPU to run {}",
          location(r.source(), n->line), c.num_processes, distributed_type->line, c.num_processes));
      c.num_processes = 1;
    }
  }
  if (const Entry* fp16 = p.find("fp16"); fp16 && !p.find("mixed_precision") && r.boolean(*fp16)) {
    c.mixed_precision = MixedPrecision::Fp16;
  }
  resolve_fp8(r, c, p);
  record_origin(r, p, c, "mixed_precision", {"mixed_precision", "fp16"}, "default: 'no', as Accelerate's");
  record_origin(r, p, c, "gradient_accumulation_steps",
                {"gradient_accumulation_steps", "deepspeed_config.gradient_accumulation_steps"},
                "default: 1, as Accelerate's");
  for (const BackendPart& part : backend_parts()) {
    if (part.resolve) part.resolve(r, c, p);
  }
  resolve_parallelism(r, c, p);
}

namespace {

// Counts a YAML stream's documents, and where the first one with content after the first document starts,
// without building them.
struct DocumentCounter : YAML::EventHandler {
  int documents = 0;
  int last_start_line = 0;      // 1-based line where the last document started
  int second_content_line = 0;  // 1-based; 0: no document after the first has content
  void OnDocumentStart(const YAML::Mark& mark) override {
    ++documents;
    last_start_line = mark.line + 1;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override { content(mark); }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t, const std::string&) override {
    content(mark);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    content(mark);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    content(mark);
  }
  void OnMapEnd() override {}
  void content(const YAML::Mark& mark) {
    if (documents > 1 && second_content_line == 0) second_content_line = mark.line + 1;
  }
};

// The first YAML document of `text`. A second document with content is an error, as is a stream the parser
// does not advance through: yaml-cpp 0.7's LoadAll loops forever on a file that is just "," (an empty
// document per turn, 320 MB/s), so the documents are counted first, with a bound, and only the first is
// built.
YAML::Node first_document(const std::string& text, const std::string& source) {
  constexpr int kMaxDocuments = 64;
  DocumentCounter counter;
  try {
    std::istringstream in(text);
    YAML::Parser parser(in);
    while (counter.documents < kMaxDocuments && parser.HandleNextDocument(counter)) {
    }
    if (counter.documents >= kMaxDocuments) {
      fail(source, counter.last_start_line, "",
           fmt::format(
               "YAML syntax error: the parser makes no progress here ({} empty documents and counting): "
               "a stray character such as ',' where a 'key: value' line belongs?",
               kMaxDocuments));
    }
    if (counter.second_content_line != 0) {
      fail(source, counter.second_content_line, "",
           "a second YAML document starts here; a config file holds exactly one (remove the '---' line and "
           "what follows, or merge the two)");
    }
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail(source, e.mark.line >= 0 ? e.mark.line + 1 : 0, "",
         fmt::format(
             "YAML syntax error: {}{}; check the indentation and quoting on this line and the one above",
             e.msg, e.mark.column >= 0 ? fmt::format(" (column {})", e.mark.column + 1) : std::string()));
  }
}

// A config file is UTF-8 text. yaml-cpp decodes a NUL byte near the start as UTF-16 and reads such a file as
// all defaults (one process, local) without a word; a UTF-16 file is refused the same way, by name.
void check_encoding(const std::string& text, const std::string& source) {
  if (const auto problem = encoding_problem(text)) fail(source, problem->first, "", problem->second);
}

Config load_yaml(const std::string& text, const std::string& source) {
  check_encoding(text, source);
  Reader reader(source);
  const YAML::Node document = first_document(text, source);

  Config config;
  config.source = source;
  if (!document || document.IsNull()) return config;  // an empty file means all defaults
  const YAML::Node& root = document;
  if (!root.IsMap()) {
    fail(source, line_of(root), "",
         fmt::format("expected a mapping of 'key: value' lines at the top level, got {}; see "
                     "config_templates/local.yaml for an example",
                     describe(root)));
  }

  // The decisive reason first, before a duplicate or unknown key: a file for another compute environment
  // (SageMaker) cannot run here, whatever else it says.
  for (const auto& pair : root) {
    const YAML::Node key = pair.first;
    const YAML::Node value = pair.second;
    if (key.IsScalar() && key.Scalar() == "compute_environment" && value.IsScalar() &&
        value.Scalar() != "LOCAL_MACHINE") {
      fail(source, line_of(key), "compute_environment", compute_environment_message(value.Scalar()));
    }
  }
  const std::vector<Entry> entries = reader.entries(root, "");
  // The schema version decides how everything else is read, so it is checked first.
  for (const Entry& e : entries) {
    if (e.name != "config_version" || e.value.IsNull()) continue;
    int64_t version = 0;
    if (!e.value.IsScalar() || !parse_int64(e.value.Scalar(), version) || version != 1) {
      reader.fail_at(
          e, fmt::format("config_version: this build of accelerate-cpp reads config_version 1 only, "
                         "got {}; upgrade accelerate-cpp or write a new file with 'accel-launch config'",
                         describe(e.value)));
    }
  }

  Pending pending;
  dispatch(reader, entries, kTop, config, pending);
  resolve(reader, config, pending);
  validate_config(config, reader.lines());
  return config;
}

}  // namespace

// load_yaml with every message bounded and printable, whatever value it quotes.
Config load_yaml_bounded(const std::string& text, const std::string& source) {
  try {
    return load_yaml(text, source);
  } catch (const ConfigError& e) {
    throw ConfigError(detail::bounded_message(e.what()), e.file(), e.line(), e.key());
  }
}

}  // namespace config_detail

Config Config::load_file(const std::string& path) {
  // Bounded: a config is a few kilobytes, and /dev/zero passed by mistake must not be read until memory
  // runs out; a named pipe nobody writes to must not block for ever.
  const auto file = config_detail::read_small_file(path, std::size_t{16} << 20);
  if (file.too_large) {
    throw ConfigError(
        fmt::format("config file '{}' is larger than 16 MiB; a config file is a few kilobytes of "
                    "YAML: check the path",
                    path),
        path);
  }
  if (!file.error.empty()) {
    const bool directory = file.error.rfind("it is a directory", 0) == 0;
    const bool fifo = file.error.rfind("it is a FIFO", 0) == 0;
    throw ConfigError(fmt::format("cannot open config file '{}': {}{}", path, file.error,
                                  fifo        ? ""
                                  : directory ? "; pass the YAML file inside it, or create one with "
                                                "'accel-launch config'"
                                              : "; create one with 'accel-launch config'"),
                      path);
  }
  return config_detail::load_yaml_bounded(file.text, path);
}

Config Config::load_string(const std::string& yaml, const std::string& source_name) {
  return config_detail::load_yaml_bounded(yaml, source_name);
}

}  // namespace accel
