// accel::Trainer on every backend row (run by dist_worker, column `trainer` of the conformance table):
// - trainer_equals_loop: a Trainer run is the hand-written accelerated loop of the same program, bit for bit
//   (accumulation with a short last window, clipping, warmup + linear decay, weight-decay groups, dropout);
// - trainer_resume: one rank gets SIGUSR1 mid-run; every rank saves at the same step and stops; a fresh
//   Trainer with train("latest") ends with the uninterrupted run's weights, bit for bit, and its state; on
//   the ZeRO-3 row also from a checkpoint written during a second train() (trainer_resume_second_run);
// - trainer_equals_loop also: gradient_checkpointing gives the same weights bit for bit;
// - trainer_best: save_total_limit 2 with load_best_model_at_end leaves exactly the best and the latest
//   checkpoints, and the model ends as the best one; save_strategy best saves at new bests only;
// - trainer_early_stop: EarlyStoppingCallback stops every rank at the same step;
// - trainer_nonfinite: a NaN loss on one rank drops that step's update on every rank (skip), or stops every
//   rank with an error naming the rank (stop).
#include <accel/distributed/env_contract.hpp>
#include <accel/optim/schedulers.hpp>
#include <accel/trainer/trainer.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <optional>

#include <unistd.h>

#include "checkpoint/manifest.hpp"
#include "dist_common.hpp"
#include "trainer/trainer_fixture.hpp"

namespace dist {
namespace {

using namespace accel;
using test::Mlp;
using test::Regression;
namespace fs = std::filesystem;

using Data = decltype(Regression(1).map(torch::data::transforms::Stack<>()));
using Batch = torch::data::Example<>;

Data data(std::int64_t n = 40) {
  return Regression(n).map(torch::data::transforms::Stack<>());
}

// A model whose blocks are a Sequential child (what gradient_checkpointing checkpoints), with dropout inside,
// and a LayerNorm, whose weight HF leaves out of weight decay (checkpointed too: wrapped, it must still be
// recognised).
struct SeqNetImpl : torch::nn::Module {
  SeqNetImpl()
      : body(register_module(
            "body",
            torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::LayerNorm(std::vector<int64_t>{16}),
                                  torch::nn::Tanh(), torch::nn::Dropout(0.2), torch::nn::Linear(16, 16)))),
        head(register_module("head", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(body->forward(x)); }
  torch::nn::Sequential body;
  torch::nn::Linear head;
};
TORCH_MODULE(SeqNet);

// The same directory on every rank (rank 0 creates and announces it).
std::string shared_dir(Accelerator& acc, const std::string& tag) {
  std::vector<std::string> dir{
      acc.is_main_process()
          ? (fs::temp_directory_path() / ("accel_trainer_" + tag + "_" + std::to_string(::getpid()))).string()
          : std::string()};
  acc.broadcast_object_list(dir);
  if (acc.is_main_process()) {
    fs::remove_all(dir[0]);
    fs::create_directories(dir[0]);
  }
  acc.wait_for_everyone();
  return dir[0];
}

AcceleratorOptions row_options() {
  return AcceleratorOptions().config(cpu_config());
}

// A fresh shared directory, through a short-lived Accelerator of the row.
std::string fresh_dir(const std::string& tag) {
  Accelerator probe(row_options());
  return shared_dir(probe, tag);
}

TrainingArguments base_args(const std::string& out) {
  return test::small_trainer_args(out);
}

std::vector<torch::Tensor> whole(Accelerator& acc, Mlp& model) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : acc.get_state_dict(model))
    out.push_back(t.cpu().clone());
  return out;
}

// The checkpoint-N folders in `out`, sorted by name.
std::vector<std::string> checkpoint_dirs(const std::string& out) {
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().filename().string().rfind("checkpoint-", 0) == 0)
      left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  return left;
}

// Rank 0 removes a shared directory once every rank is done reading it (a barrier first: without it rank 0
// removed a directory another rank was still listing, a race seen under load in CI).
void remove_shared(const std::string& dir) {
  Accelerator(row_options()).wait_for_everyone();
  const char* rank = std::getenv("RANK");
  if (rank == nullptr || std::string(rank) == "0") fs::remove_all(dir);
}

bool identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

// The loop a user writes by hand for the same arguments (HF's: accumulate, clip, step, schedule, zero_grad).
std::vector<torch::Tensor> hand_written(const TrainingArguments& a) {
  Config config = cpu_config();
  config.gradient_accumulation_steps = a.gradient_accumulation_steps;
  torch::manual_seed(3);
  Mlp model(6, 0.1);
  Accelerator acc(AcceleratorOptions().config(config));
  acc.set_seed(a.seed);
  auto loader = acc.prepare_data_loader(
      data(),
      DataLoaderOptions(static_cast<std::size_t>(a.per_device_train_batch_size)).shuffle(true).seed(a.seed));
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->named_parameters())
    (p.key().find("bias") != std::string::npos ? no_decay : decay).push_back(p.value());
  torch::optim::AdamWOptions o(a.learning_rate);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(o.weight_decay(a.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(o.weight_decay(0.0)));
  torch::optim::AdamW opt(groups, o);
  const std::int64_t per_epoch =
      (static_cast<std::int64_t>(loader->size()) + a.gradient_accumulation_steps - 1) /
      a.gradient_accumulation_steps;
  auto schedule = sched::linear_with_warmup(opt, a.warmup_steps, per_epoch * 2);
  acc.prepare(model, opt, *schedule);
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (auto& batch : *loader) {
      auto window = acc.accumulate(model);
      model->train();
      auto loss = torch::mse_loss(model(batch.data), batch.target);
      acc.backward(loss);
      if (acc.sync_gradients()) {
        acc.clip_grad_norm_(a.max_grad_norm);
        opt.step();
        schedule->step();
        opt.zero_grad();
      }
    }
  }
  return whole(acc, model);
}

