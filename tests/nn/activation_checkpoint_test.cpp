#include <accel/accelerator/accelerator.hpp>
#include <accel/errors.hpp>
#include <accel/nn/activation_checkpoint.hpp>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

torch::nn::Sequential make_mlp(bool dropout) {
  torch::nn::Sequential seq(torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Linear(32, 32),
                            torch::nn::Tanh());
  if (dropout) seq->push_back(torch::nn::Dropout(0.5));
  seq->push_back(torch::nn::Linear(32, 8));
  return seq;
}

torch::nn::Sequential make_conv(bool dropout) {
  torch::nn::Sequential seq(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                            torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).stride(2)));
  if (dropout) seq->push_back(torch::nn::Dropout(0.5));
  seq->push_back(torch::nn::SiLU());
  return seq;
}

torch::nn::Sequential deep_copy(const torch::nn::Sequential& seq) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone()));
}

/// Loss, input gradient and every parameter gradient of one training step, plus the next RNG draw.
struct StepResult {
  torch::Tensor loss;
  torch::Tensor input_grad;
  std::map<std::string, torch::Tensor> param_grads;
  torch::Tensor rng_after;
};

/// `forward` maps the input to the output; the loss weights the output with a fixed tensor so that every
/// output element gets a different gradient.
template <typename Forward>
StepResult run_step(torch::nn::Module& model, const torch::Tensor& input, Forward forward) {
  torch::manual_seed(7);
  model.zero_grad();
  auto y = forward(input);
  auto weights = torch::linspace(-1.0, 1.0, y.numel()).view_as(y).to(y.scalar_type());
  auto loss = (y * weights).sum();
  loss.backward();
  StepResult r;
  r.loss = loss.detach();
  if (input.grad().defined()) r.input_grad = input.grad().clone();
  for (const auto& p : model.named_parameters()) {
    REQUIRE(p.value().grad().defined());
    r.param_grads[p.key()] = p.value().grad().clone();
  }
  r.rng_after = torch::rand({4});
  return r;
}

void require_bitwise_equal(const StepResult& a, const StepResult& b) {
  REQUIRE(torch::equal(a.loss, b.loss));
  REQUIRE(a.input_grad.defined() == b.input_grad.defined());
  if (a.input_grad.defined()) REQUIRE(torch::equal(a.input_grad, b.input_grad));
  REQUIRE(a.param_grads.size() == b.param_grads.size());
  for (const auto& [name, grad] : a.param_grads) {
    INFO("parameter " << name);
    REQUIRE(b.param_grads.count(name) == 1);
    REQUIRE(torch::equal(grad, b.param_grads.at(name)));
  }
  REQUIRE(torch::equal(a.rng_after, b.rng_after));
}

std::vector<std::string> names_of(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters())
    names.push_back(p.key());
  return names;
}

void compare_checkpointed_to_plain(const torch::nn::Sequential& model, const torch::Tensor& x) {
  auto plain_model = deep_copy(model);
  auto ckpt_model = deep_copy(model);
  auto x1 = x.clone().requires_grad_(true);
  auto x2 = x.clone().requires_grad_(true);
  auto plain = run_step(*plain_model, x1, [&](const torch::Tensor& in) { return plain_model->forward(in); });
  auto ckpt = run_step(*ckpt_model, x2, [&](const torch::Tensor& in) {
    return accel::checkpoint([&](const torch::Tensor& t) { return ckpt_model->forward(t); }, in);
  });
  require_bitwise_equal(plain, ckpt);
}

}  // namespace

TEST_CASE("checkpointing: MLP segment gives bitwise identical loss and gradients") {
  torch::manual_seed(0);
  auto model = make_mlp(/*dropout=*/false);
  compare_checkpointed_to_plain(model, torch::randn({5, 16}));
}

TEST_CASE("checkpointing: MLP segment with dropout replays the same mask") {
  torch::manual_seed(1);
  auto model = make_mlp(/*dropout=*/true);
  compare_checkpointed_to_plain(model, torch::randn({5, 16}));
}

TEST_CASE("checkpointing: conv segment gives bitwise identical loss and gradients") {
  torch::manual_seed(2);
  auto model = make_conv(/*dropout=*/false);
  compare_checkpointed_to_plain(model, torch::randn({2, 3, 9, 9}));
}

