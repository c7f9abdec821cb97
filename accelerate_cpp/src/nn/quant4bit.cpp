// 4-bit NF4/FP4 storage with double quantisation, as bitsandbytes 0.50 computes it on the CPU
// (bitsandbytes/backends/default/ops.py quantize_4bit and _dequantize_4bit_compute, functional.py
// quantize_4bit / dequantize_4bit / create_dynamic_map / get_4bit_type). The same LibTorch operators in the
// same order, so the 4-bit codes are bit for bit bitsandbytes'. One difference, measured by
// tests/python/bnb_4bit.py: bitsandbytes' native CPU search for the 8-bit absmax codes (double quantisation)
// sometimes returns the neighbour of the nearest code; here it is always the nearest (ties to the lower
// code), so a dequantised absmax is never further from the true one than bitsandbytes'.
#include <accel/errors.hpp>
#include <accel/nn/quant4bit.hpp>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>

namespace accel::quant {
namespace {

constexpr std::int64_t kAbsmaxBlock = 256;  // bitsandbytes quantises the absmax values in blocks of 256
constexpr std::int64_t kQuantizeSlice = std::int64_t{1} << 18;  // values quantised at once (1 MiB in float32)
constexpr std::int64_t kLookupSlice = std::int64_t{1} << 20;    // codes looked up at once (int32 indices)

torch::Tensor make_code(QuantType type) {
  std::vector<float> data;
  if (type == QuantType::NF4) {
    data = {-1.0F,
            -0.6961928009986877F,
            -0.5250730514526367F,
            -0.39491748809814453F,
            -0.28444138169288635F,
            -0.18477343022823334F,
            -0.09105003625154495F,
            0.0F,
            0.07958029955625534F,
            0.16093020141124725F,
            0.24611230194568634F,
            0.33791524171829224F,
            0.44070982933044434F,
            0.5626170039176941F,
            0.7229568362236023F,
            1.0F};
  } else {
    // Bit-pattern order: 1 sign, 2 exponent, 1 mantissa bit (Python's -0 is the integer 0).
    data = {0, 0.0625F, 8, 12, 4, 6, 2, 3, 0, -0.0625F, -8, -12, -4, -6, -2, -3};
  }
  auto code = torch::tensor(data, torch::kFloat32);
  code.div_(code.abs().max());
  return code;
}

void check_blocksize(std::int64_t blocksize) {
  static const std::vector<std::int64_t> ok = {32, 64, 128, 256, 512, 1024, 2048, 4096};
  if (std::find(ok.begin(), ok.end(), blocksize) == ok.end()) {
    throw UsageError("accel::quant: blocksize " + std::to_string(blocksize) +
                     " is not one bitsandbytes offers (32, 64, 128, 256, 512, 1024, 2048 or 4096)");
  }
}

// Per-block absmax of a flat float32 tensor (the last block may be short) and the values scaled to [-1, 1]:
// for the 4-bit codes multiplied by the reciprocal in full blocks and divided in the short one (bitsandbytes'
// Python kernel); for the 8-bit absmax codes divided everywhere (its native CPU kernel).
std::pair<torch::Tensor, torch::Tensor> blockwise_scale(const torch::Tensor& flat, std::int64_t blocksize,
                                                        bool divide = false) {
  const auto n = flat.numel();
  const auto rem = n % blocksize;
  const auto full = n - rem;
  const auto blocks = full / blocksize;
  auto com = flat.narrow(0, 0, full).reshape({blocks, blocksize});
  auto absmax = std::get<0>(com.abs().max(-1));
  // Clamped in place: quantising while loading holds one scaled copy of the weight, not two.
  auto scaled = divide ? (com / absmax.view({-1, 1})).clamp_(-1, 1).reshape({-1})
                       : (com * (1.0 / absmax.clamp_min(1e-38).view({-1, 1}))).clamp_(-1, 1).reshape({-1});
  if (rem != 0) {
    auto tail = flat.narrow(0, full, rem);
    auto am = divide ? tail.abs().max() : tail.abs().max().clamp_min(1e-38);
    absmax = torch::cat({absmax, am.unsqueeze(0)});
    scaled = torch::cat({scaled, torch::clamp(tail / am, -1, 1)});
  }
  return {absmax, scaled};
}

// Index of the nearest code value (ties to the lower), for codes sorted ascending.
torch::Tensor nearest(const torch::Tensor& scaled, const torch::Tensor& sorted_code) {
  const auto n = sorted_code.numel();
  auto mid = (sorted_code.narrow(0, 0, n - 1) + sorted_code.narrow(0, 1, n - 1)) / 2;
  return torch::bucketize(scaled, mid, /*out_int32=*/true);
}

}  // namespace

std::int64_t Quantized4bit::bytes() const {
  auto size = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; };
  return size(packed) + size(absmax) + size(absmax_scale);
}