struct Run {
  std::vector<torch::Tensor> weights;
  TrainerState state;
  TrainOutput output;
};

// A Trainer run of the same program; `setup` adds callbacks or evaluation.
// With `stale_grads`, the program ran a backward on the model before the Trainer (a pretraining loop that
// left its gradients).
Run trainer_run(TrainingArguments a, const std::string& resume = "",
                const std::function<void(Trainer<Data>&)>& setup = {}, std::uint64_t init_seed = 3,
                bool stale_grads = false) {
  torch::manual_seed(init_seed);
  Mlp model(6, 0.1);
  if (stale_grads) {
    model->eval();  // no dropout: the random stream stays the run's
    const auto x = torch::linspace(-1, 1, 24).reshape({4, 6});
    torch::mse_loss(model(x), torch::ones({4, 1}) * 5).backward();
    model->train();
  }
  Trainer<Data> trainer(
      std::move(a), model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); },
      row_options());
  if (setup) setup(trainer);
  Run r;
  r.output = trainer.train(resume);
  r.state = trainer.state();
  r.weights = whole(trainer.accelerator(), model);
  return r;
}

void trainer_equals_loop() {
  const std::string out = fresh_dir("equal");
  const auto a = base_args(out);
  const auto want = hand_written(a);
  const auto got = trainer_run(a);
  CHECK_MSG(identical(got.weights, want), backend_variant
                                              << ": the Trainer's weights differ from the hand-written "
                                              << "loop's by up to " << max_diff(got.weights, want));
  CHECK_MSG(got.state.global_step == got.state.max_steps,
            "global_step " << got.state.global_step << ", max_steps " << got.state.max_steps);
  // Gradients the program left on the model before train() are not added to the first step: HF's Trainer
  // calls model.zero_grad() before training (they were, silently; on a GPU the first backward failed, the
  // stale gradients left on the CPU by prepare).
  const auto stale = trainer_run(a, "", {}, 3, /*stale_grads=*/true);
  CHECK_MSG(identical(stale.weights, want),
            backend_variant << ": gradients left from before train() changed the "
                            << "Trainer's weights by up to " << max_diff(stale.weights, want));
  // The user's optimizer holds fc2 only; fc1 still trains (requires_grad) and gets gradients. HF's Trainer
  // calls model.zero_grad() after every step, so fc1's gradients count in each step's clipping norm once:
  // the run equals one whose optimizer also holds fc1 at learning rate 0 (unchanged weights, zeroed by the
  // optimizer). Without it fc1's gradients summed over the steps into the norm (clipping at 0.05 is active).
  {
    auto tight = a;
    tight.max_grad_norm = 0.05;
    auto with_optimizer = [&](bool fc1_at_zero) {
      torch::manual_seed(3);
      Mlp model(6, 0.1);
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(model->fc2->parameters(), std::make_unique<torch::optim::AdamWOptions>(2e-2));
      if (fc1_at_zero)
        groups.emplace_back(model->fc1->parameters(), std::make_unique<torch::optim::AdamWOptions>(0.0));
      auto opt = std::make_shared<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(2e-2));
      Trainer<Data> t(
          tight, model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); },
          row_options());
      t.set_optimizer(opt);
      t.train();
      std::vector<double> norms;
      for (const auto& entry : t.state().log_history)
        if (entry.count("grad_norm") != 0) norms.push_back(entry.at("grad_norm"));
      return std::make_pair(whole(t.accelerator(), model), norms);
    };
    const auto [partial, partial_norms] = with_optimizer(false);
    const auto [zero_lr, zero_lr_norms] = with_optimizer(true);
    // Not bit for bit: under ZeRO fc1's gradient is a whole one in the first run and a slice in the second,
    // so the norm's sum runs in another order (the last bits); the bug moved weights by 5e-5 to 2e-3.
    CHECK_MSG(
        max_diff(partial, zero_lr) < 1e-7,
        backend_variant << ": with an optimizer over part of the trainable parameters the weights differ "
                        << "from HF's (model.zero_grad() every step) by up to "
                        << max_diff(partial, zero_lr));
    double worst = partial_norms.size() == zero_lr_norms.size() && !partial_norms.empty() ? 0.0 : 1.0;
    for (std::size_t i = 0; i < std::min(partial_norms.size(), zero_lr_norms.size()); ++i)
      worst = std::max(worst, std::abs(partial_norms[i] - zero_lr_norms[i]) / zero_lr_norms[i]);
    CHECK_MSG(worst < 1e-6, backend_variant << ": the logged grad_norm differs by " << worst
                                            << " (relative) over " << partial_norms.size() << " and "
                                            << zero_lr_norms.size() << " logs");
  }
  // The backend's own clipping (DeepSpeed's gradient_clipping at max_grad_norm, on the rows that have it)
  // trains as the Trainer's clipping does and logs the same grad_norm: the norm before clipping, as HF's
  // Trainer logs DeepSpeed's get_global_grad_norm() (it logged the clipped gradients' norm, 0.05 at each
  // step).
  {
    Config configured = cpu_config();
    configured.zero.gradient_clipping = 0.05;
    if (automatic_gradient_clipping(configured) > 0) {
      auto tight = a;
      tight.max_grad_norm = 0.05;
      auto run = [&](const Config& c) {
        torch::manual_seed(3);
        Mlp model(6, 0.1);
        Trainer<Data> t(
            tight, model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); },
            AcceleratorOptions().config(c));
        t.train();
        std::vector<double> norms;
        for (const auto& entry : t.state().log_history)
          if (entry.count("grad_norm") != 0) norms.push_back(entry.at("grad_norm"));
        return std::make_pair(whole(t.accelerator(), model), norms);
      };
      const auto [by_backend, backend_norms] = run(configured);
      const auto [by_trainer, trainer_norms] = run(cpu_config());
      CHECK_MSG(
          max_diff(by_backend, by_trainer) < 1e-7,
          backend_variant << ": the backend's gradient_clipping trains other weights than max_grad_norm, "
                          << "by up to " << max_diff(by_backend, by_trainer));
      double worst = backend_norms.size() == trainer_norms.size() && !trainer_norms.empty() ? 0.0 : 1.0;
      bool clipped = false;
      for (std::size_t i = 0; i < std::min(backend_norms.size(), trainer_norms.size()); ++i) {
        worst = std::max(worst, std::abs(backend_norms[i] - trainer_norms[i]) / trainer_norms[i]);
        clipped = clipped || trainer_norms[i] > 0.05;
      }
      CHECK_MSG(clipped, "no step's gradient norm exceeded 0.05: the check would not see clipped norms");
      CHECK_MSG(worst < 1e-6, backend_variant << ": under gradient_clipping the logged grad_norm differs by "
                                              << worst << " (relative) from the norm before clipping");
    }
  }
  // A train() that threw inside an optimizer step (after the first of its 2 micro-batches) leaves that step's
  // gradients held: a second train() with no checkpoint to resume is refused, naming the way out.
  {
    torch::manual_seed(3);
    Mlp model(6, 0.1);
    int calls = 0;
    Trainer<Data> t(
        base_args(out), model, data(),
        [&](Batch& b) {
          if (++calls == 4) throw std::runtime_error("a bad batch");
          return torch::mse_loss(model(b.data), b.target);
        },
        row_options());
    std::string first, second;
    try {
      t.train();
    } catch (const std::exception& e) {
      first = e.what();
    }
    const auto steps = t.state().global_step;
    try {
      t.train();
    } catch (const UsageError& e) {
      second = e.what();
    }
    CHECK_MSG(first.find("a bad batch") != std::string::npos, "the first train() gave '" << first << "'");
    CHECK_MSG(
        second.find("stopped inside an optimizer step, after 1 of its 2 micro-batches") != std::string::npos,
        "a second train() after an interrupted step gave '" << second << "'");
    // Refused before it reset anything of the run (a later train() otherwise starts a new TrainerState).
    CHECK_MSG(steps == 1 && t.state().global_step == steps,
              "the refused train() left global_step " << t.state().global_step << " (was " << steps << ")");
  }
  // logging_steps 1: one training log per step, with the loss averaged over ranks, then the summary.
  CHECK_MSG(static_cast<std::int64_t>(got.state.log_history.size()) == got.state.max_steps + 1,
            got.state.log_history.size() << " log entries for " << got.state.max_steps << " steps");
  CHECK_MSG(got.state.log_history.front().count("grad_norm") == 1, "no grad_norm logged");
  CHECK_MSG(got.output.training_loss > 0 && std::isfinite(got.output.training_loss),
            "training_loss " << got.output.training_loss);
  // gradient_checkpointing: the model's Sequential child is recomputed in backward (its dropout replayed);
  // the weights are the run's without it, bit for bit. A model with no Sequential is refused.
  auto checkpointed = [&](bool on) {
    auto args = base_args(out);
    args.gradient_checkpointing = on;
    torch::manual_seed(3);
    SeqNet net;
    Trainer<Data> t(
        args, net, data(), [&](Batch& b) { return torch::mse_loss(net(b.data), b.target); }, row_options());
    t.train();
    std::vector<torch::Tensor> w;
    for (const auto& [name, v] : t.accelerator().get_state_dict(net))
      w.push_back(v.cpu().clone());
    return std::make_pair(w, net->body[0]->name());
  };
  const auto [plain, plain_first] = checkpointed(false);
  const auto [ckpt, ckpt_first] = checkpointed(true);
  CHECK_MSG(ckpt_first.find("Checkpointed") != std::string::npos,
            "gradient_checkpointing left the block as " << ckpt_first);
  CHECK_MSG(identical(ckpt, plain),
            "gradient_checkpointing changed the weights by up to " << max_diff(ckpt, plain));
  auto no_blocks = base_args(out);
  no_blocks.gradient_checkpointing = true;
  torch::manual_seed(3);
  Mlp mlp(6, 0.0);
  Trainer<Data> refused(
      no_blocks, mlp, data(), [&](Batch& b) { return torch::mse_loss(mlp(b.data), b.target); },
      row_options());
  std::string error;
  try {
    refused.train();
  } catch (const UsageError& e) {
    error = e.what();
  }
  // With FSDP's own activation checkpointing on too: refused, as HF's Trainer refuses the pair.
  Config with_fsdp_ac = cpu_config();
  with_fsdp_ac.backend = "fsdp";
  with_fsdp_ac.fsdp.activation_checkpointing = true;
  std::string pair_error;
  try {
    Trainer<Data> both(
        no_blocks, mlp, data(), [&](Batch& b) { return torch::mse_loss(mlp(b.data), b.target); },
        AcceleratorOptions().config(with_fsdp_ac));
  } catch (const ConfigError& e) {
    pair_error = e.what();
  }
  CHECK_MSG(pair_error.find("cannot both be set; use FSDP's activation_checkpointing") != std::string::npos,
            "gradient_checkpointing with fsdp_activation_checkpointing gave: "
                << (pair_error.empty() ? "no error" : pair_error));
  CHECK_MSG(error.find("TrainingArguments gradient_checkpointing is on, but the model is not a "
                       "torch::nn::Sequential") != std::string::npos,
            "a model without Sequential blocks gave: " << (error.empty() ? "no error" : error));
  remove_shared(out);
}

