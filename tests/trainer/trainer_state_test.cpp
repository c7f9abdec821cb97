// The Trainer's torch-free parts: trainer_state.json in HF's format, HF's checkpoint rotation, and the
// early-stopping rule.
#include <accel/errors.hpp>
#include <accel/trainer/callbacks.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace accel;
using Catch::Matchers::Contains;

TEST_CASE("TrainerState: trainer_state.json round trip, in HF's layout") {
  TrainerState s;
  s.epoch = 1.5;
  s.global_step = 30;
  s.max_steps = 40;
  s.best_metric = 0.25;
  s.best_global_step = 20;
  s.best_model_checkpoint = "out/checkpoint-20";
  s.log_history = {{{"loss", 0.5}, {"learning_rate", 1e-3}, {"epoch", 0.5}, {"step", 10}},
                   {{"eval_loss", 0.25}, {"epoch", 1.0}, {"step", 20}}};
  s.stateful_callbacks["EarlyStoppingCallback"] = {{"early_stopping_patience_counter", 1}};
  const std::string json = s.to_json();
  CHECK_THAT(json, Contains("\"global_step\": 30") &&
                       Contains("\"best_model_checkpoint\": \"out/checkpoint-20\"") &&
                       Contains("\"step\": 10") && Contains("\"is_hyper_param_search\": false") &&
                       Contains("\"attributes\""));
  const auto back = TrainerState::from_json(json, "trainer_state.json");
  CHECK(back.to_json() == json);
  CHECK_THROWS_WITH(TrainerState::from_json("{\"global_step\": \"x\"", "ckpt/trainer_state.json"),
                    Contains("ckpt/trainer_state.json"));
}

TEST_CASE("checkpoints_to_delete: HF's rotation keeps the newest and the best") {
  const std::vector<std::string> all = {"c-10", "c-20", "c-30", "c-40"};
  CHECK(checkpoints_to_delete(all, 2, std::nullopt) == std::vector<std::string>{"c-10", "c-20"});
  // The best moves to the second newest place: limit 2 keeps best and latest.
  CHECK(checkpoints_to_delete(all, 2, std::string("c-10")) == std::vector<std::string>{"c-20", "c-30"});
  CHECK(checkpoints_to_delete(all, 2, std::string("c-40")) == std::vector<std::string>{"c-10", "c-20"});
  // Limit 1 with a best that is not the newest keeps two (HF).
  CHECK(checkpoints_to_delete(all, 1, std::string("c-20")) == std::vector<std::string>{"c-10", "c-30"});
  CHECK(checkpoints_to_delete(all, 1, std::string("c-40")) ==
        std::vector<std::string>{"c-10", "c-20", "c-30"});
  CHECK(checkpoints_to_delete(all, 0, std::nullopt).empty());  // no limit
}

TEST_CASE("EarlyStoppingCallback: HF's rule, its counter saved") {
  TrainingArguments args;
  args.eval_strategy = "steps";
  args.load_best_model_at_end = true;
  args.validate();  // metric_for_best_model: loss, greater_is_better: false
  TrainerState state;
  TrainerControl control;
  EarlyStoppingCallback cb(2, 0.01);
  cb.on_train_begin(args, state, control);
  auto eval = [&](double loss) {
    cb.on_evaluate(args, state, control, {{"eval_loss", loss}});
    if (!state.best_metric || loss < *state.best_metric) state.best_metric = loss;  // the Trainer's update
  };
  eval(1.0);
  CHECK(cb.patience_counter() == 0);
  eval(0.995);  // better, but not by more than the threshold
  CHECK(cb.patience_counter() == 1);
  eval(0.5);
  CHECK(cb.patience_counter() == 0);
  eval(0.6);
  CHECK_FALSE(control.should_training_stop);
  eval(0.7);
  CHECK(control.should_training_stop);
  EarlyStoppingCallback restored(2, 0.01);
  restored.load_attributes(cb.attributes());
  CHECK(restored.patience_counter() == 2);
  TrainingArguments no_best;
  CHECK_THROWS_WITH(cb.on_train_begin(no_best, state, control), Contains("load_best_model_at_end"));
}

TEST_CASE("ThroughputMonitor: samples/s, tokens/s and MFU against the peak given") {
  TrainingArguments args;
  TrainerState state;
  TrainerControl control;
  ThroughputMonitor monitor(/*flops_per_sample=*/6e6, /*peak_flops_per_device=*/1e9, /*world_size=*/2);
  monitor.on_train_begin(args, state, control);
  state.num_samples_seen = 1000;
  state.num_input_tokens_seen = 5000;
  LogEntry logs{{"loss", 0.5}};
  monitor.on_log(args, state, control, logs);
  REQUIRE(logs.count("throughput/samples_per_sec") == 1);
  const double samples = logs.at("throughput/samples_per_sec");
  CHECK(samples > 0);
  CHECK(logs.at("throughput/tokens_per_sec") == Approx(5 * samples));
  CHECK(logs.at("throughput/flops_per_sec") == Approx(6e6 * samples));
  CHECK(logs.at("throughput/mfu") == Approx(6e6 * samples / 2e9));
  LogEntry eval{{"eval_loss", 0.4}};  // evaluation logs are left alone
  monitor.on_log(args, state, control, eval);
  CHECK(eval.size() == 1);
  CHECK_THROWS_WITH(ThroughputMonitor(1, 0, 1), Contains("peak_flops_per_device"));
}
