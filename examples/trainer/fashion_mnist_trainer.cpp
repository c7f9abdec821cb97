// Fashion-MNIST with accel::Trainer: the model, the loss and the data; the loop (epochs, accumulation,
// clipping, schedule, evaluation, logging, checkpoints, resume) is the Trainer's, configured by a
// TrainingArguments file with Hugging Face's keys, on the backend the Accelerate config names:
//   accel-launch launch --config_file config_templates/ddp_cpu.yaml --num_processes 2
//     build/examples/trainer/fashion_mnist_trainer --training_args config_templates/trainer/full.yaml
//     [--learning_rate 3e-4 ...] [--data DIR] [--train-limit N] [--test-limit N] [--resume latest]
#include <accel/trainer/trainer.hpp>

#include "../fashion_mnist/fashion_mnist.hpp"

int main(int argc, char** argv) try {
  std::vector<std::string> rest;  // this program's own options; the rest are TrainingArguments
  auto args = accel::TrainingArguments::from_command_line(argc, argv, &rest);
  std::string data = fashion::default_data_dir(), resume;
  std::int64_t train_limit = 0, test_limit = 0;
  for (std::size_t i = 0; i + 1 < rest.size(); i += 2) {
    if (rest[i] == "--data")
      data = rest[i + 1];
    else if (rest[i] == "--train-limit")
      train_limit = std::stoll(rest[i + 1]);
    else if (rest[i] == "--test-limit")
      test_limit = std::stoll(rest[i + 1]);
    else if (rest[i] == "--resume")
      resume = rest[i + 1];
    else
      throw std::invalid_argument("unknown option " + rest[i]);
  }
  if (rest.size() % 2 != 0) throw std::invalid_argument("option " + rest.back() + " needs a value");

  torch::manual_seed(args.seed);
  fashion::Net model;
  auto train = fashion::Dataset(data, true, train_limit).map(torch::data::transforms::Stack<>());
  auto test = fashion::Dataset(data, false, test_limit).map(torch::data::transforms::Stack<>());
  accel::Trainer trainer(args, model, std::move(train), [&](auto& batch) {
    return torch::cross_entropy_loss(model(batch.data), batch.target);
  });
  trainer.set_eval(
      std::move(test),
      [&](auto& batch) {
        auto logits = model(batch.data);
        return accel::EvalOutput{torch::cross_entropy_loss(logits, batch.target), logits.argmax(1),
                                 batch.target};
      },
      [](const accel::EvalPrediction& p) {
        return accel::Metrics{{"accuracy", 100.0 * p.predictions.eq(p.label_ids).sum().item<double>() /
                                               static_cast<double>(p.label_ids.size(0))}};
      });
  const auto result = trainer.train(resume);
  if (result.interrupted) return 0;  // preempted: checkpoint saved, `--resume latest` continues
  const auto metrics = trainer.evaluate();
  trainer.accelerator().print("test accuracy: ", metrics.at("eval_accuracy"), "% | train loss ",
                              result.training_loss, " | ", result.metrics.at("train_samples_per_second"),
                              " samples/s");
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
