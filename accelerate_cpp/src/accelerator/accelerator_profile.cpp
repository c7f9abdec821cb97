// Accelerator::profile: LibTorch's Kineto profiler around a scope, one Chrome trace per rank.
#include <accel/accelerator/accelerator.hpp>

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace accel {

namespace {
bool g_profiling = false;  // one profiler per process: Kineto's state is global
}  // namespace

Accelerator::Profile::Profile(const ProfileOptions& options, int rank, bool cuda) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  if (g_profiling) {
    throw UsageError(
        "profile: a profile scope is already open in this process; end it before opening another");
  }
  std::error_code ec;
  std::filesystem::create_directories(options.output_trace_dir, ec);
  if (ec) {
    throw UsageError(fmt::format("profile: cannot create output_trace_dir '{}': {}", options.output_trace_dir,
                                 ec.message()));
  }
  path_ =
      (std::filesystem::path(options.output_trace_dir) / fmt::format("trace_rank_{}.json", rank)).string();
  const ProfilerConfig config(ProfilerState::KINETO, options.record_shapes, options.profile_memory,
                              options.with_stack, options.with_flops);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  g_profiling = active_ = true;
}

std::string Accelerator::Profile::stop() {
  if (!active_) return path_;
  active_ = false;
  const auto result = torch::autograd::profiler::disableProfiler();
  g_profiling = false;
  if (!result) throw UsageError("profile: LibTorch's profiler returned no result");
  result->save(path_);
  if (!std::filesystem::exists(path_)) {
    throw UsageError(fmt::format("profile: LibTorch's profiler did not write '{}'", path_));
  }
  return path_;
}

Accelerator::Profile::~Profile() {
  try {
    stop();
  } catch (const std::exception& e) {  // a destructor must not throw: report and go on
    std::cerr << "accel: profile: " << e.what() << std::endl;
  }
}

Accelerator::Profile Accelerator::profile(const ProfileOptions& options) {
  return Profile(options, state_.rank, device_.is_cuda());
}

}  // namespace accel