torch::Tensor code_4bit(QuantType type) {
  static const torch::Tensor nf4 = make_code(QuantType::NF4);
  static const torch::Tensor fp4 = make_code(QuantType::FP4);
  return type == QuantType::NF4 ? nf4 : fp4;
}

torch::Tensor dynamic_map_8bit() {
  static const torch::Tensor map = [] {
    // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)
    const int max_exponent_bits = 7, non_sign_bits = 7;
    std::vector<float> data;
    for (int i = 0; i < max_exponent_bits; ++i) {
      const auto items = static_cast<std::int64_t>(std::pow(2.0, i + non_sign_bits - max_exponent_bits) + 1);
      auto b = torch::linspace(0.1, 1, items, torch::kFloat32);
      auto means = (b.narrow(0, 0, items - 1) + b.narrow(0, 1, items - 1)) / 2.0;
      const double scale = std::pow(10.0, -(max_exponent_bits - 1) + i);
      auto pos = (means * scale).contiguous();
      auto neg = (means * -scale).contiguous();
      data.insert(data.end(), pos.data_ptr<float>(), pos.data_ptr<float>() + pos.numel());
      data.insert(data.end(), neg.data_ptr<float>(), neg.data_ptr<float>() + neg.numel());
    }
    // additional_items = 2^(7 - 7) - 1 = 0: none.
    data.push_back(0.0F);
    data.push_back(1.0F);
    while (data.size() < 256)
      data.push_back(0.0F);
    std::sort(data.begin(), data.end());
    return torch::tensor(data, torch::kFloat32);
  }();
  return map;
}

namespace {
Quantized4bit quantize_with_offset(const torch::Tensor& tensor, const Quant4bitOptions& options,
                                   std::optional<float> fixed_offset);
}  // namespace

Quantized4bit quantize_4bit(const torch::Tensor& tensor, const Quant4bitOptions& options) {
  return quantize_with_offset(tensor, options, std::nullopt);
}

