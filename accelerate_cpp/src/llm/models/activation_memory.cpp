// The activations a CausalLM training step keeps (activation_memory.hpp), tensor by tensor as causal_lm.cpp,
// fused_layer_ops.cpp, LoRA's adapters (nn/lora.cpp) and the fused loss (training/) save them.
#include "accel/llm/models/activation_memory.hpp"

#include "accel/errors.hpp"

#include <algorithm>
#include <string>

namespace accel::llm {

namespace {

// One tensor of a block, per token: its elements and bytes per element; `saved` once some node keeps it.
struct Tensor {
  double elements = 0;
  double element_bytes = 4;
  bool saved = false;
  double bytes() const { return saved ? elements * element_bytes : 0; }
};

struct BlockShape {
  double hidden, intermediate, q, kv, heads, kv_heads, e;  // e: bytes per element of the model's dtype
  bool qk_norm;
};

// Bytes per token one block keeps for backward; `input_grad`: whether its input needs a gradient (not under
// LoRA for the first block, whose input is the frozen embedding's output).
class BlockSaves {
 public:
  BlockSaves(const BlockShape& s, const ActivationMemoryOptions& o)
      : s_(s), o_(o), full_(o.lora_target_modules.empty()) {}

  double bytes(bool input_grad) {
    const double H = s_.hidden, I = s_.intermediate, e = s_.e;
    Tensor x{H, e}, rstd1{1, 4}, n1{H, e}, q{s_.q, e}, q_rstd{s_.heads, 4}, k{s_.kv, e},
        k_rstd{s_.kv_heads, 4};
    Tensor q_rot{s_.q, e}, k_rot{s_.kv, e}, v{s_.kv, e}, out{s_.q, e}, lse{s_.heads, 4};
    Tensor h{H, e}, rstd2{1, 4}, n2{H, e}, gate{I, e}, act{I, e}, up{I, e}, product{I, e};
    adapters_ = 0;
    const bool n1_grad = norm(x, rstd1, input_grad);
    bool q_grad = project("q_proj", n1, n1_grad);
    bool k_grad = project("k_proj", n1, n1_grad);
    const bool v_grad = project("v_proj", n1, n1_grad);
    if (s_.qk_norm) {  // q_norm / k_norm (Qwen3) before the rotary embedding
      q_grad = norm(q, q_rstd, q_grad);
      k_grad = norm(k, k_rstd, k_grad);
    }
    // The rotary embedding keeps only cos and sin (counted once per step); SDPA's CPU flash kernel keeps
    // q, k, v, its output and the log-sum-exp when any of them needs a gradient.
    const bool attention_grad = q_grad || k_grad || v_grad;
    for (Tensor* t : {&q_rot, &k_rot, &v, &out, &lse})
      t->saved = t->saved || attention_grad;
    // o_proj reads out.transpose(1, 2).reshape(...): a view, as the CPU kernel lays its output out as the
    // query is laid out (the projection's [B, T, heads, d]).
    const bool o_grad = project("o_proj", out, attention_grad);
    const bool n2_grad = norm(h, rstd2, input_grad || o_grad);
    const bool gate_grad = project("gate_proj", n2, n2_grad);
    const bool up_grad = project("up_proj", n2, n2_grad);
    gate.saved = gate_grad;  // silu keeps its input
    act.saved = up_grad;     // silu(gate) * up keeps each factor for the other's gradient
    up.saved = gate_grad;
    project("down_proj", product, gate_grad || up_grad);
    double sum = adapters_;
    for (const Tensor* t : {&x, &rstd1, &n1, &q, &q_rstd, &k, &k_rstd, &q_rot, &k_rot, &v, &out, &lse, &h,
                            &rstd2, &n2, &gate, &act, &up, &product})
      sum += t->bytes();
    return sum;
  }

 private:
  // The fused RMSNorm keeps its input and rstd (float32) when the input or the weight (full fine-tuning)
  // needs a gradient. Returns whether its output does.
  bool norm(Tensor& in, Tensor& rstd, bool in_grad) const {
    const bool grad = in_grad || full_;
    if (grad) in.saved = rstd.saved = true;
    return grad;
  }

  bool adapted(const std::string& name) const {
    const auto& t = o_.lora_target_modules;
    const bool all_linear = t.size() == 1 && (t[0] == "all-linear" || t[0] == "ALL-LINEAR");
    return all_linear || std::find(t.begin(), t.end(), name) != t.end();
  }

  // A projection: a trained weight keeps the input (its gradient is g^T x); a frozen one keeps nothing of its
  // input (at::linear / OneDnnLinear / Linear4bit save the weight or the codes only). A LoRA adapter
  // (float32) keeps its dropped input, the dropout's mask (float32, as CPU dropout multiplies by a noise
  // tensor; only when the input needs a gradient) and lora_A's output; without dropout the input itself (a
  // float32 copy of it on a bf16 / fp16 base). Returns whether the output needs a gradient.
  bool project(const std::string& name, Tensor& in, bool in_grad) {
    const bool lora = !full_ && adapted(name);
    if (full_) in.saved = true;
    if (lora) {
      if (o_.lora_dropout > 0) {
        adapters_ += in.elements * 4 * (in_grad ? 2 : 1);
      } else if (s_.e == 4) {
        in.saved = true;
      } else {
        adapters_ += in.elements * 4;
      }
      adapters_ += static_cast<double>(o_.lora_r) * 4;
    }
    return full_ || lora || in_grad;
  }

