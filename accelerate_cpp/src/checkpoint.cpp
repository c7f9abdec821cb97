// Accelerator::save_state / load_state. Layout of a checkpoint directory (format version 1):
//   model.safetensors, model_1.safetensors ...   full weights and buffers of each prepared model
//   model_16bit.safetensors ...                   the same in fp16/bf16 (zero3_save_16bit_model: true)
//   optimizer.pt, optimizer_1.pt ...              LibTorch archives of each optimizer's state (sharded
//                                                  backends: optimizer_rank<r>.pt per rank)
//   optimizer_full.safetensors ...                 the same state per model parameter ("<param>/<state>"),
//                                                  world-size and backend independent (built-in optimizers):
//                                                  what resuming on another world size or backend reads
//   accelerator_state.safetensors                 counters, scaler, schedulers, loader positions + metadata
//   random_states_<rank>.safetensors              RNG states of each rank
#include <accel/accelerator.hpp>
#include <accel/detail/atomic_dir.hpp>
#include <accel/schedulers.hpp>

#include "optimizer_state.hpp"
#include "rank_failures.hpp"
#include "tensor_io.hpp"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <mutex>

namespace accel {
namespace {

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
    for (int i = 0; i < static_cast<int>(torch::cuda::device_count()); ++i) {
      devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
    }
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

std::string qualified(std::size_t model, const std::string& name) {
  return model == 0 ? name : fmt::format("{}:{}", model, name);
}

// Layouts of an optimizer that updates model parameters directly: each tensor is one whole parameter.
std::vector<OptimizerTensorLayout> identity_layouts(const torch::optim::Optimizer& optimizer,
                                                    const std::vector<torch::nn::Module*>& models) {
  std::map<const void*, std::string> names;
  for (std::size_t i = 0; i < models.size(); ++i) {
    for (const auto& item : models[i]->named_parameters()) {
      names.emplace(item.value().unsafeGetTensorImpl(),
                    i == 0 ? item.key() : fmt::format("{}:{}", i, item.key()));
    }
  }
  std::vector<OptimizerTensorLayout> out;
  for (const auto& pg : optimizer.param_groups()) {
    for (const auto& t : pg.params()) {
      const auto it = names.find(t.unsafeGetTensorImpl());
      if (it == names.end()) return {};  // not every tensor is a model parameter: no conversion possible
      OptimizerTensorLayout l;
      l.pieces.push_back({it->second, 0, t.numel()});
      l.flat_numel = l.length = t.numel();
      out.push_back(std::move(l));
    }
  }
  return out;
}

std::map<std::string, std::vector<std::int64_t>> parameter_shapes(
    const std::vector<torch::nn::Module*>& models) {
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < models.size(); ++i) {
    for (const auto& item : models[i]->named_parameters()) {
      shapes[i == 0 ? item.key() : fmt::format("{}:{}", i, item.key())] = item.value().sizes().vec();
    }
  }
  return shapes;
}

// Identifies how an optimizer's tensors map onto model parameters (stage, wrap policy, world size ...): a
// checkpoint with another fingerprint is converted, never loaded slice for slice into the wrong tensors.
std::string layout_fingerprint(const std::vector<OptimizerTensorLayout>& layouts) {
  std::string text;
  for (const auto& l : layouts) {
    text += fmt::format("[{} {} {}", l.flat_numel, l.begin, l.length);
    for (const auto& p : l.pieces)
      text += fmt::format(" {}@{}+{}", p.param, p.offset, p.numel);
    text += "]";
  }
  return fmt::format("{:016x}", std::hash<std::string>{}(text));
}

constexpr const char* kStateNames[] = {"step",       "exp_avg",         "exp_avg_sq", "max_exp_avg_sq",
                                       "square_avg", "momentum_buffer", "grad_avg",   "sum"};

}  // namespace

std::vector<torch::nn::Module*> Accelerator::model_pointers() const {
  std::vector<torch::nn::Module*> out;
  for (const auto& m : models_)
    out.push_back(m.module.get());
  return out;
}

std::vector<OptimizerTensorLayout> Accelerator::optimizer_layouts(std::size_t o) const {
  const auto& optimizer = *optimizers_[o];
  const auto model = optimizer_model_[o];
  auto layouts = models_[model].engine->optimizer_layout(optimizer);
  if (layouts.empty()) return identity_layouts(optimizer, model_pointers());
  for (auto& l : layouts) {
    for (auto& piece : l.pieces)
      piece.param = qualified(model, piece.param);
  }
  return layouts;
}

