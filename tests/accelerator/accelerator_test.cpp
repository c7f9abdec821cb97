#include <catch2/catch.hpp>
#include "build_paths.hpp"

#include "test_support.hpp"

#include <accel/checkpoint/objects_archive.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/nn/sync_batchnorm.hpp>
#include <accel/optim/optim.hpp>
#include <accel/parallel/pipeline.hpp>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <fstream>

using namespace accel;
using test::Mlp;
using test::Regression;

namespace {

// Plain LibTorch: one SGD step on the whole batch x, y.
std::vector<torch::Tensor> big_batch_step(const torch::Tensor& x, const torch::Tensor& y) {
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  opt.zero_grad();
  torch::mse_loss(model(x), y).backward();
  opt.step();
  return test::snapshot(*model);
}

}  // namespace

TEST_CASE("accelerator: defaults on CPU are one local process") {
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  REQUIRE(acc.device() == torch::Device(torch::kCPU));
  REQUIRE(acc.num_processes() == 1);
  REQUIRE(acc.is_main_process());
  REQUIRE(acc.backend_name() == "local");
  auto t = torch::arange(5);
  REQUIRE(torch::equal(acc.gather(t), t));
}

TEST_CASE(
    "accelerator: a config error under accel-launch names the user's file, not only the resolved copy") {
  test::TempDir dir;
  const auto resolved = (dir.path / "accel-launch-config-abc123.yaml").string();
  std::ofstream(resolved) << "distributed_type: NO\nnum_processes: many\n";
  const std::string user_file = "/home/someone/configs/train.yaml";
  ::setenv("ACCEL_CONFIG_FILE", resolved.c_str(), 1);
  ::setenv("ACCEL_CONFIG_SOURCE", user_file.c_str(), 1);
  std::string message;
  try {
    Accelerator acc;
  } catch (const ConfigError& e) {
    message = e.what();
    CHECK(e.file() == user_file);
  }
  ::unsetenv("ACCEL_CONFIG_FILE");
  ::unsetenv("ACCEL_CONFIG_SOURCE");
  INFO(message);
  CHECK(message.find("num_processes") != std::string::npos);
  CHECK(message.rfind(user_file + ": num_processes", 0) == 0);  // the user's file first
  CHECK(message.find("(at " + resolved + ":2, ") != std::string::npos);
  CHECK(message.find("accel-launch's resolved copy of " + user_file +
                     " with its command-line options applied: "
                     "fix " +
                     user_file) != std::string::npos);
}

TEST_CASE("accelerator: accumulating 4 micro-batches equals one step on the big batch") {
  Regression data(8);
  const auto expected = big_batch_step(data.x, data.y);

  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::No, 4)));
  acc.prepare(model, opt);
  const auto initial = test::snapshot(*model);
  for (int i = 0; i < 4; ++i) {
    auto xs = data.x.slice(0, 2 * i, 2 * i + 2), ys = data.y.slice(0, 2 * i, 2 * i + 2);
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(xs), ys));
    REQUIRE(acc.sync_gradients() == (i == 3));
    opt.step();  // the user's step: a no-op until the cycle completes
    const auto now = test::snapshot(*model);
    for (std::size_t k = 0; k < now.size(); ++k) {
      if (i < 3) REQUIRE(torch::equal(now[k], initial[k]));
    }
  }
  const auto got = test::snapshot(*model);
  for (std::size_t k = 0; k < got.size(); ++k)
    REQUIRE(torch::allclose(got[k], expected[k], 1e-6, 1e-7));
  REQUIRE(acc.completed_steps() == 1);
}

TEST_CASE("accelerator: gradients always synchronise on the last batch of the data") {
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::No, 4)));
  acc.prepare(model, opt);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(12).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(2));
  std::vector<bool> syncs;
  for (auto& batch : *loader) {
    acc.backward(torch::mse_loss(model(batch.data), batch.target));
    syncs.push_back(acc.sync_gradients());
    opt.step();
    opt.zero_grad();
  }
  REQUIRE(syncs == std::vector<bool>{false, false, false, true, false, true});
  REQUIRE(acc.completed_steps() == 2);
}

TEST_CASE("accelerator: bf16 autocast runs the forward in bfloat16 and trains close to fp32") {
  Regression data(16);
  auto run = [&](MixedPrecision mp, torch::ScalarType* out_dtype) {
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.05);
    Accelerator acc(AcceleratorOptions().config(test::make_config(mp)));
    acc.prepare(model, opt);
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      auto out = model(data.x);
      *out_dtype = out.scalar_type();
      acc.backward(torch::mse_loss(out.to(torch::kFloat32), data.y));
      opt.step();
    }
    return test::snapshot(*model);
  };
  torch::ScalarType fp32_dtype{}, bf16_dtype{};
  const auto a = run(MixedPrecision::No, &fp32_dtype);
  const auto b = run(MixedPrecision::Bf16, &bf16_dtype);
  REQUIRE(fp32_dtype == torch::kFloat32);
  REQUIRE(bf16_dtype == torch::kBFloat16);
  for (std::size_t k = 0; k < a.size(); ++k) {
    REQUIRE(b[k].scalar_type() == torch::kFloat32);  // master weights stay fp32
    REQUIRE(torch::allclose(a[k], b[k], 2e-2, 2e-2));
  }
  REQUIRE_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));  // restored by the destructor
}

