#include "unit_plan.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace accel::backends::detail {
namespace {

// The model's module types (Module::name()), first seen first, the first 12 of them, for error messages.
std::string module_types(const torch::nn::Module& model) {
  std::vector<std::string> seen;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (std::find(seen.begin(), seen.end(), m->name()) == seen.end()) seen.push_back(m->name());
  std::string out;
  for (std::size_t i = 0; i < seen.size() && i < 12; ++i)
    out += (i > 0 ? ", " : "") + seen[i];
  return seen.size() > 12 ? out + ", ..." : out;
}

class Planner {
 public:
  Planner(torch::nn::Module& model, const UnitPlanOptions& options) : options_(options) {
    for (const auto& item : model.named_parameters()) {
      index_by_name_[item.key()] = numel_.size();
      numel_.push_back(item.value().numel());
    }
    assigned_.assign(numel_.size(), false);
    if (options_.policy == UnitPolicy::ClassBased) {
      classes_ = options_.wrap_classes;
      if (classes_.empty()) classes_.push_back(repeated_block_class(model));
      check_classes_exist(model);
    }
    auto rest = walk(model, "", true);
    if (!rest.empty()) add("<root>", std::move(rest));
  }

  std::vector<PlannedUnit> units;

 private:
  /// Assigns parameters of `m`'s subtree to units bottom-up; returns the ones left for the parent.
  std::vector<std::size_t> walk(torch::nn::Module& m, const std::string& prefix, bool root) {
    std::vector<std::size_t> rest;
    for (const auto& item : m.named_parameters(/*recurse=*/false)) {
      auto it = index_by_name_.find(prefix + item.key());
      if (it == index_by_name_.end() || assigned_[it->second]) continue;  // reached under another name
      assigned_[it->second] = true;
      rest.push_back(it->second);
    }
    for (const auto& child : m.named_children()) {
      auto sub = walk(*child.value(), prefix + child.key() + ".", false);
      if (sub.empty()) continue;
      if (wraps(*child.value(), sub, root)) {
        add(prefix + child.key(), std::move(sub));
      } else {
        rest.insert(rest.end(), sub.begin(), sub.end());
      }
    }
    return rest;
  }

  bool wraps(const torch::nn::Module& child, const std::vector<std::size_t>& params,
             bool parent_is_root) const {
    switch (options_.policy) {
      case UnitPolicy::PerModule:
        return true;
      case UnitPolicy::PerChild:
        return parent_is_root;
      case UnitPolicy::SizeBased: {
        std::int64_t total = 0;
        for (auto i : params)
          total += numel_[i];
        return total >= options_.min_num_params;
      }
      case UnitPolicy::ClassBased:
        return std::any_of(classes_.begin(), classes_.end(),
                           [&](const std::string& c) { return is_class(child, c); });
      case UnitPolicy::Whole:
        return false;
    }
    return false;
  }

  // `c` names `m`'s class: its name() ("torch::nn::LinearImpl"), without the namespace, or without "Impl".
  static bool is_class(const torch::nn::Module& m, const std::string& c) {
    const auto full = m.name();
    const auto colon = full.rfind(':');
    const auto bare = full.substr(colon == std::string::npos ? 0 : colon + 1);
    const auto without_impl = bare.size() > 4 && bare.compare(bare.size() - 4, 4, "Impl") == 0
                                  ? bare.substr(0, bare.size() - 4)
                                  : bare;
    return c == full || c == bare || c == without_impl;
  }

  // As Accelerate's set_auto_wrap_policy ("Could not find the transformer layer class to wrap in the
  // model"): a listed class the model does not use would silently leave its layers in the root unit.
  void check_classes_exist(const torch::nn::Module& model) const {
    const auto modules = model.modules(/*include_self=*/true);
    for (const auto& c : classes_) {
      const bool found =
          std::any_of(modules.begin(), modules.end(), [&](const auto& m) { return is_class(*m, c); });
      if (!found) {
        throw UsageError(fmt::format(
            "fsdp_transformer_layer_cls_to_wrap names '{}', but the model has no module of that class (its "
            "classes: {}); Accelerate refuses this too (\"Could not find the transformer layer class to "
            "wrap in the model\"). Name the class of the model's repeated block as Module::name() gives it "
            "(with or without namespace and Impl)",
            c, module_types(model)));
      }
    }
  }

  void add(const std::string& name, std::vector<std::size_t> params) {
    std::sort(params.begin(), params.end());  // model order
    units.push_back({name, std::move(params)});
  }

  const UnitPlanOptions& options_;
  std::vector<std::string> classes_;  // ClassBased: the options' list, or the model's repeated block class
  std::map<std::string, std::size_t> index_by_name_;
  std::vector<std::int64_t> numel_;
  std::vector<bool> assigned_;
};

}  // namespace

std::vector<PlannedUnit> plan_units(torch::nn::Module& model, const UnitPlanOptions& options) {
  return Planner(model, options).units;
}

std::string repeated_block_class(const torch::nn::Module& model) {
  std::string best;
  std::int64_t best_params = -1;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    const auto container = m->name();
    static const std::vector<std::string> kContainers = {
        "torch::nn::ModuleListImpl", "torch::nn::SequentialImpl", "torch::nn::ModuleDictImpl"};
    if (std::find(kContainers.begin(), kContainers.end(), container) == kContainers.end()) continue;
    std::vector<std::string> order;
    std::map<std::string, std::pair<int, std::int64_t>> by_type;  // instances, parameters
    for (const auto& child : m->children()) {
      auto [it, fresh] = by_type.try_emplace(child->name(), 0, 0);
      if (fresh) order.push_back(child->name());
      it->second.first += 1;
      for (const auto& p : child->parameters())
        it->second.second += p.numel();
    }
    for (const auto& type : order) {
      const auto& [instances, params] = by_type.at(type);
      if (instances >= 2 && params > best_params) {
        best = type;
        best_params = params;
      }
    }
  }
  if (best.empty()) {
    throw UsageError(fmt::format(
        "fsdp_config.fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP without "
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap wraps the module type repeated in a ModuleList or "
        "Sequential (Accelerate takes a Hugging Face model's _no_split_modules, which LibTorch modules do "
        "not "
        "have), but this model repeats none (its types: {}); name the class to wrap in "
        "fsdp_transformer_layer_cls_to_wrap, or use SIZE_BASED_WRAP or PER_CHILD_WRAP",
        module_types(model)));
  }
  return best;
}

}  // namespace accel::backends::detail

namespace accel::backends {

std::int64_t model_hidden_size(const torch::nn::Module& model) {
  std::map<std::int64_t, int> widths;
  for (const auto& p : model.parameters()) {
    if (p.dim() == 2) ++widths[p.size(1)];
  }
  std::int64_t best = 0;
  int count = 0;
  for (const auto& [width, n] : widths) {  // ascending: a later equal count is a larger width
    if (n >= count) {
      best = width;
      count = n;
    }
  }
  return best;
}

std::uint64_t auto_bucket_bytes(const torch::nn::Module& model, double factor, std::size_t element_size) {
  const auto h = static_cast<double>(model_hidden_size(model));
  if (h == 0) return 500000000;
  // Not below 1 MiB (DDP's first bucket): a model whose only matrix is small (a CNN ending in Linear(64, 10))
  // would otherwise be reduced in thousands of tiny buckets per step.
  constexpr std::uint64_t kFloor = 1u << 20;
  return std::max<std::uint64_t>(kFloor, static_cast<std::uint64_t>(factor * h * h) * element_size);
}

}  // namespace accel::backends
