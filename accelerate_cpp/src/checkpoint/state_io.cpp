#include "checkpoint/state_io.hpp"

#include <accel/errors.hpp>
#include <accel/optim/schedulers.hpp>

#include "checkpoint/atomic_dir.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/model_export.hpp"
#include "checkpoint/optimizer_reshard.hpp"
#include "checkpoint/optimizer_state.hpp"
#include "checkpoint/tensor_io.hpp"
#include "distributed/rank_failures.hpp"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

namespace accel::detail {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "accelerate-cpp";
constexpr const char* kFormatVersion = "1";

std::string indexed(const std::string& stem, std::size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : fmt::format("{}_{}{}", stem, i, ext);
}

// LRScheduler keeps its position in a protected member; read and write it through a derived-class member
// pointer (legal C++, no layout assumptions).
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& step_count(torch::optim::LRScheduler& s) { return s.*(&SchedulerAccess::step_count_); }
};

torch::Tensor scalar(std::int64_t v) {
  return torch::tensor(v, torch::kInt64);
}

std::vector<torch::Device> rng_devices() {
  std::vector<torch::Device> devices{torch::kCPU};
  if (torch::cuda::is_available()) {
    for (int i = 0; i < static_cast<int>(torch::cuda::device_count()); ++i)
      devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
  }
  return devices;
}

std::string require(const safetensors::File& f, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) {
    throw CheckpointError(
        fmt::format("{}: metadata has no '{}'; this is not an accelerate-cpp checkpoint", f.path(), key));
  }
  return it->second;
}

}  // namespace

std::vector<torch::nn::Module*> StateIO::modules() const {
  std::vector<torch::nn::Module*> out;
  for (const auto& m : p_.prepared->models)
    out.push_back(m.module.get());
  return out;
}

std::vector<OptimizerTensorLayout> StateIO::layouts(std::size_t o) const {
  const auto& optimizer = *p_.prepared->optimizers[o];
  const auto model = p_.prepared->optimizer_model[o];
  auto layouts = p_.prepared->models[model].engine->optimizer_layout(optimizer);
  if (layouts.empty()) return identity_layouts(optimizer, modules());
  for (auto& l : layouts) {
    for (auto& piece : l.pieces)
      piece.param = qualified_name(model, piece.param);
  }
  return layouts;
}

std::map<std::string, tp::SplitParameter> StateIO::qualified_splits() const {
  std::map<std::string, tp::SplitParameter> out;
  for (std::size_t i = 0; i < p_.tensor_parallel_splits.size(); ++i) {
    for (const auto& [name, split] : p_.tensor_parallel_splits[i])
      out.emplace(qualified_name(i, name), split);
  }
  return out;
}

namespace {

// The split parameter a per-parameter optimizer state key ("0.weight/exp_avg") belongs to, when the tensor
// is shaped as that parameter's slice (`whole`: as the whole parameter); null for the others (steps, groups).
const tp::SplitParameter* split_of(const std::map<std::string, tp::SplitParameter>& splits,
                                   const std::string& key, const torch::Tensor& t, bool whole) {
  const auto slash = key.rfind('/');
  if (slash == std::string::npos || key.rfind("param_groups/", 0) == 0) return nullptr;
  const auto found = splits.find(key.substr(0, slash));
  if (found == splits.end()) return nullptr;
  const auto& s = found->second;
  return t.dim() > s.dim && t.size(s.dim) == (whole ? s.full : s.length) ? &s : nullptr;
}

}  // namespace

NamedTensors StateIO::consolidated_state(std::size_t o, const std::vector<OptimizerTensorLayout>& layouts,
                                         const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                         Communicator& replicas, bool keep) const {
  auto state = consolidate_optimizer_state(
      *p_.prepared->optimizers[o], layouts, shapes,
      [&](const torch::Tensor& t) { return replicas.all_gather(t); }, keep);
  if (p_.tensor_parallel_size > 1 && keep) {
    const auto splits = qualified_splits();
    for (auto& [key, t] : state) {
      if (const auto* s = split_of(splits, key, t, /*whole=*/false)) {
        t = s->comm->all_gather(t.movedim(s->dim, 0).contiguous()).movedim(0, s->dim).contiguous();
      }
    }
  }
  return state;
}

torch::Tensor StateIO::tensor_parallel_slice(const std::map<std::string, tp::SplitParameter>& splits,
                                             const std::string& key, torch::Tensor t) {
  if (const auto* s = split_of(splits, key, t, /*whole=*/true)) t = t.narrow(s->dim, s->first, s->length);
  return t.contiguous();
}

std::string StateIO::fingerprints() const {
  std::string out;
  for (std::size_t o = 0; o < p_.prepared->optimizers.size(); ++o)
    out += (out.empty() ? "" : ",") + layout_fingerprint(layouts(o));
  return out;
}

namespace {

// An earlier checkpoint is written over only when it holds nothing but its own files: the entries its
// manifest lists (and the manifest), or directories holding listed files. Anything else (a user's notes, a
// log directory, a backup copy) is named, and save_state refuses. Without a readable manifest (a checkpoint
// from before manifests, or a damaged one) it is written over as before.
std::string added_to_checkpoint(const std::string& dir) {
  std::set<std::string> listed;
  try {
    for (const auto& f : read_manifest(dir).files)
      listed.insert(f.name);
  } catch (const std::exception&) {
    return {};
  }
  listed.insert(Manifest::kFile);
  auto holds_listed = [&](const std::string& prefix) {
    const auto it = listed.lower_bound(prefix + "/");
    return it != listed.end() && it->rfind(prefix + "/", 0) == 0;
  };
  std::vector<std::string> foreign;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const std::string rel = fs::relative(it->path(), dir, ec).generic_string();
    if (it->is_directory(ec) && !it->is_symlink(ec)) {
      if (!holds_listed(rel)) {
        foreign.push_back(rel + "/");
        it.disable_recursion_pending();
      }
    } else if (listed.count(rel) == 0) {
      foreign.push_back(rel);
    }
  }
  if (foreign.empty()) return {};
  const std::size_t shown = std::min<std::size_t>(foreign.size(), 5);
  std::vector<std::string> names(foreign.begin(), foreign.begin() + static_cast<std::ptrdiff_t>(shown));
  return fmt::format(
      "save_state: '{}' is an earlier checkpoint, but it also holds {} entr{} that save_state did not write "
      "({}{}); writing over the checkpoint would delete them. Move them out of the checkpoint, or save to "
      "another directory; nothing was written",
      dir, foreign.size(), foreign.size() == 1 ? "y" : "ies", fmt::join(names, ", "),
      foreign.size() > shown ? ", ..." : "");
}

}  // namespace