TEST_CASE("accelerator: fp16 skips the step on inf/NaN gradients and backs off the scale") {
  Regression data(8);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::Fp16)));
  acc.prepare(model, opt);
  REQUIRE(acc.scaler() != nullptr);
  REQUIRE(acc.scaler()->get_scale() == 65536.0);

  bool poison = false;
  float poison_value = std::numeric_limits<float>::infinity();
  model->fc1->weight.register_hook(
      [&](torch::Tensor g) { return poison ? torch::full_like(g, poison_value) : g; });
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    poison = true;
    poison_value = bad;
    const auto before = test::snapshot(*model);
    const double scale_before = acc.scaler()->get_scale();
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(data.x).to(torch::kFloat32), data.y));
    REQUIRE(acc.optimizer_step_was_skipped());
    opt.step();
    const auto after = test::snapshot(*model);
    for (std::size_t k = 0; k < after.size(); ++k)
      REQUIRE(torch::equal(before[k], after[k]));
    REQUIRE(acc.scaler()->get_scale() == scale_before * 0.5);
  }
  poison = false;
  const auto before = test::snapshot(*model);
  opt.zero_grad();
  acc.backward(torch::mse_loss(model(data.x).to(torch::kFloat32), data.y));
  REQUIRE_FALSE(acc.optimizer_step_was_skipped());
  opt.step();
  REQUIRE_FALSE(torch::equal(before[0], test::snapshot(*model)[0]));
  REQUIRE(acc.completed_steps() == 1);
}

TEST_CASE("accelerator: fp16 skips only the step of the optimizer whose gradients overflowed (GAN loop)") {
  Regression data(8);
  torch::manual_seed(0);
  auto G = torch::nn::Linear(6, 6);
  Mlp D;
  torch::optim::SGD opt_g(G->parameters(), 0.1);
  torch::optim::SGD opt_d(D->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::Fp16)));
  acc.prepare(G, D, opt_g, opt_d);
  acc.scaler()->load_state_dict(
      {{"scale", torch::tensor({1024.0f})}, {"growth_tracker", torch::tensor({0}, torch::kInt32)}});
  bool poison = false;
  D->fc1->weight.register_hook([&](torch::Tensor g) {
    return poison ? torch::full_like(g, std::numeric_limits<float>::infinity()) : g;
  });
  const auto d_before = test::snapshot(*D);
  const auto g_before = test::snapshot(*G);
  // D's step: its gradients overflow, so its step is skipped and the scale backs off.
  opt_d.zero_grad();
  poison = true;
  acc.backward(torch::mse_loss(D(data.x).to(torch::kFloat32), data.y) +
               D(G(data.x).detach()).to(torch::kFloat32).pow(2).mean());
  poison = false;
  CHECK(acc.optimizer_step_was_skipped(opt_d));
  opt_d.step();
  // G's step, through D: G's gradients are finite, so G steps although D's step of this batch was skipped.
  opt_g.zero_grad();
  acc.backward((D(G(data.x)).to(torch::kFloat32) - data.y).pow(2).mean());
  CHECK_FALSE(acc.optimizer_step_was_skipped(opt_g));
  opt_g.step();
  const auto d_after = test::snapshot(*D);
  for (std::size_t k = 0; k < d_after.size(); ++k)
    CHECK(torch::equal(d_before[k], d_after[k]));
  CHECK_FALSE(torch::equal(g_before[0], test::snapshot(*G)[0]));
  CHECK(torch::isfinite(test::snapshot(*G)[0]).all().item<bool>());
  CHECK(acc.scaler()->get_scale() == 512.0);
}

TEST_CASE("accelerator: fp16 gradients reach the optimizer unscaled") {
  Regression data(8);
  auto grads = [&](MixedPrecision mp) {
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    Accelerator acc(AcceleratorOptions().config(test::make_config(mp)));
    acc.prepare(model, opt);
    // The first fp16 steps may overflow at scale 65536 and be skipped; take the first clean one.
    for (int attempt = 0; attempt < 20; ++attempt) {
      acc.backward(torch::mse_loss(model(data.x).to(torch::kFloat32), data.y));
      if (!acc.optimizer_step_was_skipped()) break;
    }
    REQUIRE_FALSE(acc.optimizer_step_was_skipped());
    return model->fc2->weight.grad().clone();
  };
  REQUIRE(torch::allclose(grads(MixedPrecision::Fp16), grads(MixedPrecision::No), 2e-2, 2e-2));
}

TEST_CASE("accelerator: fp16 keeps every gradient of hand-written accumulation (two backward, one step)") {
  Regression data(8);
  // The gradient after two backward calls on half batches (loss / 2 each) must equal one backward on the
  // whole batch: the first half's gradient is unscaled after its backward and must not be unscaled twice.
  auto grads = [&](bool halves) {
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::Fp16)));
    acc.prepare(model, opt);
    acc.scaler()->load_state_dict(
        {{"scale", torch::tensor({1024.0f})}, {"growth_tracker", torch::tensor({0}, torch::kInt32)}});
    if (halves) {
      for (int h = 0; h < 2; ++h)
        acc.backward(torch::mse_loss(model(data.x.slice(0, h * 4, h * 4 + 4)).to(torch::kFloat32),
                                     data.y.slice(0, h * 4, h * 4 + 4)) /
                     2);
    } else {
      acc.backward(torch::mse_loss(model(data.x).to(torch::kFloat32), data.y));
    }
    REQUIRE_FALSE(acc.optimizer_step_was_skipped());
    REQUIRE(acc.optimizer_step_was_skipped(opt) == false);
    return model->fc1->weight.grad().clone();
  };
  const auto two = grads(true), one = grads(false);
  INFO("max difference " << (two - one).abs().max().item<double>());
  REQUIRE(torch::allclose(two, one, 1e-2, 1e-3));
}