// A checkpoint whose trainer_state.json was edited, with its manifest rewritten to agree (so the checksums
// pass): refused before training, naming the counters (the fault campaign's silent wrong loads: a resumed run
// trained 21, 30 or 0 steps). global_step -1 is out of range; N - 1 disagrees with the accelerator state's N.
void trainer_edited_state(const std::string& cut_dir, const TrainingArguments& a) {
  Accelerator probe(row_options());
  const auto saved = checkpoint_dirs(cut_dir);
  REQUIRE(!saved.empty());
  const auto source = fs::path(cut_dir) / saved.back();
  const std::int64_t step = std::stoll(saved.back().substr(std::string("checkpoint-").size()));
  const auto edited = fs::path(cut_dir) / "edited";
  for (const auto& [value, want] : std::vector<std::pair<std::string, std::string>>{
           {"-1", "global_step -1 and epoch"},
           {std::to_string(step - 1),
            "says global_step " + std::to_string(step - 1) +
                ", but the accelerator state in the same checkpoint completed " + std::to_string(step) +
                " optimizer steps; the checkpoint is damaged or was edited. Resume from another checkpoint; "
                "nothing was loaded"}}) {
    if (probe.is_main_process()) {
      fs::remove_all(edited);
      fs::copy(source, edited, fs::copy_options::recursive);
      const auto file = edited / "trainer_state.json";
      std::ifstream in(file);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      in.close();
      const std::string field = "\"global_step\": " + std::to_string(step) + ",";
      const auto at = text.find(field);
      REQUIRE(at != std::string::npos);
      text.replace(at, field.size(), "\"global_step\": " + value + ",");
      std::ofstream(file, std::ios::trunc) << text;
      const auto m = accel::detail::read_manifest(edited.string());
      accel::detail::write_manifest(
          edited.string(), accel::detail::build_manifest(edited.string(), m.checkpoint_id, m.facts, {}));
    }
    probe.wait_for_everyone();
    std::string error;
    try {
      trainer_run(
          a, edited.string(), [](Trainer<Data>& t) { t.set_eval(data(12)); }, /*init_seed=*/99);
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    CHECK_MSG(error.find(want) != std::string::npos,
              "resuming with global_step " << value << " gave: " << (error.empty() ? "no error" : error));
    probe.wait_for_everyone();
  }
}

std::vector<double> step_losses(const TrainerState& s) {
  std::vector<double> out;
  for (const auto& entry : s.log_history)
    if (entry.count("loss") > 0 && entry.count("train_runtime") == 0) out.push_back(entry.at("loss"));
  return out;
}

// A checkpoint written during a second train() of one Trainer (HF's Trainer: each train() a new run, its
// global_step from 0) resumes, in the same Trainer and in a new one, to that run's weights bit for bit and
// its per-step losses, though the Accelerator's own count of optimizer steps is ahead by the first run's.
// Mid-epoch (checkpoint-4 of 3-step epochs). On the ZeRO-3 row only (the suite's time): parameters, gradients
// and optimizer state sharded over the ranks.
void trainer_resume_second_run() {
  const std::string out = fresh_dir("second_run");
  auto a = base_args(out);
  a.save_strategy = "steps";
  a.save_steps = 4;
  torch::manual_seed(3);
  Mlp model(6, 0.1);
  Trainer<Data> trainer(
      a, model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); }, row_options());
  trainer.train();
  const auto first = step_losses(trainer.state());
  trainer.train();
  const auto second = step_losses(trainer.state());
  const auto weights = whole(trainer.accelerator(), model);
  CHECK_MSG(second.size() == 6 && first != second,
            "the second run logged " << second.size() << " losses, want 6 of its own");
  const std::string checkpoint = (fs::path(out) / "checkpoint-4").string();
  trainer.train(checkpoint);
  const auto again = whole(trainer.accelerator(), model);  // collective: not inside a message
  CHECK_MSG(identical(again, weights),
            backend_variant << ": the same Trainer resumed its second run's checkpoint-4; the weights differ "
                            << "by up to " << max_diff(again, weights));
  CHECK_MSG(step_losses(trainer.state()) == second, "the same Trainer resumed to other losses");
  const auto resumed = trainer_run(a, checkpoint, {}, /*init_seed=*/99);
  CHECK_MSG(
      identical(resumed.weights, weights),
      backend_variant << ": a new Trainer resumed the second run's checkpoint-4; the weights differ by up "
                      << "to " << max_diff(resumed.weights, weights));
  CHECK_MSG(step_losses(resumed.state) == second, "a new Trainer resumed to other losses");
  remove_shared(out);
}

