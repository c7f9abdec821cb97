// accel::quant: 4-bit NF4/FP4 storage with double quantisation (issue 26, QLoRA's base weights).
//  - the round trip's error is what the codes allow: at most half the widest gap between neighbouring codes
//    times the block's absmax (plus the absmax's own 8-bit error with double quantisation);
//  - bytes per parameter: 0.516 with double quantisation (QLoRA's goal: <= 0.52), 0.5625 without;
//  - Linear4bit computes F::linear with the dequantised weight in the input's (or autocast's) type, trains
//    nothing of the weight, and quantize_linears swaps a model's Linears in place;
//  - against bitsandbytes itself: the hidden case [.bnb], run by tests/python/python_crosschecks.sh.
#include <catch2/catch.hpp>

#include <accel/monitor/memory.hpp>
#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using accel::quant::Quant4bitOptions;
using accel::quant::QuantType;

namespace {

// A model with a Linear child, a Linear inside a Sequential child, and a head. The children are looked up by
// name in forward, so the replaced modules are the ones that run.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    register_module("a", torch::nn::Linear(16, 32));
    register_module("inner", torch::nn::Sequential(torch::nn::Linear(32, 32)));
    register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto children = named_children();
    auto h = torch::relu(children["a"]->as<accel::quant::Linear4bit>() != nullptr
                             ? children["a"]->as<accel::quant::Linear4bit>()->forward(x)
                             : children["a"]->as<torch::nn::Linear>()->forward(x));
    h = torch::relu(children["inner"]->as<torch::nn::Sequential>()->forward(h));
    return children["head"]->as<torch::nn::Linear>()->forward(h);
  }
};
TORCH_MODULE(Net);

double widest_gap(QuantType type) {
  auto code = std::get<0>(accel::quant::code_4bit(type).sort());
  return (code.narrow(0, 1, 15) - code.narrow(0, 0, 15)).max().item<double>();
}

}  // namespace

TEST_CASE("quant: the 4-bit codes and the 8-bit dynamic map are bitsandbytes'") {
  const auto nf4 = accel::quant::code_4bit(QuantType::NF4);
  REQUIRE(nf4.numel() == 16);
  CHECK(nf4[0].item<float>() == -1.0F);
  CHECK(nf4[7].item<float>() == 0.0F);
  CHECK(nf4[15].item<float>() == 1.0F);
  CHECK(torch::equal(std::get<0>(nf4.sort()), nf4));  // NF4's table is sorted
  const auto fp4 = accel::quant::code_4bit(QuantType::FP4);
  CHECK(fp4.abs().max().item<float>() == 1.0F);
  CHECK(fp4[3].item<float>() == 1.0F);                   // 0b011 = 12, the largest, normalised
  CHECK(fp4[1].item<float>() == Approx(0.0625 / 12.0));  // the subnormal
  const auto map = accel::quant::dynamic_map_8bit();
  REQUIRE(map.numel() == 256);
  CHECK(torch::equal(std::get<0>(map.sort()), map));
  CHECK(map[255].item<float>() == 1.0F);
  CHECK(map.min().item<float>() == Approx(-0.99297).epsilon(1e-4));
}

