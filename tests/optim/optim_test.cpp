// accel::optim: the fused Adam/AdamW give LibTorch's numbers and share its checkpoints both ways.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <accel/accelerator/accelerator.hpp>
#include <accel/optim/chunked_adamw.hpp>
#include <accel/optim/deepspeed_adam.hpp>
#include <accel/optim/optim.hpp>

#include <sstream>

using accel::test::Mlp;
using accel::test::Regression;

namespace {

// Trains two copies of one model for `steps` steps with the same batches: `a` with optimizer A, `b` with B.
template <typename A, typename B, typename Options>
void compare(const Options& options, int steps, int checkpoint_at = -1) {
  Regression data(16);
  torch::manual_seed(0);
  Mlp a;
  torch::manual_seed(0);
  Mlp b;
  const auto initial = accel::test::snapshot(*a);
  auto opt_a = std::make_unique<A>(a->parameters(), options);
  auto opt_b = std::make_unique<B>(b->parameters(), options);
  for (int s = 0; s < steps; ++s) {
    for (const auto& pair : {std::make_pair(&a, static_cast<torch::optim::Optimizer*>(opt_a.get())),
                             std::make_pair(&b, static_cast<torch::optim::Optimizer*>(opt_b.get()))}) {
      pair.second->zero_grad();
      torch::mse_loss((*pair.first)(data.x), data.y).backward();
      pair.second->step();
    }
    if (s == checkpoint_at) {
      // Swap states through torch::save / torch::load: B's state loads into a fresh A and vice versa.
      std::stringstream a_bytes, b_bytes;
      torch::save(*opt_a, a_bytes);
      torch::save(*opt_b, b_bytes);
      opt_a = std::make_unique<A>(a->parameters(), options);
      opt_b = std::make_unique<B>(b->parameters(), options);
      torch::load(*opt_a, b_bytes);
      torch::load(*opt_b, a_bytes);
    }
  }
  const auto pa = accel::test::snapshot(*a), pb = accel::test::snapshot(*b);
  for (std::size_t k = 0; k < pa.size(); ++k) {
    INFO("tensor " << k << ": max difference " << (pa[k] - pb[k]).abs().max().item<double>());
    REQUIRE(torch::allclose(pa[k], pb[k], 1e-5, 1e-5));
    REQUIRE(!torch::equal(pa[k], initial[k]));  // it trained
  }
}

}  // namespace

TEST_CASE("optim: fused AdamW gives torch::optim::AdamW's numbers (weight decay, amsgrad)") {
  compare<accel::optim::AdamW, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).weight_decay(0.05), 5);
  compare<accel::optim::AdamW, torch::optim::AdamW>(
      torch::optim::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true).betas({0.8, 0.95}), 5);
}

TEST_CASE("optim: fused Adam gives torch::optim::Adam's numbers (L2 weight decay, amsgrad)") {
  compare<accel::optim::Adam, torch::optim::Adam>(torch::optim::AdamOptions(1e-2), 5);
  compare<accel::optim::Adam, torch::optim::Adam>(
      torch::optim::AdamOptions(1e-2).weight_decay(0.1).amsgrad(true), 5);
}

TEST_CASE(
    "optim: fused SGD gives torch::optim::SGD's numbers (momentum, dampening, nesterov, weight decay)") {
  compare<accel::optim::SGD, torch::optim::SGD>(torch::optim::SGDOptions(0.05), 5);
  compare<accel::optim::SGD, torch::optim::SGD>(
      torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01), 5);
  compare<accel::optim::SGD, torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1),
                                                5);
  compare<accel::optim::SGD, torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true),
                                                5);
  compare<accel::optim::SGD, torch::optim::SGD>(torch::optim::SGDOptions(0.05).momentum(0.9), 6, 2);
}