TEST_CASE("checkpointing: conv segment with dropout replays the same mask") {
  torch::manual_seed(3);
  auto model = make_conv(/*dropout=*/true);
  compare_checkpointed_to_plain(model, torch::randn({2, 3, 9, 9}));
}

TEST_CASE("checkpointing: without preserve_rng_state dropout draws a new mask") {
  torch::manual_seed(3);
  auto model = make_mlp(/*dropout=*/true);
  auto plain_model = deep_copy(model);
  auto ckpt_model = deep_copy(model);
  auto x = torch::randn({5, 16});
  auto plain = run_step(*plain_model, x, [&](const torch::Tensor& in) { return plain_model->forward(in); });
  auto ckpt = run_step(*ckpt_model, x, [&](const torch::Tensor& in) {
    return accel::checkpoint([&](const torch::Tensor& t) { return ckpt_model->forward(t); }, in,
                             accel::CheckpointOptions().preserve_rng_state(false));
  });
  REQUIRE(torch::equal(plain.loss, ckpt.loss));  // the forward is not affected
  REQUIRE_FALSE(torch::equal(plain.param_grads.at("0.weight"), ckpt.param_grads.at("0.weight")));
}

TEST_CASE("checkpointing: input without requires_grad still gives parameter gradients") {
  torch::manual_seed(4);
  auto model = make_mlp(/*dropout=*/true);
  compare_checkpointed_to_plain(model, torch::randn({5, 16}));  // sanity: same path with input grads
  auto plain_model = deep_copy(model);
  auto ckpt_model = deep_copy(model);
  auto x = torch::randn({5, 16});  // data: no grad
  auto plain = run_step(*plain_model, x, [&](const torch::Tensor& in) { return plain_model->forward(in); });
  auto ckpt = run_step(*ckpt_model, x, [&](const torch::Tensor& in) {
    auto y = accel::checkpoint([&](const torch::Tensor& t) { return ckpt_model->forward(t); }, in);
    REQUIRE(y.requires_grad());
    return y;
  });
  REQUIRE_FALSE(x.grad().defined());
  require_bitwise_equal(plain, ckpt);
}

TEST_CASE("checkpointing: several inputs and outputs, integral output and input without grad") {
  torch::manual_seed(5);
  torch::nn::Linear lin(6, 6);
  auto segment = [&](const std::vector<torch::Tensor>& in) {
    auto h = torch::tanh(lin->forward(in[0])) * in[1];
    return std::vector<torch::Tensor>{h, h.argmax(1), (h * in[2]).sum()};
  };
  auto x = torch::randn({4, 6});
  auto mask = (torch::rand({4, 6}) > 0.3).to(torch::kFloat);
  auto scale = torch::randn({4, 6});

  auto run = [&](bool use_checkpoint) {
    lin->zero_grad();
    auto xi = x.clone().requires_grad_(true);
    auto si = scale.clone().requires_grad_(true);
    std::vector<torch::Tensor> inputs{xi, mask, si};
    auto out = use_checkpoint ? accel::checkpoint(segment, inputs) : segment(inputs);
    REQUIRE_FALSE(out[1].requires_grad());
    auto loss = out[0].pow(2).sum() + out[2];
    loss.backward();
    return std::vector<torch::Tensor>{loss.detach(),      out[1],          xi.grad(), si.grad(),
                                      lin->weight.grad(), lin->bias.grad()};
  };
  auto plain = run(false);
  auto ckpt = run(true);
  for (std::size_t i = 0; i < plain.size(); ++i) {
    INFO("result " << i);
    REQUIRE(torch::equal(plain[i], ckpt[i]));
  }
}

TEST_CASE("checkpointing: under NoGradGuard the segment just runs once") {
  torch::nn::Linear lin(4, 4);
  int calls = 0;
  auto x = torch::randn({2, 4}, torch::requires_grad());
  torch::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    expected = lin->forward(x);
    auto y = accel::checkpoint(
        [&](const torch::Tensor& t) {
          ++calls;
          return lin->forward(t);
        },
        x);
    REQUIRE(calls == 1);
    REQUIRE_FALSE(y.requires_grad());
    REQUIRE_FALSE(y.grad_fn());
    REQUIRE(torch::equal(y, expected));
  }
}

