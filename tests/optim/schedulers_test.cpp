#include <catch2/catch.hpp>
#include "build_paths.hpp"

#include "test_support.hpp"

#include <accel/optim/schedulers.hpp>

#include <fstream>
#include <map>
#include <sstream>

using namespace accel;
using test::Mlp;
using test::Regression;

namespace {

// PyTorch's rates for every case: tests/data/pytorch_schedules.txt, the output of tests/python/schedules.py,
// which python/python_crosschecks.sh checks against the venv's PyTorch (starting Python here cost 13 s).
const std::map<std::string, std::vector<double>>& pytorch_rates() {
  static const std::map<std::string, std::vector<double>> kRates = [] {
    const std::string path = accel::test::tests_dir() + "/data/pytorch_schedules.txt";
    std::ifstream in(path);
    if (!in)
      FAIL("cannot read " << path << " (regenerate: python tests/python/schedules.py > " << path << ")");
    std::map<std::string, std::vector<double>> rates;
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      std::string name;
      words >> name;
      double v = 0;
      while (words >> v)
        rates[name].push_back(v);
    }
    return rates;
  }();
  return kRates;
}

void check_close(const std::string& name, const std::vector<double>& got) {
  INFO(name);
  const auto& want = pytorch_rates().at(name);
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("step " << k << ": " << got[k] << " vs PyTorch " << want[k]);
    CHECK(std::abs(got[k] - want[k]) <= 1e-12 * std::max(1.0, std::abs(want[k])));
  }
}

struct Params {
  torch::Tensor a = torch::zeros({2}, torch::requires_grad()), b = torch::zeros({2}, torch::requires_grad());
};

// Two groups (0.1 and 0.02) as in the Python script; returns group 1's rate at steps 0..steps.
std::vector<double> lambda_rates(
    const std::function<std::unique_ptr<sched::Schedule>(torch::optim::Optimizer&)>& make, int steps) {
  Params p;
  torch::optim::SGD opt(
      {torch::optim::OptimizerParamGroup({p.a}, std::make_unique<torch::optim::SGDOptions>(0.1)),
       torch::optim::OptimizerParamGroup({p.b}, std::make_unique<torch::optim::SGDOptions>(0.02))},
      torch::optim::SGDOptions(0.1));
  auto schedule = make(opt);
  std::vector<double> out{opt.param_groups()[1].options().get_lr()};
  for (int s = 0; s < steps; ++s) {
    opt.step();
    schedule->step();
    out.push_back(opt.param_groups()[1].options().get_lr());
  }
  CHECK(schedule->steps() == steps);
  return out;
}

}  // namespace

TEST_CASE("schedules: transformers' warmup schedules give PyTorch LambdaLR's rates") {
  check_close("constant_with_warmup",
              lambda_rates([](auto& o) { return sched::constant_with_warmup(o, 5); }, 12));
  check_close("linear_with_warmup",
              lambda_rates([](auto& o) { return sched::linear_with_warmup(o, 3, 10); }, 12));
  check_close("cosine_with_warmup",
              lambda_rates([](auto& o) { return sched::cosine_with_warmup(o, 3, 10); }, 12));
  check_close("cosine_with_warmup_2cycles",
              lambda_rates([](auto& o) { return sched::cosine_with_warmup(o, 2, 12, 2.0); }, 14));
  check_close("polynomial_with_warmup",
              lambda_rates([](auto& o) { return sched::polynomial_with_warmup(o, 2, 10, 1e-3, 2.0); }, 12));
}

TEST_CASE(
    "schedules: cosine_with_min_lr gives transformers' rates (min_lr over the optimizer's default rate)") {
  // The SGD of lambda_rates has default rate 0.1: min_lr 0.01 is min_lr_rate 0.1, on every group.
  check_close(
      "cosine_with_min_lr_rate",
      lambda_rates([](auto& o) { return sched::cosine_with_min_lr(o, 3, 10, std::nullopt, 0.1); }, 12));
  check_close(
      "cosine_with_min_lr_2cycles",
      lambda_rates([](auto& o) { return sched::cosine_with_min_lr(o, 2, 12, 0.01, std::nullopt, 1.5); }, 14));
  Params p;
  torch::optim::SGD opt({p.a}, torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH(sched::cosine_with_min_lr(opt, 1, 10, 0.01, 0.1), Catch::Matchers::Contains("not both"));
  CHECK_THROWS_WITH(sched::cosine_with_min_lr(opt, 1, 10, std::nullopt, std::nullopt),
                    Catch::Matchers::Contains("min_lr or min_lr_rate"));
}

TEST_CASE(
    "schedules: OneCycleLR gives PyTorch's rates and momenta, and stepping past total_steps is an error") {
  {
    Params p;
    torch::optim::SGD opt({p.a, p.b}, torch::optim::SGDOptions(0.1).momentum(0.9));
    sched::OneCycleOptions o;
    o.max_lr = 0.5;
    o.total_steps = 20;
    sched::OneCycleLR schedule(opt, o);
    std::vector<double> rates{opt.param_groups()[0].options().get_lr()};
    std::vector<double> momenta{
        static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).momentum()};
    for (int s = 0; s < 20; ++s) {
      opt.step();
      schedule.step();
      rates.push_back(opt.param_groups()[0].options().get_lr());
      momenta.push_back(static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).momentum());
    }
    check_close("one_cycle_sgd", rates);
    check_close("one_cycle_sgd_momentum", momenta);
    CHECK_THROWS_WITH(schedule.step(), Catch::Contains("stepped 21 times, but total_steps is 20"));
  }
  Params p;
  torch::optim::Adam opt({p.a, p.b}, torch::optim::AdamOptions(0.1));
  sched::OneCycleOptions o;
  o.max_lr = 0.01;
  o.total_steps = 15;
  o.pct_start = 0.4;
  o.cos_anneal = false;
  o.three_phase = true;
  o.div_factor = 10;
  o.final_div_factor = 100;
  sched::OneCycleLR schedule(opt, o);
  auto beta1 = [&] {
    return std::get<0>(static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options()).betas());
  };
  std::vector<double> rates{opt.param_groups()[0].options().get_lr()}, momenta{beta1()};
  for (int s = 0; s < 15; ++s) {
    schedule.step();
    rates.push_back(opt.param_groups()[0].options().get_lr());
    momenta.push_back(beta1());
  }
  check_close("one_cycle_adam_three_phase_linear", rates);
  check_close("one_cycle_adam_three_phase_linear_momentum", momenta);
}

