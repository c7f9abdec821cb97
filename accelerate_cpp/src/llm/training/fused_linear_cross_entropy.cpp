// Chunked linear + cross-entropy (fused_linear_cross_entropy.hpp).
#include <accel/errors.hpp>
#include <accel/llm/training/fused_linear_cross_entropy.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <string>

namespace accel::llm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// float32 logits per chunk when chunk_tokens is 0. Small chunks are slow on a CPU (measured on Qwen2.5-0.5B's
// 151,936 x 896 head, 1,024 tokens: 55-token chunks took 1.8x the unfused loss's CPU time with a frozen head,
// 256-token ones 1.3x, one chunk 1.0x), and the weight gradient's addmm reads and writes the whole [V, H]
// accumulator once per chunk: 256 MiB keeps a few chunks per sequence while the logits stay a fraction.
constexpr std::int64_t kAutoChunkBytes = 256LL << 20;
constexpr std::int64_t kMinAutoChunk = 16;

std::int64_t chunk_rows(std::int64_t requested, std::int64_t vocab) {
  if (requested > 0) return requested;
  return std::max(kMinAutoChunk, kAutoChunkBytes / (vocab * static_cast<std::int64_t>(sizeof(float))));
}

// The rows of each chunk for `counted` tokens. A requested size is kept (the last chunk takes the rest). The
// automatic size is a target: the tokens go in equal chunks of at most 1.25 x it, so that no small tail chunk
// is left (each chunk packs the whole [V, H] weight for its two matmuls: at 512 tokens and Qwen's
// vocabulary, 441 + 70 rows cost two packings of the 545 MB head and a 70-row matmul; one chunk of 511 rows
// holds 311 MB of logits).
std::int64_t balanced_rows(std::int64_t requested, std::int64_t target, std::int64_t counted) {
  if (requested > 0 || counted <= 0) return target;
  const std::int64_t most = target + target / 4;
  const std::int64_t chunks = (counted + most - 1) / most;
  return (counted + chunks - 1) / chunks;
}

// labels[t + 1] for position t, ignore_index after each row's last position, flattened (ForCausalLMLoss).
torch::Tensor shifted_labels(const torch::Tensor& labels, std::int64_t ignore_index, torch::Device device) {
  return torch::constant_pad_nd(labels, {0, 1}, ignore_index).slice(1, 1).contiguous().view(-1).to(device);
}

struct Sums {
  torch::Tensor loss;         // float32 scalar: the summed token losses
  torch::Tensor grad_hidden;  // [N, H] in hidden's dtype, or undefined
  torch::Tensor grad_weight;  // [V, H] float32 accumulator, or undefined
};

// One chunk of counted tokens: the summed losses, and (scaled by 1 / denominator) the gradients.
void add_chunk(Sums& s, const torch::Tensor& rows, const torch::Tensor& hc, const torch::Tensor& weight,
               const torch::Tensor& targets, double denominator) {
  // As transformers: logits in the model's dtype, then float32.
  auto logits = torch::linear(hc, weight).to(torch::kFloat32);
  const auto lse = logits.logsumexp(1);
  const auto target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
  s.loss.add_((lse - target_logits).sum());
  if (!s.grad_hidden.defined() && !s.grad_weight.defined()) return;
  // d loss / d logits = (softmax - one_hot) / denominator, in place of the logits.
  auto grad = logits.sub_(lse.unsqueeze(1)).exp_();
  grad.scatter_add_(1, targets.unsqueeze(1), torch::full({targets.size(0), 1}, -1.0, grad.options()));
  grad.div_(denominator);
  const auto g = grad.to(hc.scalar_type());  // the upcast's backward
  if (s.grad_hidden.defined()) s.grad_hidden.index_copy_(0, rows, g.mm(weight));
  if (s.grad_weight.defined()) {
    if (s.grad_weight.scalar_type() == g.scalar_type()) {
      s.grad_weight.addmm_(g.t(), hc);
    } else {
      s.grad_weight.add_(g.t().mm(hc));
    }
  }
}

class FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
 public:
  // `denominator` < 0: the mean over the counted labels; `chunk` 0: automatic (balanced_rows).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& labels, double denominator, std::int64_t chunk,
                               std::int64_t ignore_index, bool need_hidden, bool need_weight) {
    const auto size = hidden.size(-1), vocab = weight.size(0);
    const auto flat = hidden.reshape({-1, size});
    const auto shifted = shifted_labels(labels, ignore_index, hidden.device());
    const auto rows = shifted.ne(ignore_index).nonzero().view(-1);
    const auto targets = shifted.index_select(0, rows);
    if (targets.numel() > 0) {
      const auto lo = targets.min().item<std::int64_t>(), hi = targets.max().item<std::int64_t>();
      if (lo < 0 || hi >= vocab)
        throw UsageError("accel::llm::fused_linear_cross_entropy: label " + std::to_string(lo < 0 ? lo : hi) +
                         " is outside the vocabulary [0, " + std::to_string(vocab) +
                         ") and is not the ignore index " + std::to_string(ignore_index));
    }
    const auto counted = rows.numel();
    const double denom = denominator < 0 ? static_cast<double>(counted) : denominator;
    Sums s;
    s.loss = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
    if (need_hidden) s.grad_hidden = torch::zeros_like(flat, torch::MemoryFormat::Contiguous);
    if (need_weight) s.grad_weight = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
    chunk = balanced_rows(chunk, chunk_rows(chunk, vocab), counted);
    for (std::int64_t start = 0; start < counted; start += chunk) {
      const auto r = rows.slice(0, start, std::min(counted, start + chunk));
      add_chunk(s, r, flat.index_select(0, r), weight, targets.slice(0, start, start + r.numel()), denom);
    }
    if (need_hidden) ctx->saved_data["grad_hidden"] = s.grad_hidden.view(hidden.sizes());
    if (need_weight) ctx->saved_data["grad_weight"] = s.grad_weight.to(weight.scalar_type());
    ctx->saved_data["taken"] = false;
    if (counted == 0 && denominator < 0)
      return torch::full({}, std::numeric_limits<float>::quiet_NaN(), s.loss.options());
    return s.loss.div_(denom);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (ctx->saved_data["taken"].toBool())
      throw UsageError(
          "accel::llm::fused_linear_cross_entropy: backward through the same loss a second time "
          "(retain_graph) "
          "is not supported: its gradients were handed over by the first; use causal_lm_loss for that");
    ctx->saved_data["taken"] = true;
    const auto& go = grad_outputs[0];
    const bool unit = go.device().is_cpu() && go.item<double>() == 1.0;
    auto take = [&](const char* key) {
      if (!ctx->saved_data.count(key)) return torch::Tensor();
      auto t = ctx->saved_data[key].toTensor();
      ctx->saved_data[key] = torch::Tensor();  // the gradient can become the parameter's .grad without a copy
      return unit ? t : t.mul_(go.to(t.scalar_type()));
    };
    auto gh = take("grad_hidden");
    auto gw = take("grad_weight");
    return {gh,
            gw,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

void check_inputs(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
                  std::optional<std::int64_t> num_items, const FusedCrossEntropyOptions& options) {
  auto fail = [](const std::string& what) {
    throw UsageError("accel::llm::fused_linear_cross_entropy: " + what);
  };
  if (hidden.dim() != 3 || weight.dim() != 2 || labels.dim() != 2)
    fail("hidden must be [B, T, H], weight [V, H] and labels [B, T]; got " + std::to_string(hidden.dim()) +
         ", " + std::to_string(weight.dim()) + " and " + std::to_string(labels.dim()) + " dimensions");
  if (hidden.size(0) != labels.size(0) || hidden.size(1) != labels.size(1) ||
      hidden.size(2) != weight.size(1))
    fail("shapes do not agree: hidden " + c10::str(hidden.sizes()) + ", weight " + c10::str(weight.sizes()) +
         ", labels " + c10::str(labels.sizes()));
  if (!torch::isFloatingType(hidden.scalar_type()) || hidden.scalar_type() != weight.scalar_type())
    fail(std::string("hidden and weight must share one floating dtype, got ") +
         c10::toString(hidden.scalar_type()) + " and " + c10::toString(weight.scalar_type()));
  if (labels.scalar_type() != torch::kInt64)
    fail(std::string("labels must be int64, got ") + c10::toString(labels.scalar_type()));
  if (num_items && *num_items <= 0)
    fail("num_items_in_batch must be positive, got " + std::to_string(*num_items));
  if (options.chunk_tokens_ < 0)
    fail("chunk_tokens must be 0 (automatic) or positive, got " + std::to_string(options.chunk_tokens_));
}

}  // namespace

torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& labels,
                                         std::optional<std::int64_t> num_items_in_batch,
                                         const FusedCrossEntropyOptions& options) {
  check_inputs(hidden, weight, labels, num_items_in_batch, options);
  const bool grad = torch::GradMode::is_enabled();
  return FusedLinearCrossEntropy::apply(hidden, weight, labels,
                                        num_items_in_batch ? static_cast<double>(*num_items_in_batch) : -1.0,
                                        options.chunk_tokens_, options.ignore_index_,
                                        grad && hidden.requires_grad(), grad && weight.requires_grad());
}

}  // namespace accel::llm