std::string StateIO::foreign_content(const std::string& dir) {
  // save_state replaces the whole directory (atomically): refuse when that would delete what it did not
  // write. A checkpoint is recognised by the file every save writes; an empty directory is fine.
  std::error_code ec;
  const auto status = fs::symlink_status(dir, ec);
  if (!fs::exists(status)) return {};
  if (!fs::is_directory(status)) {
    return fmt::format(
        "save_state: '{}' exists and is not a directory (a file or link); save_state would replace it. Save "
        "the checkpoint to another path, or remove it first; nothing was written",
        dir);
  }
  if (fs::exists(fs::path(dir) / kStateFile, ec)) return added_to_checkpoint(dir);
  std::vector<std::string> names;
  std::size_t count = 0;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (++count <= 3) names.push_back(entry.path().filename().string());
  }
  if (count == 0) return {};
  return fmt::format(
      "save_state: '{}' is not an accelerate-cpp checkpoint but holds {} entr{} ({}{}); save_state replaces "
      "the whole directory and will not delete files it did not write. Save to a new or empty directory (for "
      "example a sub-directory such as '{}/checkpoint'), or remove those files first; nothing was written",
      dir, count, count == 1 ? "y" : "ies", fmt::join(names, ", "), count > 3 ? ", ..." : "",
      fs::path(dir).lexically_normal().string());
}

