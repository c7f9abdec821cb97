#include "accel/llm/models/tensor_parallel.hpp"

#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "accel/config/config.hpp"
#include "accel/distributed/communicator.hpp"
#include "accel/errors.hpp"
#include "accel/llm/models/empty_weights.hpp"
#include "accel/parallel/tensor_parallel.hpp"
#include "llm/models/tensor_parallel_detail.hpp"

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

// Every size that does not split over the group, named in one UsageError (a user fixes them all at once).
void check_divisible(const ModelConfig& c, int size, bool vocab_parallel) {
  std::string problems;
  const auto check = [&](const char* key, std::int64_t value, const std::string& what) {
    if (value % size == 0) return;
    problems += (problems.empty() ? "" : "; ") + std::string(key) + " " + std::to_string(value) +
                " is not divisible by " + std::to_string(size) + " (each rank " + what + ")";
  };
  check("num_attention_heads", c.num_attention_heads, "computes num_attention_heads / size query heads");
  check("num_key_value_heads", c.num_key_value_heads, "computes num_key_value_heads / size key/value heads");
  check("intermediate_size", c.intermediate_size, "computes intermediate_size / size MLP features");
  if (vocab_parallel) {
    check("vocab_size", c.vocab_size,
          "holds vocab_size / size rows of the head (and embedding) under vocab_parallel / "
          "vocab_parallel_lm_head; the vocabulary is not padded or split unevenly: pad vocab_size in "
          "config.json and the checkpoint, or leave vocab_parallel and DeepSpeed's "
          "tensor_parallel.vocab_parallel_lm_head off");
  }
  if (problems.empty()) return;
  throw UsageError(
      "accel::llm::apply_tensor_parallel: the model (config.json) does not split over the "
      "tensor-parallel size " +
      std::to_string(size) + ": " + problems +
      "; choose a tensor-parallel size (parallelism_config_tp_size / "
      "tensor_parallel.autotp_size) that divides them");
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

// A Megatron VocabParallelEmbedding with transformers' padding_idx (the pad row gets no gradient from the
// lookup, as nn.Embedding(..., padding_idx)): accel::tp's layer holds the slice and is what
// tp::split_parameters finds; the lookup is this one's.
class LlmVocabParallelEmbeddingImpl : public tp::VocabParallelEmbeddingImpl {
 public:
  LlmVocabParallelEmbeddingImpl(const torch::nn::Embedding& full, std::shared_ptr<Communicator> group,
                                std::optional<std::int64_t> padding_idx)
      : tp::VocabParallelEmbeddingImpl(full, std::move(group)), padding_idx_(padding_idx) {}

  torch::Tensor lookup(const torch::Tensor& ids) {
    if (at::isFloatingType(ids.scalar_type()) || at::isComplexType(ids.scalar_type()) ||
        ids.scalar_type() == torch::kBool)
      throw UsageError(std::string("accel::llm: input_ids of type ") + c10::toString(ids.scalar_type()) +
                       "; pass integer ids (torch::kLong)");
    // The same ids on every rank: an id no rank holds is refused everywhere alike, not looked up as zeros.
    if (ids.numel() > 0) {
      const auto low = ids.min().item<std::int64_t>(), high = ids.max().item<std::int64_t>();
      if (low < 0 || high >= options.num_embeddings())
        throw UsageError("accel::llm: input id " + std::to_string(low < 0 ? low : high) +
                         " is outside the vocabulary [0, " + std::to_string(options.num_embeddings()) +
                         ") of model.embed_tokens (vocab_size); check the tokenizer against config.json");
    }
    const auto first = first_row(), rows = local_rows();
    const auto outside = ids.lt(first).logical_or(ids.ge(first + rows));
    std::int64_t pad = -1;  // ATen's "no padding row"
    if (padding_idx_ && *padding_idx_ >= first && *padding_idx_ < first + rows) pad = *padding_idx_ - first;
    auto looked_up = torch::embedding(weight, (ids - first).masked_fill(outside, 0), pad);
    return tp::reduce_from_tensor_parallel(looked_up.masked_fill(outside.unsqueeze(-1), 0), communicator());
  }

 private:
  std::optional<std::int64_t> padding_idx_;
};

// `p` made readable without memory (zeros broadcast to its shape), so that a layer can be split from a
// model built empty; the split layer is emptied again afterwards.
void zero_stand_in(torch::Tensor p) {
  if (detail::is_empty_parameter(p)) p.set_data(torch::zeros({}, p.options()).expand(p.sizes()));
}

// The tensor-parallel layer for the full Linear `full`: column (output rows) or row (input columns). From an
// empty model (from_pretrained_empty) the slices are empty too, for load_pretrained_slices.
std::shared_ptr<torch::nn::Module> split_linear(const std::shared_ptr<torch::nn::LinearImpl>& full,
                                                const std::shared_ptr<Communicator>& group, bool column) {
  const bool empty = detail::is_empty_parameter(full->weight);
  const auto device = full->weight.device();
  for (auto& p : full->parameters())
    zero_stand_in(p);
  const torch::nn::Linear holder(full);
  std::shared_ptr<torch::nn::Module> layer;
  if (column) {
    layer = tp::ColumnParallelLinear(holder, group).ptr();
  } else {
    layer = tp::RowParallelLinear(holder, group, /*input_is_parallel=*/true).ptr();
  }
  if (empty) detail::empty_parameters(*layer, device);
  return layer;
}

// Where the embedding and an untied head are, checked before any change. `embedding` is null when it stays
// whole (DeepSpeed's vocab_parallel_lm_head on an untied model).
struct VocabSites {
  std::shared_ptr<torch::nn::EmbeddingImpl> embedding;
  std::shared_ptr<torch::nn::LinearImpl> head;  // null when tied
};

VocabSites collect_vocab_sites(CausalLMImpl& model, bool head_only) {
  VocabSites v;
  if (head_only && !model.config().tie_word_embeddings) {
    v.head = full_linear(model, "lm_head", "lm_head");
    return v;
  }
  const auto inner = model.model->named_children();
  const auto* embed = inner.find("embed_tokens");
  if (embed != nullptr) v.embedding = std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(*embed);
  if (!v.embedding)
    throw UsageError(
        "accel::llm::apply_tensor_parallel: vocab_parallel needs model.embed_tokens to be a "
        "torch::nn::Embedding; it is " +
        (embed == nullptr ? std::string("missing") : "a " + (*embed)->name()) +
        " (already split over the vocabulary?)");
  if (model.config().tie_word_embeddings) return v;
  v.head = full_linear(model, "lm_head", "lm_head");
  return v;
}

void split_vocabulary(CausalLMImpl& model, const VocabSites& v, const std::shared_ptr<Communicator>& group) {
  if (v.head) model.replace_module("lm_head", split_linear(v.head, group, /*column=*/true));
  if (!v.embedding) return;
  const auto& full = v.embedding->weight;
  const bool empty = detail::is_empty_parameter(full);
  const auto device = full.device();
  // A stand-in without padding_idx over the same values (no copy), which accel::tp's layer slices.
  const auto values = empty ? torch::zeros({}, full.options()).expand(full.sizes()) : full.detach();
  const torch::nn::Embedding stand_in(
      torch::nn::EmbeddingOptions(full.size(0), full.size(1))._weight(values));
  auto split =
      std::make_shared<LlmVocabParallelEmbeddingImpl>(stand_in, group, v.embedding->options.padding_idx());
  if (empty) detail::empty_parameters(*split, device);
  model.model->replace_module("embed_tokens", split);
  model.model->embed_tokens = torch::nn::Embedding(nullptr);  // the full table is freed
}

}  // namespace

