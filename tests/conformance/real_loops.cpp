// Conformance scenarios from the loops users port, run on every backend row against one process with the
// whole batch (N ranks x batch B == one process x batch N*B): two models and two optimizers with gradients
// crossing models (a GAN, also with gradient accumulation), a frozen teacher, hand-written accumulation
// (plain, with no_sync, under fp16), two backward calls per batch with gradient accumulation, BatchNorm
// buffers, torch::save of the model (also after free_memory()), batches not from a prepared loader, and a
// plain loss.backward() kept from a DDP loop (refused on several ranks).
//
// Each loop is written once: with an Accelerator (acc != nullptr) it runs on this rank's rows, without one it
// is the plain single-process reference on all rows.
#include "build_paths.hpp"
#include "dist_common.hpp"

#include <accel/checkpoint/safetensors.hpp>
#include <accel/distributed/env_contract.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/nn/lora.hpp>
#include <accel/nn/sync_batchnorm.hpp>
#include <accel/optim/optim.hpp>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

namespace dist {
namespace {

using namespace accel;
using test::Mlp;
using test::Regression;

constexpr std::int64_t kBatch = 4;  // per rank
constexpr int kSteps = 4;
constexpr double kTol = 2e-5;

// Rows of global batch `s` (N*B rows) that this process computes: its own B with an accelerator (on its
// device: GPU ranks with ACCEL_TEST_DEVICE=cuda), all of them in the reference (on the CPU).
torch::Tensor rows(const torch::Tensor& t, std::int64_t s, Accelerator* acc, int world) {
  const std::int64_t global = kBatch * world;
  if (acc == nullptr) return t.slice(0, s * global, (s + 1) * global);
  const auto begin = s * global + acc->process_index() * kBatch;
  return t.slice(0, begin, begin + kBatch).to(acc->device());
}

// The ranks train where ACCEL_TEST_DEVICE says (a GPU run that fell back to the CPU would prove nothing).
void check_device(const Accelerator& acc) {
  const char* device = std::getenv("ACCEL_TEST_DEVICE");
  const bool want_cuda = device != nullptr && std::string(device) == "cuda";
  CHECK_MSG(acc.device().is_cuda() == want_cuda, "the ranks train on " << acc.device()
                                                                       << " (ACCEL_TEST_DEVICE "
                                                                       << (device ? device : "unset") << ")");
}

void backward(Accelerator* acc, const torch::Tensor& loss) {
  if (acc != nullptr) {
    acc->backward(loss);
  } else {
    loss.backward();
  }
}

// The directory a launcher script made for this run (ACCEL_TEST_SAVE_DIR).
std::string save_dir() {
  const char* dir = std::getenv("ACCEL_TEST_SAVE_DIR");
  if (dir == nullptr) throw std::runtime_error("set ACCEL_TEST_SAVE_DIR");
  return dir;
}

std::unique_ptr<torch::optim::Optimizer> sgd(const std::vector<torch::Tensor>& p) {
  return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
}

// The whole, current weights of a model (a module holder: Mlp, torch::nn::Linear): through the accelerator
// (sharded backends) or the module.
template <class Model>
std::vector<torch::Tensor> weights(Accelerator* acc, Model& model) {
  std::vector<torch::Tensor> out;
  if (acc == nullptr) return test::snapshot(*model);
  for (const auto& [name, t] : acc->get_state_dict(model)) {
    if (model->named_parameters().contains(name)) out.push_back(t.cpu().clone());
  }
  return out;
}

void compare(const std::string& what, const std::vector<torch::Tensor>& got,
             const std::vector<torch::Tensor>& want, bool main) {
  CHECK_MSG(got.size() == want.size(), what << ": " << got.size() << " tensors, want " << want.size());
  for (std::size_t k = 0; k < std::min(got.size(), want.size()); ++k) {
    const auto mine = got[k].cpu();
    const double diff = (mine - want[k]).abs().max().item<double>();
    CHECK_MSG(close(mine, want[k], kTol), what << ": tensor " << k << " differs from one process by " << diff
                                               << " (tolerance " << kTol << ")");
  }
  if (main) std::cout << backend_variant << " " << what << ": matches one process" << std::endl;
}

// Runs `loop(acc, world)` on the ranks and in one process, and compares what each returns.
void against_one_process(const std::string& what,
                         const std::function<std::vector<torch::Tensor>(Accelerator*, int)>& loop,
                         int accumulation = 1, const ProjectConfiguration& project = {}) {
  std::vector<torch::Tensor> got;
  int world = 1;
  bool main = true;
  {
    Accelerator acc(
        AcceleratorOptions().config(cpu_config(MixedPrecision::No, accumulation)).project_config(project));
    world = acc.num_processes();
    main = acc.is_main_process();
    check_device(acc);
    got = loop(&acc, world);
  }
  const auto want = loop(nullptr, world);
  compare(what, got, want, main);
}

// A GAN-shaped loop: the discriminator D steps on real and (detached) generated rows, then the generator G
// steps through D, so D also receives gradients during G's backward. Prepared in a scrambled order. Each
// model's gradients are clipped on their own (Accelerate's clip_grad_norm_(model.parameters(), max)), with a
// bound the norms exceed; the norms are compared too.
void two_models() {
  against_one_process("two models, two optimizers, each clipped", [](Accelerator* acc, int world) {
    torch::manual_seed(0);
    auto G = torch::nn::Linear(6, 6);
    Mlp D;
    auto opt_g = sgd(G->parameters());
    auto opt_d = sgd(D->parameters());
    if (acc != nullptr) acc->prepare(*opt_g, G, D, *opt_d);
    Regression data(kBatch * world * kSteps);
    std::vector<double> norms;
    const auto clip = [&](const std::vector<torch::Tensor>& parameters, double max_norm) {
      norms.push_back(acc != nullptr ? acc->clip_grad_norm_(parameters, max_norm)
                                     : torch::nn::utils::clip_grad_norm_(parameters, max_norm));
    };
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
      opt_d->zero_grad();
      backward(acc, torch::mse_loss(D(x), y) + D(G(x).detach()).pow(2).mean());
      clip(D->parameters(), 0.2);
      opt_d->step();
      opt_g->zero_grad();
      backward(acc, (D(G(x)) - y).pow(2).mean());
      clip(G->parameters(), 0.05);
      opt_g->step();
    }
    bool clipped_d = false, clipped_g = false;  // norms alternate D, G
    for (std::size_t k = 0; k + 1 < norms.size(); k += 2) {
      clipped_d = clipped_d || norms[k] > 0.2;
      clipped_g = clipped_g || norms[k + 1] > 0.05;
    }
    CHECK_MSG(clipped_d && clipped_g,
              "no gradient norm of a model exceeded its bound: clipping went untested");
    std::vector<torch::Tensor> out{torch::tensor(norms, torch::kDouble).to(torch::kFloat)};
    for (auto& t : weights(acc, G))
      out.push_back(t);
    for (auto& t : weights(acc, D))
      out.push_back(t);
    return out;
  });
}

// The GAN of two_models with gradient_accumulation_steps 2 (one accumulate() scope per batch): D receives
// gradients during G's backward on micro-steps too. Accelerate's semantics, on every row: on a micro-step
// that does not synchronise, optimizer.step() and zero_grad() do nothing, so every gradient of the cycle adds
// up (D's includes G's backward of the first batch); on the synchronising batch both zero_grad() calls are
// real, so G steps on its last batch's gradients alone (Accelerate's known trait for GANs). The reference is
// one process stepping exactly so on the whole batch.
void gan_accumulation() {
  against_one_process(
      "GAN with gradient accumulation 2 (gradients crossing models on micro-steps)",
      [](Accelerator* acc, int world) {
        torch::manual_seed(5);
        auto G = torch::nn::Linear(6, 6);
        Mlp D;
        auto opt_g = sgd(G->parameters());
        auto opt_d = sgd(D->parameters());
        if (acc != nullptr) acc->prepare(G, D, *opt_g, *opt_d);
        Regression data(kBatch * world * kSteps * 2);
        const auto loss_d = [&](const torch::Tensor& x, const torch::Tensor& y) {
          return (torch::mse_loss(D(x), y) + D(G(x).detach()).pow(2).mean()) / (acc != nullptr ? 1 : 2);
        };
        const auto loss_g = [&](const torch::Tensor& x, const torch::Tensor& y) {
          return (D(G(x)) - y).pow(2).mean() / (acc != nullptr ? 1 : 2);
        };
        for (std::int64_t s = 0; s < 2 * kSteps; ++s) {
          const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
          if (acc != nullptr) {
            auto batch = acc->accumulate(G, D);
            opt_d->zero_grad();
            acc->backward(loss_d(x, y));
            opt_d->step();
            opt_g->zero_grad();
            acc->backward(loss_g(x, y));
            opt_g->step();
            continue;
          }
          if (s % 2 == 0) {  // the first micro-step: everything adds up, nothing steps
            opt_d->zero_grad();
            opt_g->zero_grad();
            loss_d(x, y).backward();
            loss_g(x, y).backward();
            continue;
          }
          loss_d(x, y).backward();
          opt_d->step();
          opt_g->zero_grad();
          loss_g(x, y).backward();
          opt_g->step();
        }
        auto out = weights(acc, D);
        for (auto& t : weights(acc, G))
          out.push_back(t);
        return out;
      },
      /*accumulation=*/2);
}

// The plain LibTorch line that ends a program, on every backend: after accelerator.free_memory() the model is
// a whole, current LibTorch module again (ZeRO-3 / FULL_SHARD gather it), so torch::save(model) writes what
// one process trained, on every rank; and a second prepare() of new objects trains again.
void free_memory() {
  against_one_process("free_memory(), then torch::save(model) and load", [](Accelerator* acc, int world) {
    torch::manual_seed(6);
    Mlp model;
    auto opt = sgd(model->parameters());
    if (acc != nullptr) acc->prepare(model, *opt);
    Regression data(kBatch * world * kSteps);
    for (std::int64_t s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      backward(acc, torch::mse_loss(model(rows(data.x, s, acc, world)), rows(data.y, s, acc, world)));
      opt->step();
    }
    if (acc != nullptr) acc->free_memory();
    std::stringstream bytes;
    torch::save(model, bytes);
    Mlp loaded;
    torch::load(loaded, bytes);
    if (acc != nullptr) {
      Mlp again;
      auto opt2 = sgd(again->parameters());
      acc->prepare(again, *opt2);
      opt2->zero_grad();
      acc->backward(torch::mse_loss(again(rows(data.x, 0, acc, world)), rows(data.y, 0, acc, world)));
      opt2->step();
      CHECK(acc->completed_steps() == 1);  // the counters started again
    }
    return test::snapshot(*loaded);
  });
}

// A loop ported from DDP that kept `loss.backward()`: on several ranks it stops at that line with an error
// naming accelerator.backward(loss), before any engine saw a gradient; accelerator.backward still trains.
void plain_backward() {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int world = acc.num_processes();
  torch::manual_seed(3);
  Mlp model;
  auto opt = sgd(model->parameters());
  acc.prepare(model, *opt);
  Regression data(kBatch * world);
  const auto x = rows(data.x, 0, &acc, world), y = rows(data.y, 0, &acc, world);
  std::string error;
  try {
    torch::mse_loss(model(x), y).backward();
  } catch (const UsageError& e) {
    error = e.what();
  }
  CHECK_MSG(error.find("accelerator.backward(loss)") != std::string::npos &&
                error.find("'" + acc.backend_name() + "'") != std::string::npos,
            "a plain loss.backward() on " << world << " ranks: want a UsageError naming "
                                          << "accelerator.backward(loss) and the backend, got '" << error
                                          << "'");
  opt->zero_grad();
  acc.backward(torch::mse_loss(model(x), y));  // the accelerator's own backward is let through
  opt->step();
  if (acc.is_main_process()) std::cout << backend_variant << " plain backward: refused" << std::endl;
}

// LibTorch's own torch::nn::utils::clip_grad_norm_ on the prepared model's parameters, kept from a DDP loop:
// where the gradients are in .grad after a synchronising backward (one process, DDP, NO_SHARD) it clips them
// and the run equals one process clipping the same way; where a sharded backend keeps them in the
// optimizer's shards it throws at once, naming accelerator.clip_grad_norm_ (it found no gradient and clipped
// nothing, silently: issue 29, item 8), and the accelerator's clip then gives one process's numbers.
void libtorch_clip() {
  double largest = 0.0;
  against_one_process("LibTorch's clip_grad_norm_", [&](Accelerator* acc, int world) {
    torch::manual_seed(4);
    Mlp model;
    auto opt = sgd(model->parameters());
    const bool sharded =
        acc != nullptr && (acc->prepare(model, *opt), acc->capabilities().shards_optimizer_state);
    Regression data(kBatch * world * kSteps);
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
      opt->zero_grad();
      backward(acc, torch::mse_loss(model(x), y));
      if (sharded) {
        std::string error;
        try {
          torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05);
        } catch (const std::exception& e) {
          error = e.what();
        }
        CHECK_MSG(error.find("Clip with accelerator.clip_grad_norm_(max)") != std::string::npos &&
                      error.find("would find no gradient here and clip nothing") != std::string::npos,
                  "LibTorch's clip_grad_norm_ on "
                      << acc->backend_name() << ": want an error naming accelerator.clip_grad_norm_, got '"
                      << error.substr(0, 300) << "'");
        acc->clip_grad_norm_(model->parameters(), 0.05);
      } else {
        const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05);
        if (acc == nullptr) largest = std::max(largest, norm);
      }
      opt->step();
    }
    return weights(acc, model);
  });
  CHECK_MSG(largest > 0.05,
            "the gradient norms (at most " << largest << ") never exceed the bound: nothing clipped");
}