TEST_CASE("checkpointing: activations are not kept and backward recomputes exactly once") {
  torch::manual_seed(6);
  torch::nn::Linear a(8, 32), b(32, 8);
  int calls = 0;
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::optional<WeakTensor> hidden;
  auto segment = [&](const torch::Tensor& x) {
    ++calls;
    auto h = torch::relu(a->forward(x));
    if (calls == 1) hidden.emplace(h.getIntrusivePtr());
    return b->forward(h);
  };
  auto x = torch::randn({3, 8}, torch::requires_grad());

  SECTION("plain autograd keeps the hidden activation alive") {
    auto y = segment(x);
    REQUIRE_FALSE(hidden->expired());
    y.sum().backward();
  }
  SECTION("checkpoint frees it and saves only the input") {
    auto y = accel::checkpoint(segment, x);
    REQUIRE(calls == 1);
    REQUIRE(hidden->expired());
    REQUIRE(y.grad_fn()->name().find("CheckpointFunction") != std::string::npos);
    // The node's only edge is the input: the segment's graph was never recorded.
    REQUIRE(y.grad_fn()->next_edges().size() == 1);
    y.sum().backward();
    REQUIRE(calls == 2);
    REQUIRE(a->weight.grad().defined());
    REQUIRE(x.grad().defined());
  }
}

TEST_CASE("checkpointing: autocast bf16 recomputation matches plain autocast bitwise") {
  torch::manual_seed(8);
  auto model = make_mlp(/*dropout=*/true);
  auto x = torch::randn({5, 16});
  const bool was_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  const auto was_dtype = at::autocast::get_autocast_dtype(at::kCPU);

  // backward_inside: backward also runs with autocast on (the weight-cast cache is never cleared then).
  for (const bool backward_inside : {false, true}) {
    INFO("backward inside autocast: " << backward_inside);
    auto run = [&](torch::nn::Sequential m, bool use_checkpoint) {
      auto xi = x.clone().requires_grad_(true);
      return run_step(*m, xi, [&](const torch::Tensor& in) {
        at::autocast::clear_cache();
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        auto y = use_checkpoint ? accel::checkpoint([&](const torch::Tensor& t) { return m->forward(t); }, in)
                                : m->forward(in);
        REQUIRE(y.scalar_type() == at::kBFloat16);
        if (!backward_inside) {
          at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
          at::autocast::clear_cache();
        }
        return y;
      });
    };
    auto plain = run(deep_copy(model), false);
    auto ckpt = run(deep_copy(model), true);
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
    at::autocast::clear_cache();
    require_bitwise_equal(plain, ckpt);
  }
}

TEST_CASE("checkpointing: nested checkpoint inside a checkpointed segment") {
  torch::manual_seed(9);
  auto inner = make_mlp(/*dropout=*/true);
  torch::nn::Linear head(8, 8);
  auto run = [&](bool use_checkpoint) {
    auto m = deep_copy(inner);
    auto h = torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(head->clone()));
    auto holder = std::make_shared<torch::nn::Module>();  // for named_parameters()
    holder->register_module("m", m.ptr());
    holder->register_module("h", h.ptr());
    auto x = torch::randn({5, 16}).requires_grad_(true);
    return run_step(*holder, x, [&](const torch::Tensor& in) {
      if (!use_checkpoint) return h->forward(m->forward(in));
      return accel::checkpoint(
          [&](const torch::Tensor& t) {
            auto mid = accel::checkpoint([&](const torch::Tensor& u) { return m->forward(u); }, t);
            return h->forward(mid);
          },
          in);
    });
  };
  torch::manual_seed(10);
  auto plain = run(false);
  torch::manual_seed(10);
  auto ckpt = run(true);
  require_bitwise_equal(plain, ckpt);
}