void StateIO::save(const std::string& dir, const TrainingCounters& counters,
                   const std::vector<std::function<void(const std::string&)>>& hooks) {
  // The main process owns the temporary directory and commits it; every rank writes its own files into it
  // (the same path on every rank: one machine, or a shared filesystem), then all meet before the commit.
  std::unique_ptr<AtomicDirectory> out;
  std::string tmp;
  std::string failure;
  written_.clear();
  if (p_.rank == 0) {
    checkpoint_id_ = new_checkpoint_id();
    try {
      failure = foreign_content(dir);
      if (failure.empty()) {
        out = std::make_unique<AtomicDirectory>(dir);
        tmp = out->path().string();
      }
    } catch (const std::exception& e) {
      failure = fmt::format("save_state: rank 0 could not create '{}': {}", dir, e.what());
    }
  }
  tmp = p_.comm->exchange(failure.empty() ? tmp : "\n" + failure)[0];
  if (!tmp.empty() && tmp[0] == '\n') throw CheckpointError(tmp.substr(1));
  try {
    for (const auto& hook : hooks)
      hook(tmp);
    write_files(tmp, counters);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Every rank reports; one failure anywhere keeps the previous checkpoint (the temporary one is dropped).
  throw_first_failure(*p_.comm, failure, [&](std::size_t r, const std::string& what) {
    return fmt::format("save_state into '{}' failed on rank {}: {}; the previous checkpoint is intact", dir,
                       r, what);
  });
  // The manifest, written last: every rank's files with the digests computed while writing them. Then the
  // commit; every rank learns whether both succeeded.
  std::string mine;
  for (const auto& [path, digest] : written_) {
    mine += fmt::format("{}\t{}\t{}\n", fs::path(path).lexically_relative(tmp).generic_string(), digest.bytes,
                        digest.xxh64);
  }
  const auto reports = p_.comm->exchange(mine);
  failure.clear();
  if (out) {
    try {
      std::map<std::string, FileDigest> known;
      for (const auto& report : reports) {
        std::istringstream lines(report);
        std::string name;
        FileDigest d;
        while (std::getline(lines, name, '\t') && lines >> d.bytes >> d.xxh64 && lines.ignore())
          known[name] = d;
      }
      write_manifest(tmp, build_manifest(tmp, checkpoint_id_,
                                         {{"world_size", std::to_string(p_.world_size)},
                                          {"backend", p_.backend},
                                          {"completed_steps", std::to_string(counters.completed_steps)}},
                                         known));
      out->commit();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  throw_first_failure(*p_.comm, failure, [&](std::size_t, const std::string& what) {
    return fmt::format(
        "save_state into '{}' failed on rank 0 while committing: {}; the previous checkpoint is "
        "intact",
        dir, what);
  });
}

namespace {

// The global layer a pipeline stage's tensor or optimizer key belongs to: "3.weight", "3.weight/exp_avg"
// -> 3; nullopt for a name that does not start with a layer index.
std::optional<int> layer_index(const std::string& name) {
  const auto dot = name.find('.');
  try {
    if (dot != std::string::npos && dot > 0) return std::stoi(name.substr(0, dot));
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// The same for saving, where a name without a layer index is an error.
int layer_of(const std::string& name) {
  if (const auto layer = layer_index(name)) return *layer;
  throw CheckpointError(fmt::format(
      "save_state with a pipeline: '{}' is not named by its global layer (\"3.weight\"); only the stage "
      "model of prepare_pipeline is saved per layer",
      name));
}

std::string layer_file(int layer) {
  return fmt::format("layers/layer_{}.safetensors", layer);
}

std::string optimizer_layer_file(std::size_t optimizer, int layer) {
  return fmt::format("layers/optimizer_{}_layer_{}.safetensors", optimizer, layer);
}

}  // namespace

void StateIO::write_layer_files(const std::string& tmp_dir) {
  const fs::path tmp = tmp_dir;
  if (p_.prepared->models.size() != 1) {
    throw UnsupportedOperation(
        fmt::format("save_state with a pipeline saves the stage model only, but {} models are prepared; "
                    "prepare the other models with another Accelerator",
                    p_.prepared->models.size()));
  }
  Communicator& replicas = *p_.pipeline->replicas;
  const bool tensor_parallel = p_.tensor_parallel_size > 1;
  // The first replica's ranks keep the consolidated state (with tensor parallelism they gather the split
  // parameters over their group); its first tensor-parallel rank writes.
  const bool keep = replicas.rank() == 0, writer = keep && p_.tensor_parallel_rank == 0;
  // Collective over the stage's replicas (zero stage 1 gathers its optimizer shards).
  auto state = p_.prepared->models[0].engine->model_state();
  if (tensor_parallel) gather_tensor_parallel(state, p_.tensor_parallel_splits.at(0));
  std::vector<NamedTensors> optimizer_states;
  const auto shapes = parameter_shapes(modules());
  for (std::size_t o = 0; o < p_.prepared->optimizers.size(); ++o) {
    const auto l = layouts(o);
    if (optimizer_kind(*p_.prepared->optimizers[o]).empty() || l.empty()) {
      throw UnsupportedOperation(
          "save_state with a pipeline writes the optimizer state per layer, which is done for LibTorch's "
          "Adam, AdamW, SGD, RMSprop and Adagrad over the stage's parameters only; use one of them");
    }
    optimizer_states.push_back(consolidated_state(o, l, shapes, replicas, keep));
  }
  if (!writer) return;
  fs::create_directories(tmp / "layers");
  std::map<int, NamedTensors> layers;
  for (const auto& [name, t] : state)
    layers[layer_of(name)].emplace_back(name, t);
  for (const auto& [layer, tensors] : layers) {
    const auto path = (tmp / layer_file(layer)).string();
    written_[path] = write_tensors(path, tensors, {{"format", "pt"}, {"layer", std::to_string(layer)}});
  }
  for (std::size_t o = 0; o < optimizer_states.size(); ++o) {
    NamedTensors groups;  // "param_groups/<g>/lr": in every layer's file
    std::map<int, NamedTensors> per_layer;
    for (const auto& [key, t] : optimizer_states[o]) {
      if (key.rfind("param_groups/", 0) == 0) {
        groups.emplace_back(key, t);
      } else {
        per_layer[layer_of(key)].emplace_back(key, t);
      }
    }
    for (auto& [layer, tensors] : per_layer) {
      tensors.insert(tensors.end(), groups.begin(), groups.end());
      const auto path = (tmp / optimizer_layer_file(o, layer)).string();
      written_[path] = write_tensors(
          path, tensors, {{"format", "pt"}, {"optimizer", optimizer_kind(*p_.prepared->optimizers[o])}});
    }
  }
}

// The files a pipeline stage loads from, each opened once: those of a pipeline's checkpoint (`per_layer`), or
// the whole model's files of a checkpoint saved without a pipeline.
struct StateIO::LayerFiles {
  fs::path root;
  const char* call;  // the operation, for messages
  bool per_layer;
  std::map<std::string, safetensors::File> files;

  // The file at `relative` (opened on first use); null when it does not exist.
  const safetensors::File* open(const std::string& relative) {
    auto it = files.find(relative);
    if (it == files.end()) {
      const auto path = root / relative;
      if (!fs::exists(path)) return nullptr;
      it = files.emplace(relative, safetensors::File::open(path.string())).first;
    }
    return &it->second;
  }
  int layer(const std::string& name) const {
    if (const auto index = layer_index(name)) return *index;
    throw CheckpointError(fmt::format(
        "{}: the checkpoint holds one file per global layer of a Sequential, but the model's '{}' is not "
        "named by its layer (\"3.weight\"); load it into the same Sequential",
        call, name));
  }
  // Where a tensor of the model and a key of optimizer o are: the file of its global layer (a pipeline's
  // checkpoint), or the whole model's files (a checkpoint saved without a pipeline, read by a stage).
  std::string model_file(const std::string& name) const {
    return per_layer ? layer_file(layer(name)) : std::string("model.safetensors");
  }
  std::string optimizer_file(std::size_t o, const std::string& key) const {
    return per_layer ? optimizer_layer_file(o, layer(key)) : indexed("optimizer", o, "_full.safetensors");
  }
};

void StateIO::load_layer_files(const std::string& dir, bool per_layer) {
  const char* const call = p_.pipeline ? "load_state with a pipeline" : "load_state of a pipeline checkpoint";
  if (p_.prepared->models.size() != 1) {
    throw UnsupportedOperation(fmt::format("{} loads one model (the stage model), but {} models are prepared",
                                           call, p_.prepared->models.size()));
  }
  LayerFiles files{fs::path(dir), call, per_layer, {}};
  auto& module = *p_.prepared->models[0].module;
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters())
    names.push_back(item.key());
  for (const auto& item : module.named_buffers())
    names.push_back(item.key());
  // The optimizers first, the weights last (as load_models): a failure in either leaves the weights as they
  // were, and LoadRollback puts the optimizers back.
  for (std::size_t o = 0; o < p_.prepared->optimizers.size(); ++o)
    load_layer_optimizer(files, names, o, dir);
  load_layer_weights(files, names, dir);
}

void StateIO::load_layer_weights(LayerFiles& files, const std::vector<std::string>& names,
                                 const std::string& dir) {
  // Weights: each of this model's tensors from the file of its layer, whichever stage wrote it.
  std::map<std::string, torch::Tensor> state;
  for (const auto& name : names) {
    const auto relative = files.model_file(name);
    const auto* file = files.open(relative);
    if (file == nullptr || !file->contains(name)) {
      throw CheckpointError(
          fmt::format("{}: {} '{}' of this model; the checkpoint was saved from another model",
                      (files.root / relative).string(),
                      file == nullptr ? "missing, so there are no weights for" : "has no", name));
    }
    state[name] = read_tensor(*file, name);
  }
  if (p_.tensor_parallel_size > 1) {
    slice_tensor_parallel(state, p_.tensor_parallel_splits.at(0), fmt::format("load_state from '{}'", dir));
  }
  try {
    p_.prepared->models[0].engine->load_model_state(state);
  } catch (const CheckpointError& e) {  // a tensor the model lacks or shapes apart: name the checkpoint
    throw CheckpointError(fmt::format("load_state: '{}' (its layer files): {}", dir, e.what()));
  }
}

void StateIO::load_layer_optimizer(LayerFiles& files, const std::vector<std::string>& names, std::size_t o,
                                   const std::string& dir) {
  // Optimizer state: per parameter from its layer's file; the groups' learning rates from any of them.
  auto& optimizer = *p_.prepared->optimizers[o];
  const auto l = layouts(o);
  const auto kind = optimizer_kind(optimizer);
  if (kind.empty() || l.empty()) {
    throw CheckpointError(fmt::format(
        "{} reads per-parameter optimizer state, for LibTorch's Adam, AdamW, SGD, RMSprop and Adagrad over "
        "the model's parameters only",
        files.call));
  }
  const safetensors::File* any = nullptr;
  for (const auto& name : names) {
    if (const auto* f = files.open(files.optimizer_file(o, name))) {
      if (require(*f, "optimizer") != kind) {
        throw CheckpointError(
            fmt::format("{}: the checkpoint holds {} state but the prepared optimizer is {}", f->path(),
                        require(*f, "optimizer"), kind));
      }
      if (!any) any = f;
    }
  }
  if (any == nullptr && !files.per_layer) {
    throw CheckpointError(
        fmt::format("{}: missing '{}', the per-parameter optimizer state a pipeline stage reads (written "
                    "for LibTorch's Adam, AdamW, SGD, RMSprop and Adagrad)",
                    dir, indexed("optimizer", o, "_full.safetensors")));
  }
  const auto splits = qualified_splits();
  restore_optimizer_state(optimizer, l, [&](const std::string& key) {
    const safetensors::File* f =
        key.rfind("param_groups/", 0) == 0 ? any : files.open(files.optimizer_file(o, key));
    return f != nullptr && f->contains(key) ? tensor_parallel_slice(splits, key, read_tensor(*f, key))
                                            : torch::Tensor();
  });
}

namespace {

// Model files written under Accelerator::set_checkpoint_trainable_only say so in their metadata.
constexpr const char* kModelPartKey = "accelerate_cpp.model_part";
constexpr const char* kTrainableOnly = "trainable";

// Keeps, of a model's state, the parameters that require grad (LoRA adapters, modules to save).
void keep_trainable(NamedTensors& state, const torch::nn::Module& module) {
  std::set<std::string> trainable;
  for (const auto& p : module.named_parameters())
    if (p.value().requires_grad()) trainable.insert(p.key());
  NamedTensors kept;
  for (auto& [name, tensor] : state)
    if (trainable.count(name) > 0) kept.emplace_back(name, std::move(tensor));
  if (kept.size() != trainable.size()) {
    throw CheckpointError(fmt::format(
        "save_state with set_checkpoint_trainable_only: the model has {} trainable parameters but its state "
        "names {} of them; the backend names parameters otherwise than the model (save without "
        "trainable_only)",
        trainable.size(), kept.size()));
  }
  state = std::move(kept);
}

}  // namespace

void StateIO::write_files(const std::string& tmp_dir, const TrainingCounters& counters) {
  const fs::path tmp = tmp_dir;
  if (p_.pipeline) {
    if (p_.trainable_only)
      throw UsageError(
          "save_state: set_checkpoint_trainable_only is not available with a pipeline (each stage writes its "
          "layers whole); turn it off");
    write_layer_files(tmp_dir);
    if (p_.rank == 0) write_main_files(tmp_dir, {}, counters);
    write_random_states(tmp_dir);
    return;
  }
  // Collective on every rank (sharded parameters and optimizer state are gathered); rank 0 writes them.
  // With tensor parallelism every group gathers its split parameters and their state: the files are the
  // unsplit model's.
  const bool tensor_parallel = p_.tensor_parallel_size > 1;
  std::vector<NamedTensors> model_states;
  for (std::size_t i = 0; i < p_.prepared->models.size(); ++i) {
    model_states.push_back(p_.prepared->models[i].engine->model_state());
    if (tensor_parallel) gather_tensor_parallel(model_states.back(), p_.tensor_parallel_splits.at(i));
    if (p_.trainable_only) keep_trainable(model_states.back(), *p_.prepared->models[i].module);
  }
  const auto shapes = parameter_shapes(modules());
  // The first replica's ranks keep the consolidated state (with tensor parallelism each holds other slices).
  const bool keep = tensor_parallel ? replicas().rank() == 0 : p_.rank == 0;
  std::vector<std::optional<NamedTensors>> optimizer_states;
  for (std::size_t o = 0; o < p_.prepared->optimizers.size(); ++o) {
    const auto l = layouts(o);
    if (optimizer_kind(*p_.prepared->optimizers[o]).empty() || l.empty()) {
      if (tensor_parallel) {
        throw UnsupportedOperation(
            "save_state with tensor parallelism writes the optimizer state of the unsplit model, which is "
            "done for LibTorch's Adam, AdamW, SGD, RMSprop and Adagrad over the prepared models' "
            "parameters; use one of them");
      }
      optimizer_states.emplace_back();
      continue;
    }
    optimizer_states.push_back(consolidated_state(o, l, shapes, replicas(), keep));
  }
  if (p_.rank == 0) {
    write_main_files(tmp_dir, model_states, counters);
    for (std::size_t i = 0; i < optimizer_states.size(); ++i) {
      if (!optimizer_states[i]) continue;
      const auto path = (tmp / indexed("optimizer", i, "_full.safetensors")).string();
      written_[path] =
          write_tensors(path, *optimizer_states[i],
                        {{"format", "pt"}, {"optimizer", optimizer_kind(*p_.prepared->optimizers[i])}});
    }
  }
  if (p_.shards_optimizer_state && !tensor_parallel) {
    for (std::size_t i = 0; i < p_.prepared->optimizers.size(); ++i) {
      const auto path = (tmp / indexed("optimizer", i, fmt::format("_rank{}.pt", p_.rank))).string();
      written_[path] = write_optimizer(*p_.prepared->optimizers[i], path);
    }
  }
  write_random_states(tmp_dir);
}

void StateIO::write_random_states(const std::string& tmp_dir) {
  const fs::path tmp = tmp_dir;
  NamedTensors rng;
  for (const auto& d : rng_devices()) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng.emplace_back(d.str(), gen.get_state());
  }
  const auto path = (tmp / fmt::format("random_states_{}.safetensors", p_.rank)).string();
  written_[path] = write_tensors(path, rng);
  if (p_.rank == 0) {
    for (std::size_t i = 0; i < p_.objects->size(); ++i) {
      torch::serialize::OutputArchive archive;
      (*p_.objects)[i].save(archive);
      const auto object_path = (tmp / fmt::format("custom_checkpoint_{}.pt", i)).string();
      written_[object_path] = write_archive(archive, object_path);
    }
  }
}

void StateIO::write_main_files(const std::string& tmp_dir, const std::vector<NamedTensors>& model_states,
                               const TrainingCounters& counters) {
  const fs::path tmp = tmp_dir;
  for (std::size_t i = 0; i < model_states.size(); ++i) {
    const auto path = (tmp / indexed("model", i, ".safetensors")).string();
    std::map<std::string, std::string> metadata{{"format", "pt"}};
    if (p_.trainable_only) metadata[kModelPartKey] = kTrainableOnly;
    written_[path] = write_tensors(path, model_states[i], metadata);
    for (const auto& [stem, tensors] : p_.prepared->models[i].engine->extra_model_files(model_states[i])) {
      const auto extra = (tmp / indexed(stem, i, ".safetensors")).string();
      written_[extra] = write_tensors(extra, tensors, {{"format", "pt"}});
    }
  }
  for (std::size_t i = 0; i < p_.prepared->optimizers.size() && !p_.shards_optimizer_state && !p_.pipeline &&
                          p_.tensor_parallel_size == 1;
       ++i) {
    const auto path = (tmp / indexed("optimizer", i, ".pt")).string();
    written_[path] = write_optimizer(*p_.prepared->optimizers[i], path);
  }

  NamedTensors state{{"micro_steps", scalar(counters.micro_steps)},
                     {"cycle_position", scalar(counters.cycle_position)},
                     {"completed_steps", scalar(counters.completed_steps)}};
  for (std::size_t i = 0; i < p_.prepared->schedulers.size(); ++i) {
    state.emplace_back(fmt::format("scheduler.{}.step_count", i),
                       scalar(SchedulerAccess::step_count(*p_.prepared->schedulers[i])));
    if (const auto* schedule = dynamic_cast<const sched::Preparable*>(p_.prepared->schedulers[i])) {
      const auto extra = schedule->schedule_state();
      if (!extra.empty()) {
        state.emplace_back(fmt::format("scheduler.{}.state", i),
                           torch::tensor(extra, torch::TensorOptions().dtype(torch::kFloat64)));
      }
    }
  }
  for (std::size_t i = 0; i < p_.prepared->loaders.size(); ++i) {
    const auto& l = *p_.prepared->loaders[i];
    state.emplace_back(fmt::format("loader.{}.epoch", i), scalar(static_cast<std::int64_t>(l.epoch)));
    state.emplace_back(fmt::format("loader.{}.next_batch", i),
                       scalar(static_cast<std::int64_t>(l.in_epoch ? l.next_batch : 0)));
    state.emplace_back(fmt::format("loader.{}.samples_per_step", i),
                       scalar(static_cast<std::int64_t>(l.samples_per_step)));
  }
  if (p_.scaler) {
    for (auto& [k, v] : p_.scaler->state_dict())
      state.emplace_back("scaler." + k, v);
  }
  std::map<std::string, std::string> meta{{"optimizer_layouts", fingerprints()},
                                          {"format", kFormat},
                                          {"format_version", kFormatVersion},
                                          {"backend", p_.backend},
                                          {"world_size", std::to_string(p_.world_size)},
                                          {"mixed_precision", to_string(p_.mixed_precision)},
                                          {"models", std::to_string(p_.prepared->models.size())},
                                          {"optimizers", std::to_string(p_.prepared->optimizers.size())},
                                          {"schedulers", std::to_string(p_.prepared->schedulers.size())},
                                          {"loaders", std::to_string(p_.prepared->loaders.size())},
                                          {"custom_objects", std::to_string(p_.objects->size())},
                                          {"checkpoint_id", checkpoint_id_}};
  if (p_.pipeline) meta["pipeline_stages"] = std::to_string(p_.pipeline->stages);
  if (p_.tensor_parallel_size > 1) meta["tensor_parallel_size"] = std::to_string(p_.tensor_parallel_size);
  const auto state_path = (tmp / kStateFile).string();
  written_[state_path] = write_tensors(state_path, state, meta);
}

void StateIO::load_converted(std::size_t o, const std::string& path) {
  auto& optimizer = *p_.prepared->optimizers[o];
  const auto kind = optimizer_kind(optimizer);
  const auto file = safetensors::File::open(path);
  const auto saved_kind = require(file, "optimizer");
  if (kind != saved_kind) {
    throw CheckpointError(fmt::format("{}: the checkpoint holds {} state but the prepared optimizer is {}",
                                      path, saved_kind,
                                      kind.empty() ? "of a type that cannot be converted" : kind));
  }
  const auto l = layouts(o);
  if (l.empty()) {
    throw CheckpointError(
        fmt::format("{}: the prepared optimizer holds tensors that are not parameters of the "
                    "prepared models, so per-parameter state cannot be mapped onto it",
                    path));
  }
  const auto splits = qualified_splits();
  restore_optimizer_state(optimizer, l, [&](const std::string& key) {
    return file.contains(key) ? tensor_parallel_slice(splits, key, read_tensor(file, key)) : torch::Tensor();
  });
}

namespace {

void check_format(const safetensors::File& state_file) {
  if (require(state_file, "format") != kFormat) {
    throw CheckpointError(fmt::format("{}: not an accelerate-cpp checkpoint", state_file.path()));
  }
  if (const auto v = require(state_file, "format_version"); v != kFormatVersion) {
    throw CheckpointError(
        fmt::format("{}: checkpoint format version {} is not readable by this build (reads {})",
                    state_file.path(), v, kFormatVersion));
  }
}

std::int64_t read_int(const safetensors::File& state_file, const std::string& name) {
  const auto t = read_tensor(state_file, name);
  if (t.numel() != 1 || t.scalar_type() != torch::kInt64) {
    throw CheckpointError(
        fmt::format("{}: '{}' is a {} tensor of {} elements, not one int64: the file is damaged",
                    state_file.path(), name, c10::toString(t.scalar_type()), t.numel()));
  }
  return t.item<std::int64_t>();
}

TrainingCounters read_counters(const safetensors::File& state_file) {
  TrainingCounters counters;
  counters.micro_steps = read_int(state_file, "micro_steps");
  counters.cycle_position = read_int(state_file, "cycle_position");
  counters.completed_steps = read_int(state_file, "completed_steps");
  return counters;
}

}  // namespace

namespace {

// What load_state changes besides the models' weights, copied before it starts and put back when it fails
// (load is all or nothing). The weights are loaded last, each model checked whole before its first tensor is
// copied.
class LoadRollback {
 public:
  LoadRollback(const PreparedObjects& prepared, GradScaler* scaler,
               const std::vector<CheckpointedObject>* objects)
      : prepared_(prepared), scaler_(scaler), objects_(objects) {
    for (auto* o : prepared.optimizers)
      optimizers_.push_back(archived([o](torch::serialize::OutputArchive& a) { o->save(a); }));
    // The objects registered with register_for_checkpointing, through their own save and load.
    if (objects_) {
      for (const auto& object : *objects_)
        objects_state_.push_back(archived(object.save));
    }
    for (auto* s : prepared.schedulers) {
      const auto* schedule = dynamic_cast<const sched::Preparable*>(s);
      schedulers_.emplace_back(SchedulerAccess::step_count(*s),
                               schedule ? schedule->schedule_state() : std::vector<double>{});
    }
    for (const auto& l : prepared.loaders)
      loaders_.push_back(*l);
    if (scaler_) {
      for (const auto& [k, v] : scaler_->state_dict())
        scaler_state_.emplace(k, v.clone());
    }
    for (const auto& d : rng_devices()) {
      auto gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng_.emplace_back(d, gen.get_state());
    }
  }

  /// Puts everything back (best effort: a failure here is reported with the original one).
  std::string restore() noexcept {
    try {
      for (std::size_t i = 0; i < optimizers_.size(); ++i)
        unarchived(optimizers_[i],
                   [&](torch::serialize::InputArchive& a) { prepared_.optimizers[i]->load(a); });
      for (std::size_t i = 0; i < objects_state_.size(); ++i)
        unarchived(objects_state_[i], (*objects_)[i].load);
      for (std::size_t i = 0; i < schedulers_.size(); ++i) {
        SchedulerAccess::step_count(*prepared_.schedulers[i]) = schedulers_[i].first;
        if (auto* schedule = dynamic_cast<sched::Preparable*>(prepared_.schedulers[i]);
            schedule && !schedulers_[i].second.empty())
          schedule->load_schedule_state(schedulers_[i].second);
      }
      for (std::size_t i = 0; i < loaders_.size(); ++i)
        *prepared_.loaders[i] = loaders_[i];
      if (scaler_) scaler_->load_state_dict(scaler_state_);
      for (auto& [d, state] : rng_) {
        auto gen = at::globalContext().defaultGenerator(d);
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(state);
      }
      return {};
    } catch (const std::exception& e) {
      return e.what();
    }
  }

 private:
  static std::string archived(const std::function<void(torch::serialize::OutputArchive&)>& save) {
    torch::serialize::OutputArchive archive;
    save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    return bytes.str();
  }
  static void unarchived(const std::string& saved,
                         const std::function<void(torch::serialize::InputArchive&)>& load) {
    std::istringstream bytes(saved);
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    load(archive);
  }

  const PreparedObjects& prepared_;
  GradScaler* scaler_;
  const std::vector<CheckpointedObject>* objects_;
  std::vector<std::string> optimizers_, objects_state_;
  std::vector<std::pair<unsigned, std::vector<double>>> schedulers_;
  std::vector<LoaderState> loaders_;
  std::map<std::string, torch::Tensor> scaler_state_;
  std::vector<std::pair<torch::Device, torch::Tensor>> rng_;
};

}  // namespace

std::optional<std::string> StateIO::verify(const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::exists(root / Manifest::kFile, ec)) return std::nullopt;
  std::string problem, id;
  try {
    const auto manifest = read_manifest(dir);
    id = manifest.checkpoint_id;
    const bool lists_state = std::any_of(manifest.files.begin(), manifest.files.end(),
                                         [](const ManifestEntry& e) { return e.name == kStateFile; });
    if (!lists_state) {
      problem = fmt::format("{} does not list {}: it is not the manifest save_state wrote",
                            (root / Manifest::kFile).string(), kStateFile);
    }
    // Each rank verifies a share of the files, so the checkpoint is read about once more in all.
    for (std::size_t i = static_cast<std::size_t>(p_.rank); problem.empty() && i < manifest.files.size();
         i += static_cast<std::size_t>(p_.world_size))
      problem = verify_entry(dir, manifest, manifest.files[i]);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  throw_first_failure(*p_.comm, problem, [&](std::size_t r, const std::string& what) {
    return fmt::format("load_state('{}'): {} (found by rank {}); nothing was loaded", dir, what, r);
  });
  return id;
}

void StateIO::check_identity(const safetensors::File& state_file, const std::optional<std::string>& verified,
                             const std::string& dir) const {
  const auto id = state_file.metadata().find("checkpoint_id");
  const auto manifest = (fs::path(dir) / Manifest::kFile).string();
  if (verified) {
    if (id == state_file.metadata().end() || id->second != *verified) {
      throw CheckpointError(fmt::format(
          "load_state('{}'): {} belongs to checkpoint {} but {} to checkpoint {}: files of two checkpoints "
          "are "
          "mixed; resume from a directory save_state wrote; nothing was loaded",
          dir, state_file.path(), id == state_file.metadata().end() ? "(none)" : id->second.substr(0, 12),
          manifest, verified->substr(0, 12)));
    }
  } else if (id != state_file.metadata().end()) {
    throw CheckpointError(fmt::format(
        "load_state('{}'): {} is missing, so the checkpoint's files cannot be verified (every save_state "
        "writes it last): the directory is damaged or was copied partly; resume from another checkpoint; "
        "nothing was loaded",
        dir, manifest));
  } else if (p_.notice) {
    p_.notice(
        fmt::format("load_state: '{}' was saved by an accelerate-cpp without checkpoint manifests; its "
                    "files are loaded unverified (save_state again to get a verified checkpoint)",
                    dir));
  }
}

void StateIO::check_ranges(const safetensors::File& state_file, const TrainingCounters& counters,
                           const std::string& dir) const {
  auto check = [&](const std::string& key, std::int64_t low, std::int64_t high) {
    if (!state_file.contains(key)) return;
    const auto v = read_int(state_file, key);
    if (v < low || v > high) {
      throw CheckpointError(fmt::format(
          "load_state('{}'): {} holds {} = {}, outside [{}, {}]: the file is damaged or was edited; nothing "
          "was loaded",
          dir, state_file.path(), key, v, low, high));
    }
  };
  constexpr std::int64_t kMax = std::int64_t{1} << 48;
  check("micro_steps", 0, kMax);
  check("cycle_position", 0, kMax);
  check("completed_steps", 0, kMax);
  for (std::size_t i = 0; i < p_.prepared->schedulers.size(); ++i)
    check(fmt::format("scheduler.{}.step_count", i), 0, std::numeric_limits<std::uint32_t>::max());
  for (std::size_t i = 0; i < p_.prepared->loaders.size(); ++i) {
    check(fmt::format("loader.{}.epoch", i), 0, std::numeric_limits<std::uint32_t>::max());
    check(fmt::format("loader.{}.next_batch", i), 0, kMax);
    check(fmt::format("loader.{}.samples_per_step", i), 0, kMax);
  }
  const auto cycle = counters.cycle_position, micro = counters.micro_steps;
  if (cycle > micro) {
    throw CheckpointError(fmt::format(
        "load_state('{}'): {} holds cycle_position {} > micro_steps {}: the file is damaged or was edited; "
        "nothing was loaded",
        dir, state_file.path(), cycle, micro));
  }
}

TrainingCounters StateIO::load(const std::string& given,
                               const std::vector<std::function<void(const std::string&)>>& hooks) {
  // The rule save uses (AtomicDirectory): "odd/a/../b" is "odd/b" for both, whether or not "odd/a" exists.
  const std::string dir = normalize_checkpoint_dir(given).string();
  if (p_.rank == 0) recover_interrupted(dir);
  p_.comm->barrier();
  const fs::path root(dir);
  if (!fs::is_directory(root)) {
    throw CheckpointError(
        fmt::format("load_state: '{}' is not a directory; pass the directory save_state wrote", dir));
  }
  // Nothing is touched before every file is verified and every count and position checked.
  const auto verified = verify(dir);
  const auto state_file = safetensors::File::open((root / kStateFile).string());
  check_format(state_file);
  check_identity(state_file, verified, dir);
  const auto saved_world = require(state_file, "world_size");
  const auto saved_backend = require(state_file, "backend");
  const bool saved_pipeline = state_file.metadata().find("pipeline_stages") != state_file.metadata().end();
  const bool convert = needs_conversion(state_file, saved_pipeline, saved_world, saved_backend);
  check_counts(state_file, dir);
  const auto counters = read_counters(state_file);
  check_ranges(state_file, counters, dir);
  for (const auto& hook : hooks)
    hook(dir);

  // Then the objects, the weights last: a failure puts every other object back as it was.
  LoadRollback rollback(*p_.prepared, p_.scaler, p_.objects);
  try {
    const bool by_layer = saved_pipeline || p_.pipeline;
    if (!by_layer) load_optimizers(dir, convert, saved_world, saved_backend);
    load_schedulers(state_file);
    load_loaders(state_file, dir);
    load_scaler(state_file, dir);
    load_random_states(dir, convert);
    load_custom_objects(dir);
    if (by_layer) {
      load_layer_files(dir, /*per_layer=*/saved_pipeline);
    } else {
      load_models(dir);
    }
  } catch (const std::exception& e) {
    const auto problem = rollback.restore();
    throw CheckpointError(fmt::format(
        "{}; {}", e.what(),
        problem.empty()
            ? "the optimizers, schedulers, loaders, loss scaler, random states and registered objects are as "
              "they were"
            : "putting the objects back failed too (" + problem + "): restart from a checkpoint"));
  }
  return counters;
}

bool StateIO::needs_conversion(const safetensors::File& state_file, bool saved_pipeline,
                               const std::string& saved_world, const std::string& saved_backend) const {
  // Another world size or backend: the optimizer state is rebuilt from the per-parameter files.
  const auto saved_layouts = state_file.metadata().find("optimizer_layouts");
  // A pipeline's checkpoint (one file per global layer) loads with or without a pipeline, and a pipeline
  // loads one saved without: the layers are named alike ("3.weight") either way.
  // A pipeline's checkpoint is always read per layer: another number of stages is a re-partition.
  // With tensor parallelism (saved or now) the files are the unsplit model's: always converted.
  const auto saved_tp = state_file.metadata().find("tensor_parallel_size");
  return saved_pipeline || p_.pipeline.has_value() || saved_world != std::to_string(p_.world_size) ||
         saved_backend != p_.backend ||
         (saved_layouts != state_file.metadata().end() && saved_layouts->second != fingerprints()) ||
         saved_tp != state_file.metadata().end() || p_.tensor_parallel_size > 1;
}

void StateIO::check_counts(const safetensors::File& state_file, const std::string& dir) const {
  auto check_count = [&](const char* what, std::size_t have) {
    const auto saved = require(state_file, what);
    if (saved != std::to_string(have)) {
      throw CheckpointError(
          fmt::format("{}: the checkpoint holds {} {} but {} were prepared; prepare the same "
                      "objects, in the same order, as when saving",
                      dir, saved, what, have));
    }
  };
  check_count("models", p_.prepared->models.size());
  check_count("optimizers", p_.prepared->optimizers.size());
  check_count("schedulers", p_.prepared->schedulers.size());
  check_count("loaders", p_.prepared->loaders.size());
  const auto saved = state_file.metadata().find("custom_objects");
  const std::string count = saved == state_file.metadata().end() ? "0" : saved->second;
  if (count != std::to_string(p_.objects->size())) {
    throw CheckpointError(
        fmt::format("{}: the checkpoint holds {} objects registered for checkpointing but "
                    "{} are registered; call register_for_checkpointing for the same "
                    "objects, in the same order, as when saving",
                    dir, count, p_.objects->size()));
  }
}

namespace {

// What a model expects of a checkpoint: the shape of each parameter and buffer and whether it is floating
// point. Models whose engine keeps them whole are read as they are; sharded ones are walked one gathered unit
// at a time (collective, memory bounded as an export is).
std::map<std::string, std::pair<std::vector<std::int64_t>, bool>> expected_state(const PreparedModel& m) {
  std::map<std::string, std::pair<std::vector<std::int64_t>, bool>> out;
  const auto note = [&out](const std::string& name, const torch::Tensor& t) {
    out[name] = {t.sizes().vec(), t.is_floating_point()};
  };
  if (!m.engine->capabilities().shards_parameters) {
    for (const auto& item : m.module->named_parameters())
      note(item.key(), item.value());
    for (const auto& item : m.module->named_buffers())
      note(item.key(), item.value());
  } else {
    m.engine->visit_model_state([&](NamedTensors piece) {
      for (const auto& [name, t] : piece)
        note(name, t);
    });
  }
  return out;
}

// Throws CheckpointError naming `path` when `state` does not fit model `index`: a tensor missing, of another
// shape, or integer where the model has floating point (the engines' own load checks the same, one model at a
// time).
void check_fits(const PreparedModel& m, std::size_t index, const std::map<std::string, torch::Tensor>& state,
                const std::string& path) {
  for (const auto& [name, expected] : expected_state(m)) {
    const auto it = state.find(name);
    if (it == state.end()) {
      throw CheckpointError(
          fmt::format("load_state: {}: checkpoint has no tensor '{}' for model {}; was it "
                      "saved from the same model architecture?",
                      path, name, index));
    }
    if (it->second.sizes().vec() != expected.first) {
      throw CheckpointError(fmt::format(
          "load_state: {}: checkpoint tensor '{}' has shape [{}] but model {} "
          "expects [{}]",
          path, name, fmt::join(it->second.sizes(), ", "), index, fmt::join(expected.first, ", ")));
    }
    if (it->second.is_floating_point() != expected.second) {
      throw CheckpointError(
          fmt::format("load_state: {}: checkpoint tensor '{}' is {} and model {}'s is not: "
                      "integers and floating point do not convert into each other",
                      path, name, c10::toString(it->second.scalar_type()), index));
    }
  }
}

}  // namespace

void StateIO::load_models(const std::string& dir) {
  const fs::path root(dir);
  const auto& models = p_.prepared->models;
  // Every model's file is read (and, with several models, checked against its model) before the first is
  // loaded: a checkpoint whose second model does not fit leaves the first as it was, all or nothing (one
  // model is checked whole by its engine before it copies anything).
  std::vector<std::map<std::string, torch::Tensor>> states;
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < models.size(); ++i) {
    const auto f = safetensors::File::open((root / indexed("model", i, ".safetensors")).string());
    auto state = read_tensors(f);
    if (p_.tensor_parallel_size > 1)
      slice_tensor_parallel(state, p_.tensor_parallel_splits.at(i), "load_state from " + f.path());
    const auto part = f.metadata().find(kModelPartKey);
    if (part != f.metadata().end() && part->second == kTrainableOnly) {
      // Only the trainable parameters were saved: the rest is the model as the program built it now (the
      // frozen base), taken from the engine (collective under sharded parameters: every rank is here).
      for (auto& [name, tensor] : models[i].engine->model_state())
        state.emplace(name, tensor);  // keeps the saved tensor where there is one
    }
    if (models.size() > 1) check_fits(models[i], i, state, f.path());
    states.push_back(std::move(state));
    paths.push_back(f.path());
  }
  for (std::size_t i = 0; i < models.size(); ++i) {
    try {
      models[i].engine->load_model_state(states[i]);
    } catch (const CheckpointError& e) {  // a tensor the model lacks or shapes apart: name the file
      throw CheckpointError(fmt::format("load_state: {}: {}", paths[i], e.what()));
    }
  }
}

void StateIO::load_optimizers(const std::string& dir, bool convert, const std::string& saved_world,
                              const std::string& saved_backend) {
  const fs::path root(dir);
  for (std::size_t i = 0; i < p_.prepared->optimizers.size(); ++i) {
    if (convert) {
      const auto path = (root / indexed("optimizer", i, "_full.safetensors")).string();
      if (!fs::exists(path)) {
        throw CheckpointError(fmt::format(
            "{}: the checkpoint was saved by {} process(es) with the '{}' backend and this run has {} with "
            "'{}' (or another sharding layout or tensor parallelism); converting needs the per-parameter "
            "optimizer state '{}', which is written for LibTorch's Adam, "
            "AdamW, SGD, RMSprop and Adagrad only; resume with {} process(es) and `backend: {}`",
            dir, saved_world, saved_backend, p_.world_size, p_.backend, path, saved_world, saved_backend));
      }
      load_converted(i, path);
      continue;
    }
    const auto path =
        (root / indexed("optimizer", i,
                        p_.shards_optimizer_state ? fmt::format("_rank{}.pt", p_.rank) : std::string(".pt")))
            .string();
    if (!fs::exists(path))
      throw CheckpointError(fmt::format("load_state: missing optimizer file '{}'", path));
    // Read onto the CPU, then onto each parameter's device: a checkpoint saved on a GPU resumes on the CPU
    // (and on a machine without CUDA) and the other way round.
    torch::load(*p_.prepared->optimizers[i], path, torch::Device(torch::kCPU));
    place_state_on_parameters(*p_.prepared->optimizers[i]);
  }
}

void StateIO::load_schedulers(const safetensors::File& state_file) {
  for (std::size_t i = 0; i < p_.prepared->schedulers.size(); ++i) {
    SchedulerAccess::step_count(*p_.prepared->schedulers[i]) =
        static_cast<unsigned>(read_int(state_file, fmt::format("scheduler.{}.step_count", i)));
    const auto extra_key = fmt::format("scheduler.{}.state", i);
    if (auto* schedule = dynamic_cast<sched::Preparable*>(p_.prepared->schedulers[i]);
        schedule && state_file.contains(extra_key)) {
      const auto t = read_tensor(state_file, extra_key).to(torch::kFloat64).contiguous();
      schedule->load_schedule_state(
          std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel()));
    }
  }
}

void StateIO::load_loaders(const safetensors::File& state_file, const std::string& dir) {
  for (std::size_t i = 0; i < p_.prepared->loaders.size(); ++i) {
    auto& l = *p_.prepared->loaders[i];
    l.epoch = static_cast<std::uint64_t>(read_int(state_file, fmt::format("loader.{}.epoch", i)));
    l.next_batch = static_cast<std::size_t>(read_int(state_file, fmt::format("loader.{}.next_batch", i)));
    const auto sps_key = fmt::format("loader.{}.samples_per_step", i);
    std::size_t saved_step = 0;  // samples per position when saved, where this run's differs
    if (state_file.contains(sps_key) && l.samples_per_step != 0) {
      // Another world size or batch size: continue after the same number of samples.
      const auto saved_sps = static_cast<std::size_t>(read_int(state_file, sps_key));
      const auto samples = l.next_batch * saved_sps;
      if (samples % l.samples_per_step != 0) {
        throw CheckpointError(
            fmt::format("{}: loader {} stopped after {} samples of epoch {} ({} per step when saved), which "
                        "is not a whole number of this run's steps of {} samples; resume with a batch size "
                        "and number of processes whose product divides {}, or from a checkpoint saved at an "
                        "epoch end",
                        dir, i, samples, l.epoch, saved_sps, l.samples_per_step, samples));
      }
      l.next_batch = samples / l.samples_per_step;
      if (saved_sps != l.samples_per_step) saved_step = saved_sps;
    }
    // Saved at an epoch's end on another number of processes, the position can pass this run's last batch
    // by less than one saved step (the last round is padded to whole steps): that epoch is done.
    if (saved_step != 0 && l.next_batch > l.batches_in_epoch &&
        (l.next_batch - l.batches_in_epoch) * l.samples_per_step < saved_step)
      l.next_batch = l.batches_in_epoch;
    if (l.batches_in_epoch != 0 && l.next_batch > l.batches_in_epoch) {
      // Resumed there, the epoch would yield nothing and end at once.
      throw CheckpointError(
          fmt::format("{}: loader {} resumes after batch {} of epoch {}, but an epoch of this loader has {} "
                      "batches per rank: the checkpoint was saved with a larger dataset or a smaller batch "
                      "size, or is damaged; resume with the dataset and batch size it was saved with",
                      dir, i, l.next_batch, l.epoch, l.batches_in_epoch));
    }
    l.resumed = l.next_batch > 0;
    l.in_epoch = false;
    l.at_last_batch = false;
  }
}

void StateIO::load_scaler(const safetensors::File& state_file, const std::string& dir) {
  if (!p_.scaler) return;
  if (!state_file.contains("scaler.scale")) {
    throw CheckpointError(
        fmt::format("{}: the checkpoint has no fp16 loss-scaler state (saved with "
                    "mixed_precision: {}), but this run uses fp16",
                    dir, require(state_file, "mixed_precision")));
  }
  std::map<std::string, torch::Tensor> state{
      {"scale", read_tensor(state_file, "scaler.scale")},
      {"growth_tracker", read_tensor(state_file, "scaler.growth_tracker")}};
  // DeepSpeed's hysteresis left (checkpoints written before it existed have none: a full hysteresis).
  if (state_file.contains("scaler.hysteresis"))
    state.emplace("hysteresis", read_tensor(state_file, "scaler.hysteresis"));
  p_.scaler->load_state_dict(state);
}

void StateIO::load_custom_objects(const std::string& dir) {
  const fs::path root(dir);
  for (std::size_t i = 0; i < p_.objects->size(); ++i) {
    torch::serialize::InputArchive archive;
    archive.load_from((root / fmt::format("custom_checkpoint_{}.pt", i)).string());
    (*p_.objects)[i].load(archive);
  }
}

void StateIO::load_random_states(const std::string& dir, bool convert) {
  const auto rng_path = fs::path(dir) / fmt::format("random_states_{}.safetensors", p_.rank);
  // A rank that did not exist in the saved run keeps its (seeded) generators.
  if (convert && !fs::exists(rng_path)) return;
  const auto rng_file = safetensors::File::open(rng_path.string());
  for (const auto& d : rng_devices()) {
    if (!rng_file.contains(d.str())) continue;  // saved on a machine with fewer devices
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(read_tensor(rng_file, d.str()));
  }
}

}  // namespace accel::detail