void trainer_resume() {
  if (backend_variant == "zero3") trainer_resume_second_run();
  const std::string straight_dir = fresh_dir("straight"), cut_dir = fresh_dir("cut");
  auto a = base_args(straight_dir);
  a.save_strategy = "steps";
  a.save_steps = 2;
  // An evaluation at each epoch's end: a run cut at an epoch's last step must still evaluate that epoch
  // once, as the uninterrupted run does (it was skipped when the checkpoint came before the epoch's end).
  a.eval_strategy = "epoch";
  // on_epoch_begin / on_epoch_end calls: a run cut at an epoch's last step and resumed makes as many as the
  // uninterrupted run (as HF's, which resumes at the next epoch); cut mid-epoch, the resumed run begins the
  // interrupted epoch once more (as HF's).
  struct EpochCounter : TrainerCallback {
    int* begins;
    int* ends;
    EpochCounter(int* b, int* e) : begins(b), ends(e) {}
    std::string name() const override { return "EpochCounter"; }
    void on_epoch_begin(const TrainingArguments&, TrainerState&, TrainerControl&) override { ++*begins; }
    void on_epoch_end(const TrainingArguments&, TrainerState&, TrainerControl&) override { ++*ends; }
  };
  int begins = 0, ends = 0;
  const auto with_eval = [&begins, &ends](Trainer<Data>& t) {
    t.set_eval(data(12));
    t.add_callback(std::make_shared<EpochCounter>(&begins, &ends));
  };
  const auto straight = trainer_run(a, "", with_eval);
  const int straight_begins = begins, straight_ends = ends;
  // The same run, where the last rank alone is sent SIGUSR1 (as a scheduler's preemption) during step
  // `stop`: mid-epoch (step 4 on 1 and 2 ranks), and at the last step of the first epoch (the resumed loader
  // then starts the next epoch).
  const std::int64_t per_epoch = straight.state.max_steps / 2;
  for (const std::int64_t stop : {std::int64_t{4}, per_epoch}) {
    a.output_dir = cut_dir;
    begins = ends = 0;
    const auto cut = trainer_run(a, "", [stop, with_eval](Trainer<Data>& t) {
      with_eval(t);
      struct Preempt : TrainerCallback {
        Accelerator* acc;
        std::int64_t at;
        Preempt(Accelerator* a, std::int64_t s) : acc(a), at(s) {}
        std::string name() const override { return "Preempt"; }
        void on_step_begin(const TrainingArguments&, TrainerState& s, TrainerControl&) override {
          if (s.global_step == at - 1 && acc->process_index() == acc->num_processes() - 1)
            std::raise(SIGUSR1);
        }
      };
      t.add_callback(std::make_shared<Preempt>(&t.accelerator(), stop));
    });
    CHECK_MSG(cut.output.interrupted, "SIGUSR1 did not stop the run");
    CHECK_MSG(cut.state.global_step == stop,
              "stopped at step " << cut.state.global_step << ", want " << stop << " on every rank");
    const auto saved = fs::path(cut_dir) / ("checkpoint-" + std::to_string(stop));
    CHECK_MSG(fs::exists(saved / "trainer_state.json"), "no " << saved.string());
    // A fresh model (another init) resumed from the newest checkpoint.
    const auto resumed = trainer_run(a, "latest", with_eval, /*init_seed=*/99);
    const bool at_epoch_end = stop % per_epoch == 0;
    CHECK_MSG(begins == straight_begins + (at_epoch_end ? 0 : 1) && ends == straight_ends,
              "cut at " << stop << " and resumed: " << begins << " on_epoch_begin and " << ends
                        << " on_epoch_end calls, the uninterrupted run " << straight_begins << " and "
                        << straight_ends);
    CHECK_MSG(identical(resumed.weights, straight.weights),
              backend_variant << ": resumed at step " << stop
                              << ", the weights differ from the uninterrupted run's by up to "
                              << max_diff(resumed.weights, straight.weights));
    CHECK_MSG(resumed.state.global_step == straight.state.global_step,
              "resumed to step " << resumed.state.global_step << ", straight " << straight.state.global_step);
    // The log history continues from the checkpoint: one entry per step, then the summary, as straight.
    CHECK_MSG(resumed.state.log_history.size() == straight.state.log_history.size(),
              resumed.state.log_history.size()
                  << " entries after resume, " << straight.state.log_history.size() << " straight");
    for (std::size_t i = 0;
         i + 1 < straight.state.log_history.size() && i + 1 < resumed.state.log_history.size(); ++i) {
      const auto& want = straight.state.log_history[i];
      const auto& got = resumed.state.log_history[i];
      for (const char* key : {"loss", "eval_loss"}) {
        CHECK_MSG(want.count(key) == got.count(key) && (want.count(key) == 0 || want.at(key) == got.at(key)),
                  "resumed at " << stop << ": log entry " << i << " differs in " << key << " (straight "
                                << (want.count(key) ? std::to_string(want.at(key)) : std::string("none"))
                                << ", resumed "
                                << (got.count(key) ? std::to_string(got.at(key)) : std::string("none"))
                                << ")");
      }
    }
    if (stop == 4) trainer_edited_state(cut_dir, a);
    remove_shared(cut_dir);
    Accelerator(row_options()).wait_for_everyone();  // rank 0 removed it before the next cut runs
  }
  remove_shared(straight_dir);
  remove_shared(cut_dir);
}

