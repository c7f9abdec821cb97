// Accelerator: experiment tracking (init_trackers, log, end_training), as Accelerate's.
#include <accel/accelerator/accelerator.hpp>

#include <fmt/format.h>

#include <chrono>
#include <filesystem>

namespace accel {

void Accelerator::init_trackers(const std::string& project_name, const TrackerConfig& config) {
  if (project_name.empty() || project_name.find("..") != std::string::npos) {
    throw UsageError(fmt::format(
        "init_trackers: project_name '{}' must name a directory under project_dir (not empty, no '..')",
        project_name));
  }
  for (auto& t : trackers_.started)
    t->finish();
  trackers_.started.clear();
  trackers_.is_started = true;
  trackers_.ended = false;
  if (!is_main_process()) return;
  const auto dir =
      (std::filesystem::path(
           checkpointing_.project.project_dir.empty() ? "." : checkpointing_.project.project_dir) /
       project_name)
          .string();
  for (const auto& name : trackers_.names)
    trackers_.started.push_back(make_builtin_tracker(name, dir));
  for (const auto& t : trackers_.custom)
    trackers_.started.push_back(t);
  for (auto& t : trackers_.started)
    t->store_init_configuration(config);
}

void Accelerator::log(const TrackerValues& values, std::optional<std::int64_t> step) {
  if (trackers_.names.empty() && trackers_.custom.empty()) return;
  if (!trackers_.is_started) {
    throw UsageError(trackers_.ended
                         ? "log: the trackers were closed by end_training(); log before it, or call "
                           "init_trackers again to start new ones"
                         : "log: trackers are configured (log_with) but init_trackers(project_name, config) "
                           "was not called; call it once before the first log");
  }
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (auto& t : trackers_.started)
    t->log(values, step.value_or(clock_.completed_steps()), now);
}

Tracker* Accelerator::get_tracker(const std::string& name) const {
  for (const auto& t : trackers_.started) {
    if (t->name() == name) return t.get();
  }
  return nullptr;
}

void Accelerator::end_training() {
  for (auto& t : trackers_.started)
    t->finish();
  trackers_.started.clear();
  trackers_.is_started = false;
  trackers_.ended = true;
  wait_for_everyone();
}

}  // namespace accel
