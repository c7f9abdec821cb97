// Fused RMSNorm and rotary embedding, and the oneDNN linear (fused_layer_ops.hpp).
#include "llm/models/fused_layer_ops.hpp"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <optional>

namespace accel::llm::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [x0, x1] -> [-x1, x0] over the last dimension (transformers' rotate_half).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

class RmsNorm : public torch::autograd::Function<RmsNorm> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               double eps) {
    const auto h = x.to(torch::kFloat32);
    const auto rstd = torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["eps"] = eps;
    return weight * (h * rstd).to(x.scalar_type());
  }

  // y = w * n.to(d), n = h * rstd, rstd = (mean(h^2) + eps)^-1/2: dn = (g * w).to(d) in float32 (autograd's
  // casts), dh = rstd * (dn - n * mean(dn * n)), dw = sum of g * n.to(d) over the broadcast dimensions.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto& g = grad_outputs[0];
    // Buffers are reused (out= and in place) unless this backward is itself differentiated (create_graph):
    // then rstd is recomputed from x, so that the second derivative sees its dependence on x.
    const bool reuse = !torch::GradMode::is_enabled();
    const auto rstd = reuse ? saved[2]
                            : torch::rsqrt(x.to(torch::kFloat32).pow(2).mean(-1, /*keepdim=*/true) +
                                           ctx->saved_data["eps"].toDouble());
    auto n = x.to(torch::kFloat32) * rstd;
    torch::Tensor grad_x, grad_weight;
    if (ctx->needs_input_grad(0)) {
      const auto dn = (g * weight).to(x.scalar_type()).to(torch::kFloat32);
      auto t = dn * n;  // CPU tensors are not cached: three activation-sized buffers (n, dn, t), not five
      const auto dot = t.mean(-1, /*keepdim=*/true);
      t = reuse ? torch::mul_out(t, dn, rstd) : dn * rstd;
      grad_x = (reuse ? t.addcmul_(n, rstd * dot, -1.0) : t.addcmul(n, rstd * dot, -1.0)).to(x.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {
      const auto nd = n.to(x.scalar_type());
      const auto scaled = reuse && nd.is_same(n) && g.sizes() == n.sizes() ? n.mul_(g) : g * nd;
      grad_weight = scaled.sum_to_size(weight.sizes()).to(weight.scalar_type());
    }
    return {grad_x, grad_weight, torch::Tensor()};
  }
};

class Rotary : public torch::autograd::Function<Rotary> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["shape"] = x.sizes();
    return x * cos + rotate_half(x) * sin;
  }

  // d x = g * cos + rotate_half^T(g * sin), rotate_half^T([y0, y1]) = [y1, -y0]: per half,
  // d x0 = g0 * cos0 + g1 * sin1 and d x1 = g1 * cos1 - g0 * sin0, in one product and two multiply-adds
  // into it (no zero-filled slice gradients, no concatenation).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
    const auto& g = grad_outputs[0];
    const auto half = g.size(-1) / 2;
    auto grad = g * cos;
    grad.slice(-1, 0, half).addcmul_(g.slice(-1, half), sin.slice(-1, half));
    grad.slice(-1, half).addcmul_(g.slice(-1, 0, half), sin.slice(-1, 0, half), -1.0);
    return {grad.sum_to_size(ctx->saved_data["shape"].toIntVector()), torch::Tensor(), torch::Tensor()};
  }
};

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm), or
// none where this LibTorch lacks it (no oneDNN) or ACCEL_ONEDNN_LINEAR=0 turns it off.
const std::optional<c10::OperatorHandle>& onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op = []() -> std::optional<c10::OperatorHandle> {
    const char* env = std::getenv("ACCEL_ONEDNN_LINEAR");
    if ((env != nullptr && std::strcmp(env, "0") == 0) || !at::hasMKLDNN()) return std::nullopt;
    return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  }();
  return op;
}

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  torch::jit::Stack stack{x,
                          w,
                          b.defined() ? c10::IValue(b) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  onednn_linear_op()->callBoxed(&stack);
  return stack.back().toTensor();
}

