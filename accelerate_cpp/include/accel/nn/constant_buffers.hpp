#pragma once
/// \file constant_buffers.hpp
/// A marker for modules whose own buffers are constants once the module is built or loaded: the same on
/// every rank (read from the same checkpoint) and never written by forward, backward or the optimizer, such
/// as the 4-bit codes of `accel::quant::Linear4bit`. DDP's `ddp_broadcast_buffers` copies rank 0's buffers to
/// every rank after each step (PyTorch DDP's broadcast_buffers, meant for BatchNorm statistics); it skips a
/// ConstantBuffers module's own buffers, as PyTorch DDP never rebroadcasts bitsandbytes' 4-bit weights
/// (frozen parameters there, not buffers). Its child modules are judged on their own.

namespace accel {

/// Inherit it beside torch::nn::Module (or Cloneable) to mark the module's own buffers constant.
class ConstantBuffers {
 public:
  virtual ~ConstantBuffers() = default;
};

}  // namespace accel