void trainer_save_best();

void trainer_best() {
  const std::string out = fresh_dir("best");
  auto a = base_args(out);
  a.max_steps = 8;
  a.eval_strategy = "steps";
  a.eval_steps = 2;
  a.save_strategy = "steps";
  a.save_steps = 2;
  a.save_total_limit = 2;
  a.load_best_model_at_end = true;
  a.metric_for_best_model = "loss";
  a.greater_is_better = true;  // the highest eval loss (an early step) is "best": not the latest
  a.validate();
  torch::manual_seed(3);
  Mlp model(6, 0.1);
  Trainer<Data> trainer(
      a, model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); }, row_options());
  trainer.set_eval(data(22));  // 22 samples: the last round is uneven on 2 and 3 ranks
  trainer.train();
  const auto& state = trainer.state();
  const auto best_step = state.best_global_step.value_or(-1);
  const auto left = checkpoint_dirs(out);
  std::vector<std::string> want = {"checkpoint-" + std::to_string(best_step), "checkpoint-8"};
  std::sort(want.begin(), want.end());
  CHECK_MSG(best_step != 8 && best_step > 0,
            "the best step is " << best_step << "; the test needs an earlier one");
  CHECK_MSG(left == want, "left " << left.size() << " checkpoints: " << (left.empty() ? "" : left.front())
                                  << " ... " << (left.empty() ? "" : left.back()) << "; want checkpoint-"
                                  << best_step << " and checkpoint-8");
  CHECK_MSG(
      state.best_model_checkpoint == (fs::path(out) / ("checkpoint-" + std::to_string(best_step))).string(),
      "best_model_checkpoint " << state.best_model_checkpoint.value_or("none"));
  // Evaluation entries (gathered with gather_for_metrics) are the same on every rank.
  std::vector<double> evals;
  for (const auto& e : state.log_history)
    if (e.count("eval_loss")) evals.push_back(e.at("eval_loss"));
  CHECK_MSG(evals.size() == 4, evals.size() << " evaluations, want 4");
  const auto all = trainer.accelerator().gather_object(evals);  // every rank's list, one after the other
  CHECK_MSG(all.size() == evals.size() * static_cast<std::size_t>(trainer.accelerator().num_processes()),
            "gathered " << all.size() << " values");
  for (std::size_t i = 0; i < all.size(); ++i)
    CHECK_MSG(all[i] == evals[i % evals.size()],
              "eval_loss " << i % evals.size() << " differs between ranks");
  // The model ends as the best checkpoint's: evaluating it again gives the best metric exactly.
  const auto metrics = trainer.evaluate();
  CHECK_MSG(metrics.at("eval_loss") == state.best_metric.value_or(-1),
            "after load_best_model_at_end eval_loss is " << metrics.at("eval_loss") << ", the best was "
                                                         << state.best_metric.value_or(-1));
  remove_shared(out);
  trainer_save_best();
}