std::string Accelerator::optimizer_fingerprints() const {
  std::string out;
  for (std::size_t o = 0; o < optimizers_.size(); ++o)
    out += (out.empty() ? "" : ",") + layout_fingerprint(optimizer_layouts(o));
  return out;
}

std::optional<NamedTensors> Accelerator::consolidated_optimizer_state(std::size_t o) {
  const auto& optimizer = *optimizers_[o];
  if (detail::optimizer_kind(optimizer).empty()) return std::nullopt;
  const auto layouts = optimizer_layouts(o);
  if (layouts.empty()) return std::nullopt;
  const auto shapes = parameter_shapes(model_pointers());
  NamedTensors out;
  std::size_t k = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& pg = optimizer.param_groups()[g];
    out.emplace_back(fmt::format("param_groups/{}/lr", g),
                     torch::tensor(pg.options().get_lr(), torch::kFloat64));
    for (const auto& t : pg.params()) {
      const auto& layout = layouts[k++];
      const auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;  // never stepped (the same on every rank)
      for (const auto& [name, value] : detail::named_state(*it->second)) {
        if (!value.defined()) continue;
        if (name == "step") {
          for (const auto& piece : layout.pieces)
            out.emplace_back(piece.param + "/step", value.clone());
          continue;
        }
        // Sharded: every rank contributes its slice (collective, the same tensors in the same order).
        const auto flat = layout.length == layout.flat_numel
                              ? value.reshape({-1})
                              : comm_->all_gather(value.reshape({-1}).contiguous());
        if (rank_ != 0) continue;  // only the main process writes the file
        for (const auto& piece : layout.pieces) {
          out.emplace_back(
              piece.param + "/" + name,
              flat.narrow(0, piece.offset, piece.numel).reshape(shapes.at(piece.param)).cpu().clone());
        }
      }
    }
  }
  return out;
}

void Accelerator::load_converted_optimizer_state(std::size_t o, const std::string& path) {
  auto& optimizer = *optimizers_[o];
  const auto kind = detail::optimizer_kind(optimizer);
  const auto file = safetensors::File::open(path);
  const auto saved_kind = require(file, "optimizer");
  if (kind != saved_kind) {
    throw CheckpointError(fmt::format("{}: the checkpoint holds {} state but the prepared optimizer is {}",
                                      path, saved_kind,
                                      kind.empty() ? "of a type that cannot be converted" : kind));
  }
  const auto layouts = optimizer_layouts(o);
  if (layouts.empty()) {
    throw CheckpointError(
        fmt::format("{}: the prepared optimizer holds tensors that are not parameters of the "
                    "prepared models, so per-parameter state cannot be mapped onto it",
                    path));
  }
  optimizer.state().clear();
  std::size_t k = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto& pg = optimizer.param_groups()[g];
    const auto lr_key = fmt::format("param_groups/{}/lr", g);
    if (file.contains(lr_key)) pg.options().set_lr(detail::read_tensor(file, lr_key).item<double>());
    for (const auto& t : pg.params()) {
      const auto& layout = layouts.at(k++);
      std::map<std::string, torch::Tensor> named;
      for (const char* name : kStateNames) {
        // Pieces whose parameter had not stepped when saving (for example unused in a DDP run) start from
        // zero, as a fresh optimizer state would.
        const auto present = std::any_of(layout.pieces.begin(), layout.pieces.end(), [&](const auto& piece) {
          return file.contains(piece.param + "/" + name);
        });
        if (!present) continue;
        if (std::string(name) == "step") {
          std::int64_t step = 0;
          for (const auto& piece : layout.pieces) {
            const auto key = piece.param + "/step";
            if (file.contains(key))
              step = std::max(step, detail::read_tensor(file, key).item<std::int64_t>());
          }
          named["step"] = torch::tensor(step, torch::kInt64);
          continue;
        }
        auto flat = torch::zeros({layout.flat_numel}, t.options().requires_grad(false).device(torch::kCPU));
        for (const auto& piece : layout.pieces) {
          const auto key = piece.param + "/" + name;
          if (file.contains(key))
            flat.narrow(0, piece.offset, piece.numel).copy_(detail::read_tensor(file, key).reshape({-1}));
        }
        named[name] = flat.narrow(0, layout.begin, layout.length).clone().view(t.sizes()).to(t.device());
      }
      if (named.empty()) continue;  // this parameter had not stepped when the checkpoint was saved
      optimizer.state()[t.unsafeGetTensorImpl()] = detail::make_state(kind, named);
    }
  }
}

