// The causal-LM loss over logits split by vocabulary across a tensor-parallel group
// (vocab_parallel_loss.hpp).
#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>
#include <accel/llm/training/vocab_parallel_loss.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include "llm/training/chunked_loss_detail.hpp"

#include <torch/torch.h>

#include <limits>
#include <string>

namespace accel::llm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using detail::ChunkSums;

void check_group(const char* fn, const std::shared_ptr<Communicator>& group) {
  if (!group)
    throw UsageError(std::string("accel::llm::") + fn +
                     ": the tensor-parallel group is null (pass accelerator.tensor_parallel_group())");
}

// The same check on every rank (the labels are the same): a label the vocabulary does not have.
void check_targets(const char* fn, const torch::Tensor& targets, std::int64_t vocab, std::int64_t ignore) {
  detail::check_label_range(fn, targets, vocab, ignore, " (this rank's rows times the group's size)");
}

// One block of tokens' losses over the group. `logits` [c, V / N] float32 of this rank's rows (overwritten:
// on return it holds this rank's softmax probabilities); `targets` [c] full-vocabulary ids. Returns each
// token's loss; `owned` / `column` say which targets this rank holds and where.
struct Block {
  torch::Tensor token_loss;  // float32 [c]: logsumexp - the target's logit, the same on every rank
  torch::Tensor owned;       // bool [c]
  torch::Tensor column;      // int64 [c, 1]: the target's column here (0 where not owned)
};

Block block_losses(torch::Tensor& logits, const torch::Tensor& targets, Communicator& group) {
  const auto width = logits.size(1);
  const auto first = static_cast<std::int64_t>(group.rank()) * width;
  auto max = std::get<0>(logits.max(1)).contiguous();
  group.all_reduce(max, ReduceOp::Max);
  logits.sub_(max.unsqueeze(1));
  const auto local = targets - first;
  Block b;
  b.owned = local.ge(0).logical_and(local.lt(width));
  b.column = torch::where(b.owned, local, torch::zeros_like(local)).unsqueeze(1);
  const auto target = logits.gather(1, b.column).squeeze(1).masked_fill(b.owned.logical_not(), 0.0);
  logits.exp_();
  // The sum of exponentials and the target's logit of every token, in one all-reduce.
  auto sums = torch::stack({logits.sum(1), target}).contiguous();
  group.all_reduce(sums, ReduceOp::Sum);
  logits.div_(sums[0].unsqueeze(1));
  b.token_loss = sums[0].log() - sums[1];
  return b;
}

// d loss / d logits of a block, in place of its probabilities: (softmax - one_hot on this rank's rows) x
// scale.
void to_gradient(torch::Tensor& probs, const Block& b, const torch::Tensor& scale) {
  probs.mul_(scale.unsqueeze(1));
  probs.scatter_add_(1, b.column, b.owned.to(probs.scalar_type()).mul(scale).neg().unsqueeze(1));
}

// Loss over this rank's logits [N, V / N] (float32): saves the probabilities for backward.
class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, double denominator, std::int64_t ignore_index,
                               std::shared_ptr<Communicator> group) {
    const auto counted = targets.ne(ignore_index);
    // An ignored token's target becomes 0 to keep the gather in range; its loss and gradient are dropped.
    const auto safe = targets.masked_fill(counted.logical_not(), 0);
    auto probs = logits.detach().clone(at::MemoryFormat::Contiguous);
    const Block b = block_losses(probs, safe, *group);
    const auto weight = counted.to(torch::kFloat32);
    const auto count = counted.sum().item<std::int64_t>();
    const double denom = denominator < 0 ? static_cast<double>(count) : denominator;
    ctx->save_for_backward({probs, b.column, b.owned, weight});
    ctx->saved_data["denom"] = denom;
    if (count == 0 && denominator < 0)
      return torch::full({}, std::numeric_limits<float>::quiet_NaN(), logits.options());
    return (b.token_loss * weight).sum() / denom;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    Block b;
    b.column = saved[1];
    b.owned = saved[2];
    const auto scale = saved[3] * (grad_outputs[0].to(torch::kFloat32) / ctx->saved_data["denom"].toDouble());
    auto grad = saved[0].clone();
    to_gradient(grad, b, scale);
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

void add_chunk(ChunkSums& s, const torch::Tensor& rows, const torch::Tensor& hc, const torch::Tensor& weight,
               const torch::Tensor& targets, double denominator, Communicator& group) {
  auto logits = torch::linear(hc, weight).to(torch::kFloat32);  // as transformers: model dtype, then float32
  const Block b = block_losses(logits, targets, group);
  s.loss.add_(b.token_loss.sum());
  if (!s.needs_gradients()) return;
  to_gradient(logits, b, torch::full({targets.size(0)}, 1.0 / denominator, logits.options()));
  s.add_gradients(logits, rows, hc, weight);
}

class VocabParallelFusedCrossEntropy : public torch::autograd::Function<VocabParallelFusedCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& labels, double denominator, std::int64_t chunk,
                               std::int64_t ignore_index, bool need_hidden, bool need_weight,
                               std::shared_ptr<Communicator> group) {
    const auto vocab = weight.size(0) * group->world_size();
    return detail::chunked_forward(
        ctx, hidden, weight, labels, denominator, chunk, ignore_index, need_hidden, need_weight,
        [&](const torch::Tensor& targets) {
          check_targets("vocab_parallel_fused_linear_cross_entropy", targets, vocab, ignore_index);
        },
        [&](ChunkSums& s, const torch::Tensor& rows, const torch::Tensor& hc, const torch::Tensor& head,
            const torch::Tensor& targets,
            double denom) { add_chunk(s, rows, hc, head, targets, denom, *group); });
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return detail::hand_over_gradients(
        ctx, grad_outputs[0], 7,
        "accel::llm::vocab_parallel_fused_linear_cross_entropy: backward through the same loss a second time "
        "(retain_graph) is not supported: its gradients were handed over by the first; use "
        "vocab_parallel_causal_lm_loss for that");
  }
};

}  // namespace