TEST_CASE("accelerator: two models and two optimizers in one prepare call, in any order") {
  Regression data(8);
  torch::manual_seed(0);
  Mlp g, d;
  torch::optim::SGD opt_g(g->parameters(), 0.1), opt_d(d->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(opt_d, g, opt_g, d);
  REQUIRE(acc.get_state_dict(g).size() == g->named_parameters().size() + g->named_buffers().size());
  REQUIRE_THROWS_WITH(acc.get_state_dict(), Catch::Contains("get_state_dict(model)"));
  Mlp stranger;
  REQUIRE_THROWS_WITH(acc.get_state_dict(stranger), Catch::Contains("was not prepared"));
  torch::optim::SGD loose(stranger->parameters(), 0.1);
  REQUIRE_THROWS_WITH(acc.prepare(loose), Catch::Contains("no parameter of a prepared model"));
}

TEST_CASE("accelerator: accumulation without a prepared loader and two optimizers asks for accumulate()") {
  Regression data(8);
  torch::manual_seed(0);
  Mlp a, b;
  torch::optim::SGD opt_a(a->parameters(), 0.1), opt_b(b->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::No, 2)));
  acc.prepare(a, b, opt_a, opt_b);
  REQUIRE_THROWS_WITH(acc.backward(torch::mse_loss(a(data.x), data.y)),
                      Catch::Contains("accelerator.accumulate(model)"));
  // With scopes, two backward calls per batch make one micro-step: batches 1 and 2 form one cycle.
  for (int batch = 0; batch < 2; ++batch) {
    auto scope = acc.accumulate(a, b);
    acc.backward(torch::mse_loss(a(data.x), data.y));
    acc.backward(torch::mse_loss(b(data.x), data.y));
    REQUIRE(acc.sync_gradients() == (batch == 1));
  }
  REQUIRE(acc.micro_steps() == 2);
  REQUIRE(acc.completed_steps() == 1);  // one optimizer step per cycle, however many backward calls
}