void Accelerator::save_state(const std::string& dir) {
  namespace fs = std::filesystem;
  // The main process owns the temporary directory and commits it; every rank writes its own files into it
  // (the same path on every rank: one machine, or a shared filesystem), then all meet before the commit.
  sync_parameters();  // collective: the models must be current before rank 0 writes them
  std::unique_ptr<detail::AtomicDirectory> out;
  std::string tmp_path;
  std::string failure;
  if (is_main_process()) {
    try {
      out = std::make_unique<detail::AtomicDirectory>(dir);
      tmp_path = out->path().string();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  tmp_path = comm_->exchange(failure.empty() ? tmp_path : "\n" + failure)[0];
  if (!tmp_path.empty() && tmp_path[0] == '\n') {
    throw CheckpointError(
        fmt::format("save_state: rank 0 could not create '{}': {}", dir, tmp_path.substr(1)));
  }
  const fs::path tmp = tmp_path;
  try {
    for (const auto& hook : save_hooks_)
      hook(tmp.string());
    write_state_files(tmp);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Every rank reports; one failure anywhere keeps the previous checkpoint (the temporary one is dropped).
  detail::throw_first_failure(*comm_, failure, [&](std::size_t r, const std::string& what) {
    return fmt::format("save_state into '{}' failed on rank {}: {}; the previous checkpoint is intact", dir,
                       r, what);
  });
  if (out) out->commit();
  comm_->barrier();
}

void Accelerator::write_state_files(const std::filesystem::path& tmp) {
  // Collective on every rank (sharded parameters are gathered); rank 0 writes them.
  std::vector<NamedTensors> model_states;
  for (std::size_t i = 0; i < models_.size(); ++i)
    model_states.push_back(models_[i].engine->model_state());
  std::vector<std::optional<NamedTensors>> optimizer_states;
  for (std::size_t o = 0; o < optimizers_.size(); ++o)
    optimizer_states.push_back(consolidated_optimizer_state(o));
  if (rank_ == 0) {
    write_main_state_files(tmp, model_states);
    for (std::size_t i = 0; i < optimizer_states.size(); ++i) {
      if (!optimizer_states[i]) continue;
      detail::write_tensors((tmp / indexed("optimizer", i, "_full.safetensors")).string(),
                            *optimizer_states[i],
                            {{"format", "pt"}, {"optimizer", detail::optimizer_kind(*optimizers_[i])}});
    }
  }
  if (capabilities().shards_optimizer_state) {
    for (std::size_t i = 0; i < optimizers_.size(); ++i) {
      torch::save(*optimizers_[i],
                  (tmp / indexed("optimizer", i, fmt::format("_rank{}.pt", rank_))).string());
    }
  }
  NamedTensors rng;
  for (const auto& d : rng_devices()) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng.emplace_back(d.str(), gen.get_state());
  }
  detail::write_tensors((tmp / fmt::format("random_states_{}.safetensors", rank_)).string(), rng);
  if (rank_ == 0) {
    for (std::size_t i = 0; i < custom_states_.size(); ++i) {
      torch::serialize::OutputArchive archive;
      custom_states_[i].save(archive);
      archive.save_to((tmp / fmt::format("custom_checkpoint_{}.pt", i)).string());
    }
  }
}

void Accelerator::write_main_state_files(const std::filesystem::path& tmp,
                                         const std::vector<NamedTensors>& model_states) {
  for (std::size_t i = 0; i < model_states.size(); ++i) {
    detail::write_tensors((tmp / indexed("model", i, ".safetensors")).string(), model_states[i],
                          {{"format", "pt"}});
    for (const auto& [stem, tensors] : models_[i].engine->extra_model_files(model_states[i])) {
      detail::write_tensors((tmp / indexed(stem, i, ".safetensors")).string(), tensors, {{"format", "pt"}});
    }
  }
  for (std::size_t i = 0; i < optimizers_.size() && !capabilities().shards_optimizer_state; ++i) {
    torch::save(*optimizers_[i], (tmp / indexed("optimizer", i, ".pt")).string());
  }

  NamedTensors state{{"micro_steps", scalar(micro_steps_)},
                     {"cycle_position", scalar(cycle_done_ ? 0 : cycle_position_)},
                     {"completed_steps", scalar(completed_steps_)}};
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    state.emplace_back(fmt::format("scheduler.{}.step_count", i),
                       scalar(SchedulerAccess::step_count(*schedulers_[i])));
    if (const auto* schedule = dynamic_cast<const sched::Preparable*>(schedulers_[i])) {
      const auto extra = schedule->schedule_state();
      if (!extra.empty()) {
        state.emplace_back(fmt::format("scheduler.{}.state", i),
                           torch::tensor(extra, torch::TensorOptions().dtype(torch::kFloat64)));
      }
    }
  }
  for (std::size_t i = 0; i < loaders_.size(); ++i) {
    state.emplace_back(fmt::format("loader.{}.epoch", i),
                       scalar(static_cast<std::int64_t>(loaders_[i]->epoch)));
    state.emplace_back(
        fmt::format("loader.{}.next_batch", i),
        scalar(static_cast<std::int64_t>(loaders_[i]->in_epoch ? loaders_[i]->next_batch : 0)));
    state.emplace_back(fmt::format("loader.{}.samples_per_step", i),
                       scalar(static_cast<std::int64_t>(loaders_[i]->samples_per_step)));
  }
  if (scaler_) {
    for (auto& [k, v] : scaler_->state_dict())
      state.emplace_back("scaler." + k, v);
  }
  const auto fingerprints = optimizer_fingerprints();
  const std::map<std::string, std::string> meta{{"optimizer_layouts", fingerprints},
                                                {"format", kFormat},
                                                {"format_version", kFormatVersion},
                                                {"backend", backend_name()},
                                                {"world_size", std::to_string(world_size_)},
                                                {"mixed_precision", to_string(config_.mixed_precision)},
                                                {"models", std::to_string(models_.size())},
                                                {"optimizers", std::to_string(optimizers_.size())},
                                                {"schedulers", std::to_string(schedulers_.size())},
                                                {"loaders", std::to_string(loaders_.size())},
                                                {"custom_objects", std::to_string(custom_states_.size())}};
  detail::write_tensors((tmp / "accelerator_state.safetensors").string(), state, meta);
}

void Accelerator::load_state(const std::string& dir) {
  namespace fs = std::filesystem;
  if (is_main_process()) detail::recover_interrupted(dir);
  comm_->barrier();
  const fs::path root(dir);
  if (!fs::is_directory(root)) {
    throw CheckpointError(
        fmt::format("load_state: '{}' is not a directory; pass the directory save_state wrote", dir));
  }
  for (const auto& hook : load_hooks_)
    hook(dir);
  const auto state_file = safetensors::File::open((root / "accelerator_state.safetensors").string());
  if (require(state_file, "format") != kFormat) {
    throw CheckpointError(fmt::format("{}: not an accelerate-cpp checkpoint", state_file.path()));
  }
  if (const auto v = require(state_file, "format_version"); v != kFormatVersion) {
    throw CheckpointError(
        fmt::format("{}: checkpoint format version {} is not readable by this build (reads {})",
                    state_file.path(), v, kFormatVersion));
  }
  const auto saved_world = require(state_file, "world_size");
  const auto saved_backend = require(state_file, "backend");
  // Another world size or backend: the optimizer state is rebuilt from the per-parameter files.
  const auto fingerprints = optimizer_fingerprints();
  const auto saved_layouts = state_file.metadata().find("optimizer_layouts");
  const bool convert =
      saved_world != std::to_string(world_size_) || saved_backend != backend_name() ||
      (saved_layouts != state_file.metadata().end() && saved_layouts->second != fingerprints);
  auto check_count = [&](const char* what, std::size_t have) {
    const auto saved = require(state_file, what);
    if (saved != std::to_string(have)) {
      throw CheckpointError(
          fmt::format("{}: the checkpoint holds {} {} but {} were prepared; prepare the same "
                      "objects, in the same order, as when saving",
                      dir, saved, what, have));
    }
  };
  check_count("models", models_.size());
  check_count("optimizers", optimizers_.size());
  check_count("schedulers", schedulers_.size());
  check_count("loaders", loaders_.size());
  {
    const auto saved = state_file.metadata().find("custom_objects");
    const std::string count = saved == state_file.metadata().end() ? "0" : saved->second;
    if (count != std::to_string(custom_states_.size())) {
      throw CheckpointError(
          fmt::format("{}: the checkpoint holds {} objects registered for checkpointing but "
                      "{} are registered; call register_for_checkpointing for the same "
                      "objects, in the same order, as when saving",
                      dir, count, custom_states_.size()));
    }
  }

  for (std::size_t i = 0; i < models_.size(); ++i) {
    const auto f = safetensors::File::open((root / indexed("model", i, ".safetensors")).string());
    models_[i].engine->load_model_state(detail::read_tensors(f));
  }
  for (std::size_t i = 0; i < optimizers_.size(); ++i) {
    if (convert) {
      const auto path = (root / indexed("optimizer", i, "_full.safetensors")).string();
      if (!fs::exists(path)) {
        throw CheckpointError(fmt::format(
            "{}: the checkpoint was saved by {} process(es) with the '{}' backend and this run has {} with "
            "'{}' (or another sharding layout); converting needs the per-parameter optimizer state '{}', "
            "which is written for LibTorch's Adam, "
            "AdamW, SGD, RMSprop and Adagrad only; resume with {} process(es) and `backend: {}`",
            dir, saved_world, saved_backend, world_size_, backend_name(), path, saved_world, saved_backend));
      }
      load_converted_optimizer_state(i, path);
      continue;
    }
    const auto path = (root / indexed("optimizer", i,
                                      capabilities().shards_optimizer_state ? fmt::format("_rank{}.pt", rank_)
                                                                            : std::string(".pt")))
                          .string();
    if (!fs::exists(path))
      throw CheckpointError(fmt::format("load_state: missing optimizer file '{}'", path));
    torch::load(*optimizers_[i], path);
  }
  auto get = [&](const std::string& name) {
    return detail::read_tensor(state_file, name).item<std::int64_t>();
  };
  micro_steps_ = get("micro_steps");
  cycle_position_ = get("cycle_position");
  cycle_done_ = false;
  in_micro_step_ = false;
  completed_steps_ = get("completed_steps");
  stashed_grads_.clear();
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    SchedulerAccess::step_count(*schedulers_[i]) =
        static_cast<unsigned>(get(fmt::format("scheduler.{}.step_count", i)));
    const auto extra_key = fmt::format("scheduler.{}.state", i);
    if (auto* schedule = dynamic_cast<sched::Preparable*>(schedulers_[i]);
        schedule && state_file.contains(extra_key)) {
      const auto t = detail::read_tensor(state_file, extra_key).to(torch::kFloat64).contiguous();
      schedule->load_schedule_state(
          std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel()));
    }
  }
  for (std::size_t i = 0; i < loaders_.size(); ++i) {
    auto& l = *loaders_[i];
    l.epoch = static_cast<std::uint64_t>(get(fmt::format("loader.{}.epoch", i)));
    l.next_batch = static_cast<std::size_t>(get(fmt::format("loader.{}.next_batch", i)));
    const auto sps_key = fmt::format("loader.{}.samples_per_step", i);
    if (state_file.contains(sps_key) && l.samples_per_step != 0) {
      // Another world size or batch size: continue after the same number of samples.
      const auto saved_sps = static_cast<std::size_t>(get(sps_key));
      const auto samples = l.next_batch * saved_sps;
      if (samples % l.samples_per_step != 0) {
        throw CheckpointError(
            fmt::format("{}: loader {} stopped after {} samples of epoch {} ({} per step when saved), which "
                        "is not a whole "
                        "number of this run's steps of {} samples; resume with a batch size and number of "
                        "processes whose "
                        "product divides {}, or from a checkpoint saved at an epoch end",
                        dir, i, samples, l.epoch, saved_sps, l.samples_per_step, samples));
      }
      l.next_batch = samples / l.samples_per_step;
    }
    l.resumed = l.next_batch > 0;
    l.in_epoch = false;
    l.at_last_batch = false;
  }
  if (scaler_) {
    if (!state_file.contains("scaler.scale")) {
      throw CheckpointError(
          fmt::format("{}: the checkpoint has no fp16 loss-scaler state (saved with "
                      "mixed_precision: {}), but this run uses fp16",
                      dir, require(state_file, "mixed_precision")));
    }
    scaler_->load_state_dict({{"scale", detail::read_tensor(state_file, "scaler.scale")},
                              {"growth_tracker", detail::read_tensor(state_file, "scaler.growth_tracker")}});
  }
  for (std::size_t i = 0; i < custom_states_.size(); ++i) {
    torch::serialize::InputArchive archive;
    archive.load_from((root / fmt::format("custom_checkpoint_{}.pt", i)).string());
    custom_states_[i].load(archive);
  }
  const auto rng_path = root / fmt::format("random_states_{}.safetensors", rank_);
  if (convert && !fs::exists(rng_path)) {
    // This rank did not exist in the saved run: its generators keep their (seeded) state.
    if (autocast_on_) at::autocast::clear_cache();
    return;
  }
  const auto rng_file = safetensors::File::open(rng_path.string());
  for (const auto& d : rng_devices()) {
    if (!rng_file.contains(d.str())) continue;  // saved on a machine with fewer devices
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(detail::read_tensor(rng_file, d.str()));
  }
  if (autocast_on_) at::autocast::clear_cache();
}

}  // namespace accel