namespace {
// `fixed_offset`: double quantisation subtracts it from the absmax values instead of their mean (requantize
// keeps its layer's: state dicts hold the codes and scales, not the offset, which a layer takes from the
// weights it was first quantised from).
Quantized4bit quantize_with_offset(const torch::Tensor& tensor, const Quant4bitOptions& options,
                                   std::optional<float> fixed_offset) {
  check_blocksize(options.blocksize);
  const auto type = tensor.scalar_type();
  if (type != torch::kFloat32 && type != torch::kBFloat16 && type != torch::kHalf) {
    throw UsageError(
        std::string("accel::quant::quantize_4bit: 4-bit storage is made from float32, bfloat16 or "
                    "float16 weights, got ") +
        c10::toString(type));
  }
  torch::NoGradGuard no_grad;
  Quantized4bit q;
  q.options = options;
  q.dtype = type;
  q.shape = tensor.sizes().vec();
  // A slice of blocks at a time (each block's arithmetic is its own, so the codes are the same as from the
  // whole tensor): loading with load_in_4bit holds the checkpoint's tensor and slice-sized temporaries, not
  // float32 copies, scaled values and indices of the whole weight (4 x its float32 bytes; issue 51).
  const auto flat = tensor.detach().reshape({-1});
  const auto n = flat.numel();
  const auto bs = options.blocksize;
  auto absmax = torch::empty({(n + bs - 1) / bs}, torch::kFloat32);
  q.packed = torch::empty({(n + 1) / 2}, torch::kUInt8);
  const auto code = code_4bit(options.type);
  const auto order = torch::argsort(code);
  const auto sorted_code = code.index_select(0, order);
  const auto step = std::max<std::int64_t>(1, kQuantizeSlice / bs) * bs;  // whole blocks, an even count
  for (std::int64_t at = 0; at < n; at += step) {
    const auto len = std::min(step, n - at);
    auto [am, scaled] = blockwise_scale(flat.narrow(0, at, len).to(torch::kCPU, torch::kFloat32), bs);
    absmax.narrow(0, at / bs, am.numel()).copy_(am);
    if (scaled.numel() % 2 != 0) scaled = torch::constant_pad_nd(scaled, {0, 1});
    auto idx = nearest(scaled, sorted_code);
    if (options.type != QuantType::NF4) idx = order.index_select(0, idx.to(torch::kLong));
    const auto q8 = idx.to(torch::kUInt8);
    q.packed.narrow(0, at / 2, q8.numel() / 2)
        .copy_(torch::bitwise_or(torch::bitwise_left_shift(q8.slice(0, 0, c10::nullopt, 2), 4),
                                 q8.slice(0, 1, c10::nullopt, 2)));
  }
  if (!options.double_quant) {
    q.absmax = absmax.contiguous();
    return q;
  }
  // Double quantisation: the absmax values less their mean, in 8-bit dynamic-map codes per block of 256.
  const auto offset = fixed_offset ? torch::tensor(*fixed_offset) : absmax.mean();
  q.absmax_offset = offset.item<float>();
  auto [scale2, scaled2] = blockwise_scale(absmax - offset, kAbsmaxBlock, /*divide=*/true);
  auto map = dynamic_map_8bit().clone();
  map[0] = -1.0F;  // bitsandbytes' CPU search sets the first code to -1 (its range is [-0.993, 1])
  q.absmax = nearest(scaled2, map).to(torch::kUInt8).contiguous();
  q.absmax_scale = scale2.contiguous();
  return q;
}
}  // namespace

torch::Tensor dequantize_4bit(const Quantized4bit& q) {
  return dequantize_4bit(q, q.dtype);
}

namespace {

// The absmax of every block in float32 (decoded from its 8-bit codes with double quantisation).
torch::Tensor block_absmax(const Quantized4bit& q) {
  if (!q.options.double_quant) return q.absmax;
  auto map = dynamic_map_8bit().to(q.packed.device());
  map[0] = -1.0F;
  const auto codes = map.index_select(0, q.absmax.to(torch::kLong));
  const auto n = codes.numel();
  const auto blocks = (n + kAbsmaxBlock - 1) / kAbsmaxBlock;
  auto padded = torch::constant_pad_nd(codes, {0, blocks * kAbsmaxBlock - n});
  return (padded.view({blocks, kAbsmaxBlock}) * q.absmax_scale.view({-1, 1})).reshape({-1}).narrow(0, 0, n) +
         q.absmax_offset;
}

// What dequantising needs once per call: the blocks' absmax and a 256 x 2 table of (code[high nibble],
// code[low nibble]), one lookup per byte.
struct Decoder {
  explicit Decoder(const Quantized4bit& q) : q(q), absmax(block_absmax(q)) {
    const auto code = code_4bit(q.options.type);
    const auto bytes = torch::arange(256, torch::kLong);
    pairs = torch::stack(
                {code.index_select(0, bytes.div(16, "floor")), code.index_select(0, bytes.remainder(16))}, 1)
                .to(q.packed.device());
  }

