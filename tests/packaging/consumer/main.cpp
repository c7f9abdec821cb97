// Trains a linear model for a few steps through accel::Accelerator and checks that the loss went down.
#include <accel/accelerator/accelerator.hpp>

// The LibTorch headers this program uses, not <torch/torch.h>: the package build compiles this file on every
// run of the packaging test, and the umbrella header doubled its compile time (23 -> 12 s of CPU).
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

int consumer_default_processes();  // core.cpp

int main() {
  if (consumer_default_processes() != 1) return 1;
  torch::manual_seed(0);
  torch::nn::Linear model(4, 1);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  accel::Accelerator accelerator;
  accelerator.prepare(model, optimizer);
  const auto x = torch::randn({32, 4});
  const auto y = x.sum(1, true);
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model(x), y);
    accelerator.backward(loss);
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  accelerator.print("consumer: loss ", first, " -> ", last, " on ", accelerator.device());
  return last < first / 2 ? 0 : 1;
}