TEST_CASE("quant: the round trip's error is what the codes allow; 0.516 bytes per parameter") {
  torch::manual_seed(0);
  const auto w = torch::randn({257, 70});  // 17990 values: the last block of 64 is short, numel is even
  for (const auto type : {QuantType::NF4, QuantType::FP4}) {
    for (const bool double_quant : {false, true}) {
      INFO((type == QuantType::NF4 ? "nf4" : "fp4") << ", double_quant " << double_quant);
      Quant4bitOptions o;
      o.type = type;
      o.double_quant = double_quant;
      const auto q = accel::quant::quantize_4bit(w, o);
      const auto back = accel::quant::dequantize_4bit(q);
      REQUIRE(back.sizes() == w.sizes());
      REQUIRE(back.scalar_type() == torch::kFloat32);
      // Per block: |error| <= gap/2 x absmax (+ the absmax's own error, bounded by 1% here).
      const auto flat = w.reshape({-1});
      const auto err = (back.reshape({-1}) - flat).abs();
      const auto n = flat.numel();
      const auto blocks = (n + 63) / 64;
      auto padded_w = torch::constant_pad_nd(flat.abs(), {0, blocks * 64 - n}).view({blocks, 64});
      auto padded_e = torch::constant_pad_nd(err, {0, blocks * 64 - n}).view({blocks, 64});
      const auto absmax = std::get<0>(padded_w.max(1));
      // The absmax the dequantisation uses: exact, or its 8-bit dynamic-map code x scale + offset.
      auto used = absmax;
      if (double_quant) {
        auto map = accel::quant::dynamic_map_8bit().clone();
        map[0] = -1.0F;
        const auto scales = q.absmax_scale.repeat_interleave(256).narrow(0, 0, blocks);
        used = map.index_select(0, q.absmax.to(torch::kLong)) * scales + q.absmax_offset;
      }
      const auto bound = used * (widest_gap(type) / 2) + (used - absmax).abs() + 1e-6;
      CHECK((std::get<0>(padded_e.max(1)) <= bound).all().item<bool>());
      const double mean_rel = (err.mean() / flat.abs().mean()).item<double>();
      INFO("mean |error| / mean |w| = " << mean_rel);
      CHECK(mean_rel < (type == QuantType::NF4 ? 0.12 : 0.2));
    }
  }
  // Storage: 4 bits per value, one uint8 absmax per 64 values and one float per 256 absmax values.
  const auto big = torch::randn({1024, 1024});
  const auto dq = accel::quant::quantize_4bit(big);
  const double per_param = static_cast<double>(dq.bytes()) / static_cast<double>(big.numel());
  CHECK(per_param == Approx(0.5 + 1.0 / 64 + 4.0 / (64 * 256)));
  CHECK(per_param <= 0.52);
  Quant4bitOptions single;
  single.double_quant = false;
  CHECK(static_cast<double>(accel::quant::quantize_4bit(big, single).bytes()) / 1048576.0 == Approx(0.5625));
  // bfloat16 weights come back as bfloat16; other types and blocksizes are refused.
  CHECK(accel::quant::dequantize_4bit(accel::quant::quantize_4bit(w.to(torch::kBFloat16))).scalar_type() ==
        torch::kBFloat16);
  CHECK_THROWS_WITH(accel::quant::quantize_4bit(torch::ones({4}, torch::kInt32)),
                    Catch::Contains("float32, bfloat16 or float16"));
  Quant4bitOptions odd;
  odd.blocksize = 48;
  CHECK_THROWS_WITH(accel::quant::quantize_4bit(w, odd), Catch::Contains("blocksize 48"));
}

TEST_CASE("quant: Linear4bit computes the layer with the dequantised weight, and trains none of it") {
  torch::manual_seed(1);
  torch::nn::Linear dense(64, 32);
  accel::quant::Linear4bit q4(dense);
  CHECK(q4->parameters().size() == 1);  // the bias; the weight is 4-bit buffers
  const auto x = torch::randn({8, 64}, torch::requires_grad());
  const auto y = q4(x);
  const auto want = torch::nn::functional::linear(x, q4->dequantized_weight(), dense->bias);
  CHECK(torch::allclose(y, want, 1e-6, 1e-6));
  const double rel = ((y - dense(x)).abs().max() / dense(x).abs().max()).item<double>();
  INFO("max |y_4bit - y| / max |y| = " << rel);
  CHECK(rel < 0.2);  // NF4 fits normal weights; this layer has uniform ones
  y.sum().backward();
  CHECK(x.grad().defined());  // gradients reach the input (LoRA's A and B above it train)
  // bf16 autocast: the weight is dequantised straight to bf16.
  at::autocast::set_autocast_enabled(torch::kCPU, true);
  at::autocast::set_autocast_dtype(torch::kCPU, torch::kBFloat16);
  const auto yb = q4(x.detach());
  at::autocast::set_autocast_enabled(torch::kCPU, false);
  at::autocast::clear_cache();
  CHECK(yb.scalar_type() == torch::kBFloat16);
  CHECK(torch::allclose(yb.to(torch::kFloat32), y.detach(), 2e-2, 2e-2));
  // quantize_linears: every Linear but the kept-out head, in place, paths unchanged.
  Net model;
  const auto in = torch::randn({4, 16});
  const auto before = model->forward(in).detach();
  const auto replaced = accel::quant::quantize_linears(*model, {}, {"^head$"});
  CHECK(replaced == std::vector<std::string>{"a", "inner.0"});
  CHECK(model->named_children()["a"]->name() == "accel::quant::Linear4bitImpl");
  CHECK(model->named_children()["head"]->as<torch::nn::Linear>() != nullptr);
  // Inside a Sequential the module that runs (its own list, not only the registry) is the 4-bit one.
  CHECK(model->named_children()["inner"]->as<torch::nn::Sequential>()->ptr(0)->name() ==
        "accel::quant::Linear4bitImpl");
  const auto after = model->forward(in).detach();
  CHECK(((after - before).abs().max() / before.abs().max()).item<double>() < 0.1);
  // A model that calls its layers through member handles (the usual LibTorch style) would keep running the
  // full-precision layers after a registry swap: refused, naming the layer and what to do.
  struct MemberNetImpl : torch::nn::Module {
    MemberNetImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
    torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
    torch::nn::Linear fc;
  };
  auto member = std::make_shared<MemberNetImpl>();
  CHECK_THROWS_WITH(accel::quant::quantize_linears(*member),
                    Catch::Contains("'fc' is also held outside the module registry"));
  CHECK(member->named_children()["fc"]->as<torch::nn::Linear>() != nullptr);  // left as it was
}