TEST_CASE("optim: fused_replacement names the drop-in for exactly LibTorch's AdamW, Adam and SGD") {
  auto w = torch::zeros({2}, torch::requires_grad());
  struct OwnAdam : torch::optim::Adam {  // a subclass may step its own way: no suggestion
    using torch::optim::Adam::Adam;
  };
  CHECK(accel::optim::fused_replacement(torch::optim::AdamW({w})) == "accel::optim::AdamW");
  CHECK(accel::optim::fused_replacement(torch::optim::Adam({w})) == "accel::optim::Adam");
  CHECK(accel::optim::fused_replacement(torch::optim::SGD({w}, 0.1)) == "accel::optim::SGD");
  CHECK_FALSE(accel::optim::fused_replacement(accel::optim::AdamW({w})));
  CHECK_FALSE(accel::optim::fused_replacement(accel::optim::SGD({w}, 0.1)));
  CHECK_FALSE(accel::optim::fused_replacement(OwnAdam({w})));
  CHECK_FALSE(accel::optim::fused_replacement(torch::optim::Adagrad({w})));
}

TEST_CASE("optim: fused and LibTorch optimizers load each other's saved state and go on alike") {
  compare<accel::optim::AdamW, torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2).amsgrad(true), 6, 2);
  compare<accel::optim::Adam, torch::optim::Adam>(torch::optim::AdamOptions(1e-2), 6, 2);
}

TEST_CASE("optim: the step count is LibTorch's and parameters without gradient are left alone") {
  torch::manual_seed(0);
  Mlp model;
  accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  Regression data(8);
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    torch::mse_loss(model(data.x), data.y).backward();
    model->fc1->bias.mutable_grad() = torch::Tensor();  // as if unused
    opt.step();
  }
  const auto& states = opt.state();
  const auto& w =
      static_cast<const torch::optim::AdamWParamState&>(*states.at(model->fc1->weight.unsafeGetTensorImpl()));
  REQUIRE(w.step() == 3);
  REQUIRE(states.count(model->fc1->bias.unsafeGetTensorImpl()) == 0);
}

namespace {

// Parameters for the ChunkedAdamW comparison: one spanning three 2^17-element slices (a ragged tail), small
// ones, a transposed (non-contiguous) one and one that gets no gradient.
std::vector<torch::Tensor> chunked_params() {
  torch::manual_seed(3);
  return {torch::randn({(1 << 17) * 2 + 37}).requires_grad_(), torch::randn({300, 4}).requires_grad_(),
          torch::randn({3, 5}).requires_grad_(), torch::randn({300, 500}).t().requires_grad_(),
          torch::randn({4}).requires_grad_()};
}

void set_grads(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  for (std::size_t k = 0; k + 1 < params.size(); ++k)  // the last one gets none
    params[k].mutable_grad() = torch::randn_like(params[k]) * (k + 1.0);
}

template <typename State = torch::optim::AdamWParamState>
void require_bitwise(const torch::optim::Optimizer& a, const torch::optim::Optimizer& b,
                     const std::vector<torch::Tensor>& pa, const std::vector<torch::Tensor>& pb) {
  for (std::size_t k = 0; k < pa.size(); ++k) {
    INFO("parameter " << k);
    REQUIRE(torch::equal(pa[k], pb[k]));
    const auto sa = a.state().find(pa[k].unsafeGetTensorImpl());
    const auto sb = b.state().find(pb[k].unsafeGetTensorImpl());
    REQUIRE((sa == a.state().end()) == (sb == b.state().end()));
    if (sa == a.state().end()) continue;
    const auto& x = static_cast<const State&>(*sa->second);
    const auto& y = static_cast<const State&>(*sb->second);
    REQUIRE(x.step() == y.step());
    REQUIRE(torch::equal(x.exp_avg(), y.exp_avg()));
    REQUIRE(torch::equal(x.exp_avg_sq(), y.exp_avg_sq()));
    REQUIRE(x.max_exp_avg_sq().defined() == y.max_exp_avg_sq().defined());
    if (x.max_exp_avg_sq().defined()) REQUIRE(torch::equal(x.max_exp_avg_sq(), y.max_exp_avg_sq()));
  }
}

}  // namespace