  BlockShape s_;
  const ActivationMemoryOptions& o_;
  bool full_;
  double adapters_ = 0;
};

// at::CPUGeneratorImpl::get_state(): the mt19937 state and the normal-distribution cache, a uint8 tensor.
constexpr std::uint64_t kCheckpointRngBytes = 5056;

double element_bytes(const std::string& dtype) {
  if (dtype == "float32" || dtype == "fp32" || dtype == "no") return 4;
  if (dtype == "bfloat16" || dtype == "bf16" || dtype == "float16" || dtype == "fp16") return 2;
  throw ConfigError("estimate_activation_memory: dtype '" + dtype +
                    "' is not one of float32, bfloat16, float16");
}

// The fused loss's rows per chunk (training/chunked_loss_detail.hpp: chunk_rows and balanced_rows with
// chunk_tokens 0): a 256 MiB float32 target, in equal chunks of at most 1.25 x it.
std::int64_t loss_chunk_rows(std::int64_t vocab, std::int64_t counted) {
  const std::int64_t target = std::max<std::int64_t>(16, (256LL << 20) / (vocab * 4));
  if (counted <= 0) return 0;
  const std::int64_t most = target + target / 4;
  const std::int64_t chunks = (counted + most - 1) / most;
  return (counted + chunks - 1) / chunks;
}

void check(const ModelConfig& c, const ActivationMemoryOptions& o) {
  if (o.sequence_length <= 0 || o.micro_batch_size <= 0)
    throw ConfigError("estimate_activation_memory: sequence_length (" + std::to_string(o.sequence_length) +
                      ") and micro_batch_size (" + std::to_string(o.micro_batch_size) +
                      ") must be positive: give --max_length and --per_device_train_batch_size");
  if (!o.lora_target_modules.empty() && o.lora_r <= 0)
    throw ConfigError("estimate_activation_memory: lora_r must be positive, got " + std::to_string(o.lora_r));
  if (c.hidden_size <= 0 || c.num_hidden_layers <= 0 || c.num_attention_heads <= 0 || c.head_dim <= 0)
    throw ConfigError("estimate_activation_memory: the model config has no sizes (hidden_size " +
                      std::to_string(c.hidden_size) + ", num_hidden_layers " +
                      std::to_string(c.num_hidden_layers) + ")");
}

}  // namespace

std::uint64_t ActivationMemory::saved() const {
  if (layers <= 0) return head;
  return first_block + static_cast<std::uint64_t>(layers - 1) * per_block + head;
}

std::uint64_t ActivationMemory::peak() const {
  return saved() + std::max(loss_working, recompute);
}

ActivationMemory estimate_activation_memory(const ModelConfig& c, const ActivationMemoryOptions& o) {
  check(c, o);
  const double e = element_bytes(o.dtype);
  const BlockShape shape{static_cast<double>(c.hidden_size),
                         static_cast<double>(c.intermediate_size),
                         static_cast<double>(c.num_attention_heads * c.head_dim),
                         static_cast<double>(c.num_key_value_heads * c.head_dim),
                         static_cast<double>(c.num_attention_heads),
                         static_cast<double>(c.num_key_value_heads),
                         e,
                         c.qk_norm};
  // Validates the targets as the parameter counts do (a name that is no projection is refused there too).
  static const std::vector<std::string> kProjections = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"};
  const auto& t = o.lora_target_modules;
  const bool all_linear = t.size() == 1 && (t[0] == "all-linear" || t[0] == "ALL-LINEAR");
  for (const auto& name : t)
    if (!all_linear && std::find(kProjections.begin(), kProjections.end(), name) == kProjections.end())
      throw ConfigError("estimate_activation_memory: lora target '" + name +
                        "' names no projection of a block");
  const bool full = t.empty();
  const double tokens = static_cast<double>(o.sequence_length * o.micro_batch_size);
  BlockSaves block(shape, o);
  const double first = block.bytes(/*input_grad=*/full);  // LoRA: the frozen embedding's output
  const double other = block.bytes(/*input_grad=*/true);
  const double input = c.hidden_size * e;  // a block's input, per token
  ActivationMemory m;
  m.layers = c.num_hidden_layers;
  if (o.gradient_checkpointing) {
    // The checkpoint keeps each block's input only, and the CPU generator's state to replay the block's
    // dropout (preserve_rng_state); backward recomputes one block at a time (its input is already counted).
    m.first_block = m.per_block = static_cast<std::uint64_t>(tokens * input) + kCheckpointRngBytes;
    m.recompute = static_cast<std::uint64_t>(tokens * (other - input));
  } else {
    m.first_block = static_cast<std::uint64_t>(tokens * first);
    m.per_block = static_cast<std::uint64_t>(tokens * other);
  }
  // The final norm's input and rstd; the fused loss's gradient of the hidden states, computed in forward and
  // kept until backward; cos and sin ([1, T, head_dim] each without position_ids, as the padding collator
  // gives none; shared by the blocks).
  m.head = static_cast<std::uint64_t>(tokens * (input + 4 + input) +
                                      static_cast<double>(o.sequence_length) * 2 * c.head_dim * e);
  // While the loss runs: the hidden states (freed when it returns), its shifted labels, counted rows and
  // targets (int64), and one chunk: the rows' hidden states, the float32 logits (first in the model's dtype
  // when narrower, and the gradient cast back to it), their gradient's product with the head, and a few
  // per-row vectors.
  const std::int64_t counted = o.micro_batch_size * (o.sequence_length - 1);
  m.chunk_rows = loss_chunk_rows(c.vocab_size, counted);
  const double rows = static_cast<double>(m.chunk_rows);
  const double vocab = static_cast<double>(c.vocab_size);
  m.loss_working = static_cast<std::uint64_t>(
      tokens * (input + 3 * 8) + rows * vocab * (4 + (e < 4 ? e : 0)) + rows * 2 * input + rows * 5 * 4);
  return m;
}

}  // namespace accel::llm