// save_strategy best (HF 4.46+): a checkpoint at each evaluation that sets a new best, none at the end.
void trainer_save_best() {
  const std::string out = fresh_dir("save_best");
  auto a = base_args(out);
  a.max_steps = 8;
  a.eval_strategy = "steps";
  a.eval_steps = 2;
  a.save_strategy = "best";
  a.metric_for_best_model = "loss";
  a.greater_is_better = true;  // the loss falls: only the first evaluation is a new best
  a.validate();
  torch::manual_seed(3);
  Mlp model(6, 0.1);
  Trainer<Data> trainer(
      a, model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); }, row_options());
  trainer.set_eval(data(22));
  trainer.train();
  std::vector<std::string> want;
  std::optional<double> best;
  for (const auto& e : trainer.state().log_history) {
    if (!e.count("eval_loss")) continue;
    if (!best || e.at("eval_loss") > *best) {
      best = e.at("eval_loss");
      want.push_back("checkpoint-" + std::to_string(static_cast<std::int64_t>(e.at("step"))));
    }
  }
  const auto left = checkpoint_dirs(out);
  std::sort(want.begin(), want.end());
  CHECK_MSG(!want.empty() && want.size() < 4,
            want.size() << " of 4 evaluations set a new best; the test needs some that do not");
  CHECK_MSG(left == want, "save_strategy best left " << left.size() << " checkpoints, want " << want.size()
                                                     << " (" << (want.empty() ? "" : want.front()) << ")");
  CHECK_MSG(trainer.state().best_model_checkpoint.has_value(), "no best_model_checkpoint recorded");
  remove_shared(out);
}

void trainer_early_stop() {
  const std::string out = fresh_dir("early");
  auto a = base_args(out);
  a.max_steps = 20;
  a.eval_strategy = "steps";
  a.eval_steps = 1;
  a.save_strategy = "steps";
  a.save_steps = 1;
  a.load_best_model_at_end = true;
  a.metric_for_best_model = "loss";
  a.greater_is_better = true;  // the loss falls: no evaluation after the first improves
  a.save_total_limit = 1;
  a.validate();
  std::vector<std::int64_t> steps;
  auto run = trainer_run(a, "", [&](Trainer<Data>& t) {
    t.set_eval(data(22));
    t.add_callback(std::make_shared<EarlyStoppingCallback>(2));
  });
  {
    Accelerator acc(row_options());
    steps = acc.gather_object(run.state.global_step);
  }
  for (const auto s : steps)
    CHECK_MSG(s == steps.front(), "ranks stopped at different steps");
  CHECK_MSG(run.state.global_step < 20, "early stopping did not stop (step " << run.state.global_step << ")");
  remove_shared(out);
}