// A dense, contiguous, non-empty float32 CPU tensor: what detail::linear hands to oneDNN.
bool plain(const torch::Tensor& t) {
  return t.layout() == torch::kStrided && t.device().is_cpu() && t.scalar_type() == torch::kFloat32 &&
         t.is_contiguous() && !t.is_conj() && !t.is_neg() && t.numel() > 0;
}

// oneDNN is on: not under autocast, not turned off (torch.backends.mkldnn, ACCEL_ONEDNN_LINEAR=0).
bool onednn_on() {
  if (at::autocast::is_autocast_enabled(at::kCPU)) return false;
  return at::globalContext().userEnabledMkldnn() && onednn_linear_op().has_value();
}

bool onednn_linear_applies(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  if (!plain(x) || !plain(w) || (b.defined() && !plain(b))) return false;
  if (w.dim() != 2 || x.dim() < 2 || x.size(-1) != w.size(1) || (b.defined() && b.dim() != 1)) return false;
  return onednn_on();
}

// The product by oneDNN, the gradients as at::linear's autograd computes them: x' = g W (by oneDNN too, as
// linear_input_grad), W' = g^T x (MKL's mm, as at::linear's backward: oneDNN is not faster there), b' = g
// summed over rows.
// Bias = false: the node of a product without bias (an undefined tensor cannot be an autograd input).
template <bool Bias>
class OneDnnLinear : public torch::autograd::Function<OneDnnLinear<Bias>> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b) {
    // What at::linear's node keeps: the input only for the weight's gradient, the weight only for the
    // input's (a frozen projection of a LoRA model keeps no activation).
    ctx->save_for_backward(
        {w.requires_grad() ? x : torch::Tensor(), x.requires_grad() ? w : torch::Tensor()});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["out_features"] = w.size(0);
    return onednn_linear(x, w, Bias ? b : torch::Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const auto g = grad_outputs[0].reshape({-1, ctx->saved_data["out_features"].toInt()});
    torch::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0)) grad_x = linear_input_grad(g, w).view(x_sizes);
    if (ctx->needs_input_grad(1)) grad_w = g.t().mm(x.reshape({-1, x_sizes.back()}));
    if (Bias && ctx->needs_input_grad(2)) grad_b = g.sum(0);
    return {grad_x, grad_w, grad_b};
  }
};

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (!onednn_linear_applies(x, weight, bias)) return torch::linear(x, weight, bias);
  const bool grad = torch::GradMode::is_enabled() &&
                    (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!grad) return onednn_linear(x, weight, bias);
  // Without bias, the weight stands in as the third input (no gradient is returned for it there).
  return bias.defined() ? OneDnnLinear<true>::apply(x, weight, bias)
                        : OneDnnLinear<false>::apply(x, weight, weight);
}

torch::Tensor linear_input_grad(const torch::Tensor& g, const torch::Tensor& weight) {
  const auto g2 = g.reshape({-1, g.size(-1)});
  // oneDNN's op has no autograd formula: a product that must stay differentiable (the backward of a backward
  // under create_graph, where grad mode is on) is mm's.
  const bool graph = torch::GradMode::is_enabled() && (g2.requires_grad() || weight.requires_grad());
  // weight.t(): a transposed view, which oneDNN's inner product reads in place (its "ba" weight layout; no
  // copy or reorder per call: ONEDNN_VERBOSE shows the x64:gemm:jit primitive alone).
  if (!graph && plain(g2) && plain(weight) && weight.dim() == 2 && g2.size(1) == weight.size(0) &&
      onednn_on())
    return onednn_linear(g2, weight.t(), torch::Tensor());
  return g2.mm(weight);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return RmsNorm::apply(x, weight, eps);
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  // Tables that train (not the model's: they come from positions) take the unfused ops and their gradients.
  if (torch::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad()))
    return x * cos + rotate_half(x) * sin;
  return Rotary::apply(x, cos, sin);
}

}  // namespace accel::llm::detail
