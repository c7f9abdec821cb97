// Fine-tuning types on Fashion-MNIST with accel::Trainer (issue 26): a base MLP trained briefly on the first
// images (the "pretrained" model, the same on every rank) is fine-tuned on the training set in full, with
// LoRA adapters, or with QLoRA (LoRA over its Linear layers stored in 4 bits), as a model config with TRL's
// ModelConfig keys says. The training types of config_templates/trainer/ carry it as <type>.model.yaml:
//   accel-launch train -t lora build/examples/trainer/finetune [--num_train_epochs 1 ...]
//   accel-launch train -t qlora build/examples/trainer/finetune
// Options: --model_config FILE (accel::ModelArguments: TRL's ModelConfig keys, each also as --key value),
// --data DIR, --train-limit N, --test-limit N, --pretrain-steps N (200).
#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>
#include <accel/trainer/model_arguments.hpp>
#include <accel/trainer/trainer.hpp>

#include "../fashion_mnist/fashion_mnist.hpp"

#include <set>

namespace {

// Layers "1" and "3" are the hidden Linears, "5" the head.
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 256), torch::nn::ReLU(),
                               torch::nn::Linear(256, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
}

// The "pretrained" base: `steps` Adam steps on the first images, the same on every rank (seeded, no
// collectives), before the fine-tuning type applies.
void pretrain(torch::nn::Sequential& model, const std::string& data, int steps) {
  if (steps <= 0) return;
  fashion::Dataset base(data, true, 6400);
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      base.map(torch::data::transforms::Stack<>()), 128);
  torch::optim::Adam opt(model->parameters(), 1e-3);
  int step = 0;
  while (step < steps) {
    for (auto& batch : *loader) {
      opt.zero_grad();
      torch::cross_entropy_loss(model->forward(batch.data), batch.target).backward();
      opt.step();
      if (++step == steps) break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> rest;  // this program's own options; the rest are TrainingArguments
  auto args = accel::TrainingArguments::from_command_line(argc, argv, &rest);
  const auto mc = accel::ModelArguments::from_command_line(rest, &rest);  // --model_config FILE, --lora_r 8
  std::string data = fashion::default_data_dir();
  std::int64_t train_limit = 0, test_limit = 0;
  int pretrain_steps = 200;
  for (std::size_t i = 0; i + 1 < rest.size(); i += 2) {
    if (rest[i] == "--data")
      data = rest[i + 1];
    else if (rest[i] == "--train-limit")
      train_limit = std::stoll(rest[i + 1]);
    else if (rest[i] == "--test-limit")
      test_limit = std::stoll(rest[i + 1]);
    else if (rest[i] == "--pretrain-steps")
      pretrain_steps = std::stoi(rest[i + 1]);
    else
      throw std::invalid_argument("unknown option " + rest[i]);
  }
  if (rest.size() % 2 != 0) throw std::invalid_argument("option " + rest.back() + " needs a value");

  torch::manual_seed(args.seed);
  auto model = make_model();
  pretrain(model, data, pretrain_steps);
  std::int64_t base_bytes = 0;
  for (const auto& p : model->parameters())
    base_bytes += p.numel() * p.element_size();
  std::string type = "full";
  std::shared_ptr<accel::peft::LoraModel> lora;
  if (mc.load_in_4bit) {
    accel::quant::Quant4bitOptions q;
    q.type = mc.bnb_4bit_quant_type == "nf4" ? accel::quant::QuantType::NF4 : accel::quant::QuantType::FP4;
    q.double_quant = mc.use_bnb_nested_quant;
    // QLoRA keeps the modules it trains in full (here the head, a module to save) and quantises the rest.
    std::vector<std::string> keep;
    for (const auto& m : mc.lora_modules_to_save)
      keep.push_back("^" + m + "$");
    accel::quant::quantize_linears(*model, q, keep);
    type = "qlora";
  }
  if (mc.use_peft) {
    accel::peft::LoraConfig lc;
    lc.r = mc.lora_r;
    lc.lora_alpha = mc.lora_alpha;
    lc.lora_dropout = mc.lora_dropout;
    lc.target_modules = mc.lora_target_modules;
    // TRL's one-string form: all-linear, or PEFT's regular expression over the module path.
    if (mc.lora_target_modules_string) {
      if (*mc.lora_target_modules_string == "all-linear")
        lc.target_modules = {"all-linear"};
      else
        lc.target_modules_regex = *mc.lora_target_modules_string;
    }
    lc.modules_to_save = mc.lora_modules_to_save;
    lc.use_rslora = mc.use_rslora;
    lc.task_type = mc.lora_task_type;
    torch::manual_seed(args.seed + 1);
    lora = accel::peft::get_peft_model(model.ptr(), lc);
    if (type == "full") type = "lora";
  }
  std::int64_t base_after = 0;  // what the frozen or trained base holds now (4-bit buffers included)
  for (const auto& p : model->parameters())
    if (!p.requires_grad()) base_after += p.numel() * p.element_size();
  for (const auto& b : model->buffers())
    base_after += b.numel() * b.element_size();

  auto train = fashion::Dataset(data, true, train_limit).map(torch::data::transforms::Stack<>());
  auto test = fashion::Dataset(data, false, test_limit).map(torch::data::transforms::Stack<>());
  accel::Trainer trainer(args, model, std::move(train), [&](auto& batch) {
    return torch::cross_entropy_loss(model->forward(batch.data), batch.target);
  });
  trainer.set_eval(
      std::move(test),
      [&](auto& batch) {
        auto logits = model->forward(batch.data);
        return accel::EvalOutput{torch::cross_entropy_loss(logits, batch.target), logits.argmax(1),
                                 batch.target};
      },
      [](const accel::EvalPrediction& p) {
        return accel::Metrics{{"accuracy", 100.0 * p.predictions.eq(p.label_ids).sum().item<double>() /
                                               static_cast<double>(p.label_ids.size(0))}};
      });
  // A LoRA run's checkpoints hold the adapter (PEFT's files) and the trainable state, not the frozen base.
  if (lora) trainer.set_peft_model(lora);
  auto& acc = trainer.accelerator();
  std::int64_t trainable = 0;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) trainable += p.numel();
  acc.print("finetune: type ", type, " | trainable parameters ", trainable, " | base ", base_bytes,
            " bytes in fp32, held now (frozen or 4-bit) ", base_after, " bytes");
  const auto result = trainer.train();
  if (result.interrupted) return 0;
  const auto metrics = trainer.evaluate();
  if (lora) {  // PEFT's adapter files (adapter_model.safetensors, adapter_config.json), from the whole state
    const auto state = acc.get_state_dict(model);
    const auto dir = std::filesystem::path(args.output_dir) / "adapter";
    if (acc.is_main_process()) {
      lora->save_adapter(dir.string(), state);
      if (std::filesystem::exists(dir / "adapter_model.safetensors") &&
          std::filesystem::exists(dir / "adapter_config.json"))
        acc.print("finetune: PEFT adapter files written to ", dir.string());
    }
    acc.wait_for_everyone();
  }
  acc.print("finetune: ", type, " test accuracy: ", metrics.at("eval_accuracy"), "% | train loss ",
            result.training_loss);
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
