// Accelerator: save_state / load_state (the files are the state I/O part's, state_io.hpp), checkpoint
// management as Accelerate's ProjectConfiguration (automatic names, rotation, resume from the newest) and the
// objects and hooks registered for checkpointing.
#include <accel/accelerator/accelerator.hpp>

#include "checkpoint/atomic_dir.hpp"
#include "checkpoint/state_io.hpp"

#include <ATen/autocast_mode.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <regex>

namespace accel {
namespace {
namespace fs = std::filesystem;

// Optimizer state an engine keeps out of memory between steps (NVMe offload) is in memory while a checkpoint
// reads or replaces it, and goes out again after (an error doing so is reported, except while unwinding).
class HeldOptimizerState {
 public:
  explicit HeldOptimizerState(std::vector<detail::PreparedModel>& models) : models_(models) {
    for (auto& m : models_)
      m.engine->hold_optimizer_state(true);
  }
  ~HeldOptimizerState() {
    if (released_) return;
    for (auto& m : models_) {
      try {
        m.engine->hold_optimizer_state(false);
      } catch (const std::exception&) {
      }
    }
  }
  void release() {
    released_ = true;
    for (auto& m : models_)
      m.engine->hold_optimizer_state(false);
  }
  HeldOptimizerState(const HeldOptimizerState&) = delete;
  HeldOptimizerState& operator=(const HeldOptimizerState&) = delete;

 private:
  std::vector<detail::PreparedModel>& models_;
  bool released_ = false;
};

// The complete automatic checkpoints under `root` (`checkpoint_<n>` with its state file; temporary and
// interrupted ones never match), oldest first.
std::vector<std::pair<long long, fs::path>> automatic_checkpoints(const fs::path& root) {
  static const std::regex kName(R"(checkpoint_(\d{1,18}))");
  std::vector<std::pair<long long, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(name, m, kName)) continue;
    if (!fs::exists(entry.path() / detail::StateIO::kStateFile)) continue;
    out.emplace_back(std::stoll(m[1].str()), entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// `<project_dir>/checkpoints`, or UsageError for `call`() without automatic naming.
fs::path automatic_checkpoint_root(const ProjectConfiguration& project, const char* call) {
  if (!project.automatic_checkpoint_naming || project.project_dir.empty()) {
    throw UsageError(fmt::format(
        "{}() without a directory needs automatic checkpoint naming: set ProjectConfiguration's project_dir "
        "and automatic_checkpoint_naming = true in AcceleratorOptions().project_config(...), or pass the "
        "directory: {}(dir)",
        call, call));
  }
  return fs::path(project.project_dir) / "checkpoints";
}

}  // namespace

detail::StateParts Accelerator::state_parts() {
  detail::StateParts parts;
  parts.prepared = &prepared_;
  parts.objects = &checkpointing_.objects;
  parts.scaler = scaler_.get();
  parts.comm = groups_.job.get();
  parts.rank = state_.rank;
  parts.world_size = state_.world_size;
  parts.backend = backend_name();
  parts.shards_optimizer_state = capabilities().shards_optimizer_state;
  parts.mixed_precision = config_.mixed_precision;
  if (pipeline_.engine)
    parts.pipeline = detail::StateParts::Pipeline{config_.pipeline.stages, groups_.data.get()};
  // Under sequence parallelism the engines shard over every rank (groups_.replicas), not the loaders' groups.
  parts.replicas = groups_.sequence->world_size() > 1 ? groups_.replicas.get() : groups_.data.get();
  parts.tensor_parallel_size = groups_.tensor->world_size();
  parts.tensor_parallel_rank = groups_.tensor->rank();
  parts.notice = [this](std::string notice) { add_notice(std::move(notice)); };
  parts.trainable_only = checkpointing_.trainable_only;
  if (parts.tensor_parallel_size > 1) {
    for (const auto& m : prepared_.models)
      parts.tensor_parallel_splits.push_back(tp::split_parameters(*m.module));
  }
  return parts;
}

void Accelerator::save_state(const std::string& dir) {
  sync_parameters();  // collective: the models must be current before rank 0 writes them
  HeldOptimizerState held(prepared_.models);
  detail::StateIO(state_parts()).save(dir, clock_.counters(), checkpointing_.save_hooks);
  held.release();
}

void Accelerator::load_state(const std::string& dir) {
  HeldOptimizerState held(prepared_.models);
  clock_.restore(detail::StateIO(state_parts()).load(dir, checkpointing_.load_hooks));
  held.release();
  prepared_.stashed_grads.clear();
  if (autocast_.on) at::autocast::clear_cache();
}

std::string Accelerator::save_state() {
  const fs::path root = automatic_checkpoint_root(checkpointing_.project, "save_state");
  const fs::path dir = root / fmt::format("checkpoint_{}", checkpointing_.project.iteration);
  std::string problem;
  if (is_main_process()) {
    detail::recover_interrupted(dir.string());
    std::error_code ec;
    if (fs::exists(dir, ec)) {
      problem = fmt::format(
          "save_state(): the checkpoint directory '{}' already exists; set ProjectConfiguration::iteration "
          "to the next free number, or call load_state() first, which continues after the newest checkpoint",
          dir.string());
    }
  }
  problem = groups_.job->exchange(problem)[0];
  if (!problem.empty()) throw CheckpointError(problem);
  save_state(dir.string());
  ++checkpointing_.project.iteration;
  // Rotation after the new checkpoint is complete, so a crash never leaves fewer than before.
  if (checkpointing_.project.total_limit > 0 && is_main_process()) {
    auto all = automatic_checkpoints(root);
    for (std::size_t k = 0; k + static_cast<std::size_t>(checkpointing_.project.total_limit) < all.size();
         ++k) {
      std::error_code ec;
      fs::remove_all(all[k].second, ec);
    }
  }
  groups_.job->barrier();
  return dir.string();
}

std::string Accelerator::load_state() {
  const fs::path root = automatic_checkpoint_root(checkpointing_.project, "load_state");
  // The main process chooses, so every rank loads the same one.
  std::string chosen;
  if (is_main_process()) {
    const auto all = automatic_checkpoints(root);
    chosen =
        all.empty() ? std::string() : fmt::format("{}\n{}", all.back().first, all.back().second.string());
  }
  chosen = groups_.job->exchange(chosen)[0];
  if (chosen.empty()) {
    throw CheckpointError(
        fmt::format("load_state(): '{}' holds no complete checkpoint (checkpoint_<n> written "
                    "by save_state()); train from the start or pass a directory",
                    root.string()));
  }
  const auto newline = chosen.find('\n');
  const std::string dir = chosen.substr(newline + 1);
  load_state(dir);
  checkpointing_.project.iteration = std::stoi(chosen.substr(0, newline)) + 1;
  return dir;
}

void Accelerator::register_for_checkpointing(std::function<void(torch::serialize::OutputArchive&)> save,
                                             std::function<void(torch::serialize::InputArchive&)> load) {
  if (!save || !load)
    throw UsageError("register_for_checkpointing: both the save and the load function are needed");
  checkpointing_.objects.push_back({std::move(save), std::move(load)});
}

void Accelerator::register_save_state_pre_hook(std::function<void(const std::string& dir)> hook) {
  checkpointing_.save_hooks.push_back(std::move(hook));
}

void Accelerator::register_load_state_pre_hook(std::function<void(const std::string& dir)> hook) {
  checkpointing_.load_hooks.push_back(std::move(hook));
}

}  // namespace accel
