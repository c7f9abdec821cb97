// bitsandbytes' 8-bit AdamW on LibTorch: the dynamic map, blockwise (de)quantisation and the update of
// bitsandbytes 0.50's CPU kernels (backends/cpu/ops.py: _optimizer_update_8bit_blockwise_cpu,
// _optimizer_update_32bit_cpu).
#include <accel/errors.hpp>
#include <accel/optim/adamw_8bit.hpp>

#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>

namespace accel::optim {
namespace {

constexpr std::int64_t kBlock = 256;

// bitsandbytes' `torch.linspace(0.1, 1, n)` then the midpoints of neighbours, in fp32 as torch computes them.
std::vector<double> means(std::int64_t items) {
  const auto b = torch::linspace(0.1, 1, items, torch::kFloat32);
  const auto m = ((b.slice(0, 0, items - 1) + b.slice(0, 1, items)) / 2.0).contiguous();
  const auto* p = m.data_ptr<float>();
  return {p, p + m.numel()};
}

}  // namespace

torch::Tensor dynamic_map(bool is_signed) {
  constexpr int max_exponent_bits = 7, total_bits = 8, non_sign_bits = total_bits - 1;
  const int additional = (1 << (non_sign_bits - max_exponent_bits)) - 1;
  std::vector<double> data;
  int i = 0;
  for (; i < max_exponent_bits; ++i) {
    const std::int64_t items = is_signed
                                   ? (std::int64_t{1} << (i + non_sign_bits - max_exponent_bits)) + 1
                                   : (std::int64_t{1} << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    // Python multiplies a float64 power of ten by the fp32 tensor: the product is fp32, then .tolist().
    const auto scale = static_cast<float>(std::pow(10.0, -(max_exponent_bits - 1) + i));
    for (const double m : means(items)) {
      data.push_back(static_cast<float>(scale * static_cast<float>(m)));
      if (is_signed) data.push_back(static_cast<float>(-scale * static_cast<float>(m)));
    }
  }
  if (additional > 0) {  // not reached with 7 exponent bits of 8 (kept as bitsandbytes writes it)
    const auto scale = static_cast<float>(std::pow(10.0, -(max_exponent_bits - 1) + i - 1));
    for (const double m : means(additional + 1)) {
      data.push_back(static_cast<float>(scale * static_cast<float>(m)));
      if (is_signed) data.push_back(static_cast<float>(-scale * static_cast<float>(m)));
    }
  }
  data.push_back(0);
  data.push_back(1.0);
  while (data.size() < 256)
    data.push_back(0);
  std::sort(data.begin(), data.end());
  return torch::tensor(data, torch::kFloat64).to(torch::kFloat32);
}

std::pair<torch::Tensor, torch::Tensor> quantize_blockwise(const torch::Tensor& x, const torch::Tensor& code,
                                                           std::int64_t blocksize) {
  // As bitsandbytes' reference kernel (backends/default/ops.py) computes it: the full blocks scaled by the
  // reciprocal of their absmax, the last partial block divided by its absmax (clamped at 1e-38, and stored
  // so).
  const auto flat = x.detach().reshape(-1).to(torch::kFloat32);
  const auto n = flat.numel();
  const auto rem = n % blocksize, full = n - rem;
  const auto whole = flat.slice(0, 0, full).view({full / blocksize, blocksize});
  auto absmax = whole.abs().amax(1);
  auto scaled = torch::clamp(whole * (1.0 / absmax.clamp_min(1e-38)).unsqueeze(1), -1, 1).reshape(-1);
  if (rem > 0) {
    const auto tail = flat.slice(0, full);
    const auto am = tail.abs().max().clamp_min(1e-38);
    absmax = torch::cat({absmax, am.unsqueeze(0)});
    scaled = torch::cat({scaled, torch::clamp(tail / am, -1, 1)});
  }
  // The nearest value of the sorted code: bucketize over the midpoints (bitsandbytes' default kernel).
  const auto bounds = (code.slice(0, 0, -1) + code.slice(0, 1)) / 2;
  const auto q = torch::bucketize(scaled, bounds.to(scaled.device()), /*out_int32=*/true).to(torch::kUInt8);
  return {q.reshape(x.sizes()), absmax};
}

torch::Tensor dequantize_blockwise(const torch::Tensor& codes, const torch::Tensor& absmax,
                                   const torch::Tensor& code, std::int64_t blocksize) {
  const auto flat = codes.reshape(-1).to(torch::kLong);
  const auto n = flat.numel();
  const auto values = code.to(codes.device()).index_select(0, flat);
  const auto scale = absmax.repeat_interleave(blocksize).slice(0, 0, n);
  return (values * scale).reshape(codes.sizes());
}

AdamW8bitOptions::AdamW8bitOptions(double lr) : lr_(lr) {}

void AdamW8bitOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(optim_bits);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(min_8bit_size);
}

void AdamW8bitOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, optim_bits);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, min_8bit_size);
}

