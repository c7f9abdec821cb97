// accel::optim::AdamW8bit: bitsandbytes' AdamW with 8-bit blockwise state. The cases without a tag check the
// memory and the round trip; [.bnb_adamw8bit] compares with bitsandbytes itself
// (tests/python/bnb_adamw8bit.py writes its values, python_crosschecks.sh runs both): the dynamic maps and
// the reference quantisation kernel exactly, three optimizer steps of bnb.optim.AdamW(optim_bits=8) on the
// CPU within the rounding the two quantisation kernels differ by (see below).
#include <catch2/catch.hpp>

#include <accel/checkpoint/safetensors.hpp>
#include <accel/optim/adamw_8bit.hpp>

#include "checkpoint/tensor_io.hpp"

#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

using accel::optim::AdamW8bit;
using accel::optim::AdamW8bitOptions;
using accel::optim::AdamW8bitParamState;

TEST_CASE(
    "AdamW8bit: 8-bit state where bitsandbytes keeps it, a quarter of AdamW's bytes, and a round trip") {
  torch::manual_seed(0);
  auto big = torch::randn({64, 80}, torch::requires_grad());  // 5,120 elements: 8-bit state
  auto small = torch::randn({10}, torch::requires_grad());    // below min_8bit_size: fp32 state
  AdamW8bit opt({big, small}, AdamW8bitOptions(1e-2));
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    ((big * big).sum() + small.pow(3).sum()).backward();
    opt.step();
  }
  const auto& sb = static_cast<const AdamW8bitParamState&>(*opt.state().at(big.unsafeGetTensorImpl()));
  const auto& ss = static_cast<const AdamW8bitParamState&>(*opt.state().at(small.unsafeGetTensorImpl()));
  CHECK(sb.state1().scalar_type() == torch::kUInt8);
  CHECK(sb.absmax1().numel() == (5120 + 255) / 256);
  CHECK(ss.state1().scalar_type() == torch::kFloat32);
  const auto bytes =
      sb.state1().nbytes() + sb.state2().nbytes() + sb.absmax1().nbytes() + sb.absmax2().nbytes();
  CHECK(static_cast<double>(bytes) / static_cast<double>(2 * 5120 * 4) < 0.26);  // 2 + 8/256 bytes vs 8
  // torch::save / torch::load keep the codes.
  std::stringstream buffer;
  torch::serialize::OutputArchive out;
  opt.save(out);
  out.save_to(buffer);
  AdamW8bit again({big, small}, AdamW8bitOptions(1e-2));
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  again.load(in);
  const auto& sa = static_cast<const AdamW8bitParamState&>(*again.state().at(big.unsafeGetTensorImpl()));
  CHECK(torch::equal(sa.state1(), sb.state1()));
  CHECK(torch::equal(sa.absmax2(), sb.absmax2()));
  CHECK(sa.step() == 2);
  // Quantising and dequantising: each value within half a code step of its block's scale.
  const auto x = torch::randn({1000}) * 0.05;
  const auto code = accel::optim::dynamic_map(true);
  const auto [q, absmax] = accel::optim::quantize_blockwise(x, code);
  const auto back = accel::optim::dequantize_blockwise(q, absmax, code);
  CHECK((back - x).abs().max().item<double>() < 0.05 * absmax.max().item<double>());
}

namespace {

std::map<std::string, torch::Tensor> bnb_values() {
  const char* dir = std::getenv("ACCEL_BNB_DIR");
  REQUIRE(dir != nullptr);
  return accel::detail::read_tensors(
      accel::safetensors::File::open(std::string(dir) + "/adamw8bit.safetensors"));
}

}  // namespace

TEST_CASE("AdamW8bit: bitsandbytes' maps, quantisation and three AdamW8bit steps", "[.bnb_adamw8bit]") {
  auto t = bnb_values();
  CHECK(torch::equal(accel::optim::dynamic_map(true), t.at("map_signed")));
  CHECK(torch::equal(accel::optim::dynamic_map(false), t.at("map_unsigned")));
  // bitsandbytes' reference kernel (nearest code): equal.
  const auto [q, absmax] = accel::optim::quantize_blockwise(t.at("quant_input"), t.at("map_signed"));
  CHECK(torch::equal(q, t.at("quant_ref_codes")));
  CHECK(torch::equal(absmax, t.at("quant_ref_absmax")));
  // Its compiled CPU kernel (what bnb.optim runs on a CPU) rounds some values to the farther of two codes:
  // the codes are one step apart there, for well under 1% of the values.
  const auto apart = q.to(torch::kInt).sub(t.at("quant_cpu_codes").to(torch::kInt)).abs();
  CHECK(apart.max().item<int>() <= 1);
  CHECK(apart.sum().item<int>() <= q.numel() / 100);
  // Three steps of bnb.optim.AdamW(lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1, optim_bits 8).
  auto big = t.at("big_init").clone().requires_grad_(true);
  auto small = t.at("small_init").clone().requires_grad_(true);
  AdamW8bitOptions o(1e-2);
  o.betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  AdamW8bit opt({big, small}, o);
  for (int s = 0; s < 3; ++s) {
    INFO("step " << s + 1);
    const auto k = std::to_string(s);
    big.mutable_grad() = t.at("big_grad_" + k);
    small.mutable_grad() = t.at("small_grad_" + k);
    opt.step();
    // fp32 state (below min_8bit_size): bitsandbytes' 32-bit update, to float rounding.
    CHECK(torch::allclose(small.detach(), t.at("small_" + k), 1e-6, 1e-7));
    const auto& st = static_cast<const AdamW8bitParamState&>(*opt.state().at(big.unsafeGetTensorImpl()));
    // 8-bit state against bitsandbytes' optimizer with its reference (nearest-code) kernels: the same codes,
    // absmax and parameters.
    CHECK(torch::equal(st.state1(), t.at("ref_big_state1_" + k)));
    CHECK(torch::equal(st.state2(), t.at("ref_big_state2_" + k)));
    CHECK(torch::allclose(st.absmax1(), t.at("ref_big_absmax1_" + k), 1e-6, 0));
    CHECK(torch::allclose(big.detach(), t.at("ref_big_" + k), 1e-6, 1e-7));
    // Against its compiled CPU kernel: the few codes it rounds the other way move the next steps' updates a
    // little (measured: under 6% of the learning rate after 3 steps).
    const double diff = (big.detach() - t.at("big_" + k)).abs().max().item<double>();
    CHECK(diff < 0.1 * 1e-2);
    const auto codes_apart = st.state1().ne(t.at("big_state1_" + k)).sum().item<int>() +
                             st.state2().ne(t.at("big_state2_" + k)).sum().item<int>();
    CHECK(codes_apart <= 2 * 5000 * 3 / 100);
    std::cout << "bnb_adamw8bit: step " << s + 1 << ": equal to bitsandbytes' AdamW8bit with its reference "
              << "kernels; against its compiled CPU kernel: max |param difference| " << diff << ", "
              << codes_apart << " of 10000 codes one step apart" << std::endl;
  }
}
