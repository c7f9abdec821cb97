/// \file test_check.cpp
/// accel-test-check: what `accel-launch test` runs on the configured ranks (Accelerate's `accelerate test`
/// script): the process layout, the collectives, the data loader's sharding, and a few training steps with
/// the config's backend, precision and accumulation, compared with the same steps computed by one process
/// on the whole batch. Prints one line per check and exits non-zero on the first that fails.
#include <accel/accelerator/accelerator.hpp>
#include <accel/accelerator/resolved_config.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

struct CheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw CheckFailed(what);
}

// A dataset of `n` rows whose features hold the row's index, so each rank can tell which rows it got.
struct Rows : torch::data::datasets::Dataset<Rows> {
  explicit Rows(std::int64_t n) : x(torch::randn({n, 8})), y(torch::randn({n, 1})), n(n) {
    x.select(1, 0).copy_(torch::arange(n, torch::kFloat32));
  }
  torch::data::Example<> get(std::size_t i) override {
    return {x[static_cast<std::int64_t>(i)], y[static_cast<std::int64_t>(i)]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(n); }
  torch::Tensor x, y;
  std::int64_t n;
};

// A block repeated in a Sequential, as a transformer's layers are: FSDP's TRANSFORMER_BASED_WRAP (and its
// automatic choice of the block type) finds something to wrap in the check model too, and activation
// checkpointing (which checkpoints a model's Sequential children) something to checkpoint.
struct CheckBlockImpl : torch::nn::Module {
  CheckBlockImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(CheckBlock);

// With tensor parallelism (tp_size > 1): a block of two layers, Megatron's pair when `group` is given (the
// first split by rows, the second by columns: one all-reduce per forward), plain Linears for the reference.
struct TpCheckBlockImpl : torch::nn::Module {
  explicit TpCheckBlockImpl(const std::shared_ptr<accel::Communicator>& group = nullptr) {
    torch::nn::Linear full1(16, 16), full2(16, 16);
    if (group) {
      column = register_module("fc1", accel::tp::ColumnParallelLinear(full1, group, /*gather_output=*/false));
      row = register_module("fc2", accel::tp::RowParallelLinear(full2, group, /*input_is_parallel=*/true));
    } else {
      fc1 = register_module("fc1", full1);
      fc2 = register_module("fc2", full2);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + (row ? row(torch::tanh(column(x))) : fc2(torch::tanh(fc1(x))));
  }
  accel::tp::ColumnParallelLinear column{nullptr};
  accel::tp::RowParallelLinear row{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TpCheckBlock);

struct Net : torch::nn::Module {
  /// `tensor_parallel`: TpCheckBlocks, split over `group` (nullptr: the unsplit reference).
  explicit Net(bool tensor_parallel = false, const std::shared_ptr<accel::Communicator>& group = nullptr) {
    a = register_module("a", torch::nn::Linear(8, 16));
    blocks = register_module("blocks", tensor_parallel
                                           ? torch::nn::Sequential(TpCheckBlock(group), TpCheckBlock(group))
                                           : torch::nn::Sequential(CheckBlock(), CheckBlock()));
    b = register_module("b", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // Column 0 holds the row index (for the sharding check): the model reads the other columns.
    auto h = torch::tanh(a(torch::cat({torch::zeros_like(x.narrow(1, 0, 1)), x.narrow(1, 1, 7)}, 1)));
    return b(blocks->forward(h));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Sequential blocks{nullptr};
};

// The config as the user's program would get it, except that a TRANSFORMER_BASED_WRAP class list names the
// user's model's classes (LlamaDecoderLayer, ...): the check model's block stands in for them.
accel::Config check_config() {
  accel::Config config = accel::resolved_config(accel::AcceleratorOptions());
  auto& fsdp = config.fsdp;
  if (fsdp.auto_wrap_policy == accel::AutoWrapPolicy::TransformerBasedWrap &&
      !fsdp.transformer_layer_cls_to_wrap.empty()) {
    const std::string block = config.tensor_parallel_size > 1 ? TpCheckBlock()->name() : CheckBlock()->name();
    config.notices.push_back(
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap: " + fsdp.transformer_layer_cls_to_wrap +
        " (your model's) is replaced by the check model's block " + block);
    fsdp.transformer_layer_cls_to_wrap = block;
  }
  return config;
}

torch::Tensor flat_weights(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters())
    parts.push_back(p.detach().to(torch::kCPU, torch::kFloat32).reshape({-1}));
  return torch::cat(parts);
}

// 1. The process layout every rank sees.
void check_process_layout(accel::Accelerator& acc, int rank, int world) {
  const auto ranks = acc.gather(torch::tensor({static_cast<std::int64_t>(rank)}, torch::kInt64));
  require(torch::equal(ranks.cpu(), torch::arange(world, torch::kInt64)),
          "every rank has a distinct RANK in 0..WORLD_SIZE-1");
  acc.print("  ok  process layout: ranks 0..", world - 1);
}

// 2. Collectives: a sum and a broadcast.
void check_collectives(accel::Accelerator& acc, int rank, int world) {
  auto value = torch::tensor({static_cast<double>(rank + 1)}, torch::kFloat64).to(acc.device());
  const double sum = acc.reduce(value, accel::ReduceOp::Sum).item<double>();
  require(sum == world * (world + 1) / 2.0, "all-reduce sum of rank + 1");
  const auto from_main =
      acc.broadcast(torch::tensor({rank == 0 ? 42.0 : -1.0}, torch::kFloat64).to(acc.device()), 0);
  require(from_main.item<double>() == 42.0, "broadcast from the main process");
  acc.print("  ok  collectives: all-reduce and broadcast");
}

// 3. The data loader: every row exactly once per epoch over all ranks (even_batches may repeat rows to
//    complete the last round: gather_for_metrics drops them again). Returns the prepared loader, which main
//    keeps (registered with the accelerator) until its end.
auto check_data_loader(accel::Accelerator& acc, int world) {
  torch::manual_seed(1234);
  const std::int64_t rows = 8 * world * 3 + 3;
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Rows(rows).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(8));
  std::vector<std::int64_t> seen;
  for (auto& batch : *loader) {
    const auto ids = acc.gather_for_metrics(batch.data.select(1, 0).contiguous()).to(torch::kInt64).cpu();
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      seen.push_back(ids[i].item<std::int64_t>());
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(rows));
  std::iota(all.begin(), all.end(), 0);
  std::sort(seen.begin(), seen.end());
  require(seen == all, "the prepared data loader yields every row exactly once per epoch over all ranks");
  acc.print("  ok  data loader: ", rows, " rows, each once over ", world, " rank(s)");
  return loader;
}

// The reference of check 4: `steps` optimizer steps of one process on the whole batch of 4 x `world` rows,
// clipped to `clip` before each step when the config clips (deepspeed_config.gradient_clipping).
// One process on the whole batch; a step the prepared run skipped (fp16 overflow: the loss scaler's first
// scales may be too high) is skipped here too, so the comparison checks the distribution, not the scaler.
void train_reference(Net& reference, const Rows& data, int world, int steps, int gas, double clip,
                     const std::vector<bool>& skipped) {
  torch::optim::SGD ref_opt(reference.parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < steps; ++s) {
    if (skipped[static_cast<std::size_t>(s)]) continue;
    ref_opt.zero_grad();
    for (int m = 0; m < gas; ++m) {
      const auto start = (s * gas + m) * 4 * world;
      const auto loss = torch::mse_loss(reference.forward(data.x.narrow(0, start, 4 * world)),
                                        data.y.narrow(0, start, 4 * world)) /
                        gas;
      loss.backward();
    }
    if (clip > 0) torch::nn::utils::clip_grad_norm_(reference.parameters(), clip);
    ref_opt.step();
  }
}

// The same steps through the accelerator: batch 4 per rank, `model` and `opt` prepared. Returns which
// optimizer steps the fp16 loss scaler skipped.
std::vector<bool> train_prepared(accel::Accelerator& acc, std::shared_ptr<Net>& model, torch::optim::SGD& opt,
                                 const Rows& data, int rank, int world, int steps, int gas) {
  // With tensor parallelism `rank` and `world` are the data-parallel ones: the ranks of a tensor-parallel
  // group read the same rows.
  std::vector<bool> skipped(static_cast<std::size_t>(steps), false);
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < gas; ++m) {
      auto scope = acc.accumulate(model);
      const auto start = (s * gas + m) * 4 * world + 4 * rank;
      const auto x = data.x.narrow(0, start, 4).to(acc.device());
      const auto y = data.y.narrow(0, start, 4).to(acc.device());
      acc.backward(torch::mse_loss(model->forward(x).to(torch::kFloat32), y));
      opt.step();
      if (acc.sync_gradients() && acc.optimizer_step_was_skipped())
        skipped[static_cast<std::size_t>(s)] = true;
      opt.zero_grad();
    }
  }
  return skipped;
}

// The prepared model's floating-point state, flattened in state-dict order.
torch::Tensor trained_weights(accel::Accelerator& acc, std::shared_ptr<Net>& model) {
  const auto state = acc.get_state_dict(model);
  std::vector<torch::Tensor> parts;
  for (const auto& [name, t] : state) {
    if (t.is_floating_point()) parts.push_back(t.to(torch::kCPU, torch::kFloat32).reshape({-1}));
  }
  return torch::cat(parts);
}

// The end of check 4: the prepared model's weights (`trained`) against the reference's.
void compare_weights(accel::Accelerator& acc, const torch::Tensor& trained, Net& reference, int world,
                     int steps) {
  if (const char* fault = std::getenv("ACCEL_TEST_CHECK_FAULT"); fault && std::string(fault) == "weights") {
    trained.add_(1e-2);  // used by the test of `accel-launch test` itself: the comparison must catch it
  }
  const auto expected = flat_weights(reference);
  const double tolerance = acc.config().mixed_precision == accel::MixedPrecision::No ? 1e-5 : 5e-2;
  const double diff = (trained - expected).abs().max().item<double>();
  std::ostringstream why;
  why << "training on " << world << " rank(s) with " << acc.backend_name()
      << " matches one process on the whole batch (max difference " << diff << ", tolerance " << tolerance
      << ")";
  require(diff <= tolerance, why.str());
  acc.print("  ok  training: ", steps, " steps match one process (max difference ", diff, ")");
}

}  // namespace

int main() try {
  accel::Accelerator acc(accel::AcceleratorOptions().config(check_config()));
  const int rank = acc.process_index();
  const int world = acc.num_processes();
  const auto& config = acc.config();
  acc.print("accel-test-check: ", world, " process(es), backend ", acc.backend_name(), ", device ",
            acc.device().str(), ", mixed_precision ", accel::to_string(config.mixed_precision),
            ", gradient_accumulation_steps ", config.gradient_accumulation_steps);
  check_process_layout(acc, rank, world);
  check_collectives(acc, rank, world);
  const auto loader = check_data_loader(acc, world);

  // 4. Training: 4 optimizer steps with batch 4 per data-parallel rank, against one process with batch 4 x N
  //    computed on every rank without the accelerator. With tensor parallelism (tp_size) the check model's
  //    blocks are split over each tensor-parallel group and N is the number of data-parallel ranks.
  const int gas = config.gradient_accumulation_steps;
  const int steps = 4;
  const auto tp_group = acc.tensor_parallel_group();
  const bool tensor_parallel = tp_group->world_size() > 1;
  const int data_rank = acc.data_parallel_group()->rank();
  const int data_world = acc.data_parallel_group()->world_size();
  if (tensor_parallel) {
    acc.print("  note: tp_size ", tp_group->world_size(), ": the check model's blocks are tensor-parallel, ",
              data_world, " data-parallel rank(s)");
  }
  torch::manual_seed(7);
  Rows data(4 * data_world * steps * gas);
  torch::manual_seed(99);
  auto reference = std::make_shared<Net>(tensor_parallel);
  torch::manual_seed(99);
  auto model = std::make_shared<Net>(tensor_parallel, tensor_parallel ? tp_group : nullptr);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  acc.prepare(model, opt);
  const std::vector<bool> skipped = train_prepared(acc, model, opt, data, data_rank, data_world, steps, gas);
  const auto n_skipped = std::count(skipped.begin(), skipped.end(), true);
  if (n_skipped > 0) {
    acc.print("  note: the fp16 loss scaler skipped ", n_skipped, " of ", steps,
              " steps (gradients overflowed at its scale); the reference skips them too");
  }
  // On a thread of its own: prepare() switched mixed-precision autocast on for this thread, and the
  // reference is one plain fp32 process.
  std::thread([&] {
    train_reference(*reference, data, data_world, steps, gas, accel::automatic_gradient_clipping(config),
                    skipped);
  }).join();
  compare_weights(acc, trained_weights(acc, model), *reference, world, steps);
  acc.wait_for_everyone();
  acc.print("accel-test-check: all checks passed");
  return 0;
} catch (const CheckFailed& e) {
  std::cerr << "accel-test-check: FAILED: " << e.what() << std::endl;
  return 1;
} catch (const std::exception& e) {
  std::cerr << "accel-test-check: error: " << e.what() << std::endl;
  return 1;
}