// Distillation: a frozen teacher without optimizer prepared beside the student.
void frozen_teacher() {
  against_one_process("frozen teacher", [](Accelerator* acc, int world) {
    torch::manual_seed(1);
    Mlp teacher, student;
    for (auto& p : teacher->parameters())
      p.set_requires_grad(false);
    auto opt = sgd(student->parameters());
    if (acc != nullptr) acc->prepare(teacher, student, *opt);
    Regression data(kBatch * world * kSteps);
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
      opt->zero_grad();
      torch::Tensor soft;
      {
        torch::NoGradGuard no_grad;
        soft = teacher(x);
      }
      const auto out = student(x);
      backward(acc, torch::mse_loss(out, y) + 0.5 * torch::mse_loss(out, soft));
      opt->step();
    }
    auto out = weights(acc, student);
    for (auto& t : weights(acc, teacher))
      out.push_back(t);  // the teacher is unchanged and whole
    return out;
  });
}

// kSteps optimizer steps, each over two half batches: `half(h, x, y)` runs the backward of half h.
void by_halves(Accelerator* acc, int world, torch::optim::Optimizer& opt,
               const std::function<void(int, const torch::Tensor&, const torch::Tensor&)>& half) {
  Regression data(kBatch * world * kSteps);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
    const auto n = x.size(0) / 2;
    opt.zero_grad();
    for (int h = 0; h < 2; ++h)
      half(h, x.slice(0, h * n, (h + 1) * n), y.slice(0, h * n, (h + 1) * n));
    opt.step();
  }
}

