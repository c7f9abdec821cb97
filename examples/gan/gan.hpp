#pragma once
// A small GAN on Fashion-MNIST, shared by both versions of the example: the two MLPs, the noise of a batch,
// the weight checksum and the command line. The data come from examples/fashion_mnist/fashion_mnist.hpp.

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdint>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "fashion_mnist.hpp"

namespace gan {

constexpr std::int64_t kLatent = 32;
constexpr std::int64_t kPixels = 28 * 28;

/// G: latent 32 -> 128 -> 784. No activation at the end: the images are normalised to mean 0, std 1
/// (values in [-0.81, 2.02]), which tanh could not reach.
struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kLatent, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, kPixels))) {}
  torch::Tensor forward(torch::Tensor z) { return fc2(torch::relu(fc1(z))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Generator);

/// D: 784 -> 128 -> 1 logit (real vs generated).
struct DiscriminatorImpl : torch::nn::Module {
  DiscriminatorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kPixels, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::leaky_relu(fc1(x.flatten(1)), 0.2)); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Discriminator);

/// The noise of global batch `step`, for a process that holds `rows` samples of it: two draws (D step, G
/// step) of (batch_size x num_processes) x 32 from a generator seeded by (`seed`, `step`) alone, of which
/// process `rank` takes rows [rank * batch_size, rank * batch_size + rows). The noise of a sample thus
/// depends only on its place in the global batch, never on how the batch is split over processes: one process
/// with batch N*B and N ranks with batch B each (a prepared loader gives rank r the samples [r*B, (r+1)*B) of
/// every global batch of N*B) draw the same noise for the same samples, so they compute the same thing. Drawn
/// on the CPU, then moved to `device`.
inline std::pair<torch::Tensor, torch::Tensor> noise(std::uint64_t seed, std::uint64_t step,
                                                     std::size_t batch_size, std::int64_t rows, int rank = 0,
                                                     int num_processes = 1,
                                                     torch::Device device = torch::kCPU) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + step);
  const auto global_rows = static_cast<std::int64_t>(batch_size) * num_processes;
  const auto first = static_cast<std::int64_t>(batch_size) * rank;
  auto z = torch::randn({global_rows, kLatent}, gen).narrow(0, first, rows).to(device);
  auto z2 = torch::randn({global_rows, kLatent}, gen).narrow(0, first, rows).to(device);
  return {z, z2};
}

/// Sum of |w| over a model's tensors (`named_parameters()`, or the pairs of a state dict).
inline double abs_sum(const torch::OrderedDict<std::string, torch::Tensor>& tensors) {
  double sum = 0;
  for (const auto& item : tensors)
    sum += item.value().detach().abs().sum().to(torch::kCPU).item<double>();
  return sum;
}
inline double abs_sum(const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  double sum = 0;
  for (const auto& [name, t] : tensors)
    sum += t.detach().abs().sum().to(torch::kCPU).item<double>();
  return sum;
}

/// A fresh, unprepared model holding `weights` (whole tensors by name, as `get_state_dict` returns them):
/// what torch::save can write whatever the backend, since a prepared model's own parameters may be sharded
/// (ZeRO-3, FSDP FULL_SHARD). `torch::load(model, path)` reads the file back.
template <class Model>
Model with_weights(const std::vector<std::pair<std::string, torch::Tensor>>& weights) {
  Model model;
  torch::NoGradGuard no_grad;
  auto params = model->named_parameters();
  auto buffers = model->named_buffers();
  if (weights.size() != params.size() + buffers.size())
    throw std::runtime_error("with_weights: " + std::to_string(weights.size()) + " tensors for a model of " +
                             std::to_string(params.size() + buffers.size()));
  for (const auto& [name, t] : weights) {
    auto* target = params.find(name) != nullptr ? params.find(name) : buffers.find(name);
    if (target == nullptr) throw std::runtime_error("with_weights: the model has no tensor " + name);
    target->copy_(t);
  }
  return model;
}

/// A number with 6 significant digits.
inline std::string g6(double x) {
  std::ostringstream os;
  os << std::setprecision(6) << x;
  return os.str();
}
inline std::string g6(const torch::Tensor& t) {
  return g6(t.item<double>());
}

struct Args {
  int epochs = 1;
  std::size_t batch_size = 64;  // per process
  double lr = 2e-4;
  std::int64_t train_limit = 0;  // 0: all 60000
  std::uint64_t seed = 1;        // model initialisation and noise
  std::string data_dir = fashion::default_data_dir();
  std::string save_dir;  // accelerated version: torch::save(G) and (D) here at the end
};

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--epochs")
      a.epochs = std::stoi(next());
    else if (k == "--batch-size")
      a.batch_size = std::stoul(next());
    else if (k == "--lr")
      a.lr = std::stod(next());
    else if (k == "--train-limit")
      a.train_limit = std::stoll(next());
    else if (k == "--seed")
      a.seed = std::stoull(next());
    else if (k == "--data")
      a.data_dir = next();
    else if (k == "--save")
      a.save_dir = next();
    else {
      throw std::invalid_argument("unknown argument " + k +
                                  "; use --epochs N --batch-size B --lr X --train-limit N --seed S "
                                  "--data DIR --save DIR");
    }
  }
  return a;
}

}  // namespace gan