TEST_CASE(
    "quant: Linear4bit keeps its codes for backward, not the dequantised weight (bitsandbytes' MatMul4Bit)") {
  torch::manual_seed(2);
  torch::nn::Linear dense(1024, 1024);
  accel::quant::Linear4bit q4(dense);
  q4->bias.set_requires_grad(true);
  const auto x = torch::randn({4, 1024}, torch::requires_grad());
  accel::CpuMemoryCounter::install();
  const auto before = accel::CpuMemoryCounter::current();
  auto y = q4(x);
  // Held until backward: the output (16 KiB), not a float32 copy of the weight (4 MiB) as F::linear saves.
  const auto held = accel::CpuMemoryCounter::current() - before;
  INFO("bytes held after forward: " << held);
  CHECK(held < 1024 * 1024);
  const auto g = torch::randn({4, 1024});
  y.backward(g);
  const auto w = q4->dequantized_weight();
  CHECK(torch::allclose(x.grad(), g.mm(w), 1e-6, 1e-6));
  CHECK(torch::allclose(q4->bias.grad(), g.sum(0), 1e-6, 1e-6));
  // Without a bias (o_proj, gate/up/down_proj), on a [B, T, in] input, single quantisation.
  accel::quant::Quant4bitOptions single;
  single.double_quant = false;
  accel::quant::Linear4bit plain(torch::nn::Linear(torch::nn::LinearOptions(64, 32).bias(false)), single);
  const auto x3 = torch::randn({2, 3, 64}, torch::requires_grad());
  const auto g3 = torch::randn({2, 3, 32});
  const auto y3 = plain(x3);
  CHECK(torch::allclose(y3, x3.matmul(plain->dequantized_weight().t()), 1e-6, 1e-6));
  y3.backward(g3);
  CHECK(torch::allclose(x3.grad(), g3.matmul(plain->dequantized_weight()), 1e-6, 1e-6));
}

