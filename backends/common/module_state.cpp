#include "module_state.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>

namespace accel::backends::detail {

NamedTensors module_state(torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_parameters())
    out.emplace_back(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers())
    out.emplace_back(item.key(), item.value().detach());
  return out;
}

NamedTensors module_state_copy(torch::nn::Module& module) {
  auto out = module_state(module);
  for (auto& [name, t] : out)
    t = t.clone();
  return out;
}

NamedTensors module_buffers(torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_buffers())
    out.emplace_back(item.key(), item.value().detach());
  return out;
}

void check_module_state(const torch::nn::Module& module, const std::map<std::string, torch::Tensor>& state) {
  auto check = [&](const std::string& name, const torch::Tensor& dst) {
    auto it = state.find(name);
    if (it == state.end()) {
      throw CheckpointError(fmt::format(
          "checkpoint has no tensor '{}' for the model; was it saved from the same model architecture?",
          name));
    }
    if (it->second.sizes() != dst.sizes()) {
      throw CheckpointError(fmt::format("checkpoint tensor '{}' has shape [{}] but the model expects [{}]",
                                        name, fmt::join(it->second.sizes(), ", "),
                                        fmt::join(dst.sizes(), ", ")));
    }
    if (it->second.is_floating_point() != dst.is_floating_point()) {
      throw CheckpointError(fmt::format(
          "checkpoint tensor '{}' is {} but the model's is {}: integers and floating point do not convert "
          "into each other; was it saved from the same model?",
          name, c10::toString(it->second.scalar_type()), c10::toString(dst.scalar_type())));
    }
  };
  for (const auto& item : module.named_parameters())
    check(item.key(), item.value());
  for (const auto& item : module.named_buffers())
    check(item.key(), item.value());
}

void load_module_state(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  // Every tensor is checked before the first is copied: a checkpoint of another architecture leaves the
  // model as it was.
  check_module_state(module, state);
  for (const auto& item : module.named_parameters())
    item.value().copy_(state.at(item.key()));
  for (const auto& item : module.named_buffers())
    item.value().copy_(state.at(item.key()));
}

NamedTensors converted(const NamedTensors& state, c10::ScalarType dtype) {
  NamedTensors out;
  for (const auto& [name, t] : state)
    out.emplace_back(name, t.is_floating_point() ? t.to(dtype) : t);
  return out;
}

std::vector<std::pair<std::string, NamedTensors>> model_16bit_files(
    const NamedTensors& full_state, const std::optional<c10::ScalarType>& dtype) {
  if (!dtype) return {};
  return {{"model_16bit", converted(full_state, *dtype)}};
}

std::vector<std::pair<std::string, torch::Tensor>> take_over_model(Communicator& comm,
                                                                   torch::nn::Module& model,
                                                                   const std::string& who) {
  check_same_model_everywhere(comm, model, who);
  broadcast_module(comm, model);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model.named_parameters())
    out.emplace_back(item.key(), item.value());
  return out;
}

void check_same_model_everywhere(Communicator& comm, torch::nn::Module& model, const std::string& who) {
  std::string signature;
  for (const auto& item : model.named_parameters()) {
    signature += fmt::format("{}:[{}];", item.key(), fmt::join(item.value().sizes(), ","));
  }
  for (const auto& item : model.named_buffers()) {
    signature += fmt::format("{}:[{}];", item.key(), fmt::join(item.value().sizes(), ","));
  }
  const auto all = comm.exchange(signature);
  for (int r = 1; r < comm.world_size(); ++r) {
    if (all[static_cast<std::size_t>(r)] != all[0]) {
      throw DistributedError(
          fmt::format("{}: the model on rank {} differs from rank 0's: {}; every rank must build "
                      "the same model",
                      who, r, first_difference(all[0], all[static_cast<std::size_t>(r)])));
    }
  }
}

void broadcast_module(Communicator& comm, torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters())
    comm.broadcast(p, 0);
  for (auto& b : model.buffers())
    comm.broadcast(b, 0);
}

std::string first_difference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  std::string ea, eb;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(sa, ea, ';'));
    const bool gb = static_cast<bool>(std::getline(sb, eb, ';'));
    if (!ga && !gb) return "identical";
    if (!ga) ea = "<nothing>";
    if (!gb) eb = "<nothing>";
    if (ea != eb) return fmt::format("'{}' on rank 0 vs '{}'", ea, eb);
  }
}

}  // namespace accel::backends::detail