// Accumulation by hand with gradient_accumulation_steps 1: two backward calls (half batches), one step.
void hand_accumulation() {
  against_one_process("hand-written accumulation (two backward calls, one step)",
                      [](Accelerator* acc, int world) {
                        torch::manual_seed(2);
                        Mlp model;
                        auto opt = sgd(model->parameters());
                        if (acc != nullptr) acc->prepare(model, *opt);
                        by_halves(acc, world, *opt, [&](int, const torch::Tensor& x, const torch::Tensor& y) {
                          backward(acc, torch::mse_loss(model(x), y) / 2);
                        });
                        return weights(acc, model);
                      });
}

// LoRA (accel::peft::get_peft_model) on a frozen Mlp whose forward code knows nothing of it: only the
// adapters train, sharded and reduced like any parameter; N ranks x B equal one process x N*B, and the frozen
// base weights end bitwise as they started.
void lora() {
  std::vector<torch::Tensor> initial;
  against_one_process("LoRA adapters on a frozen base", [&](Accelerator* acc, int world) {
    torch::manual_seed(11);
    Mlp model;
    peft::LoraConfig config;
    config.r = 4;
    config.lora_alpha = 8;
    config.target_modules = {"fc1", "fc2"};
    auto adapters = peft::get_peft_model(model, config);
    initial = test::snapshot(*model);
    auto opt = sgd(model->parameters());
    if (acc != nullptr) acc->prepare(model, *opt);
    by_halves(acc, world, *opt, [&](int, const torch::Tensor& x, const torch::Tensor& y) {
      backward(acc, torch::mse_loss(model(x), y) / 2);
    });
    if (acc == nullptr) return test::snapshot(*model);
    // By name, in the model's order: zero3 orders its state dict by unit (each adapter is a unit of its own).
    const auto names = model->named_parameters().keys();
    std::map<std::string, torch::Tensor> state;
    for (const auto& [name, t] : acc->get_state_dict(model))
      state[name] = t.cpu().clone();
    std::vector<torch::Tensor> w;
    for (std::size_t k = 0; k < names.size(); ++k) {
      w.push_back(state.at(names[k]));
      const bool adapter = names[k].find("lora_") != std::string::npos;
      const bool same = torch::equal(w.back(), initial[k]);
      CHECK_MSG(adapter != same, backend_variant << ": " << names[k]
                                                 << (adapter ? " did not train" : " changed though frozen"));
    }
    return w;
  });
}

// Accumulation by hand with Accelerate's no_sync: the first half batch under `no_sync(model)` (no
// communication), the second synchronised; one step. The same numbers as one process with the whole batch.
void no_sync() {
  against_one_process("no_sync for one backward, then a synchronised one", [](Accelerator* acc, int world) {
    torch::manual_seed(7);
    Mlp model;
    auto opt = sgd(model->parameters());
    if (acc != nullptr) acc->prepare(model, *opt);
    by_halves(acc, world, *opt, [&](int h, const torch::Tensor& x, const torch::Tensor& y) {
      if (h == 1) {
        backward(acc, torch::mse_loss(model(x), y) / 2);  // synchronised
        return;
      }
      std::optional<Accelerator::NoSync> local;
      if (acc != nullptr) local.emplace(acc->no_sync(model));
      const auto loss = torch::mse_loss(model(x), y) / 2;
      if (acc != nullptr) acc->communicator().reset_counters();
      backward(acc, loss);
      // The micro-step contract (backend.hpp): no gradient is reduced unless the backend says it reduces on
      // micro-steps (ZeRO-3); engines that shard parameters still gather them for backward, nothing else
      // moves.
      if (acc != nullptr) {
        const auto caps = acc->capabilities();
        const auto& comm = acc->communicator();
        const auto reduced = comm.bytes(Collective::AllReduce).wire +
                             comm.bytes(Collective::ReduceScatter).wire + comm.bytes(Collective::Reduce).wire;
        const auto gathered = comm.bytes(Collective::AllGather).wire;
        static bool printed = false;  // one line per run, not per step
        const bool main = acc->is_main_process() && !printed;
        printed = true;
        if (caps.communicates_on_micro_steps) {
          if (main)
            std::cout << backend_variant << " no_sync: bytes not checked (excluded by trait "
                      << "communicates_on_micro_steps: gradients are reduced on every backward)" << std::endl;
        } else {
          CHECK_MSG(reduced == 0, "a backward under no_sync reduced gradients: " << reduced << " bytes");
          if (caps.shards_parameters) {
            CHECK_MSG(comm.total_wire_bytes() == gathered, "a backward under no_sync moved "
                                                               << comm.total_wire_bytes() - gathered
                                                               << " bytes besides the parameter all-gathers");
            if (main)
              std::cout << backend_variant << " no_sync: " << reduced << " gradient bytes, " << gathered
                        << " bytes of parameter all-gathers (trait shards_parameters)" << std::endl;
          } else {
            CHECK_MSG(comm.total_wire_bytes() == 0,
                      "a backward under no_sync moved " << comm.total_wire_bytes() << " bytes");
          }
        }
      }
    });
    return weights(acc, model);
  });
}

