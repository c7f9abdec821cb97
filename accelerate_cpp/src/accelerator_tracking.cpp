// Accelerator: experiment tracking (init_trackers, log, end_training), as Accelerate's.
#include <accel/accelerator.hpp>

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
  for (auto& t : trackers_)
    t->finish();
  trackers_.clear();
  trackers_started_ = true;
  trackers_ended_ = false;
  if (!is_main_process()) return;
  const auto dir =
      (std::filesystem::path(project_.project_dir.empty() ? "." : project_.project_dir) / project_name)
          .string();
  for (const auto& name : tracker_names_)
    trackers_.push_back(make_builtin_tracker(name, dir));
  for (const auto& t : custom_trackers_)
    trackers_.push_back(t);
  for (auto& t : trackers_)
    t->store_init_configuration(config);
}

void Accelerator::log(const TrackerValues& values, std::optional<std::int64_t> step) {
  if (tracker_names_.empty() && custom_trackers_.empty()) return;
  if (!trackers_started_) {
    throw UsageError(trackers_ended_
                         ? "log: the trackers were closed by end_training(); log before it, or call "
                           "init_trackers again to start new ones"
                         : "log: trackers are configured (log_with) but init_trackers(project_name, config) "
                           "was not called; call it once before the first log");
  }
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (auto& t : trackers_)
    t->log(values, step.value_or(completed_steps_), now);
}

Tracker* Accelerator::get_tracker(const std::string& name) const {
  for (const auto& t : trackers_) {
    if (t->name() == name) return t.get();
  }
  return nullptr;
}

void Accelerator::end_training() {
  for (auto& t : trackers_)
    t->finish();
  trackers_.clear();
  trackers_started_ = false;
  trackers_ended_ = true;
  wait_for_everyone();
}

}  // namespace accel
