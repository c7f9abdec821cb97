// What the backends' fact sheets answer for the rest of the library (config.hpp): what a config shards, how
// to name its layout, and the advice listing the layouts that satisfy a condition. Nothing here names a
// backend: each answer is read from `BackendInfo::sharding`, `layout_setting` and `layouts`.
#include <accel/config/config.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

namespace accel {

BackendCapabilities sharding_of(const Config& config) {
  const BackendInfo* backend = find_backend(config.backend);
  if (backend == nullptr || !backend->sharding) return {};
  return backend->sharding(config);
}

double automatic_gradient_clipping(const Config& config) {
  const BackendInfo* backend = find_backend(config.backend);
  if (backend == nullptr || !backend->gradient_clipping) return 0.0;
  return backend->gradient_clipping(config);
}

LossScaling loss_scaling_of(const Config& config) {
  const BackendInfo* backend = find_backend(config.backend);
  if (backend == nullptr || !backend->loss_scaling) return {};
  return backend->loss_scaling(config);
}

std::string describe_layout(const Config& config) {
  const BackendInfo* backend = find_backend(config.backend);
  const std::string setting =
      backend != nullptr && backend->layout_setting ? backend->layout_setting(config) : std::string();
  return setting.empty() ? config.backend : fmt::format("{} ({})", config.backend, setting);
}

std::string layouts_where(const std::function<bool(const BackendCapabilities&)>& keep,
                          LayoutSpelling spelling) {
  const bool flags = spelling == LayoutSpelling::Flags;
  std::vector<std::string> items;
  for (const BackendInfo& backend : config_backends()) {
    if (backend.max_processes == 1) continue;  // advice is for runs of several processes
    Config base;
    base.backend = backend.name;
    if (backend.layouts.empty()) {
      if (keep(sharding_of(base))) items.push_back(backend.name);
      continue;
    }
    std::vector<std::string> values;
    std::string key;
    for (const BackendLayout& layout : backend.layouts) {
      Config c = base;
      if (layout.apply) layout.apply(c);
      if (!keep(sharding_of(c))) continue;
      key = layout.key;
      values.push_back(layout.value);
    }
    if (values.empty()) continue;
    const std::string joined =
        values.size() == 1
            ? values.front()
            : fmt::format("{} or {}", fmt::join(values.begin(), values.end() - 1, ", "), values.back());
    items.push_back(flags ? fmt::format("{} with --{} {}", backend.name, key, joined)
                          : fmt::format("{} with {}: {}", backend.name, key, joined));
  }
  const std::string lead = flags ? "--backend " : "backend: ";
  if (items.empty()) return lead + "(none)";
  if (items.size() == 1) return lead + items.front();
  return fmt::format("{}{}, or {}", lead, fmt::join(items.begin(), items.end() - 1, ", "), items.back());
}

}  // namespace accel