// Hand-written accumulation under fp16 loss scaling: the gradient of the first backward is unscaled after it
// and must be neither lost nor unscaled twice. fp16 rounds, so the check is on the weight updates relative to
// their size (a lost half batch moves them by tens of percent; rounding by well under one).
void fp16_hand_accumulation() {
  auto loop = [](Accelerator* acc, int world) {
    torch::manual_seed(8);
    Mlp model;
    const auto initial = test::snapshot(*model);
    auto opt = sgd(model->parameters());
    if (acc != nullptr) {
      acc->prepare(model, *opt);
      // A scale that does not overflow at the first steps, so no step is skipped and both runs take 4.
      acc->scaler()->load_state_dict(
          {{"scale", torch::tensor({1024.0f})}, {"growth_tracker", torch::tensor({0}, torch::kInt32)}});
    }
    by_halves(acc, world, *opt, [&](int h, const torch::Tensor& x, const torch::Tensor& y) {
      backward(acc, torch::mse_loss(model(x).to(torch::kFloat32), y) / 2);
      if (h == 1) CHECK_MSG(acc == nullptr || !acc->optimizer_step_was_skipped(), "fp16 skipped a step");
    });
    auto w = weights(acc, model);
    for (std::size_t k = 0; k < w.size() && k < initial.size(); ++k)
      w[k] = w[k] - initial[k];
    return w;
  };
  std::vector<torch::Tensor> got;
  int world = 1;
  bool main = true;
  {
    Accelerator acc(AcceleratorOptions().config(cpu_config(MixedPrecision::Fp16)));
    world = acc.num_processes();
    main = acc.is_main_process();
    check_device(acc);
    got = loop(&acc, world);
  }
  const auto want = loop(nullptr, world);
  CHECK_MSG(got.size() == want.size(), "fp16: " << got.size() << " tensors, want " << want.size());
  double worst = 0;
  for (std::size_t k = 0; k < std::min(got.size(), want.size()); ++k) {
    const double scale = want[k].abs().max().item<double>();
    const double rel = (got[k] - want[k]).abs().max().item<double>() / std::max(scale, 1e-12);
    worst = std::max(worst, rel);
    CHECK_MSG(rel < 0.05, "fp16 hand-written accumulation: the update of tensor "
                              << k << " differs from one fp32 process by " << rel * 100
                              << "% of its size (tolerance 5%): a gradient was lost or unscaled twice");
  }
  if (main)
    std::cout << backend_variant << " fp16 hand-written accumulation: updates within " << worst * 100
              << "% of one fp32 process" << std::endl;
}

// gradient_accumulation_steps 2 with two models, each with its own loss and backward per batch: every
// optimizer steps once per two batches (Accumulate scopes mark the batches; no prepared loader).
void two_backward_accumulation() {
  constexpr int kAccumulation = 2;
  against_one_process(
      "two backward calls per batch, accumulation 2",
      [](Accelerator* acc, int world) {
        torch::manual_seed(3);
        Mlp a, b;
        auto opt_a = sgd(a->parameters());
        auto opt_b = sgd(b->parameters());
        if (acc != nullptr) acc->prepare(a, b, *opt_a, *opt_b);
        Regression data(kBatch * world * kSteps * kAccumulation);
        int steps_a = 0;
        for (std::int64_t s = 0; s < kSteps * kAccumulation; ++s) {
          std::optional<Accelerator::Accumulate> batch;
          if (acc != nullptr) batch.emplace(acc->accumulate(a, b));
          const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
          // The reference accumulates by hand: loss / 2 and a step every second batch.
          const double scale = acc != nullptr ? 1.0 : 1.0 / kAccumulation;
          const bool step = acc != nullptr ? true : s % kAccumulation == kAccumulation - 1;
          backward(acc, torch::mse_loss(a(x), y) * scale);
          if (step) {
            if (acc == nullptr || acc->sync_gradients()) ++steps_a;
            opt_a->step();
            opt_a->zero_grad();
          }
          backward(acc, torch::mse_loss(b(x), y.neg()) * scale);
          if (step) {
            opt_b->step();
            opt_b->zero_grad();
          }
        }
        CHECK_MSG(steps_a == kSteps, "optimizer A stepped " << steps_a << " times, want " << kSteps);
        auto out = weights(acc, a);
        for (auto& t : weights(acc, b))
          out.push_back(t);
        return out;
      },
      kAccumulation);
}

// Batches made by the loop itself (no prepared loader, no sync_parameters()), then a forward after the last
// step: the outputs must be the updated model's.
void own_batches() {
  against_one_process("batches not from a prepared loader", [](Accelerator* acc, int world) {
    torch::manual_seed(4);
    Mlp model;
    auto opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
    if (acc != nullptr) acc->prepare(model, *opt);
    Regression data(kBatch * world * (kSteps + 1));
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
      opt->zero_grad();
      backward(acc, torch::mse_loss(model(x), y));
      opt->step();
    }
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      // The same rows on every rank.
      out = model(data.x.slice(0, 0, 8).to(acc != nullptr ? acc->device() : torch::kCPU))
                .detach()
                .cpu()
                .clone();
    }
    auto w = weights(acc, model);
    w.push_back(out);
    return w;
  });
}

// The fused optimizer on every row: N ranks stepping accel::optim::AdamW (on the backend's flat shards where
// it shards) end where one process with LibTorch's AdamW ends.
void fused_adamw() {
  against_one_process(
      "accel::optim::AdamW (fused) vs one process with torch::optim::AdamW", [](Accelerator* acc, int world) {
        torch::manual_seed(10);
        Mlp model;
        const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true);
        std::unique_ptr<torch::optim::Optimizer> opt;
        if (acc != nullptr) {
          opt = std::make_unique<accel::optim::AdamW>(model->parameters(), options);
          acc->prepare(model, *opt);
        } else {
          opt = std::make_unique<torch::optim::AdamW>(model->parameters(), options);
        }
        Regression data(kBatch * world * kSteps);
        for (std::int64_t s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          backward(acc, torch::mse_loss(model(rows(data.x, s, acc, world)), rows(data.y, s, acc, world)));
          opt->step();
        }
        return weights(acc, model);
      });
}

// BatchNorm statistics: identical on every rank after every optimizer step (rank 0's, as PyTorch DDP's
// broadcast_buffers); with `ddp_broadcast_buffers: false` on DDP they drift apart (the check can fail).
void buffers() {
  for (const bool broadcast : {true, false}) {
    if (!broadcast && backend_variant != "ddp") {
      if (ProcessState::from_environment().rank == 0)
        std::cout << backend_variant
                  << " buffers (broadcast false): not run (ddp_broadcast_buffers is DDP's key)" << std::endl;
      continue;
    }
    auto config = cpu_config();
    config.ddp_broadcast_buffers = broadcast;
    Accelerator acc(AcceleratorOptions().config(config));
    const int world = acc.num_processes();
    torch::manual_seed(5);
    torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                                torch::nn::Linear(16, 1));
    auto opt = sgd(model->parameters());
    acc.prepare(model, *opt);
    Regression data(kBatch * world * kSteps);
    bool equal_everywhere = true;
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto x = rows(data.x, s, &acc, world), y = rows(data.y, s, &acc, world);
      opt->zero_grad();
      acc.backward(torch::mse_loss(model->forward(x), y));
      opt->step();
      for (const auto& b : model->named_buffers()) {
        const auto all = acc.gather(b.value().to(torch::kFloat64).reshape({1, -1}));
        for (int r = 1; r < world; ++r)
          equal_everywhere = equal_everywhere && torch::equal(all[r], all[0]);
      }
    }
    if (broadcast) {
      CHECK_MSG(equal_everywhere, "buffers differ across ranks after an optimizer step");
    } else if (world > 1) {
      CHECK_MSG(!equal_everywhere, "with ddp_broadcast_buffers: false the ranks' statistics must drift");
    }
    if (acc.is_main_process())
      std::cout << backend_variant << " buffers (broadcast " << broadcast << "): equal " << equal_everywhere
                << std::endl;
  }
}