  // Values [start, start + len) of the flat weight into `out` (float32, at least len rounded up to even):
  // `start` is a multiple of the blocksize (even). Each value is code x absmax, one float32 product, as
  // bitsandbytes computes it: the same bits whatever the slices.
  void fill(std::int64_t start, std::int64_t len, const torch::Tensor& out) const {
    const auto bytes = q.packed.reshape({-1}).narrow(0, start / 2, (len + 1) / 2);
    auto out_pairs = out.narrow(0, 0, 2 * bytes.numel()).view({-1, 2});
    for (std::int64_t at = 0; at < bytes.numel(); at += kLookupSlice) {
      const auto n = std::min(kLookupSlice, bytes.numel() - at);
      auto into = out_pairs.narrow(0, at, n);
      torch::index_select_out(into, pairs, 0, bytes.narrow(0, at, n).to(torch::kInt));
    }
    auto values = out.narrow(0, 0, len);
    const auto bs = q.options.blocksize;
    const auto first = start / bs;
    const auto full = len / bs;  // whole blocks; a short last block (the weight's end) is scaled on its own
    values.narrow(0, 0, full * bs).view({full, bs}).mul_(absmax.narrow(0, first, full).view({-1, 1}));
    if (full * bs < len) values.narrow(0, full * bs, len - full * bs).mul_(absmax.narrow(0, first + full, 1));
  }

  const Quantized4bit& q;
  torch::Tensor absmax, pairs;
};

// Calls fn(row, rows, w) for consecutive row slices of the 2-d weight, w = W[row : row + rows] dequantised
// to `dtype`, each slice about `slice_bytes` of float32 (at least one row; slices start on a block boundary),
// in one reused buffer: the whole dequantised weight never exists (issue 51).
template <typename Fn>
void for_each_row_slice(const Quantized4bit& q, torch::ScalarType dtype, std::int64_t slice_bytes, Fn&& fn) {
  const auto out = q.shape.at(0), in = q.shape.at(1);
  const auto bs = q.options.blocksize;
  const auto unit = bs / std::gcd(in, bs);  // rows per whole number of blocks
  const auto budget_rows = std::max<std::int64_t>(1, slice_bytes / std::max<std::int64_t>(1, in * 4));
  const auto slices = (out + budget_rows - 1) / budget_rows;
  auto rows = (out + slices - 1) / slices;  // even slices, not a short last one
  rows = std::min(out, (rows + unit - 1) / unit * unit);
  const Decoder decoder(q);
  const auto device = q.packed.device();
  auto buffer = torch::empty({rows * in + 1}, torch::TensorOptions(torch::kFloat32).device(device));
  torch::Tensor cast;
  if (dtype != torch::kFloat32) cast = torch::empty({rows * in}, torch::TensorOptions(dtype).device(device));
  for (std::int64_t row = 0; row < out; row += rows) {
    const auto n = std::min(rows, out - row);
    decoder.fill(row * in, n * in, buffer);
    auto w = buffer.narrow(0, 0, n * in).view({n, in});
    if (cast.defined()) w = cast.narrow(0, 0, n * in).view({n, in}).copy_(w);
    fn(row, n, w);
  }
}

// y = x W^T + b, W dequantised and multiplied a row slice (output features) at a time.
torch::Tensor linear_4bit(const torch::Tensor& x, const Quantized4bit& q, const torch::Tensor& bias,
                          std::int64_t slice_bytes) {
  const auto x2 = x.reshape({-1, x.size(-1)});
  auto y = torch::empty({x2.size(0), q.shape.at(0)}, x.options());
  for_each_row_slice(q, x.scalar_type(), slice_bytes, [&](std::int64_t row, std::int64_t n, const auto& w) {
    auto into = y.narrow(1, row, n);  // strided columns: BLAS writes them in place (ldc = out)
    torch::mm_out(into, x2, w.t());
  });
  if (bias.defined() && bias.numel() > 0) y.add_(bias);
  auto sizes = x.sizes().vec();
  sizes.back() = q.shape.at(0);
  return y.view(sizes);
}

// dx = g W, summed over the row slices of W: dx += g[:, a:b] W[a:b].
torch::Tensor linear_4bit_input_grad(const torch::Tensor& g, const Quantized4bit& q, torch::ScalarType dtype,
                                     std::int64_t slice_bytes) {
  const auto g2 = g.reshape({-1, g.size(-1)});
  const auto g2d = g2.to(dtype);
  const bool reduced = dtype == torch::kBFloat16 || dtype == torch::kHalf;
  // In bf16 / fp16 each slice's product is rounded to the dtype, then summed in float32 and rounded once
  // more: k + 1 roundings over k slices where bitsandbytes' one `g @ W` has one (within the dtype's
  // tolerance; the fp32 path below is one accumulation, as one GEMM).
  auto dx = torch::empty({g2.size(0), q.shape.at(1)}, g2.options().dtype(reduced ? torch::kFloat32 : dtype));
  for_each_row_slice(q, dtype, slice_bytes, [&](std::int64_t row, std::int64_t n, const auto& w) {
    const auto part = g2d.narrow(1, row, n);
    if (reduced) {
      row == 0 ? dx.copy_(part.mm(w)) : dx.add_(part.mm(w));
    } else if (row == 0) {
      torch::mm_out(dx, part, w);
    } else {
      dx.addmm_(part, w);
    }
  });
  if (reduced) dx = dx.to(dtype);
  auto sizes = g.sizes().vec();
  sizes.back() = q.shape.at(1);
  return dx.view(sizes);
}

}  // namespace

