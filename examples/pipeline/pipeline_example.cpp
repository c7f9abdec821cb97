// Pipeline parallelism on Fashion-MNIST: a Sequential MLP cut into stages, trained with the 1F1B (or GPipe)
// schedule over micro-batches; with more processes than stages, each stage runs in several data-parallel
// replicas (the config's backend: ddp or zero stage 1). The same binary trains with one process (the whole
// model, the same micro-batches) or under accel-launch with `pipeline_config:`
// (config_templates/pipeline_1f1b.yaml), and ends where one process ends:
//
//   build/examples/pipeline/pipeline_example --steps 30
//   build/launcher/accel-launch launch --config_file config_templates/pipeline_1f1b.yaml
//       build/examples/pipeline/pipeline_example --steps 30
//
// Prints "final loss <x>" (the mean loss of the last step) and "weight checksum <x>" (the sum of the absolute
// values of every weight, over all stages). `--clip 0.5` clips the whole model's gradient norm; `--save-at 10
// --checkpoint DIR` saves the state after step 10, `--resume DIR` continues from it (with any number of
// stages).
#include <accel/accelerator/accelerator.hpp>
#include <accel/parallel/pipeline.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "fashion_mnist.hpp"

int main(int argc, char** argv) try {
  int steps = 30;
  std::int64_t batch = 64;
  double lr = 0.05;
  double clip = 0;  // > 0: clip the whole model's gradient norm to it (every stage's part counted)
  int save_at = 0;  // > 0: save_state(checkpoint) after this step
  std::string checkpoint = "pipeline_checkpoint", resume;
  bool prepared_loader =
      false;  // --loader prepared: accelerator.prepare_data_loader, --batch-size per replica
  std::string data_dir = fashion::default_data_dir();
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--steps") {
      steps = std::stoi(v);
    } else if (k == "--batch-size") {
      batch = std::stoll(v);
    } else if (k == "--lr") {
      lr = std::stod(v);
    } else if (k == "--clip") {
      clip = std::stod(v);
    } else if (k == "--save-at") {
      save_at = std::stoi(v);
    } else if (k == "--checkpoint") {
      checkpoint = v;
    } else if (k == "--resume") {
      resume = v;
    } else if (k == "--loader") {
      if (v != "prepared" && v != "plain") throw std::invalid_argument("--loader takes prepared or plain");
      prepared_loader = v == "prepared";
    } else if (k == "--data") {
      data_dir = v;
    } else {
      throw std::invalid_argument(
          "unknown argument " + k +
          "; use --steps N --batch-size B --lr X --clip MAX_NORM --save-at STEP --checkpoint DIR "
          "--resume DIR --loader prepared|plain --data DIR");
    }
  }
  accel::Accelerator accelerator;
  // Every rank builds the same model; each keeps the layers of its own stage.
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(784, 256), torch::nn::ReLU(),
                              torch::nn::Linear(256, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
  auto& stage = accelerator.prepare_pipeline(model);
  torch::optim::SGD optimizer(stage.parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  accelerator.prepare(optimizer);  // zero stage 1 shards its state over the stage's replicas
  // Every stage of a replica reads the same batches: the first uses the images, the last the labels. A
  // plain loader gives every rank the global batch (each replica takes its rows); a loader prepared after
  // prepare_pipeline gives each replica its own batches of --batch-size.
  const int replicas = accelerator.num_processes() / accelerator.config().pipeline.stages;
  const auto samples = steps * batch * (prepared_loader ? replicas : 1);
  auto dataset = fashion::Dataset(data_dir, /*train=*/true, samples).map(torch::data::transforms::Stack<>());
  auto loss_fn = [](const torch::Tensor& output, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(output, target);
  };
  // A checkpoint holds one file per layer: it resumes with any number of stages and replicas. The batches
  // trained on are saved with it (fp16 may skip optimizer steps, so completed_steps() would not tell).
  std::int64_t trained = 0;
  accelerator.register_for_checkpointing(
      [&](torch::serialize::OutputArchive& a) { a.write("batches", torch::tensor(trained)); },
      [&](torch::serialize::InputArchive& a) {
        torch::Tensor t;
        a.read("batches", t);
        trained = t.item<std::int64_t>();
      });
  double loss = 0;
  int step = 0;
  auto train_on = [&](const torch::Tensor& images, const torch::Tensor& labels) {
    optimizer.zero_grad();
    loss = accelerator.pipeline_step(images, labels, loss_fn);
    if (clip > 0) accelerator.clip_grad_norm_(clip);
    optimizer.step();
    trained = ++step;
    if (step % 10 == 0) accelerator.print("step ", step, " loss ", loss);
    if (step == save_at) accelerator.save_state(checkpoint);
  };
  if (prepared_loader) {
    // Saved and restored with the state: a resumed loader continues after the batches already seen.
    auto loader = accelerator.prepare_data_loader<torch::data::samplers::SequentialSampler>(
        std::move(dataset), torch::data::DataLoaderOptions(static_cast<std::size_t>(batch)));
    if (!resume.empty()) accelerator.load_state(resume);
    step = static_cast<int>(trained);
    for (auto& b : *loader)
      train_on(b.data, b.target);
  } else {
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        std::move(dataset), static_cast<std::size_t>(batch));
    if (!resume.empty()) accelerator.load_state(resume);
    for (auto& b : *loader) {
      if (step < trained) {  // resumed: this batch was trained on before the checkpoint
        ++step;
        continue;
      }
      train_on(b.data, b.target);
    }
  }
  double checksum = 0;
  for (const auto& p : stage.parameters())
    checksum += p.abs().sum().item<double>();
  // Every stage's replicas hold the same weights: the sum over all ranks counts each stage `replicas` times.
  checksum =
      accelerator.reduce(torch::tensor(checksum, torch::kFloat64), accel::ReduceOp::Sum).item<double>() /
      replicas;
  auto precise = [](double v) {
    std::ostringstream out;
    out << std::setprecision(12) << v;
    return out.str();
  };
  accelerator.print("final loss ", precise(loss));
  accelerator.print("weight checksum ", precise(checksum));
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
