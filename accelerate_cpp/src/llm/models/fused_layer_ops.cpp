// Fused RMSNorm and rotary embedding (fused_layer_ops.hpp).
#include "llm/models/fused_layer_ops.hpp"

#include <torch/torch.h>

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

}  // namespace

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
