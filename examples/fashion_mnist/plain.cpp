// Fashion-MNIST with a plain LibTorch loop: the baseline that accelerated.cpp changes by a few lines.
#include "fashion_mnist.hpp"

int main(int argc, char** argv) try {
  const auto args = fashion::parse_args(argc, argv);
  torch::manual_seed(0);
  fashion::Net model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(args.lr));
  auto train =
      fashion::Dataset(args.data_dir, true, args.train_limit).map(torch::data::transforms::Stack<>());
  auto test = fashion::Dataset(args.data_dir, false, args.test_limit).map(torch::data::transforms::Stack<>());
  auto train_loader = torch::data::make_data_loader(std::move(train), args.batch_size);
  auto test_loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(std::move(test),
                                                                                             args.batch_size);

  for (int epoch = 0; epoch < args.epochs; ++epoch) {
    model->train();
    const auto start = std::chrono::steady_clock::now();
    std::size_t seen = 0;
    for (auto& batch : *train_loader) {
      optimizer.zero_grad();
      auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      loss.backward();
      optimizer.step();
      seen += batch.data.size(0);
    }
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    std::cout << "epoch " << epoch << ": " << seen / took.count() << " samples/s" << std::endl;
  }

  model->eval();
  torch::NoGradGuard no_grad;
  std::int64_t correct = 0, total = 0;
  for (auto& batch : *test_loader) {
    auto predictions = model(batch.data).argmax(1);
    correct += predictions.eq(batch.target).sum().item<std::int64_t>();
    total += batch.target.size(0);
  }
  std::cout << "test accuracy: " << 100.0 * correct / total << "% (" << total << " images)" << std::endl;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
