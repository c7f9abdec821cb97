// Accelerator::save_state / load_state. Layout of a checkpoint directory (format version 1):
//   model.safetensors, model_1.safetensors ...   full weights and buffers of each prepared model
//   optimizer.pt, optimizer_1.pt ...              LibTorch archives of each optimizer's state
//   accelerator_state.safetensors                 counters, scaler, schedulers, loader positions + metadata
//   random_states_<rank>.safetensors              RNG states of each rank
#include <accel/accelerator.hpp>
#include <accel/detail/atomic_dir.hpp>

#include "tensor_io.hpp"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <filesystem>
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

}  // namespace

void Accelerator::save_state(const std::string& dir) {
  namespace fs = std::filesystem;
  // The main process owns the temporary directory and commits it; every rank writes its own files into it
  // (the same path on every rank: one machine, or a shared filesystem), then all meet before the commit.
  backend_->sync_parameters();  // collective: the model must be current before rank 0 writes it
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
    write_state_files(tmp);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Every rank reports; one failure anywhere keeps the previous checkpoint (the temporary one is dropped).
  const auto results = comm_->exchange(failure);
  for (int r = 0; r < world_size_; ++r) {
    if (!results[static_cast<std::size_t>(r)].empty()) {
      throw CheckpointError(
          fmt::format("save_state into '{}' failed on rank {}: {}; the previous checkpoint is intact", dir, r,
                      results[static_cast<std::size_t>(r)]));
    }
  }
  if (out) out->commit();
  comm_->barrier();
}

void Accelerator::write_state_files(const std::filesystem::path& tmp) {
  // Collective on every rank (sharded parameters are gathered); rank 0 writes them.
  std::vector<NamedTensors> model_states;
  for (std::size_t i = 0; i < models_.size(); ++i)
    model_states.push_back(backend_->model_state());
  if (rank_ == 0) write_main_state_files(tmp, model_states);
  if (backend_->shards_optimizer_state()) {
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
}

void Accelerator::write_main_state_files(const std::filesystem::path& tmp,
                                         const std::vector<NamedTensors>& model_states) {
  for (std::size_t i = 0; i < model_states.size(); ++i) {
    detail::write_tensors((tmp / indexed("model", i, ".safetensors")).string(), model_states[i],
                          {{"format", "pt"}});
  }
  for (std::size_t i = 0; i < optimizers_.size() && !backend_->shards_optimizer_state(); ++i) {
    torch::save(*optimizers_[i], (tmp / indexed("optimizer", i, ".pt")).string());
  }

  NamedTensors state{{"micro_steps", scalar(micro_steps_)},
                     {"cycle_position", scalar(cycle_position_)},
                     {"completed_steps", scalar(completed_steps_)}};
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    state.emplace_back(fmt::format("scheduler.{}.step_count", i),
                       scalar(SchedulerAccess::step_count(*schedulers_[i])));
  }
  for (std::size_t i = 0; i < loaders_.size(); ++i) {
    state.emplace_back(fmt::format("loader.{}.epoch", i),
                       scalar(static_cast<std::int64_t>(loaders_[i]->epoch)));
    state.emplace_back(
        fmt::format("loader.{}.next_batch", i),
        scalar(static_cast<std::int64_t>(loaders_[i]->in_epoch ? loaders_[i]->next_batch : 0)));
  }
  if (scaler_) {
    for (auto& [k, v] : scaler_->state_dict())
      state.emplace_back("scaler." + k, v);
  }
  const std::map<std::string, std::string> meta{{"format", kFormat},
                                                {"format_version", kFormatVersion},
                                                {"backend", backend_->name()},
                                                {"world_size", std::to_string(world_size_)},
                                                {"mixed_precision", to_string(config_.mixed_precision)},
                                                {"models", std::to_string(models_.size())},
                                                {"optimizers", std::to_string(optimizers_.size())},
                                                {"schedulers", std::to_string(schedulers_.size())},
                                                {"loaders", std::to_string(loaders_.size())}};
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
  const auto state_file = safetensors::File::open((root / "accelerator_state.safetensors").string());
  if (require(state_file, "format") != kFormat) {
    throw CheckpointError(fmt::format("{}: not an accelerate-cpp checkpoint", state_file.path()));
  }
  if (const auto v = require(state_file, "format_version"); v != kFormatVersion) {
    throw CheckpointError(
        fmt::format("{}: checkpoint format version {} is not readable by this build (reads {})",
                    state_file.path(), v, kFormatVersion));
  }
  if (const auto w = require(state_file, "world_size"); w != std::to_string(world_size_)) {
    throw CheckpointError(
        fmt::format("{}: the checkpoint was saved by {} processes but this run has {}; resume with "
                    "the same number of processes",
                    dir, w, world_size_));
  }
  if (const auto b = require(state_file, "backend"); b != backend_->name()) {
    throw CheckpointError(
        fmt::format("{}: the checkpoint was saved by the '{}' backend but this run uses '{}'; resume with "
                    "`backend: {}` or "
                    "consolidate the checkpoint first",
                    dir, b, backend_->name(), b));
  }
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

  for (std::size_t i = 0; i < models_.size(); ++i) {
    const auto f = safetensors::File::open((root / indexed("model", i, ".safetensors")).string());
    backend_->load_model_state(detail::read_tensors(f));
  }
  for (std::size_t i = 0; i < optimizers_.size(); ++i) {
    const auto path = (root / indexed("optimizer", i,
                                      backend_->shards_optimizer_state() ? fmt::format("_rank{}.pt", rank_)
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
  completed_steps_ = get("completed_steps");
  stashed_grads_.clear();
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    SchedulerAccess::step_count(*schedulers_[i]) =
        static_cast<unsigned>(get(fmt::format("scheduler.{}.step_count", i)));
  }
  for (std::size_t i = 0; i < loaders_.size(); ++i) {
    auto& l = *loaders_[i];
    l.epoch = static_cast<std::uint64_t>(get(fmt::format("loader.{}.epoch", i)));
    l.next_batch = static_cast<std::size_t>(get(fmt::format("loader.{}.next_batch", i)));
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
  const auto rng_file =
      safetensors::File::open((root / fmt::format("random_states_{}.safetensors", rank_)).string());
  for (const auto& d : rng_devices()) {
    if (!rng_file.contains(d.str())) continue;  // saved on a machine with fewer devices
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(detail::read_tensor(rng_file, d.str()));
  }
  if (autocast_on_) at::autocast::clear_cache();
}

}  // namespace accel
