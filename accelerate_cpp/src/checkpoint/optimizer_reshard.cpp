#include "checkpoint/optimizer_reshard.hpp"

#include "checkpoint/optimizer_state.hpp"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>

namespace accel::detail {
namespace {

constexpr const char* kStateNames[] = {"step",       "exp_avg",         "exp_avg_sq", "max_exp_avg_sq",
                                       "square_avg", "momentum_buffer", "grad_avg",   "sum"};

}  // namespace

std::string qualified_name(std::size_t model, const std::string& name) {
  return model == 0 ? name : fmt::format("{}:{}", model, name);
}

std::vector<OptimizerTensorLayout> identity_layouts(const torch::optim::Optimizer& optimizer,
                                                    const std::vector<torch::nn::Module*>& models) {
  std::map<const void*, std::string> names;
  for (std::size_t i = 0; i < models.size(); ++i) {
    for (const auto& item : models[i]->named_parameters())
      names.emplace(item.value().unsafeGetTensorImpl(), qualified_name(i, item.key()));
  }
  std::vector<OptimizerTensorLayout> out;
  for (const auto& pg : optimizer.param_groups()) {
    for (const auto& t : pg.params()) {
      const auto it = names.find(t.unsafeGetTensorImpl());
      if (it == names.end()) return {};
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
    for (const auto& item : models[i]->named_parameters())
      shapes[qualified_name(i, item.key())] = item.value().sizes().vec();
  }
  return shapes;
}

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

NamedTensors consolidate_optimizer_state(const torch::optim::Optimizer& optimizer,
                                         const std::vector<OptimizerTensorLayout>& layouts,
                                         const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                         const std::function<torch::Tensor(const torch::Tensor&)>& all_gather,
                                         bool keep) {
  NamedTensors out;
  std::size_t k = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& pg = optimizer.param_groups()[g];
    if (keep) {
      out.emplace_back(fmt::format("param_groups/{}/lr", g),
                       torch::tensor(pg.options().get_lr(), torch::kFloat64));
    }
    for (const auto& t : pg.params()) {
      const auto& layout = layouts.at(k++);
      const auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;  // never stepped (the same on every rank)
      for (const auto& [name, value] : named_state(*it->second)) {
        if (!value.defined()) continue;
        if (name == "step") {
          for (const auto& piece : layout.pieces) {
            if (keep) out.emplace_back(piece.param + "/step", value.clone());
          }
          continue;
        }
        const auto flat = layout.length == layout.flat_numel ? value.reshape({-1})
                                                             : all_gather(value.reshape({-1}).contiguous());
        if (!keep) continue;
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

void restore_optimizer_state(torch::optim::Optimizer& optimizer,
                             const std::vector<OptimizerTensorLayout>& layouts,
                             const std::function<torch::Tensor(const std::string& key)>& lookup) {
  const auto kind = optimizer_kind(optimizer);
  optimizer.state().clear();
  std::size_t k = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto& pg = optimizer.param_groups()[g];
    if (const auto lr = lookup(fmt::format("param_groups/{}/lr", g)); lr.defined())
      pg.options().set_lr(lr.item<double>());
    for (const auto& t : pg.params()) {
      const auto& layout = layouts.at(k++);
      std::map<std::string, torch::Tensor> named;
      for (const char* name : kStateNames) {
        std::vector<torch::Tensor> saved;
        bool present = false;
        for (const auto& piece : layout.pieces) {
          saved.push_back(lookup(piece.param + "/" + name));
          present = present || saved.back().defined();
        }
        if (!present) continue;
        if (std::string(name) == "step") {
          std::int64_t step = 0;
          for (const auto& s : saved) {
            if (s.defined()) step = std::max(step, s.item<std::int64_t>());
          }
          named["step"] = torch::tensor(step, torch::kInt64);
          continue;
        }
        auto flat = torch::zeros({layout.flat_numel}, t.options().requires_grad(false).device(torch::kCPU));
        for (std::size_t p = 0; p < layout.pieces.size(); ++p) {
          if (saved[p].defined()) {
            flat.narrow(0, layout.pieces[p].offset, layout.pieces[p].numel).copy_(saved[p].reshape({-1}));
          }
        }
        named[name] = flat.narrow(0, layout.begin, layout.length).clone().view(t.sizes()).to(t.device());
      }
      if (named.empty()) continue;  // this tensor's parameters had not stepped when the state was saved
      optimizer.state()[t.unsafeGetTensorImpl()] = make_state(kind, named);
    }
  }
}

}  // namespace accel::detail