void apply_tensor_parallel(CausalLMImpl& model, const std::shared_ptr<Communicator>& group,
                           const TensorParallelOptions& options) {
  if (!group)
    throw UsageError(
        "accel::llm::apply_tensor_parallel: the tensor-parallel group is null (pass "
        "accelerator.tensor_parallel_group())");
  if (options.vocab_parallel_ && options.vocab_parallel_lm_head_)
    throw UsageError(
        "accel::llm::apply_tensor_parallel: vocab_parallel and vocab_parallel_lm_head (DeepSpeed's "
        "tensor_parallel.vocab_parallel_lm_head) are both set, and they differ for an untied model "
        "(vocab_parallel also splits embed_tokens, DeepSpeed's key leaves it whole); set one of them");
  const int size = group->world_size();
  if (size == 1) return;
  const bool vocab_split = options.vocab_parallel_ || options.vocab_parallel_lm_head_;
  check_divisible(model.config(), size, vocab_split);
  auto sites = collect_sites(model);  // every check before any change
  std::optional<VocabSites> vocab;
  if (vocab_split) vocab = collect_vocab_sites(model, options.vocab_parallel_lm_head_);
  for (auto& site : sites)
    site.parent->replace_module(site.name, split_linear(site.full, group, site.column));
  sites.clear();  // the full layers are freed
  if (vocab) split_vocabulary(model, *vocab, group);
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

TensorParallelOptions tensor_parallel_options(const Config& config) {
  return TensorParallelOptions().vocab_parallel_lm_head(config.backend == "zero" &&
                                                        config.zero.vocab_parallel_lm_head);
}

void load_pretrained_slices(CausalLMImpl& model, const std::string& dir) {
  const auto splits = tp::split_parameters(model);
  std::vector<detail::CheckpointPart> parts;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    detail::CheckpointPart part;
    part.name = item.key();
    part.into = item.value();
    part.full_shape = item.value().sizes().vec();
    if (const auto s = splits.find(item.key()); s != splits.end()) {
      part.full_shape[static_cast<std::size_t>(s->second.dim)] = s->second.full;
      part.dim = s->second.dim;
      part.first = s->second.first;
      part.length = s->second.length;
    }
    parts.push_back(std::move(part));
  }
  detail::read_checkpoint_parts(dir, parts, model.config());
}