torch::Tensor vocab_parallel_causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                                            const std::shared_ptr<Communicator>& group,
                                            std::optional<std::int64_t> num_items_in_batch,
                                            std::int64_t ignore_index) {
  constexpr const char* kFn = "vocab_parallel_causal_lm_loss";
  check_group(kFn, group);
  if (logits.dim() != 3 || labels.dim() != 2 || logits.size(0) != labels.size(0) ||
      logits.size(1) != labels.size(1))
    throw UsageError(
        "accel::llm::vocab_parallel_causal_lm_loss: logits must be [B, T, V / N] and labels [B, T] of the "
        "same B and T; got logits " +
        c10::str(logits.sizes()) + " and labels " + c10::str(labels.sizes()));
  if (num_items_in_batch && *num_items_in_batch <= 0)
    throw UsageError("accel::llm::vocab_parallel_causal_lm_loss: num_items_in_batch must be positive, got " +
                     std::to_string(*num_items_in_batch));
  const auto width = logits.size(-1);
  const auto targets = detail::shifted_labels(labels, ignore_index, logits.device());
  check_targets(kFn, targets.masked_select(targets.ne(ignore_index)), width * group->world_size(),
                ignore_index);
  const auto flat = logits.to(torch::kFloat32).reshape({-1, width});
  return VocabParallelCrossEntropy::apply(
      flat, targets, num_items_in_batch ? static_cast<double>(*num_items_in_batch) : -1.0, ignore_index,
      group);
}

torch::Tensor vocab_parallel_fused_linear_cross_entropy(const torch::Tensor& hidden,
                                                        const torch::Tensor& weight,
                                                        const torch::Tensor& labels,
                                                        const std::shared_ptr<Communicator>& group,
                                                        std::optional<std::int64_t> num_items_in_batch,
                                                        const FusedCrossEntropyOptions& options) {
  constexpr const char* kFn = "accel::llm::vocab_parallel_fused_linear_cross_entropy: ";
  check_group("vocab_parallel_fused_linear_cross_entropy", group);
  if (hidden.dim() != 3 || weight.dim() != 2 || labels.dim() != 2 || hidden.size(0) != labels.size(0) ||
      hidden.size(1) != labels.size(1) || hidden.size(2) != weight.size(1))
    throw UsageError(
        std::string(kFn) + "hidden must be [B, T, H], weight [V / N, H] and labels [B, T]; got " +
        c10::str(hidden.sizes()) + ", " + c10::str(weight.sizes()) + " and " + c10::str(labels.sizes()));
  if (!torch::isFloatingType(hidden.scalar_type()) || hidden.scalar_type() != weight.scalar_type())
    throw UsageError(std::string(kFn) + "hidden and weight must share one floating dtype, got " +
                     c10::toString(hidden.scalar_type()) + " and " + c10::toString(weight.scalar_type()));
  if (labels.scalar_type() != torch::kInt64)
    throw UsageError(std::string(kFn) + "labels must be int64, got " + c10::toString(labels.scalar_type()));
  if (num_items_in_batch && *num_items_in_batch <= 0)
    throw UsageError(std::string(kFn) + "num_items_in_batch must be positive, got " +
                     std::to_string(*num_items_in_batch));
  if (options.chunk_tokens_ < 0)
    throw UsageError(std::string(kFn) + "chunk_tokens must be 0 (automatic) or positive, got " +
                     std::to_string(options.chunk_tokens_));
  // Each rank's hidden-state gradient covers its vocabulary rows only: Megatron's f sums them in backward.
  const auto h = tp::copy_to_tensor_parallel(hidden, group);
  const bool grad = torch::GradMode::is_enabled();
  return VocabParallelFusedCrossEntropy::apply(
      h, weight, labels, num_items_in_batch ? static_cast<double>(*num_items_in_batch) : -1.0,
      options.chunk_tokens_, options.ignore_index_, grad && h.requires_grad(), grad && weight.requires_grad(),
      group);
}

}  // namespace accel::llm