// SyncBatchNorm: N ranks with batch B normalise with the global batch's statistics, so the weights and the
// running statistics equal one process with BatchNorm1d on N*B (per-rank BatchNorm does not: see `buffers`).
// `checkpointed`: the normalisation layer itself wrapped in accel::Checkpointed (its statistics then update
// in the forward and again in the recomputation, in both runs), which prepare must still connect.
void sync_batchnorm_run(bool checkpointed) {
  const std::string what = checkpointed
                               ? "SyncBatchNorm inside accel::Checkpointed (weights and running statistics)"
                               : "SyncBatchNorm (weights and running statistics)";
  against_one_process(what, [checkpointed](Accelerator* acc, int world) {
    torch::manual_seed(9);
    torch::nn::Sequential model;
    model->push_back(torch::nn::Linear(6, 16));
    if (acc != nullptr) {
      if (checkpointed) {
        model->push_back(accel::Checkpointed(accel::nn::SyncBatchNorm(16)));
      } else {
        model->push_back(accel::nn::SyncBatchNorm(16));
      }
    } else if (checkpointed) {
      model->push_back(accel::Checkpointed(torch::nn::BatchNorm1d(16)));
    } else {
      model->push_back(torch::nn::BatchNorm1d(16));
    }
    model->push_back(torch::nn::ReLU());
    model->push_back(torch::nn::Linear(16, 1));
    auto opt = sgd(model->parameters());
    if (acc != nullptr) acc->prepare(model, *opt);
    Regression data(kBatch * world * kSteps);
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto x = rows(data.x, s, acc, world), y = rows(data.y, s, acc, world);
      opt->zero_grad();
      backward(acc, torch::mse_loss(model->forward(x), y));
      opt->step();
    }
    std::vector<torch::Tensor> out;
    if (acc != nullptr) {
      for (const auto& [name, t] : acc->get_state_dict(model))
        out.push_back(t.to(torch::kCPU, torch::kFloat64).clone());
    } else {
      for (const auto& p : model->named_parameters())
        out.push_back(p.value().to(torch::kFloat64).clone());
      for (const auto& b : model->named_buffers())
        out.push_back(b.value().to(torch::kFloat64).clone());
    }
    return out;
  });
}

void sync_batchnorm() {
  sync_batchnorm_run(false);
  sync_batchnorm_run(true);
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// torch::save(model), the way users save: the full, current weights, or an error naming the call to use;
// never an empty or stale file.
void torch_save() {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("accel-torch-save-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  torch::manual_seed(6);
  Mlp model;
  std::vector<torch::Tensor> expected;
  int process_index_of_this_run = 0;
  {
    Accelerator acc(AcceleratorOptions().config(cpu_config()));
    const int world = acc.num_processes();
    process_index_of_this_run = acc.process_index();
    auto opt = sgd(model->parameters());
    acc.prepare(model, *opt);
    Regression data(kBatch * world * kSteps);
    for (std::int64_t s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      acc.backward(torch::mse_loss(model(rows(data.x, s, &acc, world)), rows(data.y, s, &acc, world)));
      opt->step();
    }
    const auto caps = acc.capabilities();
    const auto file = (dir / ("inside_" + std::to_string(acc.process_index()) + ".pt")).string();
    const auto error = what_of([&] { torch::save(model, file); });
    if (caps.shards_parameters) {
      CHECK_MSG(error.find("get_state_dict") != std::string::npos,
                "torch::save of a parameter-sharded model must name get_state_dict, got: " << error);
    } else if (caps.shards_optimizer_state) {
      CHECK_MSG(error.find("wait_for_everyone") != std::string::npos,
                "torch::save right after optimizer.step() must name wait_for_everyone, got: " << error);
    } else {
      CHECK_MSG(error.empty(), "torch::save failed: " << error);
    }
    acc.wait_for_everyone();  // Accelerate's idiom before saving on the main process
    expected = weights(&acc, model);
    if (!caps.shards_parameters) {
      const auto again = what_of([&] { torch::save(model, file); });
      CHECK_MSG(again.empty(), "torch::save after wait_for_everyone failed: " << again);
      Mlp fresh;
      torch::load(fresh, file);
      compare("torch::save after wait_for_everyone", test::snapshot(*fresh), expected, false);
    }
  }
  // After the accelerator is gone the model is whole and current on every backend.
  const auto file = (dir / "after.pt").string();
  const auto error = what_of([&] { torch::save(model, file); });
  CHECK_MSG(error.empty(), "torch::save after the accelerator was destroyed failed: " << error);
  Mlp fresh;
  if (error.empty()) torch::load(fresh, file);
  compare("torch::save of the trained model, loaded into a fresh one", test::snapshot(*fresh), expected,
          true);
  // For a fresh process (scenario load_saved): the file and the weights it must hold, from rank 0.
  if (const char* out = std::getenv("ACCEL_TEST_SAVE_DIR");
      out != nullptr && process_index_of_this_run == 0) {
    fs::copy_file(file, fs::path(out) / "model.pt", fs::copy_options::overwrite_existing);
    torch::save(expected, (fs::path(out) / "expected.pt").string());
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// A fresh process loads what torch_save wrote (ACCEL_TEST_SAVE_DIR): the weights the training produced.
void load_saved() {
  const std::string dir = save_dir();
  Mlp fresh;
  torch::load(fresh, (std::filesystem::path(dir) / "model.pt").string());
  std::vector<torch::Tensor> expected;
  torch::load(expected, (std::filesystem::path(dir) / "expected.pt").string());
  compare("torch::save of a " + backend_variant + "-trained model, loaded by a fresh process",
          test::snapshot(*fresh), expected, true);
}

// Four Linear(16, 16) layers (1088 bytes each), so sharding engines gather four units.
torch::nn::Sequential export_model() {
  return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 16));
}

// Float tensors to a safetensors file through the library's own writer, for Python and later processes.
void write_reference(const NamedTensors& state, const std::string& path) {
  std::vector<safetensors::TensorView> views;
  for (const auto& [name, t] : state)
    views.push_back({name, safetensors::DType::F32, t.sizes().vec(), t.data_ptr(),
                     static_cast<std::size_t>(t.numel()) * t.element_size()});
  safetensors::write_file(path, views);
}

// What check_hf_export.py checks, with the library's own safetensors reader (whose files Python reads and
// writes: the "safetensors:" tests): the index's shard names and weight_map, metadata format=pt, each shard
// within max_shard_size, total_size, and every tensor bitwise equal to `reference`. Returns "" or the first
// difference.
std::string check_export(const std::string& dir, const NamedTensors& reference, std::uint64_t max_shard) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> where;  // tensor -> file that holds it
  std::vector<safetensors::File> files;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    const auto index = nlohmann::json::parse(in);
    std::set<std::string> names;
    for (const auto& [tensor, file] : index.at("weight_map").items())
      names.insert(file.get<std::string>());
    const std::size_t n = names.size();
    std::size_t k = 1;
    for (const auto& name : names) {
      char want[64];
      std::snprintf(want, sizeof want, "model-%05zu-of-%05zu.safetensors", k++, n);
      if (name != want) return "shard " + name + ", want " + want;
    }
    std::uint64_t total = 0;
    for (const auto& name : names) {
      files.push_back(safetensors::File::open((fs::path(dir) / name).string()));
      const auto& shard = files.back();
      const auto format = shard.metadata().find("format");
      if (format == shard.metadata().end() || format->second != "pt")
        return name + ": metadata format is not 'pt' (transformers refuses such files)";
      std::uint64_t size = 0;
      for (const auto& tensor : shard.names()) {
        const auto listed = index["weight_map"].find(tensor);
        if (listed == index["weight_map"].end() || *listed != name)
          return tensor + " is in " + name + " but the index does not say so";
        where[tensor] = name;
        size += shard.info(tensor).nbytes;
      }
      if (size > max_shard && shard.names().size() > 1)
        return name + " holds " + std::to_string(size) + " bytes, more than max_shard_size";
      total += size;
    }
    if (index["weight_map"].size() != where.size()) return "the index lists tensors that no shard holds";
    if (index.at("metadata").at("total_size").get<std::uint64_t>() != total)
      return "metadata.total_size differs from the shards' " + std::to_string(total) + " bytes";
  } else {
    files.push_back(safetensors::File::open((fs::path(dir) / "model.safetensors").string()));
    for (const auto& tensor : files.back().names())
      where[tensor] = "model.safetensors";
  }
  if (where.size() != reference.size())
    return std::to_string(where.size()) + " tensors, want " + std::to_string(reference.size());
  for (const auto& [name, t] : reference) {
    const auto it = where.find(name);
    if (it == where.end()) return "no tensor " + name;
    for (const auto& file : files) {
      if (!file.contains(name)) continue;
      const auto& info = file.info(name);
      const auto want = t.contiguous();
      if (info.dtype != safetensors::DType::F32 || info.shape != want.sizes().vec() ||
          info.nbytes != static_cast<std::size_t>(want.numel()) * want.element_size() ||
          std::memcmp(file.data(name), want.data_ptr(), info.nbytes) != 0)
        return name + " differs from the reference";
    }
  }
  return "";
}