void trainer_nonfinite() {
  const std::string out = fresh_dir("nan");
  auto a = base_args(out);
  a.max_steps = 4;
  for (const std::string policy : {"skip", "stop"}) {
    a.nonfinite_loss = policy;
    torch::manual_seed(3);
    Mlp model(6, 0.1);
    Trainer<Data>* self = nullptr;
    int calls = 0;
    // The last rank's loss is NaN on the first micro-batch of step 2.
    Trainer<Data> trainer(
        a, model, data(),
        [&](Batch& b) {
          auto loss = torch::mse_loss(model(b.data), b.target);
          auto& acc = self->accelerator();
          if (calls++ == 2 && acc.process_index() == acc.num_processes() - 1) loss = loss * std::nan("");
          return loss;
        },
        row_options());
    self = &trainer;
    const std::string last = std::to_string(trainer.accelerator().num_processes() - 1);
    if (policy == "stop") {
      try {
        trainer.train();
        CHECK_MSG(false, "nonfinite_loss stop: training went on after a NaN loss");
      } catch (const Error& e) {
        CHECK_MSG(std::string(e.what()).find("rank(s) " + last) != std::string::npos &&
                      std::string(e.what()).find("step 2") != std::string::npos,
                  "the error does not name step 2 and rank " << last << ": " << e.what());
      }
      continue;
    }
    trainer.train();
    const auto& state = trainer.state();
    CHECK_MSG(state.skipped_steps == 1, "skipped " << state.skipped_steps << " steps, want 1 on every rank");
    CHECK_MSG(state.global_step == 4, "global_step " << state.global_step);
    auto w = whole(trainer.accelerator(), model);
    double sum = 0;
    for (const auto& t : w) {
      CHECK_MSG(torch::isfinite(t).all().item<bool>(), "a weight is NaN after the skipped step");
      sum += t.sum().item<double>();
    }
    // Every replica took the same steps (DDP replicas would diverge if one rank stepped alone).
    for (const auto v : trainer.accelerator().gather_object(sum))
      CHECK_MSG(v == sum, "replicas differ");
  }
  remove_shared(out);
}

// Where TrainingArguments and the Accelerate config both speak (precision, accumulation, clipping, seed,
// trackers), a value set in one of them wins and two different values are a ConfigError naming both.
void trainer_config_merge() {
  auto make = [](TrainingArguments a, Config c) {
    torch::manual_seed(3);
    Mlp model(6, 0.1);
    Trainer<Data> t(
        std::move(a), model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); },
        AcceleratorOptions().config(c));
    return t.accelerator().config();
  };
  Config c = cpu_config();
  c.source = "accelerate.yaml";
  TrainingArguments a;
  a.output_dir = "unused";
  a.source = "run.yaml";
  a.bf16 = true;
  c.mixed_precision = MixedPrecision::Fp16;
  try {
    make(a, c);
    CHECK_MSG(false, "bf16 in TrainingArguments and fp16 in the Accelerate config were accepted");
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    CHECK_MSG(m.find("bf16") != std::string::npos && m.find("fp16") != std::string::npos &&
                  m.find("run.yaml") != std::string::npos && m.find("accelerate.yaml") != std::string::npos,
              "the conflict message does not name both keys and files: " << m);
  }
  c.mixed_precision = MixedPrecision::No;
  CHECK_MSG(make(a, c).mixed_precision == MixedPrecision::Bf16,
            "bf16 from TrainingArguments was not applied");
  a.bf16 = false;
  c.mixed_precision = MixedPrecision::Bf16;
  CHECK_MSG(make(a, c).mixed_precision == MixedPrecision::Bf16, "the Accelerate config's bf16 was dropped");
  c.mixed_precision = MixedPrecision::No;
  // Accumulation: the config's 4 with the arguments' default 1 -> 4; an explicit 2 against 4 -> error.
  c.gradient_accumulation_steps = 4;
  CHECK_MSG(make(a, c).gradient_accumulation_steps == 4, "the Accelerate config's accumulation was dropped");
  a.gradient_accumulation_steps = 2;
  a.explicit_keys.push_back("gradient_accumulation_steps");
  CHECK_THROWS_WITH(make(a, c), Catch::Matchers::Contains("gradient_accumulation_steps"));
  c.gradient_accumulation_steps = 1;
  CHECK_MSG(make(a, c).gradient_accumulation_steps == 2, "TrainingArguments' accumulation was not applied");
  // Clipping: DeepSpeed's gradient_clipping 1.0 against max_grad_norm 0.5.
  c.zero.gradient_clipping = 1.0;
  a.max_grad_norm = 0.5;
  CHECK_THROWS_WITH(make(a, c), Catch::Matchers::Contains("gradient_clipping"));
  c.zero.gradient_clipping = 0;
  // DeepSpeed's gradient_clipping "auto" (a JSON file's, or a YAML deepspeed_config section without it, which
  // Accelerate leaves "auto") is max_grad_norm under HF's Trainer (HfTrainerDeepSpeedConfig.fill_match), not
  // Accelerate's 1.0: max_grad_norm 0.5 clips at 0.5 (was refused as a conflict), 0 does not clip (clipped at
  // 1.0). The configs are read from files as a user brings them (the Qwen project's ds_config_zero2.json).
  {
    const auto json = fs::temp_directory_path() / ("ds_clip_auto_" + std::to_string(::getpid()) + ".json");
    std::ofstream(json) << R"({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto",
                              "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"})";
    for (const std::string& section :
         {std::string("  zero_stage: 2\n"), "  deepspeed_config_file: " + json.string() + "\n"}) {
      const Config ds = Config::load_string(
          "backend: zero\nuse_cpu: true\nnum_processes: 2\ndeepspeed_config:\n" + section, "ds.yaml");
      c.zero.gradient_clipping = ds.zero.gradient_clipping;
      c.zero.gradient_clipping_auto = ds.zero.gradient_clipping_auto;
      c.zero.trainer_keys = ds.zero.trainer_keys;
      c.origins = ds.origins;
      for (const double norm : {0.5, 0.0}) {
        a.max_grad_norm = norm;
        const double got = make(a, c).zero.gradient_clipping;
        CHECK_MSG(got == norm, "deepspeed_config " << section << " with gradient_clipping auto ("
                                                   << c.origins["gradient_clipping"] << "): max_grad_norm "
                                                   << norm << " gave gradient_clipping " << got);
      }
    }
    fs::remove(json);
    c.zero.gradient_clipping = 0;
    c.zero.gradient_clipping_auto = false;
    c.zero.trainer_keys.clear();
    c.origins.clear();
    a.max_grad_norm = 0.5;
  }
  // The other format's block switched off in the JSON leaves TrainingArguments' precision on (HF:
  // Accelerate's set_mixed_precision adds the wanted block; fill_match then has nothing to check): it trained
  // in fp32.
  {
    const auto json = fs::temp_directory_path() / ("ds_precision_" + std::to_string(::getpid()) + ".json");
    const struct {
      const char* text;
      bool bf16;
      MixedPrecision want;
    } cases[] = {
        {R"({"zero_optimization": {"stage": 2}, "fp16": {"enabled": false}})", true, MixedPrecision::Bf16},
        {R"({"zero_optimization": {"stage": 2}, "bf16": {"enabled": false}, "fp16": {"enabled": "auto"}})",
         false, MixedPrecision::Fp16}};
    for (const auto& k : cases) {
      std::ofstream(json) << k.text;
      const Config ds = Config::load_string(
          "backend: zero\nuse_cpu: true\nnum_processes: 2\ndeepspeed_config:\n"
          "  deepspeed_config_file: " +
              json.string() + "\n",
          "ds.yaml");
      Config d = c;
      d.mixed_precision = ds.mixed_precision;
      d.zero.trainer_keys = ds.zero.trainer_keys;
      TrainingArguments p = a;
      p.bf16 = k.bf16;
      p.fp16 = !k.bf16;
      const auto got = make(p, d).mixed_precision;
      CHECK_MSG(got == k.want, k.text << " with TrainingArguments " << (k.bf16 ? "bf16" : "fp16")
                                      << " gave mixed_precision " << to_string(got));
    }
    fs::remove(json);
  }
  // Seed and trackers.
  c.seed = 7;
  a.explicit_keys.push_back("seed");
  CHECK_THROWS_WITH(make(a, c), Catch::Matchers::Contains("seed"));
  c.seed.reset();
  c.log_with = "csv";
  a.report_to = {"tensorboard"};
  CHECK_THROWS_WITH(make(a, c),
                    Catch::Matchers::Contains("report_to") && Catch::Matchers::Contains("log_with"));
  a.report_to = {"none"};
  CHECK_MSG(make(a, c).log_with == "csv", "the Accelerate config's log_with was dropped");
  // AcceleratorOptions().log_with counts as the Accelerate side too.
  c.log_with.clear();
  a.report_to = {"tensorboard"};
  try {
    torch::manual_seed(3);
    Mlp model(6, 0.1);
    Trainer<Data> t(
        a, model, data(), [&](Batch& b) { return torch::mse_loss(model(b.data), b.target); },
        AcceleratorOptions().config(c).log_with("csv"));
    CHECK_MSG(false, "report_to tensorboard and AcceleratorOptions().log_with(\"csv\") were both accepted");
  } catch (const ConfigError& e) {
    CHECK_MSG(std::string(e.what()).find("report_to") != std::string::npos, e.what());
  }
}