torch::Tensor dequantize_4bit(const Quantized4bit& q, torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  std::int64_t numel = 1;
  for (auto s : q.shape)
    numel *= s;
  // The looked-up values go straight into the output, a slice of codes at a time, and are scaled in place:
  // the weight's float32 bytes once, beside int32 indices of one slice (not int64 indices of every code, a
  // padded copy and a product: 4 x the weight, the step's transient peak under QLoRA; issue 51).
  auto out = torch::empty({numel + 1}, torch::TensorOptions(torch::kFloat32).device(q.packed.device()));
  Decoder(q).fill(0, numel, out);
  auto values = out.narrow(0, 0, numel);
  return dtype == torch::kFloat32 ? values.view(q.shape) : values.to(dtype).view(q.shape);
}

Linear4bitImpl::Linear4bitImpl(const torch::nn::Linear& linear, const Quant4bitOptions& options) {
  weight_ = quantize_4bit(linear->weight.detach().cpu(), options);
  if (linear->bias.defined()) bias = linear->bias.detach().clone();
  reset();
  to(linear->weight.device());
}

void Linear4bitImpl::reset() {
  packed_ = register_buffer("weight_packed", weight_.packed);
  absmax_ = register_buffer("weight_absmax", weight_.absmax);
  if (weight_.absmax_scale.defined())
    absmax_scale_ = register_buffer("weight_absmax_scale", weight_.absmax_scale);
  if (bias.defined()) bias = register_parameter("bias", bias);
}

torch::Tensor Linear4bitImpl::dequantized_weight(torch::ScalarType dtype) const {
  return dequantize_4bit(current(), dtype);
}

void Linear4bitImpl::check_shape(const torch::Tensor& weight, const char* call) const {
  if (weight.sizes() != torch::IntArrayRef(weight_.shape)) {
    throw UsageError(fmt::format("Linear4bit::{}: the weight has shape {}, the layer's is {}", call,
                                 fmt::join(weight.sizes().vec(), "x"), fmt::join(weight_.shape, "x")));
  }
}

void Linear4bitImpl::requantize(const torch::Tensor& weight) {
  check_shape(weight, "requantize");
  // The layer's absmax offset stays: a checkpoint written before or after the merge then decodes alike in any
  // layer quantised from the same weights (the offset is not in the state dict).
  store(quantize_with_offset(
      weight.detach().to(torch::kCPU, weight_.dtype), weight_.options,
      weight_.options.double_quant ? std::optional<float>(weight_.absmax_offset) : std::nullopt));
}