TEST_CASE("accelerator: a GAN's two backward calls per batch count one completed step") {
  // The accelerated loop (one process) against the same loop in plain LibTorch: one completed step per batch,
  // and the same weights, as D also receives gradients in G's backward.
  Regression data(8);
  auto run = [&](bool accelerated) {
    torch::manual_seed(0);
    Mlp g, d;
    torch::optim::SGD opt_g(g->parameters(), 0.1), opt_d(d->parameters(), 0.1);
    std::optional<Accelerator> acc;
    if (accelerated) {
      acc.emplace(AcceleratorOptions().config(test::make_config()));
      acc->prepare(g, d, opt_g, opt_d);
    }
    for (int batch = 0; batch < 3; ++batch) {
      std::optional<Accelerator::Accumulate> scope;
      if (acc) scope.emplace(acc->accumulate(g, d));
      opt_d.zero_grad();
      auto loss_d = torch::mse_loss(d(data.x), data.y);
      acc ? acc->backward(loss_d) : loss_d.backward();
      opt_d.step();
      opt_g.zero_grad();
      auto loss_g = torch::mse_loss(d(data.x + g(data.x)), data.y);  // D gets gradients here too
      acc ? acc->backward(loss_g) : loss_g.backward();
      opt_g.step();
    }
    if (acc) REQUIRE(acc->completed_steps() == 3);
    std::vector<torch::Tensor> weights;
    for (auto& p : g->parameters())
      weights.push_back(p.detach().clone());
    for (auto& p : d->parameters())
      weights.push_back(p.detach().clone());
    return weights;
  };
  const auto plain = run(false), accelerated = run(true);
  REQUIRE(plain.size() == accelerated.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    CHECK(torch::equal(plain[i], accelerated[i]));
}

namespace {
// The least a backend must write: preparing and the backward hooks. Everything else has a default.
class MinimalEngine : public Backend {
 public:
  std::string name() const override { return "minimal"; }
  BackendCapabilities capabilities() const override { return {}; }
  void prepare_model(torch::nn::Module& /*model*/) override {}
  void prepare_optimizer(torch::optim::Optimizer& /*optimizer*/) override {}
  void before_backward(bool /*sync*/) override {}
  void after_backward(bool /*sync*/) override {}
};
// A backend the program registers itself, made of MinimalEngine.
BackendDescriptor minimal_descriptor() {
  BackendDescriptor d;
  d.name = "minimal";
  d.capabilities = [](const Config&) { return BackendCapabilities{}; };
  d.factory = [](const BackendContext&) { return std::make_unique<MinimalEngine>(); };
  return d;
}
}  // namespace

TEST_CASE("backends: every built-in engine has a config part, and every config part an engine") {
  BackendRegistry registry;
  register_builtin_backends(registry);
  std::vector<std::string> config_names;
  for (const BackendInfo& info : config_backends())
    config_names.push_back(info.name);
  std::sort(config_names.begin(), config_names.end());
  REQUIRE(registry.names() == config_names);
  // local -> ddp with several processes comes from the config part, for the launcher and the registry alike.
  REQUIRE(registry.resolve("local", 2).name == "ddp");
  REQUIRE(registry.resolve("local", 1).name == "local");
  REQUIRE_THROWS_WITH(registry.resolve("mine", 1), Catch::Contains("backend 'mine' is not available"));
}

TEST_CASE("backends: CPU offload of a sharded optimizer names the fused accel::optim drop-in") {
  BackendRegistry registry;
  register_builtin_backends(registry);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::Adam adam(model->parameters());
  torch::optim::SGD sgd(model->parameters(), 0.1);
  accel::optim::Adam fused(model->parameters());
  torch::optim::RMSprop rmsprop(model->parameters());
  Config config = test::make_config();
  BackendContext context;
  context.config = &config;
  context.device = torch::Device(torch::kCUDA, 0);  // offload moves state off a GPU; no GPU is touched here
  context.world_size = 2;
  const auto notes = [&](const std::string& backend, const torch::optim::Optimizer& opt) {
    config.backend = backend;
    const auto& d = registry.resolve(backend, 2);
    REQUIRE(d.optimizer_notices);
    return d.optimizer_notices(context, opt);
  };
  config.zero.stage = 2;
  config.zero.offload_optimizer_device = OffloadDevice::Cpu;
  const auto adam_notes = notes("zero", adam);
  REQUIRE(adam_notes.size() == 1);
  CHECK_THAT(adam_notes[0],
             Catch::StartsWith("deepspeed_config.offload_optimizer_device: cpu: torch::optim::Adam "
                               "steps the CPU shard with LibTorch's unfused update"));
  CHECK_THAT(adam_notes[0], Catch::Contains("accel::optim::Adam (#include <accel/optim/optim.hpp>") &&
                                Catch::Contains("DeepSpeed's CPU-Adam role), 4-11x faster"));
  const auto sgd_notes = notes("zero", sgd);
  REQUIRE(sgd_notes.size() == 1);
  CHECK_THAT(sgd_notes[0], Catch::Contains("torch::optim::SGD steps") &&
                               Catch::Contains("accel::optim::SGD") && Catch::Contains("about 2x faster") &&
                               !Catch::Contains("Adam"));
  CHECK(notes("zero", fused).empty());    // already the fused step
  CHECK(notes("zero", rmsprop).empty());  // no fused drop-in to suggest
  config.zero.stage = 3;
  config.zero.offload_optimizer_device = OffloadDevice::None;
  config.zero.offload_param_device = OffloadDevice::Cpu;
  const auto stage3 = notes("zero", adam);
  REQUIRE(stage3.size() == 1);
  CHECK_THAT(stage3[0], Catch::StartsWith("deepspeed_config.offload_param_device: cpu: torch::optim::Adam"));
  config.zero.offload_param_device = OffloadDevice::None;
  CHECK(notes("zero", adam).empty());  // nothing offloaded
  config.fsdp.offload_params = true;
  config.fsdp.sharding_strategy = ShardingStrategy::FullShard;
  const auto fsdp = notes("fsdp", adam);
  REQUIRE(fsdp.size() == 1);
  CHECK_THAT(fsdp[0], Catch::StartsWith("fsdp_config.fsdp_offload_params: true: torch::optim::Adam"));
  config.fsdp.sharding_strategy = ShardingStrategy::NoShard;  // DDP: nothing sharded, nothing offloaded
  CHECK(notes("fsdp", adam).empty());
  config.fsdp.sharding_strategy = ShardingStrategy::FullShard;
  context.device = torch::kCPU;  // a CPU run: the state is on the CPU already (a config notice says so)
  CHECK(notes("fsdp", adam).empty());
}

TEST_CASE("backends: a descriptor's optimizer notes reach notices() when the optimizer is prepared") {
  auto registry = std::make_shared<BackendRegistry>();
  BackendDescriptor d = minimal_descriptor();
  d.optimizer_notices = [](const BackendContext&, const torch::optim::Optimizer& opt) {
    return std::vector<std::string>{"groups: " + std::to_string(opt.param_groups().size())};
  };
  registry->add(d);
  Config config = test::make_config();
  config.backend = "minimal";
  Accelerator acc(AcceleratorOptions().config(config).registry(registry));
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Mlp other;
  torch::optim::SGD other_opt(other->parameters(), 0.1);
  CHECK(acc.notices().empty());
  acc.prepare(model, opt, other, other_opt);
  REQUIRE(acc.notices() == std::vector<std::string>{"groups: 1"});  // the same note once, not per optimizer
}

TEST_CASE("notices: fp16 on the CPU, and a pipeline_config the program never uses, are said once") {
  const auto count = [](const std::vector<std::string>& notes, const std::string& part) {
    return std::count_if(notes.begin(), notes.end(),
                         [&](const std::string& n) { return n.find(part) != std::string::npos; });
  };
  {
    Accelerator fp16(AcceleratorOptions().config(test::make_config(MixedPrecision::Fp16)));
    CHECK(count(fp16.notices(), "mixed_precision: fp16 on the CPU") == 1);
    Accelerator bf16(AcceleratorOptions().config(test::make_config(MixedPrecision::Bf16)));
    CHECK(count(bf16.notices(), "fp16 on the CPU") == 0);
  }
  Config config = test::make_config();
  config.num_processes = 2;  // what the file says; this test runs one process
  config.backend = "ddp";
  config.pipeline.stages = 2;
  Accelerator acc(AcceleratorOptions().config(config));
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  acc.prepare(model, opt);
  CHECK(count(acc.notices(), "pipeline_config") == 0);
  const auto x = torch::randn({4, 6}), y = torch::randn({4, 1});
  for (int step = 0; step < 2; ++step)
    acc.backward(torch::mse_loss(model(x), y));
  CHECK(count(acc.notices(), "pipeline_config asks for 2 stages") == 1);
}

TEST_CASE("backends: a minimal engine trains under its own name, and its optional operations throw") {
  auto registry = std::make_shared<BackendRegistry>();
  BackendDescriptor d = minimal_descriptor();
  registry->add(d);
  Regression data(8);
  const auto expected = big_batch_step(data.x, data.y);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Config config = test::make_config();
  config.backend = "minimal";  // a backend the program registered itself: no config part, no YAML section
  Accelerator acc(AcceleratorOptions().config(config).registry(registry));
  REQUIRE(acc.backend_name() == "minimal");
  acc.prepare(model, opt);
  opt.zero_grad();
  acc.backward(torch::mse_loss(model(data.x), data.y));
  opt.step();
  const auto got = test::snapshot(*model);
  for (std::size_t k = 0; k < got.size(); ++k)
    REQUIRE(torch::allclose(got[k], expected[k]));
  REQUIRE_THROWS_AS(acc.get_state_dict(model), UnsupportedOperation);
  REQUIRE_THROWS_WITH(acc.get_state_dict(model), Catch::Contains("minimal does not support model_state()"));
  REQUIRE_THROWS_WITH(acc.clip_grad_norm_(model->parameters(), 1.0),
                      Catch::Contains("minimal does not support gradients()"));
}

TEST_CASE("accelerator: clip_grad_norm_ clips the global norm and returns it") {
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(model, opt);
  Regression data(8);
  acc.backward(100.0 * torch::mse_loss(model(data.x), data.y));
  double expected = 0;
  for (const auto& p : model->parameters())
    expected += p.grad().pow(2).sum().item<double>();
  expected = std::sqrt(expected);
  REQUIRE(acc.clip_grad_norm_(0.5) == Approx(expected).epsilon(1e-5));
  double after = 0;
  for (const auto& p : model->parameters())
    after += p.grad().pow(2).sum().item<double>();
  REQUIRE(std::sqrt(after) == Approx(0.5).epsilon(1e-4));
}

TEST_CASE("accelerator: misuse gets a clear error") {
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  Mlp model;
  acc.prepare(model);
  REQUIRE_THROWS_WITH(acc.prepare(model),
                      "prepare: this model was already prepared; prepare each model once");
  auto loss = torch::ones({1});
  REQUIRE_THROWS_WITH(acc.backward(loss),
                      "backward: the loss does not require grad; was it computed under torch::NoGradGuard?");
}

TEST_CASE("accelerator: set_seed makes runs repeatable") {
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.set_seed(123);
  const auto a = torch::rand({4});
  acc.set_seed(123);
  REQUIRE(torch::equal(a, torch::rand({4})));
}

TEST_CASE(
    "accelerator: settings without effect in this run are reported, and zero3_save_16bit_model writes fp16") {
  Config c = test::make_config();
  c.backend = "zero";
  c.zero.stage = 3;
  c.zero.offload_param_device = OffloadDevice::Cpu;
  c.zero.zero3_init_flag = true;
  c.zero.zero3_save_16bit_model = true;
  Accelerator acc(AcceleratorOptions().config(c));
  const auto& notes = acc.notices();
  // zero3_init_flag has an effect at stage 3 (a model built empty loads sharded): no note about it.
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] ==
        "deepspeed_config.offload_param_device: cpu has no effect: this run trains on the CPU, where that "
        "state "
        "lives already");
  {
    Config c2 = test::make_config();
    c2.backend = "zero";
    c2.zero.stage = 2;
    c2.zero.zero3_init_flag = true;
    Accelerator stage2(AcceleratorOptions().config(c2));
    REQUIRE(stage2.notices().size() == 1);
    CHECK(stage2.notices().front() ==
          "deepspeed_config.zero3_init_flag: true has no effect: zero_stage 2 keeps every parameter whole on "
          "each rank; only stage 3 loads weights sharded (each rank reading the slices it owns)");
  }
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  acc.prepare(model, opt);
  CHECK(notes.size() == 1);  // no note about the optimizer: offload does nothing on a CPU run
  Regression data(8);
  acc.backward(torch::mse_loss(model(data.x), data.y));
  opt.step();
  test::TempDir dir;
  acc.save_state(dir.path.string());
  const auto full = safetensors::File::open((dir.path / "model.safetensors").string());
  const auto half = safetensors::File::open((dir.path / "model_16bit.safetensors").string());
  REQUIRE(half.names() == full.names());
  for (const auto& name : full.names()) {
    CHECK(half.info(name).dtype == safetensors::DType::F16);
    CHECK(half.info(name).shape == full.info(name).shape);
  }
  // The fp16 copy holds the same (rounded) weights as the fp32 model.
  const auto& info = full.info("fc2.weight");
  const auto w32 =
      torch::from_blob(const_cast<std::uint8_t*>(full.data("fc2.weight")), info.shape, torch::kFloat32);
  const auto w16 =
      torch::from_blob(const_cast<std::uint8_t*>(half.data("fc2.weight")), info.shape, torch::kFloat16);
  CHECK(torch::allclose(w16.to(torch::kFloat32), w32, 1e-3, 1e-3));
  CHECK(!torch::equal(w32, torch::zeros_like(w32)));
}

