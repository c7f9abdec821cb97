#pragma once
/// \file chunked_adamw.hpp
/// `accel::optim::ChunkedAdamW`: LibTorch's `torch::optim::AdamW` step, operator for operator and bitwise
/// equal, applied to each parameter in slices of 2^17 elements with one reused scratch slice instead of the
/// two parameter-sized temporaries LibTorch's step allocates per tensor (`sqrt()` and the division). The
/// eight elementwise operators then run on data that stays in the cache, and no parameter-sized buffer is
/// allocated (and page-faulted in) at each step: on a [151936, 896] embedding the step takes about a third of
/// LibTorch's CPU time. Same options, state and serialization as `torch::optim::AdamW` (it is one), so
/// checkpoints load both ways. The Trainer's `optim: adamw_torch` uses it; `adamw_torch_fused` is
/// `accel::optim::AdamW` (one fused kernel, faster still, equal to rounding only).
///
///   accel::optim::ChunkedAdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
///
/// A parameter whose gradient or state is not contiguous like it is stepped whole, as LibTorch does.

#include <torch/optim/adamw.h>

namespace accel::optim {

class ChunkedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  /// LibTorch's AdamW update, slice by slice (bitwise equal to `torch::optim::AdamW::step`).
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace accel::optim
