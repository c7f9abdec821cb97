// Fashion-MNIST with accelerate-cpp: plain.cpp plus a few lines. Runs as one process, or on many ranks under
// accel-launch, with the backend, precision and accumulation chosen in the YAML config.
#include <accel/accelerator/accelerator.hpp>

#include "fashion_mnist.hpp"

int main(int argc, char** argv) try {
  const auto args = fashion::parse_args(argc, argv);
  torch::manual_seed(0);
  fashion::Net model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(args.lr));
  accel::Accelerator accelerator(accel::AcceleratorOptions()
                                     .project_dir(args.log_dir)
                                     .log_with(args.log_with == "none" ? "" : args.log_with));
  accelerator.prepare(model, optimizer);
  accelerator.init_trackers("fashion_mnist", {{"lr", args.lr},
                                              {"batch_size", args.batch_size},
                                              {"epochs", args.epochs},
                                              {"processes", accelerator.num_processes()}});
  auto train =
      fashion::Dataset(args.data_dir, true, args.train_limit).map(torch::data::transforms::Stack<>());
  auto test = fashion::Dataset(args.data_dir, false, args.test_limit).map(torch::data::transforms::Stack<>());
  auto train_loader = accelerator.prepare_data_loader(std::move(train), args.batch_size);
  auto test_loader = accelerator.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(test), args.batch_size);

  for (int epoch = 0; epoch < args.epochs; ++epoch) {
    model->train();
    const auto start = std::chrono::steady_clock::now();
    std::size_t seen = 0, step = 0;
    auto bar = accelerator.progress_bar(train_loader->size(), "epoch " + std::to_string(epoch), "batches");
    for (auto& batch : *train_loader) {
      bar.update();
      optimizer.zero_grad();
      auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      accelerator.backward(loss);
      optimizer.step();
      seen += batch.data.size(0) * accelerator.num_processes();
      if (++step % 100 == 0) {  // progress on the main rank: mean loss over ranks, global samples/s
        const auto mean_loss = accelerator.reduce(loss.detach(), accel::ReduceOp::Mean).item<double>();
        const std::chrono::duration<double> t = std::chrono::steady_clock::now() - start;
        accelerator.log({{"train/loss", mean_loss}, {"train/samples_per_s", seen / t.count()}});
        bar.set_postfix("loss " + std::to_string(mean_loss));
        accelerator.print("epoch ", epoch, " [", seen, "/", train_loader->dataset_size(), "] loss ",
                          mean_loss, " | ", static_cast<int>(seen / t.count()), " samples/s");
      }
    }
    bar.close();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    accelerator.print("epoch ", epoch, ": ", seen / took.count(), " samples/s");
  }

  model->eval();
  torch::NoGradGuard no_grad;
  std::int64_t correct = 0, total = 0;
  for (auto& batch : *test_loader) {
    auto predictions = accelerator.gather_for_metrics(model(batch.data).argmax(1));
    auto targets = accelerator.gather_for_metrics(batch.target);
    correct += predictions.eq(targets).sum().item<std::int64_t>();
    total += targets.size(0);
  }
  accelerator.print("test accuracy: ", 100.0 * correct / total, "% (", total, " images)");
  accelerator.log({{"test/accuracy", 100.0 * correct / total}});
  accelerator.end_training();
  if (!args.save_dir.empty()) accelerator.save_state(args.save_dir);
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