TEST_CASE("accelerator: fp16 under zero runs DeepSpeed's loss scaler: hysteresis, window, minimum, state") {
  // DeepSpeed's defaults as a YAML DEEPSPEED config gets them (hysteresis 2), one process, stage 2.
  Config c = test::make_config(MixedPrecision::Fp16);
  c.backend = "zero";
  c.zero.fp16_initial_scale_power = 10;
  c.zero.fp16_loss_scale_window = 2;
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(c));
  acc.prepare(model, opt);
  REQUIRE(acc.scaler() != nullptr);
  CHECK(acc.scaler()->get_scale() == 1024.0);
  Regression data(8);
  bool poison = false;
  model->fc1->weight.register_hook([&](torch::Tensor g) {
    return poison ? torch::full_like(g, std::numeric_limits<float>::infinity()) : g;
  });
  auto step = [&](bool overflow) {
    opt.zero_grad();
    poison = overflow;
    acc.backward(torch::mse_loss(model(data.x).to(torch::kFloat32), data.y));
    poison = false;
    const auto before = test::snapshot(*model);
    opt.step();
    const bool moved = !torch::equal(test::snapshot(*model)[0], before[0]);
    CHECK(acc.optimizer_step_was_skipped() == overflow);
    CHECK(moved != overflow);
    return acc.scaler()->get_scale();
  };
  CHECK(step(true) == 1024.0);  // absorbed by the hysteresis: skipped, the scale kept
  test::TempDir dir;
  acc.save_state(dir.path.string());  // the hysteresis left (1) is in the checkpoint
  CHECK(step(true) == 512.0);         // the second overflow halves it
  acc.load_state(dir.path.string());
  CHECK(acc.scaler()->hysteresis_left() == 1);
  CHECK(step(true) == 512.0);  // as after the second overflow of the uninterrupted run
  CHECK(step(false) == 512.0);
  CHECK(step(false) == 512.0);
  CHECK(step(false) == 1024.0);                 // window 2: the first growth after window + 1 clean steps
  CHECK(acc.scaler()->hysteresis_left() == 2);  // refilled by the growth
}