TEST_CASE("checkpointing: Checkpointed keeps parameter names and checkpoints only when training") {
  torch::manual_seed(11);
  torch::nn::Linear lin(4, 3);
  accel::Checkpointed wrapped(lin);
  REQUIRE(names_of(*wrapped) == std::vector<std::string>{"weight", "bias"});
  REQUIRE(wrapped->parameters()[0].unsafeGetTensorImpl() == lin->weight.unsafeGetTensorImpl());

  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto y = wrapped->forward(x);
  REQUIRE(y.grad_fn()->name().find("CheckpointFunction") != std::string::npos);
  REQUIRE(torch::equal(y, lin->forward(x)));

  wrapped->eval();
  REQUIRE_FALSE(lin->is_training());
  REQUIRE(wrapped->forward(x).grad_fn()->name().find("CheckpointFunction") == std::string::npos);
  wrapped->train();
  REQUIRE(lin->is_training());

  auto copy = std::dynamic_pointer_cast<accel::CheckpointedImpl>(wrapped->clone());
  REQUIRE(copy);
  REQUIRE(names_of(*copy) == names_of(*wrapped));
  REQUIRE(copy->parameters()[0].unsafeGetTensorImpl() != lin->weight.unsafeGetTensorImpl());
  REQUIRE(torch::equal(copy->forward(x), y));

  std::ostringstream printed;
  printed << *wrapped;
  REQUIRE(printed.str().find("accel::Checkpointed(torch::nn::Linear") != std::string::npos);

  REQUIRE_THROWS_WITH(accel::Checkpointed(torch::nn::AnyModule()),
                      Catch::Contains("module to wrap is empty"));
}

TEST_CASE(
    "checkpointing: checkpoint_sequential keeps names and tensors, gradients and optimizer steps match") {
  torch::manual_seed(12);
  // A Sequential cannot hold a Sequential (AnyModule rejects its template forward), but it can hold a
  // Checkpointed Sequential: one segment of two layers, which checkpoint_sequential leaves alone.
  torch::nn::Sequential model(
      torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Dropout(0.5),
      accel::Checkpointed(torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::Tanh())),
      torch::nn::Linear(32, 8));
  auto plain_model = deep_copy(model);
  auto ckpt_model = deep_copy(model);

  torch::optim::SGD plain_opt(plain_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ckpt_opt(ckpt_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto names_before = names_of(*ckpt_model);
  std::vector<c10::TensorImpl*> tensors_before;
  for (const auto& p : ckpt_model->parameters())
    tensors_before.push_back(p.unsafeGetTensorImpl());

  accel::checkpoint_sequential(ckpt_model);
  accel::checkpoint_sequential(ckpt_model);  // idempotent
  REQUIRE(names_of(*ckpt_model) == names_before);
  REQUIRE(names_before[0] == "0.weight");
  REQUIRE(names_before[2] == "3.0.weight");
  std::vector<c10::TensorImpl*> tensors_after;
  for (const auto& p : ckpt_model->parameters())
    tensors_after.push_back(p.unsafeGetTensorImpl());
  REQUIRE(tensors_after == tensors_before);
  for (std::size_t i = 0; i < ckpt_model->size(); ++i) {
    auto wrapper = ckpt_model->ptr<accel::CheckpointedImpl>(i);
    REQUIRE(wrapper);
    REQUIRE(ckpt_model->named_children()[i].value().get() == wrapper.get());
  }

  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({5, 16});
    auto plain = run_step(*plain_model, x, [&](const torch::Tensor& in) { return plain_model->forward(in); });
    auto ckpt = run_step(*ckpt_model, x, [&](const torch::Tensor& in) {
      auto y = ckpt_model->forward(in);
      REQUIRE(y.grad_fn()->name().find("CheckpointFunction") != std::string::npos);
      return y;
    });
    require_bitwise_equal(plain, ckpt);
    plain_opt.step();
    ckpt_opt.step();
  }
  for (std::size_t i = 0; i < plain_model->parameters().size(); ++i) {
    REQUIRE(torch::equal(plain_model->parameters()[i], ckpt_model->parameters()[i]));
  }

  // eval() reaches the wrapped Dropout through the wrapper: no dropout, no checkpoint.
  ckpt_model->eval();
  plain_model->eval();
  auto x = torch::randn({5, 16});
  auto y = ckpt_model->forward(x);
  REQUIRE(y.grad_fn()->name().find("CheckpointFunction") == std::string::npos);
  REQUIRE(torch::equal(y, plain_model->forward(x)));

  // Cloning the wrapped Sequential keeps the names too.
  auto cloned = deep_copy(ckpt_model);
  REQUIRE(names_of(*cloned) == names_before);
}