TEST_CASE("optim: ChunkedAdamW is torch::optim::AdamW bitwise (slices, decay, amsgrad, checkpoints)") {
  // One intra-op thread: a second one spends this case's time spinning between the many small operators.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  struct Restore {
    int n;
    ~Restore() { at::set_num_threads(n); }
  } restore{threads};
  for (const bool amsgrad : {false, true}) {
    INFO("amsgrad " << amsgrad);
    const auto options =
        torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad).betas({0.8, 0.95});
    auto pa = chunked_params(), pb = chunked_params();
    const auto untouched = pa.back().detach().clone();
    auto a = std::make_unique<accel::optim::ChunkedAdamW>(pa, options);
    auto b = std::make_unique<torch::optim::AdamW>(pb, options);
    for (int s = 0; s < 3; ++s) {
      set_grads(pa, s);
      set_grads(pb, s);
      a->step();
      b->step();
      if (s == 1) {  // each loads the other's saved state and goes on alike
        std::stringstream a_bytes, b_bytes;
        torch::save(*a, a_bytes);
        torch::save(*b, b_bytes);
        a = std::make_unique<accel::optim::ChunkedAdamW>(pa, options);
        b = std::make_unique<torch::optim::AdamW>(pb, options);
        torch::load(*a, b_bytes);
        torch::load(*b, a_bytes);
      }
    }
    require_bitwise(*a, *b, pa, pb);
    REQUIRE(torch::equal(pa.back(), untouched));  // no gradient: no decay, no state
  }
}

namespace {

// LAMB from the paper (You et al. 2019, Algorithm 2), written elementwise in doubles, one parameter tensor
// at a time, as the reference for accel::optim::Lamb.
struct ReferenceLamb {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, min_coeff = 0, max_coeff = 0;
  bool bias_correction = true;
  std::vector<std::vector<double>> m, v;
  int t = 0;

  void step(std::vector<std::vector<double>>& w, const std::vector<std::vector<double>>& g) {
    if (m.empty()) {
      for (const auto& x : w) {
        m.emplace_back(x.size(), 0.0);
        v.emplace_back(x.size(), 0.0);
      }
    }
    ++t;
    for (std::size_t k = 0; k < w.size(); ++k) {
      std::vector<double> u(w[k].size());
      double w_sq = 0, u_sq = 0;
      for (std::size_t i = 0; i < w[k].size(); ++i) {
        m[k][i] = beta1 * m[k][i] + (1 - beta1) * g[k][i];
        v[k][i] = beta2 * v[k][i] + (1 - beta2) * g[k][i] * g[k][i];
        const double m_hat = bias_correction ? m[k][i] / (1 - std::pow(beta1, t)) : m[k][i];
        const double v_hat = bias_correction ? v[k][i] / (1 - std::pow(beta2, t)) : v[k][i];
        u[i] = m_hat / (std::sqrt(v_hat) + eps) + weight_decay * w[k][i];
        w_sq += w[k][i] * w[k][i];
        u_sq += u[i] * u[i];
      }
      double ratio = 1.0;
      if (w_sq > 0 && u_sq > 0)
        ratio = std::min(max_coeff, std::max(min_coeff, std::sqrt(w_sq) / std::sqrt(u_sq)));
      for (std::size_t i = 0; i < w[k].size(); ++i)
        w[k][i] -= lr * ratio * u[i];
    }
  }
};

std::vector<double> to_doubles(const torch::Tensor& t) {
  const auto d = t.detach().to(torch::kFloat64).contiguous().reshape({-1});
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

void check_lamb_against_reference(const accel::optim::LambOptions& options) {
  Regression data(16);
  torch::manual_seed(0);
  Mlp model;
  {
    torch::NoGradGuard no_grad;
    model->fc1->bias.zero_();  // a zero parameter: trust ratio 1 on the first step
  }
  accel::optim::Lamb opt(model->parameters(), options);
  const auto [beta1, beta2] = options.betas();
  ReferenceLamb ref;
  ref.lr = options.lr();
  ref.beta1 = beta1;
  ref.beta2 = beta2;
  ref.eps = options.eps();
  ref.weight_decay = options.weight_decay();
  ref.min_coeff = options.min_coeff();
  ref.max_coeff = options.max_coeff();
  ref.bias_correction = options.bias_correction();
  std::vector<std::vector<double>> w;
  for (const auto& p : model->parameters())
    w.push_back(to_doubles(p));
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    torch::mse_loss(model(data.x), data.y).backward();
    std::vector<std::vector<double>> g;
    for (const auto& p : model->parameters())
      g.push_back(to_doubles(p.grad()));
    opt.step();
    ref.step(w, g);
    const auto params = model->parameters();
    for (std::size_t k = 0; k < params.size(); ++k) {
      const auto got = to_doubles(params[k]);
      double worst = 0;
      for (std::size_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, std::abs(got[i] - w[k][i]));
      INFO("step " << s << ", tensor " << k << ": max difference " << worst);
      REQUIRE(worst <= 1e-6);
      // Keep the float model and the reference on the same point: the reference follows the float weights.
      w[k] = got;
    }
  }
}

}  // namespace