// Whether hf_export also runs Python's check (the scenario hf_export_python): the export's bytes come from
// one writer whatever the backend, so Python reads them on one row (local) and the library's reader checks
// the same things on every row, without starting Python (~5 s) on each.
bool python_export_check = false;

// Hugging Face export: save_model writes shards plus an index (or one file) that the library's reader (and,
// as hf_export_python, Python's safetensors and a transformers-style sharded loader) read back bitwise;
// load_model restores them into a fresh prepared model; get_state_dict(model, MainProcess) equals the
// all-ranks state on the main process and is empty elsewhere; get_state_dict(model) is a copy that later
// steps leave alone. The measured peak of tensor bytes held stays below one shard plus one unit on the main
// process, and below the whole model on the other ranks where parameters are sharded.
void hf_export() {
  namespace fs = std::filesystem;
  torch::manual_seed(8);
  auto model = export_model();
  torch::manual_seed(9);
  auto fresh = export_model();
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int world = acc.num_processes();
  const bool main = acc.is_main_process();
  auto opt = sgd(model->parameters());
  acc.prepare(model, *opt, fresh);
  const auto x = torch::randn({kBatch * world * kSteps, 16});
  for (std::int64_t s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    acc.backward(model->forward(rows(x, s, &acc, world)).pow(2).mean());
    opt->step();
  }
  {
    // get_state_dict returns copies: a snapshot kept while training goes on (the best model so far) keeps
    // the values it had.
    const NamedTensors snapshot = acc.get_state_dict(model);
    std::vector<torch::Tensor> kept;
    for (const auto& [name, t] : snapshot)
      kept.push_back(t.clone());
    opt->zero_grad();
    acc.backward(model->forward(rows(x, 0, &acc, world)).pow(2).mean());
    opt->step();
    const NamedTensors now = acc.get_state_dict(model);
    bool trained = false;
    for (std::size_t k = 0; k < snapshot.size(); ++k) {
      CHECK_MSG(torch::equal(snapshot[k].second, kept[k]),
                "get_state_dict gave a view of '" << snapshot[k].first
                                                  << "', not a copy: the next optimizer step changed it");
      trained = trained || !torch::equal(now[k].second, kept[k]);
    }
    CHECK_MSG(trained, "the optimizer step changed no parameter");
  }
  const NamedTensors reference = acc.get_state_dict(model);
  std::uint64_t total = 0;
  for (const auto& [name, t] : reference)
    total += static_cast<std::uint64_t>(t.numel()) * t.element_size();

  // The main-process-only state dict.
  const NamedTensors on_main = acc.get_state_dict(model, StateDictOn::MainProcess);
  if (main) {
    CHECK_MSG(on_main.size() == reference.size(),
              "main-process state dict has " << on_main.size() << " tensors, want " << reference.size());
    for (std::size_t k = 0; k < std::min(on_main.size(), reference.size()); ++k) {
      CHECK_MSG(
          on_main[k].first == reference[k].first && torch::equal(on_main[k].second, reference[k].second),
          "main-process state dict differs at " << reference[k].first);
    }
  } else {
    CHECK_MSG(on_main.empty(),
              "other ranks must get an empty main-process state dict, got " << on_main.size());
  }

  // One directory for every rank (the main process names it).
  const std::string dir = acc.communicator().exchange(
      (fs::temp_directory_path() / ("accel-hf-export-" + std::to_string(::getpid()))).string())[0];
  const std::uint64_t max_shard = 1500;  // each Linear(16, 16) holds 1088 bytes: four shards
  // An earlier single-file export in the directory is replaced by the shards.
  const ModelExport single = acc.save_model(model, dir);
  if (main) {
    CHECK_MSG(single.files == std::vector<std::string>{"model.safetensors"}, "one file expected");
  }
  const ModelExport report = acc.save_model(model, dir, std::to_string(max_shard));
  const std::uint64_t unit = 1088;
  if (main) {
    CHECK_MSG(report.files.size() == 5 && report.files.back() == "model.safetensors.index.json" &&
                  report.files.front() == "model-00001-of-00004.safetensors",
              "want 4 shards and the index, got " << report.files.size() << " files");
    CHECK_MSG(!fs::exists(fs::path(dir) / "model.safetensors"), "the earlier single file must be gone");
    CHECK_MSG(report.total_bytes == total, "total_size " << report.total_bytes << ", want " << total);
    CHECK_MSG(report.peak_held_bytes <= max_shard + (acc.capabilities().shards_parameters ? unit : total),
              "the main process held " << report.peak_held_bytes << " bytes at once");
  } else {
    CHECK_MSG(report.files.empty(), "only the main process writes");
    if (acc.capabilities().shards_parameters) {
      CHECK_MSG(report.peak_held_bytes <= unit && report.peak_held_bytes < total,
                "rank " << acc.process_index() << " held " << report.peak_held_bytes
                        << " bytes at once; one unit is " << unit);
    }
  }
  std::cout << backend_variant << " hf_export: rank " << acc.process_index() << " peak "
            << report.peak_held_bytes << " bytes of a " << total << "-byte model (max_shard_size "
            << max_shard << ")" << std::endl;

  // The library's reader, then (hf_export_python) Python's safetensors and a transformers-style sharded
  // loader read the export back, bitwise.
  if (main) {
    const std::string problem = check_export(dir, reference, max_shard);
    CHECK_MSG(problem.empty(), "the export in " << dir << ": " << problem);
    if (problem.empty())
      std::cout << backend_variant << " hf_export: " << reference.size()
                << " tensors read back bitwise by the library's reader" << std::endl;
  }
  if (main && python_export_check) {
    const std::string reference_file = dir + ".reference.safetensors";
    write_reference(reference, reference_file);
    const std::string python = accel::test::python();
    CHECK_MSG(!python.empty(), "ACCEL_PYTHON is not set: configure with -DACCEL_PYTHON=<venv python>");
    if (!python.empty()) {
      const std::string command = python + " " + accel::test::tests_dir() + "/python/check_hf_export.py " +
                                  dir + " " + reference_file + " " + std::to_string(max_shard);
      CHECK_MSG(std::system(command.c_str()) == 0, "the Python check failed: " << command);
    }
    fs::remove(reference_file);
  }

  // load_model into a fresh prepared model gives the same weights.
  acc.load_model(fresh, dir);
  const NamedTensors loaded = acc.get_state_dict(fresh);
  CHECK_MSG(loaded.size() == reference.size(), "load_model: " << loaded.size() << " tensors");
  for (std::size_t k = 0; k < std::min(loaded.size(), reference.size()); ++k) {
    CHECK_MSG(torch::equal(loaded[k].second, reference[k].second),
              "load_model: " << reference[k].first << " differs from the exported weights");
  }
  if (main)
    std::cout << backend_variant << " hf_export: load_model restores the exported weights" << std::endl;
  acc.wait_for_everyone();
  // For another world size and backend (scenario hf_import): the export and the weights it holds.
  if (const char* out = std::getenv("ACCEL_TEST_SAVE_DIR"); out != nullptr && main) {
    fs::copy(dir, fs::path(out) / "export",
             fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    write_reference(reference, (fs::path(out) / "reference.safetensors").string());
  }
  if (main) fs::remove_all(dir);
}

// Loads what hf_export wrote (ACCEL_TEST_SAVE_DIR) into a fresh model prepared on this row and world size.
void hf_import() {
  namespace fs = std::filesystem;
  const std::string out = save_dir();
  torch::manual_seed(9);
  auto model = export_model();
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  acc.prepare(model);
  acc.load_model(model, (fs::path(out) / "export").string());
  const auto reference = safetensors::File::open((fs::path(out) / "reference.safetensors").string());
  const NamedTensors got = acc.get_state_dict(model);
  CHECK_MSG(got.size() == reference.names().size(),
            "load_model gave " << got.size() << " tensors, the export holds " << reference.names().size());
  for (const auto& [name, t] : got) {
    const auto& info = reference.info(name);
    const auto want =
        torch::from_blob(const_cast<std::uint8_t*>(reference.data(name)), info.shape, torch::kFloat32);
    CHECK_MSG(torch::equal(t, want), "load_model: " << name << " differs from the exported weights");
  }
  if (acc.is_main_process()) {
    std::cout << backend_variant << " hf_import: " << acc.num_processes()
              << " process(es) loaded the export bitwise" << std::endl;
  }
}

// Automatic checkpoints with a rank killed (SIGKILL) in the middle of a save (ACCEL_TEST_PHASE=crash), then
// resumed (ACCEL_TEST_PHASE=resume): load_state() picks the newest complete checkpoint, which holds the
// weights and the registered state of that moment, and the numbering continues after it.
void auto_checkpoint() {
  namespace fs = std::filesystem;
  const char* out = std::getenv("ACCEL_TEST_SAVE_DIR");
  const char* phase_env = std::getenv("ACCEL_TEST_PHASE");
  if (out == nullptr || phase_env == nullptr)
    throw std::runtime_error("set ACCEL_TEST_SAVE_DIR and ACCEL_TEST_PHASE");
  const std::string phase = phase_env;
  ProjectConfiguration project;
  project.project_dir = (fs::path(out) / "run").string();
  project.automatic_checkpoint_naming = true;
  project.total_limit = 2;
  torch::manual_seed(0);
  Mlp model;
  auto opt = sgd(model->parameters());
  std::int64_t steps = 0;
  Accelerator acc(AcceleratorOptions().config(cpu_config()).project_config(project));
  const int world = acc.num_processes();
  acc.prepare(model, *opt);
  acc.register_for_checkpointing(
      [&](torch::serialize::OutputArchive& a) { a.write("steps", torch::tensor(steps)); },
      [&](torch::serialize::InputArchive& a) {
        torch::Tensor t;
        a.read("steps", t);
        steps = t.item<std::int64_t>();
      });
  Regression data(kBatch * world * kSteps);
  auto train = [&](std::int64_t s) {
    opt->zero_grad();
    acc.backward(torch::mse_loss(model(rows(data.x, s, &acc, world)), rows(data.y, s, &acc, world)));
    opt->step();
    ++steps;
  };
  const fs::path checkpoints = fs::path(project.project_dir) / "checkpoints";
  const std::string reference = (fs::path(out) / "at_checkpoint_1.safetensors").string();
  if (phase == "crash") {
    train(0);
    acc.save_state();
    train(1);
    acc.save_state();
    const NamedTensors state = acc.get_state_dict(model);
    if (acc.is_main_process()) write_reference(state, reference);
    train(2);
    const int rank = acc.process_index();
    acc.register_save_state_pre_hook([rank](const std::string&) {
      if (rank == 1) {
        std::cout << "auto_checkpoint: rank 1 killed while saving checkpoint_2" << std::endl;
        ::raise(SIGKILL);
      }
    });
    acc.save_state();
    CHECK_MSG(false, "the save with a killed rank must not complete");
    return;
  }
  const std::string loaded = acc.load_state();
  CHECK_MSG(loaded == (checkpoints / "checkpoint_1").string(), "load_state() picked " << loaded);
  CHECK_MSG(steps == 2, "the registered step counter is " << steps << ", want 2");
  CHECK_MSG(acc.project_configuration().iteration == 2,
            "the numbering continues at " << acc.project_configuration().iteration);
  const auto want = safetensors::File::open(reference);
  for (const auto& [name, t] : acc.get_state_dict(model)) {
    const auto& info = want.info(name);
    const auto w = torch::from_blob(const_cast<std::uint8_t*>(want.data(name)), info.shape, torch::kFloat32);
    CHECK_MSG(torch::equal(t, w), "after load_state() " << name << " is not the weight of checkpoint_1");
  }
  train(2);
  CHECK_MSG(acc.save_state() == (checkpoints / "checkpoint_2").string(), "the next save is not checkpoint_2");
  if (acc.is_main_process()) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(checkpoints))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    CHECK_MSG((names == std::vector<std::string>{"checkpoint_1", "checkpoint_2"}),
              "checkpoints after the resumed save: " << names.size() << " entries, first " << names.front());
    std::cout
        << "auto_checkpoint: resumed from checkpoint_1 after a rank was killed while saving checkpoint_2"
        << std::endl;
  }
}