void Linear4bitImpl::load_weight(const torch::Tensor& weight) {
  check_shape(weight, "load_weight");
  store(quantize_4bit(weight.detach().cpu(), weight_.options));
}

void Linear4bitImpl::store(Quantized4bit q) {
  // The registered buffers keep their identity (state dicts, to(device) and optimizers that saw them).
  torch::NoGradGuard no_grad;
  const auto device = packed_.device();
  packed_.set_data(q.packed.to(device));
  absmax_.set_data(q.absmax.to(device));
  if (absmax_scale_.defined()) absmax_scale_.set_data(q.absmax_scale.to(device));
  q.packed = packed_;
  q.absmax = absmax_;
  q.absmax_scale = absmax_scale_;
  weight_ = std::move(q);
}

namespace {

// y = x W^T + b with the 4-bit W dequantised in forward and again in backward, as bitsandbytes' MatMul4Bit:
// autograd keeps the layer's codes, not a full-precision copy of its weight until backward (F::linear saves
// the dequantised weight it multiplies: for QLoRA on Qwen2.5-0.5B, 1.4 GB of float32 per batch in flight).
// Neither pass holds the whole dequantised weight: both multiply a row slice at a time (linear_4bit). The
// input is not saved: the weight is frozen, and the input's gradient needs only the weight.
class Linear4bitFunction : public torch::autograd::Function<Linear4bitFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& bias, const Quantized4bit& q, std::int64_t slice_bytes,
                               bool graph_only) {
    ctx->save_for_backward({q.packed, q.absmax, q.absmax_scale});
    ctx->saved_data["offset"] = static_cast<double>(q.absmax_offset);
    ctx->saved_data["shape"] = q.shape;
    ctx->saved_data["dtype"] = static_cast<std::int64_t>(q.dtype);
    ctx->saved_data["type"] = static_cast<std::int64_t>(q.options.type);
    ctx->saved_data["blocksize"] = q.options.blocksize;
    ctx->saved_data["double_quant"] = q.options.double_quant;
    ctx->saved_data["compute"] = static_cast<std::int64_t>(input.scalar_type());
    ctx->saved_data["slice_bytes"] = slice_bytes;
    if (graph_only) {  // forward_graph_only: the value is not read, only the graph is backpropagated
      auto sizes = input.sizes().vec();
      sizes.back() = q.shape.at(0);
      return torch::empty(sizes, input.options());
    }
    // An empty `bias` stands for none (autograd's Function takes no undefined input).
    return linear_4bit(input, q, bias, slice_bytes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Quantized4bit q;
    q.packed = saved[0];
    q.absmax = saved[1];
    q.absmax_scale = saved[2];
    q.absmax_offset = static_cast<float>(ctx->saved_data["offset"].toDouble());
    q.shape = ctx->saved_data["shape"].toIntVector();
    q.dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    q.options.type = static_cast<QuantType>(ctx->saved_data["type"].toInt());
    q.options.blocksize = ctx->saved_data["blocksize"].toInt();
    q.options.double_quant = ctx->saved_data["double_quant"].toBool();
    const auto compute = static_cast<torch::ScalarType>(ctx->saved_data["compute"].toInt());
    const auto& g = grads[0];
    torch::Tensor grad_input, grad_bias;
    if (ctx->needs_input_grad(0))
      grad_input = linear_4bit_input_grad(g, q, compute, ctx->saved_data["slice_bytes"].toInt());
    if (ctx->needs_input_grad(1)) grad_bias = g.reshape({-1, g.size(-1)}).sum(0);
    return {grad_input, grad_bias, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

Quantized4bit Linear4bitImpl::current() const {
  Quantized4bit q = weight_;
  q.packed = packed_;  // the buffers follow to(device)
  q.absmax = absmax_;
  q.absmax_scale = absmax_scale_;
  return q;
}

torch::Tensor Linear4bitImpl::compute(const torch::Tensor& input, bool graph_only) {
  // The compute dtype: the input's floating type (bf16 under autocast arrives as the autocast casts it).
  const auto dtype = at::autocast::is_autocast_enabled(input.device().type())
                         ? at::autocast::get_autocast_dtype(input.device().type())
                         : input.scalar_type();
  const auto b = bias.defined() ? bias.to(dtype) : torch::Tensor();
  const auto x = input.to(dtype);
  if (torch::GradMode::is_enabled() && (x.requires_grad() || (b.defined() && b.requires_grad()))) {
    return Linear4bitFunction::apply(x, b.defined() ? b : torch::empty({0}, x.options()), current(),
                                     slice_bytes, graph_only);
  }
  torch::NoGradGuard no_grad;
  return linear_4bit(x, current(), b, slice_bytes);
}

torch::Tensor Linear4bitImpl::forward(const torch::Tensor& input) {
  const auto y = compute(input, /*graph_only=*/false);
  return output_hook ? output_hook(input, y) : y;
}

torch::Tensor Linear4bitImpl::forward_graph_only(const torch::Tensor& input) {
  if (output_hook) return forward(input);  // the hook may read or change the value
  return compute(input, /*graph_only=*/true);
}

std::vector<std::string> quantize_linears(torch::nn::Module& model, const Quant4bitOptions& options,
                                          const std::vector<std::string>& keep_out) {
  std::vector<std::regex> keep;
  for (const auto& k : keep_out)
    keep.emplace_back(k);
  std::vector<std::string> replaced;
  // Parents first, then their children by name: replace_module on the parent keeps every path. A Sequential
  // or ModuleList parent runs its own list of modules, not the registry: that entry is replaced too (as
  // checkpoint_sequential does).
  const auto modules = model.named_modules("", /*include_self=*/true);
  for (const auto& item : modules) {
    auto& parent = *item.value();
    const bool listed = dynamic_cast<torch::nn::SequentialImpl*>(&parent) != nullptr ||
                        dynamic_cast<torch::nn::ModuleListImpl*>(&parent) != nullptr;
    for (const auto& child : parent.named_children()) {
      if (dynamic_cast<torch::nn::LinearImpl*>(child.value().get()) == nullptr) continue;
      const std::string path = item.key().empty() ? child.key() : item.key() + "." + child.key();
      if (std::any_of(keep.begin(), keep.end(),
                      [&](const std::regex& r) { return std::regex_search(path, r); }))
        continue;
      // The references we know of: the parent's registry, `modules`, this loop's copy of the children and a
      // Sequential's or ModuleList's own list. One more is a handle the model keeps (`torch::nn::Linear fc1`
      // as a member its forward calls): the forward would go on using the full-precision layer, so refuse.
      const long known = 3 + (listed ? 1 : 0);
      if (child.value().use_count() > known) {
        throw UsageError(
            "accel::quant::quantize_linears: '" + path +
            "' is also held outside the module registry (a member " + "handle such as `torch::nn::Linear " +
            child.key() + "` that the forward calls), so the forward " +
            "would keep using the full-precision layer. Build the model with the 4-bit layers instead " +
            "(accel::quant::Linear4bit(torch::nn::Linear(...)) as the member), or call the layers through " +
            "named_children()/a Sequential, or keep this layer out with keep_out");
      }
      Linear4bit q(torch::nn::Linear(std::static_pointer_cast<torch::nn::LinearImpl>(child.value())),
                   options);
      if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
        for (auto it = seq->begin(); it != seq->end(); ++it)
          if (it->ptr().get() == child.value().get()) *it = torch::nn::AnyModule(q);
      } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
        for (auto it = list->begin(); it != list->end(); ++it)
          if (it->get() == child.value().get()) *it = q.ptr();
      }
      parent.replace_module(child.key(), q);
      replaced.push_back(path);
    }
  }
  return replaced;
}

}  // namespace accel::quant