double AdamW8bitOptions::get_lr() const {
  return lr();
}

void AdamW8bitOptions::set_lr(const double lr) {
  this->lr(lr);
}

void AdamW8bitParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(state1);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(state2);
  if (absmax1().defined()) {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(absmax1);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(absmax2);
  }
}

void AdamW8bitParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, state1);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, state2);
  if (state1().scalar_type() == torch::kUInt8) {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, absmax1);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, absmax2);
  }
}

AdamW8bit::AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     AdamW8bitOptions defaults)
    : Optimizer(param_groups, std::make_unique<AdamW8bitOptions>(defaults)) {
  const auto [beta1, beta2] = defaults.betas();
  if (!(defaults.lr() >= 0) || !(defaults.eps() >= 0) || !(defaults.weight_decay() >= 0) || !(beta1 >= 0) ||
      !(beta1 < 1) || !(beta2 >= 0) || !(beta2 < 1) ||
      (defaults.optim_bits() != 8 && defaults.optim_bits() != 32)) {
    throw UsageError(fmt::format(
        "AdamW8bit: invalid options (lr {}, betas ({}, {}), eps {}, weight_decay {}, optim_bits {}: 8 or 32)",
        defaults.lr(), beta1, beta2, defaults.eps(), defaults.weight_decay(), defaults.optim_bits()));
  }
}

torch::Tensor AdamW8bit::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  static const torch::Tensor signed_map = dynamic_map(true), unsigned_map = dynamic_map(false);
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const AdamW8bitOptions&>(group.options());
    const auto [beta1, beta2] = o.betas();
    const double lr = o.lr(), wd = o.weight_decay(), eps = o.eps();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse())
        throw UnsupportedOperation("accel::optim::AdamW8bit does not support sparse gradients");
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<AdamW8bitParamState>();
        const bool quantised = o.optim_bits() == 8 && p.numel() >= o.min_8bit_size();
        const auto dtype = quantised ? torch::kUInt8 : torch::kFloat32;
        // bitsandbytes' get_state_buffer: zeros (code 0 dequantises to code_map[0] * absmax 0 = 0).
        fresh->state1(torch::zeros(p.sizes(), p.options().dtype(dtype)));
        fresh->state2(torch::zeros(p.sizes(), p.options().dtype(dtype)));
        if (quantised) {
          const auto blocks = (p.numel() + kBlock - 1) / kBlock;
          fresh->absmax1(torch::zeros({blocks}, p.options().dtype(torch::kFloat32)));
          fresh->absmax2(torch::zeros({blocks}, p.options().dtype(torch::kFloat32)));
        }
        slot = std::move(fresh);
      }
      auto& st = static_cast<AdamW8bitParamState&>(*slot);
      st.step(st.step() + 1);
      const auto step = static_cast<double>(st.step());
      const auto grad = p.grad().to(torch::kFloat32);
      auto pf = p.detach().to(torch::kFloat32);
      const double c1 = 1.0 - std::pow(beta1, step), c2 = std::sqrt(1.0 - std::pow(beta2, step));
      if (st.state1().scalar_type() == torch::kUInt8) {
        // _optimizer_update_8bit_blockwise_cpu ("adam").
        auto m = dequantize_blockwise(st.state1(), st.absmax1(), signed_map);
        auto v = dequantize_blockwise(st.state2(), st.absmax2(), unsigned_map);
        m.mul_(beta1).add_(grad, 1.0 - beta1);
        v.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        const auto denom = (v.sqrt() / c2).add_(eps);
        if (wd > 0) pf.mul_(1.0 - lr * wd);
        pf.addcdiv_(m, denom, -lr / c1);
        auto [q1, a1] = quantize_blockwise(m, signed_map);
        auto [q2, a2] = quantize_blockwise(v, unsigned_map);
        st.state1().copy_(q1);
        st.absmax1().copy_(a1);
        st.state2().copy_(q2);
        st.absmax2().copy_(a2);
      } else {
        // _optimizer_update_32bit_cpu ("adam").
        st.state1().mul_(beta1).add_(grad, 1.0 - beta1);
        st.state2().mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        const double step_size = -lr * c2 / c1;
        if (wd > 0) pf.mul_(1.0 - lr * wd);
        const auto update = st.state1() / (st.state2().sqrt() + eps * c2);
        pf.add_(update, step_size);
      }
      p.detach().copy_(pf);
    }
  }
  return loss;
}

void AdamW8bit::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamW8bitParamState, AdamW8bitOptions>(archive, *this);
}

void AdamW8bit::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<AdamW8bitParamState, AdamW8bitOptions>(archive, *this);
}

}  // namespace accel::optim