// Under `accel-launch launch --max_restarts 1`: rank 1 is killed (SIGKILL) after the checkpoint of step 2 on
// the first attempt; the restarted ranks load_state() the newest checkpoint and finish. The weights equal one
// process that trained on the whole batch without interruption.
void restart_resume() {
  namespace fs = std::filesystem;
  const std::string out = save_dir();
  const int attempt = std::atoi(std::getenv(env::kRestartCount) ? std::getenv(env::kRestartCount) : "0");
  ProjectConfiguration project;
  project.project_dir = (fs::path(out) / "run").string();
  project.automatic_checkpoint_naming = true;
  project.total_limit = 2;
  against_one_process(
      "killed, restarted by accel-launch and resumed",
      [&](Accelerator* acc, int world) {
        torch::manual_seed(0);
        Mlp model;
        auto opt = sgd(model->parameters());
        Regression data(kBatch * world * kSteps);
        std::int64_t start = 0;
        if (acc != nullptr) {
          acc->prepare(model, *opt);
          acc->register_for_checkpointing(
              [&](torch::serialize::OutputArchive& a) { a.write("start", torch::tensor(start)); },
              [&](torch::serialize::InputArchive& a) {
                torch::Tensor t;
                a.read("start", t);
                start = t.item<std::int64_t>();
              });
          if (attempt > 0) {
            const std::string from = acc->load_state();
            if (acc->is_main_process())
              std::cout << "restart_resume: attempt " << attempt << " resumed from " << from << " at step "
                        << start << std::endl;
          }
        }
        for (std::int64_t s = start; s < kSteps; ++s) {
          opt->zero_grad();
          backward(acc, torch::mse_loss(model(rows(data.x, s, acc, world)), rows(data.y, s, acc, world)));
          opt->step();
          if (acc != nullptr) {
            start = s + 1;
            acc->save_state();
            if (attempt == 0 && s == 1 && acc->process_index() == 1) ::raise(SIGKILL);
          }
        }
        return weights(acc, model);
      },
      1, project);
}