TEST_CASE(
    "optim: LAMB follows the paper's algorithm (trust ratio, decoupled weight decay, bias correction)") {
  check_lamb_against_reference(accel::optim::LambOptions(0.01).weight_decay(0.01));
  check_lamb_against_reference(accel::optim::LambOptions(0.05).bias_correction(false).betas({0.8, 0.99}));
  check_lamb_against_reference(accel::optim::LambOptions(0.01).max_coeff(0.05).min_coeff(0.01));  // clamped
}

TEST_CASE("optim: LAMB's state saves and loads, and sharding backends refuse it with the reason") {
  Regression data(16);
  torch::manual_seed(0);
  Mlp a;
  torch::manual_seed(0);
  Mlp b;
  accel::optim::Lamb opt_a(a->parameters(), accel::optim::LambOptions(0.01));
  auto opt_b = std::make_unique<accel::optim::Lamb>(b->parameters(), accel::optim::LambOptions(0.02));
  for (int s = 0; s < 4; ++s) {
    if (s == 2) {
      std::stringstream bytes;
      torch::save(opt_a, bytes);
      opt_b = std::make_unique<accel::optim::Lamb>(b->parameters(), accel::optim::LambOptions(0.5));
      torch::load(*opt_b, bytes);  // state and options (lr 0.01) come from the file
    }
    for (auto [model, opt] : {std::make_pair(&a, static_cast<torch::optim::Optimizer*>(&opt_a)),
                              std::make_pair(&b, static_cast<torch::optim::Optimizer*>(opt_b.get()))}) {
      opt->zero_grad();
      torch::mse_loss((*model)(data.x), data.y).backward();
      opt->step();
    }
    if (s == 1) {
      // b has stepped with lr 0.02 so far: make it a's weights again before the swap.
      torch::NoGradGuard no_grad;
      for (std::size_t k = 0; k < a->parameters().size(); ++k)
        b->parameters()[k].copy_(a->parameters()[k]);
    }
  }
  const auto pa = accel::test::snapshot(*a), pb = accel::test::snapshot(*b);
  for (std::size_t k = 0; k < pa.size(); ++k)
    REQUIRE(torch::equal(pa[k], pb[k]));

  accel::Config zero = accel::test::make_config();
  zero.backend = "zero";
  zero.zero.stage = 2;
  accel::Accelerator acc(accel::AcceleratorOptions().config(zero));
  Mlp model;
  accel::optim::Lamb lamb(model->parameters());
  REQUIRE_THROWS_WITH(acc.prepare(model, lamb),
                      Catch::Contains("accel::optim::Lamb updates each parameter from norms over the whole "
                                      "parameter, but the 'zero' backend"));
}

namespace {

// DeepSpeed 0.19.6's Adam update in doubles, as csrc/includes/cpu_adam.h writes it (Adam_Optimizer::Step_1
// with update_state; FusedAdam's csrc/adam/multi_tensor_adam.cu is the same formula): with bias_correction
// bc1 = 1 - beta1^t and bc2 = 1 / sqrt(1 - beta2^t), else both 1.
struct ReferenceDeepSpeedAdam {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool adamw_mode = true, bias_correction = true;
  std::vector<std::vector<double>> m, v;
  int t = 0;