TEST_CASE("schedules: ReduceLROnPlateau gives PyTorch's rates") {
  Params p;
  torch::optim::SGD opt({p.a, p.b}, torch::optim::SGDOptions(0.1));
  sched::PlateauOptions o;
  o.factor = 0.5;
  o.patience = 2;
  o.threshold = 0.1;
  o.cooldown = 1;
  o.min_lr = 0.004;
  sched::ReduceLROnPlateau plateau(opt, o);
  std::vector<double> rates;
  for (double metric : {1.0, 0.95, 0.99, 0.98, 0.97, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5}) {
    plateau.step(metric);
    rates.push_back(opt.param_groups()[0].options().get_lr());
  }
  check_close("plateau", rates);
}

TEST_CASE(
    "schedules: prepared, a schedule steps once per optimizer step (not on micro-steps, not on fp16 skips)") {
  Regression data(8);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto schedule = sched::linear_with_warmup(opt, 2, 10);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::No, 2)));
  acc.prepare(model, opt, *schedule);
  for (int micro = 0; micro < 6; ++micro) {
    acc.backward(torch::mse_loss(model(data.x), data.y));
    opt.step();
    schedule->step();  // called every micro-step, as in Accelerate loops
    opt.zero_grad();
  }
  CHECK(schedule->steps() == 3);  // 6 micro-steps, accumulation 2
  CHECK(opt.param_groups()[0].options().get_lr() == Approx(0.1 * 7.0 / 8.0));  // linear after warmup: step 3

  // fp16: a step skipped for inf gradients does not advance the schedule.
  torch::manual_seed(0);
  Mlp model16;
  torch::optim::SGD opt16(model16->parameters(), 0.1);
  auto schedule16 = sched::constant_with_warmup(opt16, 4);
  Accelerator acc16(AcceleratorOptions().config(test::make_config(MixedPrecision::Fp16, 1)));
  acc16.prepare(model16, opt16, *schedule16);
  acc16.backward(torch::mse_loss(model16(data.x), data.y) * std::numeric_limits<float>::infinity());
  opt16.step();
  schedule16->step();
  CHECK(acc16.optimizer_step_was_skipped());
  CHECK(schedule16->steps() == 0);
  opt16.zero_grad();
  acc16.backward(torch::mse_loss(model16(data.x), data.y));
  opt16.step();
  schedule16->step();
  CHECK_FALSE(acc16.optimizer_step_was_skipped());
  CHECK(schedule16->steps() == 1);
}

TEST_CASE("schedules: save_state and load_state restore the step count and the plateau's state") {
  test::TempDir dir;
  Regression data(8);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto cosine = sched::cosine_with_warmup(opt, 1, 6);
  sched::PlateauOptions o;
  o.patience = 0;
  sched::ReduceLROnPlateau plateau(opt, o);
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(model, opt, *cosine, plateau);
  for (int s = 0; s < 3; ++s) {
    acc.backward(torch::mse_loss(model(data.x), data.y));
    opt.step();
    cosine->step();
    opt.zero_grad();
  }
  plateau.step(1.0);
  plateau.step(0.5);
  const auto saved_plateau = plateau.schedule_state();
  const double saved_lr = opt.param_groups()[0].options().get_lr();
  acc.save_state((dir.path / "ckpt").string());
  for (int s = 0; s < 2; ++s)
    cosine->step();
  plateau.step(9.0);
  acc.load_state((dir.path / "ckpt").string());
  CHECK(cosine->steps() == 3);
  CHECK(plateau.schedule_state() == saved_plateau);
  CHECK(opt.param_groups()[0].options().get_lr() == saved_lr);
}
