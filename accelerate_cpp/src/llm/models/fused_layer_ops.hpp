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
/// gradient is needed, one autograd node whose backward runs at::linear's backward ops (g W, g^T x, the sum
/// of g). Falls back to torch::linear under autocast, for a dtype other than float32, a device other than the
/// CPU, non-contiguous or empty operands, a LibTorch without oneDNN, or ACCEL_ONEDNN_LINEAR=0 in the
/// environment (which gives transformers' values bit for bit again).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {});

}  // namespace accel::llm::detail