  void step(std::vector<std::vector<double>>& w, const std::vector<std::vector<double>>& g) {
    if (m.empty()) {
      for (const auto& x : w) {
        m.emplace_back(x.size(), 0.0);
        v.emplace_back(x.size(), 0.0);
      }
    }
    ++t;
    const double bias1 = bias_correction ? 1 - std::pow(beta1, t) : 1.0;
    const double bias2 = bias_correction ? 1 / std::sqrt(1 - std::pow(beta2, t)) : 1.0;
    const double step_size = -lr / bias1, w_decay = -lr * weight_decay;
    for (std::size_t k = 0; k < w.size(); ++k) {
      for (std::size_t i = 0; i < w[k].size(); ++i) {
        double grad = g[k][i], param = w[k][i];
        if (weight_decay > 0 && !adamw_mode) grad = param * weight_decay + grad;
        m[k][i] = m[k][i] * beta1 + grad * (1 - beta1);
        v[k][i] = v[k][i] * beta2 + grad * grad * (1 - beta2);
        const double update = m[k][i] / (std::sqrt(v[k][i]) * bias2 + eps);
        if (weight_decay > 0 && adamw_mode) param += w_decay * param;
        w[k][i] = update * step_size + param;
      }
    }
  }
};

// The largest difference between `opt` and the reference over `steps` full-batch steps of `model`; the
// reference follows the float weights after each step.
double deepspeed_adam_gap(torch::optim::Optimizer& opt, Mlp& model, ReferenceDeepSpeedAdam ref, int steps) {
  Regression data(16);
  std::vector<std::vector<double>> w;
  for (const auto& p : model->parameters())
    w.push_back(to_doubles(p));
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::mse_loss(model(data.x), data.y).backward();
    std::vector<std::vector<double>> g;
    for (const auto& p : model->parameters())
      g.push_back(to_doubles(p.grad()));
    opt.step();
    ref.step(w, g);
    const auto params = model->parameters();
    for (std::size_t k = 0; k < params.size(); ++k) {
      const auto got = to_doubles(params[k]);
      for (std::size_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, std::abs(got[i] - w[k][i]));
      w[k] = got;
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("optim: DeepSpeedAdamW / DeepSpeedAdam follow DeepSpeed's Adam with and without bias_correction") {
  for (const bool adamw_mode : {true, false}) {
    for (const bool bias_correction : {true, false}) {
      INFO("adam_w_mode " << adamw_mode << ", bias_correction " << bias_correction);
      torch::manual_seed(0);
      Mlp model;
      ReferenceDeepSpeedAdam ref;
      ref.lr = 0.01;
      ref.beta1 = 0.8;
      ref.beta2 = 0.95;
      ref.eps = 1e-8;
      ref.weight_decay = 0.1;
      ref.adamw_mode = adamw_mode;
      ref.bias_correction = bias_correction;
      if (adamw_mode) {
        accel::optim::DeepSpeedAdamW opt(
            model->parameters(), torch::optim::AdamWOptions(0.01).betas({0.8, 0.95}).weight_decay(0.1),
            bias_correction);
        CHECK(opt.bias_correction() == bias_correction);
        CHECK(deepspeed_adam_gap(opt, model, ref, 6) <= 2e-6);
      } else {
        accel::optim::DeepSpeedAdam opt(model->parameters(),
                                        torch::optim::AdamOptions(0.01).betas({0.8, 0.95}).weight_decay(0.1),
                                        bias_correction);
        CHECK(opt.bias_correction() == bias_correction);
        CHECK(deepspeed_adam_gap(opt, model, ref, 6) <= 2e-6);
      }
    }
  }
  // The reference tells the two apart: without bias correction the first step is about
  // (1 - beta1) / sqrt(1 - beta2) = 0.89 of the corrected one here; with betas (0.9, 0.999) 3.2 times it.
  torch::manual_seed(0);
  Mlp model;
  accel::optim::DeepSpeedAdamW raw(model->parameters(), torch::optim::AdamWOptions(0.01), false);
  ReferenceDeepSpeedAdam corrected;
  corrected.lr = 0.01, corrected.beta1 = 0.9, corrected.beta2 = 0.999, corrected.eps = 1e-8;
  CHECK(deepspeed_adam_gap(raw, model, corrected, 1) > 1e-4);
  // FusedAdam refuses amsgrad.
  CHECK_THROWS_WITH(
      accel::optim::DeepSpeedAdamW(model->parameters(), torch::optim::AdamWOptions().amsgrad(true)),
      Catch::Contains("amsgrad"));
}

TEST_CASE("optim: with bias_correction DeepSpeedAdamW / DeepSpeedAdam are LibTorch's AdamW / Adam bitwise") {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  struct Restore {
    int n;
    ~Restore() { at::set_num_threads(n); }
  } restore{threads};
  {
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.8, 0.95});
    auto pa = chunked_params(), pb = chunked_params();
    accel::optim::DeepSpeedAdamW a(pa, options);
    torch::optim::AdamW b(pb, options);
    for (int s = 0; s < 3; ++s) {
      set_grads(pa, s);
      set_grads(pb, s);
      a.step();
      b.step();
    }
    require_bitwise(a, b, pa, pb);
  }
  {
    const auto options = torch::optim::AdamOptions(1e-2).weight_decay(0.1).betas({0.8, 0.95});
    auto pa = chunked_params(), pb = chunked_params();
    accel::optim::DeepSpeedAdam a(pa, options);
    torch::optim::Adam b(pb, options);
    for (int s = 0; s < 3; ++s) {
      set_grads(pa, s);
      set_grads(pb, s);
      a.step();
      b.step();
    }
    require_bitwise<torch::optim::AdamParamState>(a, b, pa, pb);
  }
}

TEST_CASE("optim: DeepSpeedAdamW without bias_correction steps ZeRO's shards as the whole model") {
  // ZeRO re-points the optimizer at its flat shards and the optimizer's own step runs there, the state in
  // memory or swapped to NVMe files between steps: the switch holds on every path.
  Regression data(16);
  accel::test::TempDir swap;
  const auto run = [&](int stage, accel::OffloadDevice offload) {
    torch::manual_seed(0);
    Mlp model;
    accel::optim::DeepSpeedAdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1),
                                     /*bias_correction=*/false);
    std::optional<accel::Accelerator> acc;
    if (stage > 0) {
      auto c = accel::test::make_config();
      c.backend = "zero";
      c.zero.stage = stage;
      c.zero.offload_optimizer_device = offload;
      if (offload == accel::OffloadDevice::Nvme) {
        c.zero.offload_optimizer_nvme_path = swap.path.string();
        c.zero.offload_optimizer_buffer_count = 2;
      }
      acc.emplace(accel::AcceleratorOptions().config(c));
      acc->prepare(model, opt);
    }
    for (int s = 0; s < 4; ++s) {
      opt.zero_grad();
      const auto loss = torch::mse_loss(model(data.x), data.y);
      if (acc)
        acc->backward(loss);
      else
        loss.backward();
      opt.step();
    }
    if (acc) acc->free_memory();  // the model whole and current
    return accel::test::snapshot(*model);
  };
  const auto whole = run(0, accel::OffloadDevice::None);
  for (const auto& [stage, offload] :
       {std::make_pair(2, accel::OffloadDevice::None), std::make_pair(3, accel::OffloadDevice::Cpu),
        std::make_pair(2, accel::OffloadDevice::Nvme)}) {
    const auto sharded = run(stage, offload);
    for (std::size_t k = 0; k < whole.size(); ++k) {
      INFO("stage " << stage << ", offload " << static_cast<int>(offload) << ", tensor " << k);
      REQUIRE(torch::allclose(sharded[k], whole[k], 1e-6, 1e-7));
    }
  }
}
