// The small Trainer run the trainer tests share: 2 epochs of 4-row batches, accumulation 2, AdamW with weight
// decay, warmup then linear decay, clipping at 0.5, a log every step, no checkpoints.
#pragma once

#include <accel/trainer/training_arguments.hpp>

#include <string>

namespace accel::test {

inline TrainingArguments small_trainer_args(const std::string& output_dir) {
  TrainingArguments a;
  a.output_dir = output_dir;
  a.num_train_epochs = 2;
  a.per_device_train_batch_size = 4;
  a.per_device_eval_batch_size = 4;
  a.gradient_accumulation_steps = 2;
  a.explicit_keys.push_back("gradient_accumulation_steps");
  a.learning_rate = 2e-2;
  a.weight_decay = 0.01;
  a.warmup_steps = 2;
  a.max_grad_norm = 0.5;
  a.logging_steps = 1;
  a.save_strategy = "no";
  a.disable_tqdm = true;
  a.seed = 42;
  return a;
}

}  // namespace accel::test