TEST_CASE("checkpointing: misuse is reported with a clear message") {
  torch::nn::Linear lin(3, 3);
  auto x = torch::randn({2, 3}, torch::requires_grad());
  REQUIRE_THROWS_AS(accel::checkpoint(accel::CheckpointSegment{}, x), accel::UsageError);
  REQUIRE_THROWS_WITH(
      accel::checkpoint([&](const torch::Tensor& t) { return lin->forward(t); }, torch::Tensor()),
      Catch::Contains("input 0 is an undefined tensor"));
  REQUIRE_THROWS_WITH(accel::checkpoint(accel::CheckpointSegmentList([](const std::vector<torch::Tensor>&) {
                                          return std::vector<torch::Tensor>{};
                                        }),
                                        {x}),
                      Catch::Contains("returned no tensor"));

  auto y = accel::checkpoint([&](const torch::Tensor& t) { return lin->forward(t); }, x);
  REQUIRE_THROWS_WITH(torch::autograd::grad({y.sum()}, {x}), Catch::Contains("torch::autograd::grad"));

  auto z = accel::checkpoint([&](const torch::Tensor& t) { return lin->forward(t).pow(2); }, x);
  REQUIRE_THROWS_AS(torch::autograd::backward({z.sum()}, {}, std::nullopt, /*create_graph=*/true),
                    accel::UnsupportedOperation);

  torch::nn::Sequential empty(nullptr);
  REQUIRE_THROWS_AS(accel::checkpoint_sequential(empty), accel::UsageError);
}

TEST_CASE("checkpointing: the YAML switch checkpoints a Sequential model with identical gradients") {
  auto run = [](bool on) {
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                                torch::nn::Linear(16, 1));
    accel::Config c;
    c.use_cpu = true;
    c.zero.activation_checkpointing = on;
    accel::Accelerator acc(accel::AcceleratorOptions().config(c));
    torch::optim::SGD opt(model->parameters(), 0.1);
    acc.prepare(model, opt);
    torch::manual_seed(1);
    const auto x = torch::randn({8, 6}), y = torch::randn({8, 1});
    acc.backward(torch::mse_loss(model->forward(x), y));
    std::vector<torch::Tensor> grads;
    for (const auto& p : model->named_parameters())
      grads.push_back(p.value().grad().clone());
    return std::make_pair(grads, model->named_parameters().keys());
  };
  const auto [plain, plain_names] = run(false);
  const auto [ckpt, ckpt_names] = run(true);
  REQUIRE(plain_names == ckpt_names);
  for (std::size_t i = 0; i < plain.size(); ++i)
    REQUIRE(torch::equal(plain[i], ckpt[i]));
}

namespace {

// A decoder block as transformers lays them out: called by its type from a ModuleList with a second input (an
// additive mask that needs no gradient), dropout inside, and derived from GradientCheckpointingLayer.
struct GcBlockImpl : torch::nn::Module, accel::GradientCheckpointingLayer {
  torch::nn::Linear up{nullptr}, down{nullptr};
  GcBlockImpl() {
    up = register_module("up", torch::nn::Linear(8, 16));
    down = register_module("down", torch::nn::Linear(16, 8));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask) {
    return checkpointed_call(
               [this](const std::vector<torch::Tensor>& in) {
                 auto h = torch::dropout(torch::gelu(up->forward(in[0])), 0.2, is_training());
                 return std::vector<torch::Tensor>{in[0] + down->forward(h) + in[1]};
               },
               {x, mask}, is_training())
        .front();
  }
};
TORCH_MODULE(GcBlock);

struct GcDecoderImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  torch::nn::Linear head{nullptr};
  GcDecoderImpl() {
    for (int i = 0; i < 3; ++i)
      layers->push_back(GcBlock());
    register_module("layers", layers);
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    for (const auto& layer : *layers)
      x = layer->as<GcBlockImpl>()->forward(x, mask);  // by type, as transformers' decoder loops do
    return head->forward(x);
  }
};
TORCH_MODULE(GcDecoder);

// A plain block in a ModuleList: no wrapper can stand in for it.
struct PlainBlockImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(PlainBlock);

}  // namespace

