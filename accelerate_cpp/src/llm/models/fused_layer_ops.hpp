// The decoder layer's elementwise blocks as single autograd nodes (fused_layer_ops.cpp): the forward runs the
// same ATen ops as transformers (the same values, bit for bit), but builds no graph of small nodes; the
// backward is the closed form, in fewer passes over the activations and with less kept for it.
#pragma once

#include <torch/torch.h>

namespace accel::llm::detail {

/// transformers' RMSNorm, `weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)`, as one
/// node that keeps x and the per-row rsqrt only (not the float32 copy, the squares and the normalized
/// values). Gradients: x's (in x's dtype) and, where it requires grad, weight's; within float32 rounding of
/// autograd's through the unfused ops.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

/// The rotary embedding `x * cos + rotate_half(x) * sin` (x [B, heads, T, D], cos and sin broadcasting to it
/// and needing no gradient) as one node: its backward `g * cos + rotate_half^T(g * sin)` allocates no
/// zero-filled slice gradients. The same values and gradients as the unfused ops.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

/// `torch::linear(x, weight, bias)` with the product computed by oneDNN's fp32 GEMM (the
/// `mkldnn::_linear_pointwise` operator of the same LibTorch): on this project's AMD EPYC (AVX-512) CPU it
/// runs the model's product shapes faster than the MKL sgemm behind at::linear (BENCHMARKS.md, issue 50).
/// Values equal at::linear's within float32 rounding (another summation order), not bit for bit. Where a
/// gradient is needed, one autograd node whose backward computes the input's gradient g W by oneDNN too
/// (linear_input_grad), the weight's g^T x by at::linear's own op (MKL's mm: oneDNN is not faster there) and
/// the bias's as the sum of g. Falls back to torch::linear under autocast, for a dtype other than float32, a
/// device other than the CPU, non-contiguous or empty operands, a LibTorch without oneDNN, with
/// torch.backends.mkldnn off (at::globalContext().setUserEnabledMkldnn(false)), or ACCEL_ONEDNN_LINEAR=0 in
/// the environment (which gives transformers' values bit for bit again, forward and backward).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

/// `g.reshape({-1, g.size(-1)}).mm(weight)`: the input gradient of `linear(x, weight)` for an output gradient
/// g [..., out] (weight [out, in]; returns [N, in]), by oneDNN's fp32 GEMM reading the weight's transposed
/// view in place (no copy, no reorder): on this machine 10-15% less CPU time than MKL's mm on Qwen2-0.5B's
/// MLP and head shapes at one thread (15-30% at two), 3-11% on its 896- and 128-wide ones. The rules of
/// detail::linear: mm (bit for bit at::linear's backward) wherever that falls back, for a g that is not
/// contiguous as [N, out] (mm reads it strided; a copy would cost more), and in grad mode with g or weight
/// requiring grad (the backward of a backward under create_graph: oneDNN's op has no autograd formula, mm's
/// product stays differentiable).
torch::Tensor linear_input_grad(const torch::Tensor& g, const torch::Tensor& weight);

}  // namespace accel::llm::detail