// Under `accel-launch launch --max_restarts 1` (tests/launcher/restart_resume.sh): on the first attempt rank
// 1 is killed (SIGKILL) while checkpoint-4 is being written; the restarted ranks train("latest"), which
// resumes from checkpoint-3, the newest complete one, and end with the uninterrupted run's weights, bit for
// bit.
void trainer_restart() {
  const char* dir = std::getenv("ACCEL_TEST_SAVE_DIR");
  REQUIRE(dir != nullptr);
  const int attempt = std::atoi(std::getenv(env::kRestartCount) ? std::getenv(env::kRestartCount) : "0");
  auto a = base_args((fs::path(dir) / ("straight_" + std::to_string(attempt))).string());
  a.save_strategy = "steps";
  a.save_steps = 1;
  a.save_total_limit = 2;
  const auto straight = trainer_run(a);
  a.output_dir = (fs::path(dir) / "cut").string();
  const auto resumed = trainer_run(
      a, "latest",
      [attempt](Trainer<Data>& t) {
        auto& acc = t.accelerator();
        acc.register_save_state_pre_hook([attempt, &acc](const std::string& tmp) {
          if (attempt == 0 && acc.process_index() == 1 && acc.completed_steps() == 4) ::raise(SIGKILL);
          (void)tmp;
        });
      },
      /*init_seed=*/attempt == 0 ? 3 : 99);  // the restarted attempt starts from another init: all is loaded
  CHECK_MSG(identical(resumed.weights, straight.weights),
            backend_variant << ": after the restart the weights differ from the uninterrupted run's by up to "
                            << max_diff(resumed.weights, straight.weights));
  if (std::getenv("RANK") == nullptr || std::string(std::getenv("RANK")) == "0") {
    std::cout << "trainer_restart: attempt " << attempt << " ended at step " << resumed.state.global_step
              << " with the uninterrupted run's weights: "
              << (identical(resumed.weights, straight.weights) ? "yes" : "no") << std::endl;
  }
}

}  // namespace

std::map<std::string, std::function<void()>> trainer_scenarios() {
  return {{"trainer_equals_loop", trainer_equals_loop},
          {"trainer_resume", trainer_resume},
          {"trainer_best", trainer_best},
          {"trainer_early_stop", trainer_early_stop},
          {"trainer_nonfinite", trainer_nonfinite},
          {"trainer_config_merge", trainer_config_merge},
          {"trainer_restart", trainer_restart}};
}

}  // namespace dist