// Experiment tracking with every built-in tracker on N ranks: only the main process writes; TensorBoard's own
// Python reader, csv and json read back exactly the values logged (tests/python/check_tracking.py).
void tracking() {
  namespace fs = std::filesystem;
  const std::string out = save_dir();
  torch::manual_seed(0);
  Mlp model;
  auto opt = sgd(model->parameters());
  Accelerator acc(AcceleratorOptions().config(cpu_config()).log_with("all").project_dir(out));
  const int world = acc.num_processes();
  acc.prepare(model, *opt);
  bool refused = false;
  try {
    acc.log({{"loss", 1.0}});
  } catch (const UsageError& e) {
    refused = std::string(e.what()).find("init_trackers") != std::string::npos;
  }
  CHECK_MSG(refused, "log() before init_trackers() must throw UsageError naming init_trackers");
  acc.init_trackers("run", {{"lr", 0.05}, {"batch", kBatch}, {"backend", backend_variant}, {"fused", false}});
  CHECK_MSG((acc.get_tracker("tensorboard") != nullptr) == acc.is_main_process(),
            "the main process alone has trackers");
  Regression data(kBatch * world * kSteps);
  std::ostringstream expected;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    const auto loss = torch::mse_loss(model(rows(data.x, s, &acc, world)), rows(data.y, s, &acc, world));
    acc.backward(loss);
    opt->step();
    const double mean_loss = acc.reduce(loss.detach(), ReduceOp::Mean).item<double>();
    const double lr = 0.05 / static_cast<double>(s + 1);
    acc.log({{"loss", mean_loss}, {"lr", lr}});  // at completed_steps(): 1, 2, ...
    acc.log({{"eval/metric", -mean_loss}}, 100 + s);
    expected << std::setprecision(17) << s + 1 << " loss " << mean_loss << "\n"
             << s + 1 << " lr " << lr << "\n"
             << 100 + s << " eval/metric " << -mean_loss << "\n";
  }
  acc.end_training();
  if (!acc.is_main_process()) return;
  const fs::path expected_file = fs::path(out) / "expected.txt";
  std::ofstream(expected_file) << expected.str();
  const std::string python = accel::test::python();
  CHECK_MSG(!python.empty(), "ACCEL_PYTHON is not set: configure with -DACCEL_PYTHON=<venv python>");
  const std::string command = python + " " + accel::test::tests_dir() + "/python/check_tracking.py " +
                              (fs::path(out) / "run").string() + " " + expected_file.string() + " " +
                              backend_variant;
  CHECK_MSG(std::system(command.c_str()) == 0, "the Python check failed: " << command);
}

// accelerator.profile() on every rank: each writes its own trace, with its training step's operators.
void profile() {
  namespace fs = std::filesystem;
  const std::string out = save_dir();
  torch::manual_seed(0);
  Mlp model;
  auto opt = sgd(model->parameters());
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int world = acc.num_processes();
  acc.prepare(model, *opt);
  Regression data(kBatch * world);
  const auto traces = (fs::path(out) / "traces").string();
  {
    auto prof = acc.profile(ProfileOptions{traces});
    acc.backward(torch::mse_loss(model(rows(data.x, 0, &acc, world)), rows(data.y, 0, &acc, world)));
    opt->step();
  }
  acc.wait_for_everyone();
  if (!acc.is_main_process()) return;
  for (int r = 0; r < world; ++r) {
    const auto path = fs::path(traces) / ("trace_rank_" + std::to_string(r) + ".json");
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK_MSG(text.find("\"traceEvents\"") != std::string::npos, path << " is not a Chrome trace");
    CHECK_MSG(text.find("aten::addmm") != std::string::npos, path << " lacks the forward's aten::addmm");
    CHECK_MSG(text.find("gloo:all_reduce") != std::string::npos, path << " lacks the gradient all-reduce");
  }
  std::cout << "profile: trace_rank_0.json and trace_rank_1.json hold each rank's all-reduce" << std::endl;
}

}  // namespace

std::map<std::string, std::function<void()>> real_loop_scenarios() {
  return {{"two_models", two_models},
          {"frozen_teacher", frozen_teacher},
          {"gan_accumulation", gan_accumulation},
          {"plain_backward", plain_backward},
          {"lora", lora},
          {"libtorch_clip", libtorch_clip},
          {"free_memory", free_memory},
          {"hand_accumulation", hand_accumulation},
          {"no_sync", no_sync},
          {"fp16_hand_accumulation", fp16_hand_accumulation},
          {"two_backward_accumulation", two_backward_accumulation},
          {"own_batches", own_batches},
          {"fused_adamw", fused_adamw},
          {"buffers", buffers},
          {"sync_batchnorm", sync_batchnorm},
          {"torch_save", torch_save},
          {"load_saved", load_saved},
          {"hf_export", hf_export},
          {"hf_export_python",
           [] {
             python_export_check = true;
             hf_export();
             python_export_check = false;
           }},
          {"hf_import", hf_import},
          {"auto_checkpoint", auto_checkpoint},
          {"restart_resume", restart_resume},
          {"tracking", tracking},
          {"profile", profile}};
}

}  // namespace dist