TEST_CASE("quant: Linear4bit multiplies the weight a row slice at a time, never dequantising it whole") {
  // The sliced product against the whole dequantised weight: the same values to float rounding (the forward's
  // dot products are the same; backward sums the slices' products), for slices that cut inside a row of
  // blocks (in 70: a slice is a multiple of 32 rows), an odd weight, a bias, [B, T, in] inputs and bf16.
  torch::manual_seed(4);
  struct Case {
    std::int64_t out, in, slice_bytes;
  };
  for (const auto& [out, in, slice_bytes] :
       std::vector<Case>{{300, 70, 0}, {300, 70, 9000}, {129, 63, 9000}, {40, 256, std::int64_t{1} << 30}}) {
    {
      INFO("weight " << out << "x" << in << ", slice_bytes " << slice_bytes);
      accel::quant::Linear4bit q4(torch::nn::Linear(in, out));
      q4->slice_bytes = slice_bytes;
      q4->bias.set_requires_grad(true);
      const auto w = q4->dequantized_weight();
      const auto x = torch::randn({2, 5, in}, torch::requires_grad());
      const auto g = torch::randn({2, 5, out});
      const auto y = q4(x);
      CHECK(torch::allclose(y, torch::nn::functional::linear(x, w, q4->bias), 1e-5, 1e-6));
      y.backward(g);
      CHECK(torch::allclose(x.grad(), g.matmul(w), 1e-5, 1e-6));
      CHECK(torch::allclose(q4->bias.grad(), g.reshape({-1, out}).sum(0), 1e-5, 1e-6));
      // forward_graph_only: the same gradients, the value not computed.
      const auto x2 = x.detach().clone().requires_grad_(true);
      q4->bias.mutable_grad().reset();
      const auto y2 = q4->forward_graph_only(x2);
      CHECK(y2.sizes() == y.sizes());
      y2.backward(g);
      CHECK(torch::equal(x2.grad(), x.grad()));
      CHECK(torch::allclose(q4->bias.grad(), g.reshape({-1, out}).sum(0), 1e-5, 1e-6));
      // bf16 (the QLoRA compute dtype under autocast): within bf16's rounding of the whole-weight product.
      const auto xb = x.detach().to(torch::kBFloat16).requires_grad_(true);
      const auto yb = q4(xb);
      const auto wb = q4->dequantized_weight(torch::kBFloat16);
      CHECK(torch::allclose(
          yb.to(torch::kFloat32),
          torch::nn::functional::linear(xb, wb, q4->bias.to(torch::kBFloat16)).to(torch::kFloat32), 2e-2,
          2e-2));
      yb.backward(g.to(torch::kBFloat16));
      CHECK(torch::allclose(xb.grad().to(torch::kFloat32), g.matmul(wb.to(torch::kFloat32)), 2e-2, 2e-2));
      // No grad: the same sliced product.
      torch::NoGradGuard no_grad;
      CHECK(torch::allclose(q4(x), y, 0, 0));
    }
  }
  // Memory: a [2048, 1024] layer (8 MiB of float32) in slices of 1 MiB holds at most about a slice beyond
  // its input, output and gradients in forward and in backward, where a whole dequantised weight is 8 MiB.
  accel::quant::Linear4bit big(torch::nn::Linear(1024, 2048));
  big->slice_bytes = std::int64_t{1} << 20;
  const auto x = torch::randn({16, 1024}, torch::requires_grad());
  const auto g = torch::randn({16, 2048});
  accel::CpuMemoryCounter::install();
  const auto before = accel::CpuMemoryCounter::current();
  accel::CpuMemoryCounter::reset_peak();
  auto y = big(x);
  y.backward(g);
  const auto extra = accel::CpuMemoryCounter::peak() - before;
  INFO("peak bytes above the start through forward and backward: " << extra);
  CHECK(extra < 3 * (std::int64_t{1} << 20));  // one 1 MiB slice (+ its int32 indices) + x's grad and y
  // Quantising goes a slice of 2^18 values at a time: a [1024, 1024] float32 tensor (4 MiB) is quantised with
  // slice-sized temporaries beside its 0.5 MiB of codes (whole, they were 3 x 4 MiB), and its codes equal
  // those of its first and last 128 rows quantised apart (each block's scale is its own).
  const auto w = torch::randn({1024, 1024});
  accel::CpuMemoryCounter::reset_peak();
  const auto start = accel::CpuMemoryCounter::current();
  const auto q = accel::quant::quantize_4bit(w);
  const auto quant_extra = accel::CpuMemoryCounter::peak() - start;
  INFO("peak bytes above the start while quantising 4 MiB of float32: " << quant_extra);
  CHECK(quant_extra < 4 * (std::int64_t{1} << 20));  // measured 3.2 MB: 1 MiB slices, 0.5 MiB of codes
  const auto first = accel::quant::quantize_4bit(w.narrow(0, 0, 128));
  const auto last = accel::quant::quantize_4bit(w.narrow(0, 896, 128));
  CHECK(torch::equal(q.packed.narrow(0, 0, first.packed.numel()), first.packed));
  CHECK(torch::equal(q.packed.narrow(0, q.packed.numel() - last.packed.numel(), last.packed.numel()),
                     last.packed));
}