TEST_CASE("checkpointing: a ModuleList of decoder blocks trains with checkpointing as without, bit for bit") {
  // Three AdamW steps: the losses and every gradient equal the plain run's exactly (the recomputation replays
  // the dropout masks).
  auto run = [](bool on) {
    torch::manual_seed(0);
    GcDecoder model;
    if (on) CHECK(accel::checkpoint_model_blocks(*model, "gradient_checkpointing") == 3);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    std::vector<double> losses;
    std::vector<torch::Tensor> grads;
    torch::manual_seed(1);
    const auto mask = torch::zeros({4, 8});
    for (int step = 0; step < 3; ++step) {
      const auto x = torch::randn({4, 8}), y = torch::randn({4, 1});
      opt.zero_grad();
      const auto loss = torch::mse_loss(model->forward(x, mask), y);
      loss.backward();
      losses.push_back(loss.item<double>());
      for (const auto& p : model->parameters())
        grads.push_back(p.grad().clone());
      opt.step();
    }
    return std::make_pair(losses, grads);
  };
  const auto [plain_losses, plain_grads] = run(false);
  const auto [ckpt_losses, ckpt_grads] = run(true);
  CHECK(plain_losses == ckpt_losses);
  REQUIRE(plain_grads.size() == ckpt_grads.size());
  for (std::size_t i = 0; i < plain_grads.size(); ++i)
    REQUIRE(torch::equal(plain_grads[i], ckpt_grads[i]));
  GcDecoder model;
  for (const auto& layer : *model->layers)
    CHECK_FALSE(layer->as<GcBlockImpl>()->gradient_checkpointing());
  accel::checkpoint_model_blocks(*model, "gradient_checkpointing",
                                 accel::CheckpointOptions().preserve_rng_state(false));
  for (const auto& layer : *model->layers)
    CHECK(layer->as<GcBlockImpl>()->gradient_checkpointing());
}

TEST_CASE(
    "checkpointing: Sequential blocks of a ModuleList are checkpointed in place; other blocks are refused") {
  struct SeqList : torch::nn::Module {
    torch::nn::ModuleList layers;
    SeqList() {
      layers->push_back(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh()));
      layers->push_back(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh()));
      register_module("layers", layers);
    }
  };
  auto run = [](bool on) {
    torch::manual_seed(2);
    auto m = std::make_shared<SeqList>();
    if (on) CHECK(accel::checkpoint_model_blocks(*m, "gradient_checkpointing") == 2);
    auto x = torch::randn({3, 4});
    for (const auto& layer : *m->layers)
      x = layer->as<torch::nn::SequentialImpl>()->forward(x);  // still a Sequential: callers by type work
    x.sum().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : m->named_parameters())
      g.push_back(p.value().grad().clone());
    return std::make_pair(g, m->named_parameters().keys());
  };
  const auto [plain, plain_names] = run(false);
  const auto [ckpt, ckpt_names] = run(true);
  CHECK(plain_names == ckpt_names);
  for (std::size_t i = 0; i < plain.size(); ++i)
    CHECK(torch::equal(plain[i], ckpt[i]));
  struct PlainList : torch::nn::Module {
    torch::nn::ModuleList layers;
    PlainList() {
      layers->push_back(PlainBlock());
      register_module("layers", layers);
    }
  };
  PlainList plain_list;
  CHECK_THROWS_WITH(accel::checkpoint_model_blocks(plain_list, "TrainingArguments gradient_checkpointing"),
                    Catch::Matchers::Contains("TrainingArguments gradient_checkpointing is on") &&
                        Catch::Matchers::Contains("'layers.0'") &&
                        Catch::Matchers::Contains("accel::GradientCheckpointingLayer"));
}