TEST_CASE("accelerator: stage 3 refuses tied parameters with a clear message") {
  struct TiedImpl : torch::nn::Module {
    TiedImpl() {
      a = register_module("a", torch::nn::Linear(4, 4));
      register_parameter("head", a->weight);  // the same tensor under a second name, as tied embeddings are
    }
    torch::nn::Linear a{nullptr};
  };
  Config c = test::make_config();
  c.backend = "zero";
  c.zero.stage = 3;
  Accelerator acc(AcceleratorOptions().config(c));
  auto model = std::make_shared<TiedImpl>();
  REQUIRE_THROWS_WITH(acc.prepare(model),
                      Catch::Contains("parameters 'head' and 'a.weight' share memory (tied weights)"));
}

TEST_CASE("SyncBatchNorm: unconnected it is BatchNorm, and connected its own backward matches BatchNorm's") {
  torch::manual_seed(0);
  const auto x = torch::randn({6, 3, 4, 4}) * 2 + 1;
  const auto dy = torch::randn({6, 3, 4, 4});
  auto run = [&](torch::nn::Module& bn, const std::function<torch::Tensor(const torch::Tensor&)>& f) {
    auto in = x.clone().requires_grad_(true);
    for (auto& p : bn.parameters()) {
      torch::NoGradGuard no_grad;
      p.copy_(torch::linspace(0.5, 1.5, p.numel()));
    }
    auto y = f(in);
    (y * dy).sum().backward();
    std::vector<torch::Tensor> out{y.detach(), in.grad()};
    for (auto& p : bn.parameters())
      out.push_back(p.grad());
    for (auto& b : bn.buffers())
      out.push_back(b.to(torch::kFloat64));
    return out;
  };
  torch::nn::BatchNorm2d ref(torch::nn::BatchNormOptions(3).momentum(0.3));
  const auto want = run(*ref, [&](const torch::Tensor& in) { return ref(in); });
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  for (const bool connected : {false, true}) {
    accel::nn::SyncBatchNorm bn(torch::nn::BatchNormOptions(3).momentum(0.3));
    REQUIRE(bn->named_parameters().keys() == ref->named_parameters().keys());
    REQUIRE(bn->named_buffers().keys() == ref->named_buffers().keys());
    // Connected to a one-process communicator, the synchronised path (all-reduces over one rank) runs.
    if (connected) bn->set_communicator(&acc.communicator());
    const auto got = run(*bn, [&](const torch::Tensor& in) { return bn(in); });
    REQUIRE(got.size() == want.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      INFO("connected " << connected << ", tensor " << k << ": max difference "
                        << (got[k] - want[k]).abs().max().item<double>());
      REQUIRE(torch::allclose(got[k], want[k], 1e-4, 1e-5));
    }
    bn->eval();
    ref->eval();
    REQUIRE(torch::allclose(bn(x), ref(x), 1e-4, 1e-5));
    ref->train();
  }
  accel::nn::SyncBatchNorm bad(3);
  REQUIRE_THROWS_WITH(bad(torch::randn({2, 4})), Catch::Contains("expected an input of shape (N, 3, ...)"));
}

namespace {
struct Tagged {
  std::string tag;
  torch::Tensor t;
  void save(torch::serialize::OutputArchive& a) const {
    a.write("t", t);
    a.write("tag", torch::tensor(std::vector<std::int64_t>(tag.begin(), tag.end())));
  }
  void load(torch::serialize::InputArchive& a) {
    torch::Tensor chars;
    a.read("t", t);
    a.read("tag", chars);
    tag.clear();
    for (std::int64_t k = 0; k < chars.numel(); ++k)
      tag += static_cast<char>(chars[k].item<std::int64_t>());
  }
};
}  // namespace

TEST_CASE(
    "objects: codecs round-trip strings, numbers, containers and archive types, and truncation is an error") {
  std::string bytes;
  const std::map<std::string, std::vector<std::pair<int, double>>> value{{"a", {{1, 0.5}, {2, -1.0}}},
                                                                         {"", {}}};
  encode_object(bytes, value);
  encode_object(bytes, std::string("with\0nul", 8));
  encode_object(bytes, Tagged{"ema", torch::arange(3)});
  std::string_view in(bytes);
  CHECK(decode_object<std::map<std::string, std::vector<std::pair<int, double>>>>(in) == value);
  CHECK(decode_object<std::string>(in) == std::string("with\0nul", 8));
  const auto tagged = decode_object<Tagged>(in);
  CHECK(tagged.tag == "ema");
  CHECK(torch::equal(tagged.t, torch::arange(3)));
  CHECK(in.empty());
  std::string_view cut(bytes.data(), 5);
  using Nested = std::map<std::string, std::vector<std::pair<int, double>>>;
  CHECK_THROWS_WITH(decode_object<Nested>(cut), Catch::Contains("object bytes end early"));

  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  CHECK(acc.gather_object(std::string("solo")) == std::vector<std::string>{"solo"});
  CHECK(acc.gather_object(std::vector<int>{1, 2}) == std::vector<int>{1, 2});
  std::vector<double> list{1.5};
  acc.broadcast_object_list(list);
  CHECK(list == std::vector<double>{1.5});
  CHECK_FALSE(acc.check_trigger());
  acc.set_trigger();
  CHECK(acc.check_trigger());
  CHECK_FALSE(acc.check_trigger());
  CHECK_THROWS_AS(acc.broadcast_object_list(list, 1), UsageError);
}

