// Chunked linear + cross-entropy (fused_linear_cross_entropy.hpp).
#include <accel/errors.hpp>
#include <accel/llm/training/fused_linear_cross_entropy.hpp>

#include "llm/models/fused_layer_ops.hpp"
#include "llm/training/chunked_loss_detail.hpp"

#include <torch/torch.h>

#include <limits>
#include <string>

namespace accel::llm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using detail::ChunkSums;

// One chunk of counted tokens: the summed losses, and (scaled by 1 / denominator) the gradients.
void add_chunk(ChunkSums& s, const torch::Tensor& rows, const torch::Tensor& hc, const torch::Tensor& weight,
               const torch::Tensor& targets, double denominator) {
  // As transformers: logits in the model's dtype, then float32; in float32 on the CPU by oneDNN's GEMM
  // (detail::linear: within float32 rounding of at::linear's; other dtypes and autocast: at::linear).
  auto logits = detail::linear(hc, weight).to(torch::kFloat32);
  const auto target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
  // at::logsumexp's own steps (amax, infinite maxima taken as 0, the sum of exp(x - max), log + max: the
  // same lse, bit for bit), but with exp(x - max) made in place of the logits and kept: no [c, V] temporary
  // (a fresh 311 MB at 511 tokens of Qwen's vocabulary, page faults included) and one exp pass, not two.
  const auto maxes = logits.amax(1, /*keepdim=*/true);
  maxes.masked_fill_(maxes.abs() == std::numeric_limits<double>::infinity(), 0);
  auto grad = logits.sub_(maxes).exp_();  // logits no longer: exp(x - max)
  const auto sums = grad.sum(1, /*keepdim=*/true);
  const auto lse = sums.log().add_(maxes).squeeze(1);
  s.loss.add_((lse - target_logits).sum());
  if (!s.needs_gradients()) return;
  // d loss / d logits = (softmax - one_hot) / denominator: exp(x - max) / (sum * denominator), in place.
  grad.mul_(sums.mul(denominator).reciprocal_());
  grad.scatter_add_(1, targets.unsqueeze(1),
                    torch::full({targets.size(0), 1}, -1.0 / denominator, grad.options()));
  s.add_gradients(grad, rows, hc, weight);
}

class FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
 public:
  // `denominator` < 0: the mean over the counted labels; `chunk` 0: automatic (balanced_rows).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& labels, double denominator, std::int64_t chunk,
                               std::int64_t ignore_index, bool need_hidden, bool need_weight) {
    const auto vocab = weight.size(0);
    return detail::chunked_forward(
        ctx, hidden, weight, labels, denominator, chunk, ignore_index, need_hidden, need_weight,
        [&](const torch::Tensor& targets) {
          detail::check_label_range("fused_linear_cross_entropy", targets, vocab, ignore_index);
        },
        [&](ChunkSums& s, const torch::Tensor& rows, const torch::Tensor& hc, const torch::Tensor& head,
            const torch::Tensor& targets, double denom) { add_chunk(s, rows, hc, head, targets, denom); });
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return detail::hand_over_gradients(
        ctx, grad_outputs[0], 6,
        "accel::llm::fused_linear_cross_entropy: backward through the same loss a second time (retain_graph) "
        "is not supported: its gradients were handed over by the first; use causal_lm_loss for that");
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