CausalLM from_pretrained_tensor_parallel(const std::string& dir, const std::shared_ptr<Communicator>& group,
                                         const LoadOptions& load, const TensorParallelOptions& options) {
  if (load.load_in_4bit_)
    throw UsageError("accel::llm::from_pretrained_tensor_parallel('" + dir +
                     "'): load_in_4bit is refused: tensor parallelism splits full-precision projections only "
                     "(load without load_in_4bit)");
  auto model = from_pretrained_empty(dir, load);
  apply_tensor_parallel(*model, group, options);
  load_pretrained_slices(*model, dir);
  return model;
}

namespace detail {

torch::Tensor vocab_parallel_embed(torch::nn::Module& embedding, const torch::Tensor& ids) {
  if (auto* e = dynamic_cast<LlmVocabParallelEmbeddingImpl*>(&embedding)) return e->lookup(ids);
  if (auto* e = dynamic_cast<tp::VocabParallelEmbeddingImpl*>(&embedding)) return e->forward(ids);
  return {};
}

std::shared_ptr<Communicator> vocab_parallel_group(const CausalLMImpl& model) {
  if (model.config().tie_word_embeddings) {
    const auto children = model.model->named_children();
    const auto* embed = children.find("embed_tokens");
    if (embed == nullptr) return nullptr;
    const auto* e = dynamic_cast<const tp::VocabParallelEmbeddingImpl*>(embed->get());
    return e != nullptr ? e->communicator() : nullptr;
  }
  const auto children = model.named_children();
  const auto* head = children.find("lm_head");
  if (head == nullptr) return nullptr;
  const auto* c = dynamic_cast<const tp::ColumnParallelLinearImpl*>(head->get());
  return c != nullptr && !c->options.gather_output() ? c->communicator() : nullptr;
}

torch::Tensor vocab_parallel_logits(CausalLMImpl& model, const torch::Tensor& hidden) {
  if (model.config().tie_word_embeddings) {
    auto* e = model.model->named_children()["embed_tokens"]->as<tp::VocabParallelEmbeddingImpl>();
    return torch::linear(tp::copy_to_tensor_parallel(hidden, e->communicator()), e->weight);
  }
  return model.named_children()["lm_head"]->as<tp::ColumnParallelLinearImpl>()->forward(hidden);
}

torch::Tensor vocab_parallel_plain_weight(CausalLMImpl& model) {
  if (model.config().tie_word_embeddings) {
    const auto embed = model.model->named_children()["embed_tokens"];
    auto* e = embed->as<tp::VocabParallelEmbeddingImpl>();
    return e != nullptr && embed->children().empty() ? e->weight : torch::Tensor();
  }
  const auto head = model.named_children()["lm_head"];
  auto* c = head->as<tp::ColumnParallelLinearImpl>();
  if (c == nullptr || !head->children().empty() || (c->bias.defined() && c->bias.numel() > 0)) return {};
  return c->weight;
}

}  // namespace detail

}  // namespace accel::llm
