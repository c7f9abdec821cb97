#include "accel/llm/models/tensor_parallel.hpp"

#include <torch/torch.h>

#include <string>
#include <vector>

#include "accel/distributed/communicator.hpp"
#include "accel/errors.hpp"
#include "accel/parallel/tensor_parallel.hpp"

namespace accel::llm {
namespace {

// One projection to split: where it is registered, the full layer, and which way it is cut.
struct Site {
  torch::nn::Module* parent = nullptr;
  std::string name;
  std::string path;
  std::shared_ptr<torch::nn::LinearImpl> full;
  bool column = true;
};

void check_divisible(const ModelConfig& c, int size) {
  const auto refuse = [&](const char* key, std::int64_t value, const char* what) {
    throw UsageError("accel::llm::apply_tensor_parallel: " + std::string(key) + " " + std::to_string(value) +
                     " of the model (config.json) is not divisible by the tensor-parallel size " +
                     std::to_string(size) + ": each rank computes " + what +
                     "; choose a tensor-parallel size (parallelism_config_tp_size / "
                     "tensor_parallel.autotp_size) that divides it");
  };
  if (c.num_attention_heads % size != 0)
    refuse("num_attention_heads", c.num_attention_heads, "num_attention_heads / size query heads");
  if (c.num_key_value_heads % size != 0)
    refuse("num_key_value_heads", c.num_key_value_heads, "num_key_value_heads / size key/value heads");
  if (c.intermediate_size % size != 0)
    refuse("intermediate_size", c.intermediate_size, "intermediate_size / size MLP features");
}

// The registered child `name` of `parent` (path `path`) as a full Linear, or a UsageError saying why not.
std::shared_ptr<torch::nn::LinearImpl> full_linear(torch::nn::Module& parent, const std::string& name,
                                                   const std::string& path) {
  const auto children = parent.named_children();
  const auto* child = children.find(name);
  if (child == nullptr)
    throw UsageError("accel::llm::apply_tensor_parallel: the model has no module '" + path + "'");
  auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(*child);
  if (!linear) {
    throw UsageError("accel::llm::apply_tensor_parallel: '" + path + "' is a " + (*child)->name() +
                     ", not a torch::nn::Linear: only full-precision projections are split (a 4-bit "
                     "quant::Linear4bit cannot be: load without load_in_4bit; a tensor-parallel layer is "
                     "already split)");
  }
  if (linear->named_children().contains("lora_A")) {
    throw UsageError("accel::llm::apply_tensor_parallel: '" + path +
                     "' has LoRA adapters: split the model first, then call accel::peft::get_peft_model "
                     "(LoRA adapts the tensor-parallel layers)");
  }
  return linear;
}

std::vector<Site> collect_sites(CausalLMImpl& model) {
  std::vector<Site> sites;
  std::int64_t index = 0;
  for (const auto& block : *model.model->layers) {
    const std::string prefix = "model.layers." + std::to_string(index++) + ".";
    const auto parts = block->named_children();
    for (const char* part : {"self_attn", "mlp"}) {
      const auto* holder = parts.find(part);
      if (holder == nullptr)
        throw UsageError("accel::llm::apply_tensor_parallel: the model has no module '" + prefix + part +
                         "'");
      torch::nn::Module& parent = **holder;
      const bool attention = std::string(part) == "self_attn";
      const std::vector<std::pair<const char*, bool>> names =
          attention ? std::vector<std::pair<const char*, bool>>{{"q_proj", true},
                                                                {"k_proj", true},
                                                                {"v_proj", true},
                                                                {"o_proj", false}}
                    : std::vector<std::pair<const char*, bool>>{
                          {"gate_proj", true}, {"up_proj", true}, {"down_proj", false}};
      for (const auto& [name, column] : names) {
        const std::string path = prefix + part + "." + name;
        sites.push_back({&parent, name, path, full_linear(parent, name, path), column});
      }
    }
  }
  return sites;
}

// A weight applied to this rank's heads only (Qwen3's q_norm / k_norm, per head_dim): its gradient here is
// the sum over this rank's heads; the sum over the group's ranks is the whole model's.
void sum_gradient_over_group(torch::Tensor& weight, const std::shared_ptr<Communicator>& group) {
  if (!weight.requires_grad()) return;
  weight.register_hook([group](const torch::Tensor& grad) {
    auto sum = grad.clone();
    group->all_reduce(sum, ReduceOp::Sum);
    return sum;
  });
}

}  // namespace

void apply_tensor_parallel(CausalLMImpl& model, const std::shared_ptr<Communicator>& group) {
  if (!group)
    throw UsageError(
        "accel::llm::apply_tensor_parallel: the tensor-parallel group is null (pass "
        "accelerator.tensor_parallel_group())");
  const int size = group->world_size();
  if (size == 1) return;
  check_divisible(model.config(), size);
  auto sites = collect_sites(model);  // every check before any change
  for (auto& site : sites) {
    const torch::nn::Linear full(std::move(site.full));
    if (site.column) {
      site.parent->replace_module(site.name, tp::ColumnParallelLinear(full, group));
    } else {
      site.parent->replace_module(site.name, tp::RowParallelLinear(full, group, /*input_is_parallel=*/true));
    }
  }
  if (!model.config().qk_norm) return;
  for (const auto& block : *model.model->layers) {
    const auto attention = block->named_children()["self_attn"];
    for (const auto& norm : attention->named_children()) {
      if (norm.key() != "q_norm" && norm.key() != "k_norm") continue;
      for (auto& p : norm.value()->parameters(/*recurse=*/false))
        sum_gradient_over_group(p, group);
    }
  }
}

}  // namespace accel::llm