TEST_CASE("checkpointing: checkpoint_recomputing() is true only in the segment's recomputation") {
  // A checkpoint nested in another: each segment sees its own pass, the flag is restored after each.
  std::vector<std::string> seen;
  auto note = [&](const char* where) {
    seen.push_back(std::string(where) + (accel::checkpoint_recomputing() ? " recomputing" : " forward"));
  };
  const accel::CheckpointSegment inner = [&](const torch::Tensor& h) {
    note("inner");
    return h.sin();
  };
  const accel::CheckpointSegment outer = [&](const torch::Tensor& h) {
    note("outer");
    auto y = accel::checkpoint(inner, h * 2);
    note("outer after inner");
    return y.cos();
  };
  const auto x = torch::randn({5}, torch::requires_grad());
  const auto y = accel::checkpoint(outer, x);
  CHECK_FALSE(accel::checkpoint_recomputing());
  y.sum().backward();
  CHECK_FALSE(accel::checkpoint_recomputing());
  // Forward: outer, then inner run plainly (grad mode is off in the outer forward). Backward: the outer
  // segment recomputed (its nested checkpoint's forward is a forward), then the inner one recomputed.
  CHECK(seen == std::vector<std::string>{"outer forward", "inner forward", "outer after inner forward",
                                         "outer recomputing", "inner forward",
                                         "outer after inner recomputing", "inner recomputing"});
  const auto expected = (-(x.detach() * 2).sin().sin() * (x.detach() * 2).cos() * 2);
  CHECK(torch::allclose(x.grad(), expected));
}

namespace {
struct ProductCounter {  // matrix products (linear, matmul, mm, addmm) run on this thread meanwhile
  static inline int count = 0;
  at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        const std::string_view name = fn.name();
        if (name == "aten::mm" || name == "aten::addmm" || name == "aten::matmul" || name == "aten::linear")
          ++count;
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  ProductCounter() { count = 0; }
  ~ProductCounter() { at::removeCallback(handle); }
};
}  // namespace

TEST_CASE("checkpointing: linear_graph_only has torch::linear's gradients bit for bit and no product") {
  torch::manual_seed(5);
  for (const auto& batch : {std::vector<std::int64_t>{6}, {2, 3}}) {
    for (const bool with_bias : {false, true}) {
      for (const bool weight_grad : {false, true}) {
        INFO("batch dims " << batch.size() << ", bias " << with_bias << ", weight grad " << weight_grad);
        auto in_shape = batch, out_shape = batch;
        in_shape.push_back(16);
        out_shape.push_back(8);
        const auto x = torch::randn(in_shape);
        const auto w = torch::randn({8, 16}).set_requires_grad(weight_grad);
        const auto b = with_bias ? torch::randn({8}).set_requires_grad(true) : torch::Tensor();
        const auto g = torch::randn(out_shape);
        auto grads = [&](bool graph_only) {
          const auto xi = x.clone().set_requires_grad(true);
          for (auto t : {w, b})
            if (t.defined() && t.grad().defined()) t.mutable_grad().reset();
          torch::Tensor y;
          int products = 0;
          {
            ProductCounter counter;
            y = graph_only ? accel::linear_graph_only(xi, w, b) : torch::linear(xi, w, b);
            products = ProductCounter::count;
          }
          CHECK(y.sizes() == torch::IntArrayRef(out_shape));
          CHECK((graph_only ? products == 0 : products > 0));  // aten::linear and its addmm or mm
          y.backward(g);
          return std::vector<torch::Tensor>{xi.grad(), w.grad(), with_bias ? b.grad() : torch::Tensor()};
        };
        const auto ref = grads(false), ours = grads(true);
        CHECK(torch::equal(ref[0], ours[0]));
        CHECK(ref[1].defined() == weight_grad);
        CHECK(ours[1].defined() == weight_grad);
        if (weight_grad) CHECK(torch::equal(ref[1], ours[1]));
        if (with_bias) CHECK(torch::equal(ref[2], ours[2]));
      }
    }
  }
  // Where no graph is built, or autocast casts, the values are computed: torch::linear itself.
  const auto x = torch::randn({3, 16}), w = torch::randn({8, 16});
  {
    torch::NoGradGuard no_grad;
    CHECK(torch::equal(accel::linear_graph_only(x, w), torch::linear(x, w)));
  }
  CHECK(torch::equal(accel::linear_graph_only(x[0], w), torch::linear(x[0], w)));
  CHECK_THROWS_AS(accel::linear_graph_only(x, torch::randn({8, 15})), accel::UsageError);
  CHECK_THROWS_AS(accel::linear_graph_only(x, w, torch::randn({7})), accel::UsageError);
}