TEST_CASE("profile: a scope writes this rank's Chrome trace with the operators and the marked regions") {
  test::TempDir dir;
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  const auto traces = (dir.path / "traces").string();
  std::string path;
  {
    auto prof = acc.profile(ProfileOptions{traces, /*record_shapes=*/true});
    CHECK_THROWS_AS(acc.profile(ProfileOptions{traces}), UsageError);  // one profiler per process
    {
      RECORD_FUNCTION("my_training_step", std::vector<c10::IValue>());
      const auto a = torch::randn({64, 64});
      CHECK(torch::mm(a, a).size(0) == 64);
    }
    path = prof.path();
  }
  CHECK(path == (dir.path / "traces" / "trace_rank_0.json").string());
  REQUIRE(std::filesystem::exists(path));
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("\"traceEvents\"") != std::string::npos);
  CHECK(text.find("aten::mm") != std::string::npos);
  CHECK(text.find("my_training_step") != std::string::npos);
  const std::string python = accel::test::python();
  if (!python.empty()) {
    // Valid JSON whose events include the matrix product with its input shapes.
    const std::string command = python +
                                " -c \"import json,sys; d=json.load(open(sys.argv[1])); "
                                "e=[x for x in d['traceEvents'] if x.get('name')=='aten::mm']; "
                                "assert e and e[0]['args']['Input Dims']==[[64,64],[64,64]], e\" " +
                                path;
    CHECK(std::system(command.c_str()) == 0);
  }
  // A new scope after the first one has ended works (and overwrites the file).
  { auto again = acc.profile(ProfileOptions{traces}); }
  CHECK(std::filesystem::exists(path));
}

TEST_CASE("pipeline: a layer that takes two arguments is named by its own index") {
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(6, 6), torch::nn::Bilinear(6, 6, 1));
  acc.prepare_pipeline(model);
  auto mse = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  CHECK_THROWS_WITH(
      acc.pipeline_step(torch::randn({4, 6}), torch::randn({4, 1}), mse),
      Catch::Contains("layer 1 (of this stage's layers 0 to 1) threw") &&
          Catch::Contains("passed through layers 0 to 0") &&
          Catch::Contains("check that layer 1 takes one tensor and fits the output of layer 0"));
}