// Run by tests/python/python_crosschecks.sh after bnb_4bit.py wrote bitsandbytes' results into ACCEL_BNB_DIR.
TEST_CASE("quant: the same codes as bitsandbytes", "[.bnb]") {
  const char* dir = std::getenv("ACCEL_BNB_DIR");
  REQUIRE(dir != nullptr);
  auto read = [&](const std::string& name, torch::ScalarType type, std::int64_t n) {
    std::ifstream f(std::string(dir) + "/" + name, std::ios::binary);
    REQUIRE(f.good());
    auto t = torch::empty({n}, type);
    f.read(reinterpret_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(n * t.element_size()));
    REQUIRE(f.gcount() == n * t.element_size());
    return t;
  };
  std::ifstream cases(std::string(dir) + "/cases.txt");
  REQUIRE(cases.good());
  std::string line;
  int count = 0;
  std::int64_t absmax_codes = 0, absmax_differ = 0;
  while (std::getline(cases, line)) {
    std::istringstream in(line);
    std::string name, type;
    std::int64_t blocksize = 0, numel = 0, nested = 0;
    in >> name >> type >> blocksize >> nested >> numel;
    INFO("case " << name);
    const auto w = read(name + ".input", torch::kFloat32, numel);
    Quant4bitOptions o;
    o.type = type == "nf4" ? QuantType::NF4 : QuantType::FP4;
    o.blocksize = blocksize;
    o.double_quant = nested != 0;
    const auto q = accel::quant::quantize_4bit(w, o);
    const auto packed = read(name + ".packed", torch::kUInt8, q.packed.numel());
    CHECK(torch::equal(q.packed, packed));  // the 4-bit codes: bit for bit
    const auto blocks = (numel + blocksize - 1) / blocksize;
    if (!o.double_quant) {
      CHECK(torch::equal(q.absmax, read(name + ".absmax", torch::kFloat32, blocks)));
      CHECK(torch::equal(accel::quant::dequantize_4bit(q), read(name + ".deq", torch::kFloat32, numel)));
    } else {
      const auto theirs = read(name + ".absmax", torch::kUInt8, blocks);
      const auto scale = read(name + ".state2", torch::kFloat32, (blocks + 255) / 256);
      const float offset = read(name + ".offset", torch::kFloat32, 1).item<float>();
      CHECK(torch::equal(q.absmax_scale, scale));
      CHECK(q.absmax_offset == offset);
      // Where the 8-bit absmax codes differ, ours is the nearer code to the true (absmax - offset) / scale.
      auto map = accel::quant::dynamic_map_8bit().clone();
      map[0] = -1.0F;
      const auto truth = read(name + ".absmax_true", torch::kFloat32, blocks);
      const auto differ = (q.absmax != theirs).nonzero().reshape({-1});
      absmax_codes += blocks;
      absmax_differ += differ.numel();
      for (std::int64_t i = 0; i < differ.numel(); ++i) {
        const auto k = differ[i].item<std::int64_t>();
        const float target = (truth[k].item<float>() - offset) / scale[k / 256].item<float>();
        const float ours = map[q.absmax[k].item<std::uint8_t>()].item<float>();
        const float bnb = map[theirs[k].item<std::uint8_t>()].item<float>();
        CHECK(std::abs(ours - target) < std::abs(bnb - target));
      }
      // With bitsandbytes' absmax codes, the dequantised tensor is bitsandbytes' exactly.
      auto same = q;
      same.absmax = theirs;
      CHECK(torch::equal(accel::quant::dequantize_4bit(same), read(name + ".deq", torch::kFloat32, numel)));
    }
    ++count;
  }
  CHECK(count >= 4);
  std::cout << "bnb: " << count << " cases; 4-bit codes equal; 8-bit absmax codes differ in " << absmax_differ
            << " of " << absmax_codes << " (ours the nearer each time)\n";
}