TEST_CASE("accelerator: a pipeline on one process trains like the plain loop, and backward() is refused") {
  auto config = test::make_config(MixedPrecision::No, 4);  // 4 micro-batches per step
  Accelerator acc(AcceleratorOptions().config(config));
  auto make = [] {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
  };
  auto model = make(), reference = make();
  auto& stage = acc.prepare_pipeline(model);
  CHECK(stage.stages() == 1);
  CHECK(stage.parameters().size() == 4);
  torch::optim::SGD opt(stage.parameters(), 0.1), ref_opt(reference->parameters(), 0.1);
  Regression data(24);
  auto mse = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  for (int step = 0; step < 3; ++step) {
    const auto x = data.x.narrow(0, step * 8, 8), y = data.y.narrow(0, step * 8, 8);
    opt.zero_grad();
    const double loss = acc.pipeline_step(x, y, mse);
    opt.step();
    ref_opt.zero_grad();
    auto ref_loss = torch::mse_loss(reference->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    CHECK(loss == Approx(ref_loss.item<double>()).epsilon(1e-6));
  }
  const auto ours = stage.parameters(), theirs = reference->parameters();
  for (std::size_t i = 0; i < ours.size(); ++i)
    CHECK(torch::allclose(ours[i], theirs[i], 1e-5, 1e-6));
  CHECK(acc.completed_steps() == 3);
  CHECK(acc.pipeline_evaluate(data.x, data.y, mse) ==
        Approx(torch::mse_loss(reference->forward(data.x), data.y).item<double>()).epsilon(1e-6));
  CHECK_THROWS_WITH(acc.backward(torch::mse_loss(model->forward(data.x), data.y)),
                    Catch::Contains("call accelerator.pipeline_step(inputs, targets, loss_fn) instead"));
  CHECK_THROWS_WITH(acc.prepare_pipeline(make()), Catch::Contains("already runs a pipeline"));
  // What does not work with a pipeline yet fails loudly instead of giving a silently wrong result.
  // A loader prepared after prepare_pipeline shards over the replicas (here one: every batch).
  auto after = acc.prepare_data_loader(Regression(8).map(torch::data::transforms::Stack<>()), 4);
  int batches = 0;
  for (auto& b : *after) {
    CHECK(b.data.size(0) == 4);
    ++batches;
  }
  CHECK(batches == 2);
  // clip_grad_norm_ clips the whole model's gradient norm: here one stage, the plain loop's.
  const auto x0 = data.x.narrow(0, 0, 8), y0 = data.y.narrow(0, 0, 8);
  opt.zero_grad();
  acc.pipeline_step(x0, y0, mse);
  ref_opt.zero_grad();
  torch::mse_loss(reference->forward(x0), y0).backward();
  const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.01);
  CHECK(acc.clip_grad_norm_(stage.parameters(), 0.01) == Approx(ref_norm).epsilon(1e-6));
  for (std::size_t i = 0; i < ours.size(); ++i)
    CHECK(torch::allclose(ours[i].grad(), theirs[i].grad(), 1e-5, 1e-7));
  // save_state writes one file per global layer (Linear 0 and 2; Tanh has none); load_state restores the
  // weights and the optimizer's momentum after more steps changed them.
  {
    torch::optim::SGD momentum(stage.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    acc.prepare(momentum);
    momentum.zero_grad();
    acc.pipeline_step(data.x.narrow(0, 0, 8), data.y.narrow(0, 0, 8), mse);
    momentum.step();
    test::TempDir dir;
    acc.save_state(dir.path.string());
    CHECK(std::filesystem::exists(dir.path / "layers" / "layer_0.safetensors"));
    CHECK(std::filesystem::exists(dir.path / "layers" / "layer_2.safetensors"));
    CHECK(std::filesystem::exists(dir.path / "layers" / "optimizer_0_layer_2.safetensors"));
    CHECK_FALSE(std::filesystem::exists(dir.path / "layers" / "layer_1.safetensors"));
    {
      // Without a pipeline the per-layer checkpoint loads into the same Sequential (weights and momentum).
      Accelerator plain(AcceleratorOptions().config(test::make_config()));
      auto other = make();
      for (const auto& p : other->parameters())
        p.data().zero_();
      torch::optim::SGD other_opt(other->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      plain.prepare(other, other_opt);
      auto other_loader = plain.prepare_data_loader(Regression(8).map(torch::data::transforms::Stack<>()), 4);
      plain.load_state(dir.path.string());
      const auto mine = stage.parameters(), loaded = other->parameters();
      REQUIRE(mine.size() == loaded.size());
      for (std::size_t i = 0; i < mine.size(); ++i) {
        CHECK(torch::equal(mine[i], loaded[i]));
        const auto& a =
            static_cast<torch::optim::SGDParamState&>(*momentum.state().at(mine[i].unsafeGetTensorImpl()));
        const auto& b =
            static_cast<torch::optim::SGDParamState&>(*other_opt.state().at(loaded[i].unsafeGetTensorImpl()));
        CHECK(torch::equal(a.momentum_buffer(), b.momentum_buffer()));
      }
    }
    std::vector<torch::Tensor> saved;
    for (const auto& p : stage.parameters())
      saved.push_back(p.detach().clone());
    for (int i = 0; i < 2; ++i) {
      momentum.zero_grad();
      acc.pipeline_step(data.x.narrow(0, 8, 8), data.y.narrow(0, 8, 8), mse);
      momentum.step();
    }
    const auto after_one = [&] {
      momentum.zero_grad();
      acc.pipeline_step(data.x.narrow(0, 16, 8), data.y.narrow(0, 16, 8), mse);
      momentum.step();
      std::vector<torch::Tensor> out;
      for (const auto& p : stage.parameters())
        out.push_back(p.detach().clone());
      return out;
    };
    acc.load_state(dir.path.string());
    for (std::size_t i = 0; i < saved.size(); ++i)
      CHECK(torch::equal(stage.parameters()[i], saved[i]));
    const auto first = after_one();
    acc.load_state(dir.path.string());
    const auto second = after_one();  // the same step from the same state, momentum included
    for (std::size_t i = 0; i < first.size(); ++i)
      CHECK(torch::equal(first[i], second[i]));
  }
  // Mixed precision runs the stages under autocast.
  Accelerator bf16(AcceleratorOptions().config(test::make_config(MixedPrecision::Bf16, 2)));
  auto bf16_model = make();
  bf16.prepare_pipeline(bf16_model);
  CHECK(std::isfinite(bf16.pipeline_step(x0, y0, mse)));
  Accelerator with_loader(AcceleratorOptions().config(test::make_config()));
  auto loader = with_loader.prepare_data_loader(Regression(8).map(torch::data::transforms::Stack<>()), 4);
  CHECK_THROWS_WITH(with_loader.prepare_pipeline(make()),
                    Catch::Contains("prepare the data loaders after prepare_pipeline"));
}

TEST_CASE("accelerator: pipeline_step before prepare_pipeline names the call to make") {
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  auto mse = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  CHECK_THROWS_WITH(acc.pipeline_step(torch::zeros({4, 6}), torch::zeros({4, 1}), mse),
                    Catch::Contains("call accelerator.prepare_pipeline(model) first"));
}

// Issue 49: ACCEL_COLLECTIVE_TIMEOUT overrides collective_timeout_seconds and is held to the key's bounds (a
// timeout of centuries would leave a hung collective unreported that long).
TEST_CASE("accelerator: ACCEL_COLLECTIVE_TIMEOUT is held to collective_timeout_seconds' bounds") {
  ::setenv("ACCEL_COLLECTIVE_TIMEOUT", "3153600000", 1);
  try {
    Accelerator acc(AcceleratorOptions().config(test::make_config()));
    FAIL("no exception");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("ACCEL_COLLECTIVE_TIMEOUT='3153600000'") &&
                             Catch::Contains("more than 7 days"));
  }
  ::setenv("ACCEL_COLLECTIVE_TIMEOUT", "600", 1);
  CHECK_NOTHROW(Accelerator(AcceleratorOptions().config(test::make_config())));
  ::unsetenv("ACCEL_COLLECTIVE_TIMEOUT");
}