TEST_CASE("quant: QLoRA trains LoRA adapters over 4-bit Linears like LoRA over the dequantised weights") {
  // Two copies of one model: one quantised (4-bit base), one whose Linear weights are those 4-bit weights
  // dequantised. The same adapters (same seed) trained the same steps give the same outputs: the 4-bit
  // layer adds PEFT's term exactly as the full-precision observer does, and only the adapters train.
  auto build = [] {
    torch::manual_seed(7);
    return Net();
  };
  Net q = build();
  accel::quant::quantize_linears(*q, {}, {"^head$"});
  Net plain = build();
  {
    torch::NoGradGuard no_grad;
    auto qc = q->named_children();
    auto pc = plain->named_children();
    pc["a"]->as<torch::nn::Linear>()->weight.copy_(
        qc["a"]->as<accel::quant::Linear4bit>()->dequantized_weight());
    auto q_inner = qc["inner"]->as<torch::nn::Sequential>()->ptr(0);
    auto p_inner = pc["inner"]->as<torch::nn::Sequential>()->ptr(0);
    std::dynamic_pointer_cast<torch::nn::LinearImpl>(p_inner)->weight.copy_(
        std::dynamic_pointer_cast<accel::quant::Linear4bitImpl>(q_inner)->dequantized_weight());
  }
  accel::peft::LoraConfig config;
  config.r = 4;
  config.lora_alpha = 8;
  config.target_modules = {"a", "0"};
  torch::manual_seed(11);
  auto q_lora = accel::peft::get_peft_model(q.ptr(), config);
  torch::manual_seed(11);
  auto p_lora = accel::peft::get_peft_model(plain.ptr(), config);
  const auto packed_before = q->named_buffers()["a.weight_packed"].clone();
  std::vector<torch::Tensor> q_params, p_params;
  for (auto& p : q->parameters())
    if (p.requires_grad()) q_params.push_back(p);
  for (auto& p : plain->parameters())
    if (p.requires_grad()) p_params.push_back(p);
  REQUIRE(q_params.size() == 4);  // lora_A and lora_B of two layers
  REQUIRE(p_params.size() == 4);
  torch::optim::AdamW q_opt(q_params, torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW p_opt(p_params, torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(3);
  const auto x = torch::randn({16, 16}), y = torch::randn({16, 4});
  for (int s = 0; s < 5; ++s) {
    q_opt.zero_grad();
    torch::mse_loss(q->forward(x), y).backward();
    q_opt.step();
    p_opt.zero_grad();
    torch::mse_loss(plain->forward(x), y).backward();
    p_opt.step();
  }
  const auto got = q->forward(x).detach(), want = plain->forward(x).detach();
  INFO("max difference " << (got - want).abs().max().item<double>());
  CHECK(torch::allclose(got, want, 1e-5, 1e-5));
  CHECK(torch::equal(q->named_buffers()["a.weight_packed"], packed_before));  // the 4-bit base is frozen
  CHECK(q->named_parameters().contains("a.lora_A.weight"));                   // PEFT's names
  CHECK(q->named_parameters().contains("inner.0.lora_B.weight"));
  // PEFT counts a 4-bit base's elements in "all params".
  CHECK(q_lora->trainable_parameters() == p_lora->trainable_parameters());
  // merge on a 4-bit base, as PEFT's: dequantise, add the adapters' product, quantise again; the layer then
  // adds no term (its output is the requantised weight's alone); unmerge subtracts the product the same way;
  // merge_and_unload leaves plain 4-bit layers with the merged weights and no adapters.
  auto* a = dynamic_cast<accel::quant::Linear4bitImpl*>(q->named_modules()["a"].get());
  REQUIRE(a != nullptr);
  const auto named = q->named_parameters();
  const auto delta = torch::matmul(named["a.lora_B.weight"], named["a.lora_A.weight"]).detach() * (8.0 / 4.0);
  const auto sum = a->dequantized_weight() + delta;
  // A copy of the layer before the merge (sharing its buffers, with its own quantisation constants): what a
  // model quantised from the same weights holds, into which a checkpoint of the merged model loads (the
  // absmax offset is the layer's, not in the state dict).
  const auto pristine = std::make_shared<accel::quant::Linear4bitImpl>(*a);
  const float offset = a->quantized().absmax_offset;
  {
    torch::NoGradGuard no_grad;
    const auto probe = torch::randn({3, a->in_features()});
    const auto plain_linear = [&] {
      return torch::nn::functional::linear(probe, a->dequantized_weight(), a->bias);
    };
    CHECK_FALSE(torch::equal(a->forward(probe), plain_linear()));  // adapted: the term is added
    q_lora->merge();
    // The sum, in 4 bits again: within a code step of the block's range (NF4's widest gap is 0.28 of it).
    const auto err = (a->dequantized_weight() - sum).abs().max().item<double>();
    INFO("requantised merge error " << err << ", the sum's largest entry " << sum.abs().max().item<double>());
    CHECK(err <= 0.2 * sum.abs().max().item<double>());
    CHECK(a->quantized().absmax_offset == offset);
    // The merged buffers (the copy shares them, as a checkpoint loaded into it would fill them) decode alike.
    CHECK(torch::equal(pristine->dequantized_weight(), a->dequantized_weight()));
    CHECK(torch::equal(a->forward(probe), plain_linear()));  // merged: no term on top
    const auto merged = q->forward(x);
    INFO("merged outputs differ from the adapted ones by " << (merged - got).abs().max().item<double>());
    CHECK(torch::allclose(merged, got, 0.25, 0.25));  // the 4-bit rounding of the sum, no more
    q_lora->unmerge();
    CHECK_FALSE(torch::equal(a->forward(probe), plain_linear()));  // the term again
    q_lora->merge_and_unload();
    CHECK_FALSE(q->named_parameters().contains("a.lora_A.weight"));
    CHECK(torch::equal(a->forward(probe), plain_linear()));
  }
}
