// One rank of the tensor-parallel tests. CTest starts it on 2 or 3 ranks (4 for tp x dp) through
// accel-launch; each rank builds the parallel layers from the same full layers as an unsplit reference in
// this same process and checks outputs, gradients (its slice of the full gradient) and weights after SGD
// steps against it. The scenario runs as the one Catch2 test case of the process (as pipeline_worker).
//
//   tensor_parallel_worker mlp          Column -> GELU -> Row against Linear -> GELU -> Linear; seeded layers
//   tensor_parallel_worker embedding    VocabParallelEmbedding against torch::nn::Embedding
//   tensor_parallel_worker count        one all-reduce in forward and one in backward per Column-Row pair
//   tensor_parallel_worker bad_size     sizes not divisible by the group, wrong inputs: UsageError
//   tensor_parallel_worker tp_dp        (4 ranks) 2-way tensor x 2-way data parallel against one process
//   tensor_parallel_worker accelerator  (4 ranks) the same through Accelerator (tensor_parallel_size 2, ddp)
//   tensor_parallel_worker config_tp    (4 ranks) the same with tp_size 2 from a config's parallelism_config
//   tensor_parallel_worker megatron_tp  (4 ranks) the same from Accelerate's Megatron-LM file (tp_degree 2,
//                                       recomputed activations, the backend clipping)
//   tensor_parallel_worker export_<ddp|zero2|zero3|fsdp_full_shard>  (2 or 4 ranks) Accelerator with
//                                       tensor_parallel_size 2 on that backend: clip_grad_norm_ (2-norm and
//                                       inf) as one process clips the unsplit model, get_state_dict and
//                                       save_model write the unsplit model, load_model slices it back
//   tensor_parallel_worker pipeline     (4 or 8 ranks) 2 pipeline stages x 2-way tensor parallel (x 2
//   replicas
//                                       on 8): losses, clipped norms and weights of one process, whole-model
//                                       get_state_dict, save_state / load_state resuming exactly
//   tensor_parallel_worker megatron_pipeline  (8 ranks) the same from Accelerate's Megatron-LM file (tp 2,
//                                       pp 2, distributed optimizer, recomputed activations, clipping)
//   tensor_parallel_worker lora         LoRA (accel::peft) on the Column and Row layers against LoRA on the
//                                       unsplit Linears: outputs, adapter gradients and SGD steps, merge,
//                                       save_adapter (refused without the whole state) and load_adapter
//   tensor_parallel_worker lora_accelerator  (4 ranks) the same through Accelerator, tp 2 x ddp 2:
//                                       clip_grad_norm_, and save_adapter of get_state_dict as one process's
//   tensor_parallel_worker state_<ddp|zero2|zero3>  save_state / load_state with tensor_parallel_size 2:
//                                       resumes exactly; resumes a run without tensor parallelism and back
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <accel/accelerator/accelerator.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/distributed/communicator.hpp>
#include <accel/distributed/cuda_device.hpp>
#include <accel/errors.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/nn/lora.hpp>
#include <accel/optim/schedulers.hpp>
#include <accel/parallel/parallel_attention.hpp>
#include <accel/parallel/pipeline.hpp>
#include <accel/parallel/tensor_parallel.hpp>
#include <accel/trainer/trainer.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <tuple>

#include "dist_common.hpp"
#include "scenario_main.hpp"
#include "trainer/trainer_fixture.hpp"

// <torch/torch.h> redefines CHECK as a fatal check that aborts the process: use CHECK_MSG (Catch2) here.

namespace {

using accel::Collective;
using accel::Communicator;
using accel::UsageError;
using namespace accel::tp;

constexpr std::int64_t kIn = 8, kHidden = 24, kOut = 6, kBatch = 8;
constexpr double kTol = 1e-5;
constexpr auto kTimeout = std::chrono::seconds(60);

// Where `mlp` runs its layers: the CPU, or with ACCEL_TEST_DEVICE=cuda the GPU (ranks may share it through
// Gloo with ACCEL_CUDA_COLLECTIVES=gloo; tests/gpu/ranks_share_gpu.sh).
torch::Device test_device() {
  const char* device = std::getenv("ACCEL_TEST_DEVICE");
  if (device == nullptr || std::string(device) != "cuda") return torch::kCPU;
  if (!torch::cuda::is_available())
    throw std::runtime_error("ACCEL_TEST_DEVICE=cuda, but LibTorch sees no CUDA device on this machine");
  const auto state = accel::ProcessState::from_environment();
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(accel::cuda_device_for(
                            state, static_cast<int>(torch::cuda::device_count()), /*ranks_may_share=*/true))};
}

std::shared_ptr<Communicator> communicator() {
  accel::CommunicatorOptions options;
  options.timeout = kTimeout;
  if (const char* group = std::getenv("ACCEL_CUDA_COLLECTIVES"); group != nullptr && *group != '\0')
    options.cuda_collectives = accel::parse_cuda_collectives(group, "ACCEL_CUDA_COLLECTIVES");
  return Communicator::create(accel::ProcessState::from_environment(), test_device(), options);
}

// The message of the UsageError `f` throws; "no error" / "other: ..." otherwise.
std::string usage_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
  return "no error";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool close(const torch::Tensor& a, const torch::Tensor& b, double tol = kTol) {
  return a.defined() && b.defined() && a.sizes() == b.sizes() && torch::allclose(a, b, tol, tol);
}

torch::nn::Linear seeded_linear(std::uint64_t seed, std::int64_t in, std::int64_t out) {
  torch::manual_seed(seed);
  return torch::nn::Linear(in, out);
}

// The unsplit MLP, and the tensor-parallel one cut from the same full layers.
struct Mlps {
  torch::nn::Linear full1, full2;
  torch::nn::Sequential reference, parallel;
  ColumnParallelLinear column{nullptr};
  RowParallelLinear row{nullptr};
};

Mlps make_mlps(const std::shared_ptr<Communicator>& comm, bool gather = false) {
  Mlps m{seeded_linear(1, kIn, kHidden), seeded_linear(2, kHidden, kOut), {}, {}};
  m.reference = torch::nn::Sequential(m.full1, torch::nn::GELU(), m.full2);
  m.column = ColumnParallelLinear(m.full1, comm, /*gather_output=*/gather);
  m.row = RowParallelLinear(m.full2, comm, /*input_is_parallel=*/!gather);
  m.parallel = torch::nn::Sequential(m.column, torch::nn::GELU(), m.row);
  m.reference->to(test_device());
  m.parallel->to(test_device());
  return m;
}

// Each parallel parameter's value (and gradient) against its slice of the reference's.
void compare_parameters(const std::string& what, Mlps& m, bool grads) {
  const auto c0 = m.column->first_row(), cn = m.column->local_rows();
  const auto r0 = m.row->first_column(), rn = m.row->local_columns();
  // name, this rank's parameter, the full one, and the slice of it (dimension, first, count; dimension -1:
  // all of it).
  struct Slice {
    std::string name;
    torch::Tensor mine, full;
    std::int64_t dim, first, count;
  };
  const std::vector<Slice> slices{{"column weight", m.column->weight, m.full1->weight, 0, c0, cn},
                                  {"column bias", m.column->bias, m.full1->bias, 0, c0, cn},
                                  {"row weight", m.row->weight, m.full2->weight, 1, r0, rn},
                                  {"row bias", m.row->bias, m.full2->bias, -1, 0, 0}};
  for (const auto& s : slices) {
    const auto cut = [&](const torch::Tensor& t) {
      return s.dim < 0 ? t : t.narrow(s.dim, s.first, s.count);
    };
    CHECK_MSG(close(s.mine, cut(s.full)),
              what << ": " << s.name << " differs from its slice of the full layer");
    if (grads) {
      CHECK_MSG(close(s.mine.grad(), cut(s.full.grad())),
                what << ": gradient of " << s.name << " differs from its slice of the full gradient");
    }
  }
}

void train_and_compare(const std::string& what, Mlps& m) {
  torch::manual_seed(10);
  const auto x = torch::randn({kBatch, kIn}).to(test_device()),
             y = torch::randn({kBatch, kOut}).to(test_device());
  CHECK_MSG(m.column->weight.device() == test_device() && m.row->weight.device() == test_device(),
            what << ": the layers are on " << m.column->weight.device() << ", want " << test_device());
  torch::optim::SGD ref_opt(m.reference->parameters(), 0.5), opt(m.parallel->parameters(), 0.5);
  for (int step = 0; step < 3; ++step) {
    const std::string at = fmt::format("{}, step {}", what, step);
    ref_opt.zero_grad();
    opt.zero_grad();
    auto x_ref = x.clone().requires_grad_(true), x_par = x.clone().requires_grad_(true);
    auto out_ref = m.reference->forward(x_ref), out = m.parallel->forward(x_par);
    CHECK_MSG(close(out, out_ref), at << ": output differs from the unsplit MLP's");
    torch::mse_loss(out_ref, y).backward();
    torch::mse_loss(out, y).backward();
    CHECK_MSG(close(x_par.grad(), x_ref.grad()), at << ": input gradient differs");
    compare_parameters(at, m, /*grads=*/true);
    ref_opt.step();
    opt.step();
    compare_parameters(at + " after SGD", m, /*grads=*/false);
  }
}

void mlp() {
  auto comm = communicator();
  const int r = comm->rank(), n = comm->world_size();

  {
    auto m = make_mlps(comm);
    std::vector<std::string> names;
    for (const auto& item : m.parallel->named_parameters())
      names.push_back(item.key());
    CHECK_MSG((names == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}),
              "names " << fmt::format("{}", fmt::join(names, ",")));
    CHECK_MSG((m.column->first_row() == r * kHidden / n && m.column->local_rows() == kHidden / n),
              "column rows");
    CHECK_MSG((m.row->first_column() == r * kHidden / n && m.row->local_columns() == kHidden / n),
              "row columns");
    CHECK_MSG(m.column->weight.sizes() == torch::IntArrayRef({kHidden / n, kIn}), "column weight shape");
    CHECK_MSG(m.row->weight.sizes() == torch::IntArrayRef({kOut, kHidden / n}), "row weight shape");
    train_and_compare("column -> row", m);
  }
  {
    auto m = make_mlps(comm, /*gather=*/true);
    train_and_compare("column with gather_output -> row without input_is_parallel", m);
  }

  // Seeded layers hold the slices of torch::nn::Linear built after torch::manual_seed(seed), and leave the
  // global generator where it was; unseeded ones draw the full layer from the global generator.
  torch::manual_seed(42);
  ColumnParallelLinear column(ColumnParallelLinearOptions(kIn, kHidden).seed(1), comm);
  RowParallelLinear row(RowParallelLinearOptions(kHidden, kOut).seed(2), comm);
  VocabParallelEmbedding embedding(VocabParallelEmbeddingOptions(kHidden, 5).seed(3), comm);
  const auto after = torch::rand({4});
  torch::manual_seed(42);
  CHECK_MSG(torch::equal(after, torch::rand({4})), "a seeded layer moved the global generator");
  const auto full1 = seeded_linear(1, kIn, kHidden), full2 = seeded_linear(2, kHidden, kOut);
  torch::manual_seed(3);
  const torch::nn::Embedding full_embedding(kHidden, 5);
  const auto k = kHidden / n;
  CHECK_MSG(torch::equal(column->weight, full1->weight.narrow(0, r * k, k)) &&
                torch::equal(column->bias, full1->bias.narrow(0, r * k, k)),
            "seeded column layer: not the slice of Linear after manual_seed(1)");
  CHECK_MSG(
      torch::equal(row->weight, full2->weight.narrow(1, r * k, k)) && torch::equal(row->bias, full2->bias),
      "seeded row layer: not the slice of Linear after manual_seed(2)");
  CHECK_MSG(torch::equal(embedding->weight, full_embedding->weight.narrow(0, r * k, k)),
            "seeded embedding: not the slice of Embedding after manual_seed(3)");
  // Every rank's slices side by side are the full layer: N ranks start where one process starts.
  CHECK_MSG(torch::equal(comm->all_gather(column->weight), full1->weight), "gathered column weight");
  CHECK_MSG(torch::equal(comm->all_gather(row->weight.t().contiguous()).t(), full2->weight),
            "gathered row weight");
  torch::manual_seed(5);
  ColumnParallelLinear unseeded(ColumnParallelLinearOptions(kIn, kHidden).bias(false), comm);
  torch::manual_seed(5);
  const torch::nn::Linear unseeded_full(torch::nn::LinearOptions(kIn, kHidden).bias(false));
  CHECK_MSG(
      torch::equal(unseeded->weight, unseeded_full->weight.narrow(0, r * k, k)) && !unseeded->bias.defined(),
      "unseeded column layer: not the slice of Linear drawn from the global generator");

  // reset_parameters draws the same full layer again; clone() copies the slices and keeps the group.
  {
    torch::NoGradGuard no_grad;
    column->weight.zero_();
  }
  column->reset_parameters();
  CHECK_MSG(torch::equal(column->weight, full1->weight.narrow(0, r * k, k)), "reset_parameters");
  auto copy = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(column->clone());
  REQUIRE(copy);
  CHECK_MSG(
      (torch::equal(copy->weight, column->weight) && copy->weight.data_ptr() != column->weight.data_ptr()),
      "clone: a copy of the weight");
  CHECK_MSG((copy->communicator() == comm && copy->first_row() == column->first_row()),
            "clone: same group and rows");
  std::ostringstream printed;
  printed << *row;
  CHECK_MSG(contains(printed.str(),
                     fmt::format("accel::tp::RowParallelLinear(in_features={}, out_features={}, "
                                 "bias=true, input_is_parallel=true, columns [{}, {}) on rank {} of {})",
                                 kHidden, kOut, r * k, (r + 1) * k, r, n)),
            "printed " << printed.str());
}

// ParallelMultiheadAttention cut from a torch::nn::MultiheadAttention (8 heads over the group): the same
// output as the unsplit layer, with a causal float mask and with a boolean key-padding mask, the same input
// gradient, and each rank's projection gradients equal to its heads' rows (q, k, v) and columns (out) of the
// unsplit layer's; an SGD step keeps them equal. A number of heads the group cannot divide is refused.
void attention() {
  auto comm = communicator();
  const std::int64_t E = 24, H = 6, L = 5, B = 3;
  torch::manual_seed(11);
  torch::nn::MultiheadAttention full(torch::nn::MultiheadAttentionOptions(E, H));
  ParallelMultiheadAttention split(full, comm);
  const auto n = comm->world_size(), r = comm->rank();
  CHECK_MSG(split->local_heads() == H / n && split->first_head() == r * (H / n), "heads of rank " << r);
  torch::manual_seed(12);
  const auto x = torch::randn({L, B, E}), kv = torch::randn({L + 2, B, E});
  const auto causal = torch::triu(torch::full({L, L + 2}, -INFINITY), 3);
  auto padding = torch::zeros({B, L + 2}, torch::kBool);
  padding[1][L + 1] = true;
  const auto per_rows = E / n;
  for (int variant = 0; variant < 2; ++variant) {
    full->zero_grad();
    split->zero_grad();
    auto xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
    const auto mask = variant == 0 ? causal : torch::Tensor();
    const auto pad = variant == 1 ? padding : torch::Tensor();
    const auto want = std::get<0>(full(xa, kv, kv, pad, /*need_weights=*/false, mask));
    const auto got = split(xb, kv, kv, pad, mask);
    CHECK_MSG(close(got, want, kTol), "attention output (variant "
                                          << variant << ") differs by "
                                          << (got - want).abs().max().item<double>());
    const auto target = torch::randn_like(want);
    (want * target).sum().backward();
    (got * target).sum().backward();
    CHECK_MSG(close(xb.grad(), xa.grad(), kTol), "attention input gradient (variant " << variant << ")");
    const auto& g = full->in_proj_weight.grad();
    const std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs{
        {split->q_proj->weight.grad(), g.narrow(0, r * per_rows, per_rows)},
        {split->k_proj->weight.grad(), g.narrow(0, E + r * per_rows, per_rows)},
        {split->v_proj->weight.grad(), g.narrow(0, 2 * E + r * per_rows, per_rows)},
        {split->q_proj->bias.grad(), full->in_proj_bias.grad().narrow(0, r * per_rows, per_rows)},
        {split->out_proj->weight.grad(), full->out_proj->weight.grad().narrow(1, r * per_rows, per_rows)},
        {split->out_proj->bias.grad(), full->out_proj->bias.grad()}};
    for (std::size_t k = 0; k < pairs.size(); ++k)
      CHECK_MSG(close(pairs[k].first, pairs[k].second, kTol),
                "attention gradient " << k << " (variant " << variant << ")");
  }
  // The split parameters are found for get_state_dict / save_model / save_state.
  const auto splits = split_parameters(*split);
  CHECK_MSG(splits.count("q_proj.weight") == 1 && splits.count("out_proj.weight") == 1 &&
                splits.count("out_proj.bias") == 0,
            "split parameters of the attention: " << splits.size());
  if (n > 1) {
    torch::nn::MultiheadAttention odd(torch::nn::MultiheadAttentionOptions(E, n + 1));
    std::string error;
    try {
      ParallelMultiheadAttention bad(odd, comm);
    } catch (const UsageError& e) {
      error = e.what();
    }
    CHECK_MSG(error.find("cannot be split evenly") != std::string::npos, "odd heads: '" << error << "'");
  }
}

void embedding() {
  auto comm = communicator();
  const int r = comm->rank(), n = comm->world_size();
  constexpr std::int64_t kVocab = 24, kDim = 5;
  const auto k = kVocab / n;
  torch::manual_seed(3);
  torch::nn::Embedding full(kVocab, kDim);
  VocabParallelEmbedding parallel(full, comm);
  CHECK_MSG((parallel->first_row() == r * k && parallel->local_rows() == k), "embedding rows");
  CHECK_MSG(torch::equal(parallel->weight, full->weight.narrow(0, r * k, k)), "embedding slice");

  torch::manual_seed(11);
  const auto ids = torch::randint(0, kVocab, {3, 7}, torch::kLong);
  const auto w = torch::randn({3, 7, kDim});
  torch::optim::SGD ref_opt(full->parameters(), 0.5), opt(parallel->parameters(), 0.5);
  for (int step = 0; step < 2; ++step) {
    ref_opt.zero_grad();
    opt.zero_grad();
    comm->reset_counters();
    auto out = parallel->forward(ids);
    CHECK_MSG(comm->bytes(Collective::AllReduce).calls == 1,
              "step " << step << ": forward all-reduces " << comm->bytes(Collective::AllReduce).calls);
    const auto out_ref = full->forward(ids);
    CHECK_MSG(close(out, out_ref), "step " << step << ": embedding output differs");
    (out_ref * w).sum().backward();
    comm->reset_counters();
    (out * w).sum().backward();
    CHECK_MSG(comm->bytes(Collective::AllReduce).calls == 0,
              "backward all-reduces " << comm->bytes(Collective::AllReduce).calls);
    CHECK_MSG(close(parallel->weight.grad(), full->weight.grad().narrow(0, r * k, k)),
              "step " << step << ": embedding gradient differs from its slice");
    ref_opt.step();
    opt.step();
    CHECK_MSG(close(parallel->weight, full->weight.narrow(0, r * k, k)),
              "step " << step << ": weights differ");
  }

  // Errors, alike on every rank (the ids are the same everywhere), before any collective.
  auto msg = usage_error_of([&] {
    parallel->forward(torch::tensor(std::vector<std::int64_t>{1, kVocab, 2}));
  });
  CHECK_MSG(contains(msg, "accel::tp::VocabParallelEmbedding: id 24 is outside the vocabulary [0, 24)"), msg);
  msg = usage_error_of([&] { parallel->forward(torch::tensor({-1, 2})); });
  CHECK_MSG(contains(msg, "id -1 is outside the vocabulary"), msg);
  msg = usage_error_of([&] { parallel->forward(torch::tensor({1.0, 2.0})); });
  CHECK_MSG(contains(msg, "ids of type Float; pass integer ids"), msg);
  msg = usage_error_of([&] {
    VocabParallelEmbedding(torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kDim).padding_idx(0)),
                           comm);
  });
  CHECK_MSG(contains(msg, "the full embedding has padding_idx 0"), msg);
}

void count() {
  auto comm = communicator();
  auto m = make_mlps(comm);
  torch::manual_seed(10);
  const auto x = torch::randn({kBatch, kIn}).requires_grad_(true);
  const auto all_reduce = [&] { return comm->bytes(Collective::AllReduce); };

  comm->reset_counters();
  auto out = m.parallel->forward(x);
  CHECK_MSG(all_reduce().calls == 1, "forward: " << all_reduce().calls << " all-reduces");
  CHECK_MSG(all_reduce().payload == kBatch * kOut * 4, "forward payload " << all_reduce().payload);
  CHECK_MSG(comm->total_wire_bytes() == all_reduce().wire, "forward: only all-reduces");
  comm->reset_counters();
  out.sum().backward();
  CHECK_MSG(all_reduce().calls == 1, "backward: " << all_reduce().calls << " all-reduces");
  CHECK_MSG(all_reduce().payload == kBatch * kIn * 4, "backward payload " << all_reduce().payload);
  CHECK_MSG(comm->total_wire_bytes() == all_reduce().wire, "backward: only all-reduces");

  // An input that needs no gradient (the first layer of a model): forward's all-reduce, none in backward.
  comm->reset_counters();
  out = m.parallel->forward(x.detach());
  CHECK_MSG(all_reduce().calls == 1, "forward all-reduces " << all_reduce().calls);
  comm->reset_counters();
  out.sum().backward();
  CHECK_MSG(all_reduce().calls == 0,
            "no input gradient: " << all_reduce().calls << " all-reduces in backward");

  // Two pairs: two each way.
  torch::nn::Sequential two(m.column, torch::nn::GELU(), m.row,
                            ColumnParallelLinear(seeded_linear(4, kOut, kHidden), comm), torch::nn::GELU(),
                            RowParallelLinear(seeded_linear(5, kHidden, kOut), comm));
  comm->reset_counters();
  out = two->forward(x);
  CHECK_MSG(all_reduce().calls == 2, "two pairs, forward: " << all_reduce().calls);
  comm->reset_counters();
  out.sum().backward();
  CHECK_MSG(all_reduce().calls == 2, "two pairs, backward: " << all_reduce().calls);

  // Gathered output and scattered input: one all-gather each way instead (and the all-reduces as above).
  auto g = make_mlps(comm, /*gather=*/true);
  comm->reset_counters();
  out = g.parallel->forward(x);
  CHECK_MSG((all_reduce().calls == 1 && comm->bytes(Collective::AllGather).calls == 1),
            "gathered, forward: " << all_reduce().calls << " all-reduces, "
                                  << comm->bytes(Collective::AllGather).calls << " all-gathers");
  comm->reset_counters();
  out.sum().backward();
  CHECK_MSG((all_reduce().calls == 1 && comm->bytes(Collective::AllGather).calls == 1),
            "gathered, backward: " << all_reduce().calls << " all-reduces, "
                                   << comm->bytes(Collective::AllGather).calls << " all-gathers");

  // One process: the same layers hold everything and compute the unsplit MLP.
  auto solo = Communicator::create(accel::ProcessState(), torch::kCPU);
  auto one = make_mlps(solo);
  CHECK_MSG(close(one.parallel->forward(x), one.reference->forward(x)),
            "one process: output differs from the unsplit MLP");
  CHECK_MSG((one.column->local_rows() == kHidden && one.row->local_columns() == kHidden),
            "one process holds every row and column");
}

void bad_size() {
  auto comm = communicator();
  const int r = comm->rank(), n = comm->world_size();
  const std::int64_t odd = 4 * n + 1;
  auto msg = usage_error_of([&] { ColumnParallelLinear(ColumnParallelLinearOptions(kIn, odd), comm); });
  CHECK_MSG(
      contains(msg, fmt::format("accel::tp::ColumnParallelLinear: out_features {} is not divisible by the "
                                "tensor-parallel size {} (rank {} of the group); make out_features a "
                                "multiple of {} (e.g. {})",
                                odd, n, r, n, 5 * n)),
      msg);
  msg = usage_error_of([&] { RowParallelLinear(torch::nn::Linear(odd, kOut), comm); });
  CHECK_MSG(contains(msg, fmt::format("accel::tp::RowParallelLinear: in_features {} is not divisible by the "
                                      "tensor-parallel size {}",
                                      odd, n)),
            msg);
  msg = usage_error_of([&] { VocabParallelEmbedding(VocabParallelEmbeddingOptions(odd, 4), comm); });
  CHECK_MSG(contains(msg, fmt::format("accel::tp::VocabParallelEmbedding: num_embeddings {} is not divisible",
                                      odd)),
            msg);
  msg = usage_error_of([&] { ColumnParallelLinear(ColumnParallelLinearOptions(kIn, kHidden), nullptr); });
  CHECK_MSG(contains(msg, "accel::tp::ColumnParallelLinear: the tensor-parallel communicator is null"), msg);
  msg = usage_error_of([&] { RowParallelLinear(RowParallelLinearOptions(kHidden, 0), comm); });
  CHECK_MSG(contains(msg, "accel::tp::RowParallelLinear: out_features is 0; it must be positive"), msg);

  // Inputs of the wrong width are refused before any collective, alike on every rank.
  auto m = make_mlps(comm);
  msg = usage_error_of([&] { m.column->forward(torch::randn({2, kIn - 1})); });
  CHECK_MSG(
      contains(msg, fmt::format("accel::tp::ColumnParallelLinear: input of shape [2, {}] where the last "
                                "dimension must be {} (in_features)",
                                kIn - 1, kIn)),
      msg);
  msg = usage_error_of([&] { m.row->forward(torch::randn({2, kHidden})); });
  CHECK_MSG(contains(msg, fmt::format("accel::tp::RowParallelLinear: input of shape [2, {}] where the last "
                                      "dimension must be {} (in_features / tensor-parallel size",
                                      kHidden, kHidden / n)),
            msg);
  msg = usage_error_of([&] { scatter_to_tensor_parallel(torch::randn({2, odd}), comm); });
  CHECK_MSG(contains(msg, fmt::format("the input's last dimension {} is not divisible", odd)), msg);
  // The group still works afterwards (nobody was left inside a collective).
  auto t = torch::ones({1});
  comm->all_reduce(t, accel::ReduceOp::Sum);
  CHECK_MSG(t.item<float>() == static_cast<float>(n), "the group after the errors: sum " << t.item<float>());
}

// 2-way tensor x 2-way data parallel on 4 ranks, rank = dp_index * tp + tp_index: tensor-parallel groups
// {0,1},{2,3}, data-parallel groups {0,2},{1,3}. Each replica takes half the batch; gradients are averaged
// over the data-parallel group; the weights follow one process with the whole batch.
void tp_dp() {
  auto comm = communicator();
  REQUIRE(comm->world_size() == 4);
  constexpr int kTp = 2, kDp = 2;
  const int r = comm->rank(), tp_index = r % kTp, dp_index = r / kTp;
  auto tp = comm->split({{0, 1}, {2, 3}});
  auto dp = comm->split({{0, 2}, {1, 3}});
  REQUIRE((tp->rank() == tp_index && tp->world_size() == kTp && dp->rank() == dp_index &&
           dp->world_size() == kDp));
  auto m = make_mlps(tp);
  torch::manual_seed(10);
  const auto x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  const auto rows = kBatch / kDp;
  const auto my_x = x.narrow(0, dp_index * rows, rows), my_y = y.narrow(0, dp_index * rows, rows);
  torch::optim::SGD ref_opt(m.reference->parameters(), 0.5), opt(m.parallel->parameters(), 0.5);
  for (int step = 0; step < 3; ++step) {
    const std::string at = fmt::format("tp x dp, step {}", step);
    ref_opt.zero_grad();
    opt.zero_grad();
    auto out_ref = m.reference->forward(x);
    torch::mse_loss(out_ref, y).backward();
    tp->reset_counters();
    dp->reset_counters();
    auto out = m.parallel->forward(my_x);
    CHECK_MSG(close(out, out_ref.narrow(0, dp_index * rows, rows)), at << ": output rows differ");
    torch::mse_loss(out, my_y).backward();
    // The first layer's input needs no gradient: the tensor-parallel group all-reduced once (forward).
    CHECK_MSG(tp->bytes(Collective::AllReduce).calls == 1,
              at << ": tp all-reduces " << tp->bytes(Collective::AllReduce).calls);
    for (auto& p : m.parallel->parameters()) {
      auto& grad = p.mutable_grad();
      dp->all_reduce(grad, accel::ReduceOp::Sum);
      grad.div_(kDp);
    }
    CHECK_MSG(dp->bytes(Collective::AllReduce).calls == 4,
              "dp all-reduces " << dp->bytes(Collective::AllReduce).calls);
    compare_parameters(at, m, /*grads=*/true);
    ref_opt.step();
    opt.step();
    compare_parameters(at + " after SGD", m, /*grads=*/false);
  }
}

// Where the tensor-parallel size comes from.
enum class TpFrom { Program, ParallelismConfig, MegatronLm };

// Accelerate's Megatron-LM file for tp 2 x dp 2: Megatron's DDP (zero stage 0), activations recomputed,
// gradients clipped to 0.05 by the backend on every step.
const char* kMegatronTpFile =
    "distributed_type: MEGATRON_LM\nnum_processes: 4\nuse_cpu: true\nmegatron_lm_config:\n"
    "  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 1\n  megatron_lm_recompute_activations: true\n"
    "  megatron_lm_use_distributed_optimizer: false\n  megatron_lm_gradient_clipping: 0.05\n";

// The same through the Accelerator: AcceleratorOptions().tensor_parallel_size(2) on 4 ranks (or the config
// file's parallelism_config_tp_size 2, or a Megatron-LM file's megatron_lm_tp_degree 2), the DDP backend (or
// zero stage 0) reducing over the data-parallel groups, a prepared loader giving both ranks of a group the
// same batches, and what would silently see only this rank's slices refused.
void accelerator_from(TpFrom from) {
  REQUIRE(communicator()->world_size() == 4);
  const bool from_file = from != TpFrom::Program, megatron = from == TpFrom::MegatronLm;
  accel::Config config;
  config.backend = "ddp";
  config.use_cpu = true;
  config.num_processes = 4;
  double clip = 0;  // what the backend clips to on every step
  if (megatron) {
    config = accel::Config::load_string(kMegatronTpFile, "megatron.yaml");
    CHECK_MSG(config.backend == "zero" && config.zero.stage == 0 && config.tensor_parallel_size == 2 &&
                  config.pipeline.stages == 1 && config.zero.activation_checkpointing &&
                  config.zero.gradient_clipping == 0.05,
              "megatron.yaml read as " << config.to_yaml());
    clip = config.zero.gradient_clipping;
  } else if (from_file) {
    config = accel::Config::load_string(
        "distributed_type: MULTI_CPU\nnum_processes: 4\nparallelism_config:\n"
        "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_tp_size: 2\n",
        "tp.yaml");
    REQUIRE(config.tensor_parallel_size == 2);
    // The program asking for another size than the file: refused, naming both.
    const auto clash = usage_error_of(
        [&] { accel::Accelerator four(accel::AcceleratorOptions().config(config).tensor_parallel_size(4)); });
    CHECK_MSG(contains(clash,
                       "AcceleratorOptions().tensor_parallel_size(4) and the config's "
                       "parallelism_config.parallelism_config_tp_size 2 (tp.yaml) disagree"),
              clash);
    // A trainable model without accel::tp layers under the file's tp_size: refused at prepare (each rank of a
    // pair would train a whole copy; with its own data sharding the copies would drift apart).
    const auto plain = usage_error_of([&] {
      accel::Accelerator other(accel::AcceleratorOptions().config(config));
      torch::nn::Linear model(kIn, kOut);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      other.prepare(model, sgd);
    });
    CHECK_MSG(contains(plain,
                       "parallelism_config_tp_size 2 (tp.yaml) asks for tensor parallelism, but this "
                       "model has no accel::tp layer"),
              plain);
  }
  accel::Accelerator acc(from_file ? accel::AcceleratorOptions().config(config)
                                   : accel::AcceleratorOptions().config(config).tensor_parallel_size(2));
  auto tp = acc.tensor_parallel_group(), dp = acc.data_parallel_group();
  const int r = acc.process_index();
  CHECK_MSG(tp->job_ranks() == std::vector<int>({r / 2 * 2, r / 2 * 2 + 1}) &&
                dp->job_ranks() == std::vector<int>({r % 2, r % 2 + 2}),
            "groups " << fmt::format("{} and {}", fmt::join(tp->job_ranks(), ","),
                                     fmt::join(dp->job_ranks(), ",")));
  auto m = make_mlps(tp);
  torch::optim::SGD ref_opt(m.reference->parameters(), 0.5), opt(m.parallel->parameters(), 0.5);
  acc.prepare(m.parallel, opt);
  if (megatron) {
    // megatron_lm_recompute_activations: each layer of the block recomputes in backward (split_parameters
    // must see through the wrappers for the clipping to count each slice once).
    for (const auto& layer : m.parallel->children())
      CHECK_MSG(std::dynamic_pointer_cast<accel::CheckpointedImpl>(layer) != nullptr,
                "a layer is not checkpointed");
  }
  // 16 samples, batches of 4 per replica: the ranks of a tensor-parallel group read the same rows.
  torch::manual_seed(10);
  const auto xs = torch::randn({16, kIn}), ys = torch::randn({16, kOut});
  auto loader =
      acc.prepare_data_loader(torch::data::datasets::TensorDataset(torch::cat({xs, ys}, 1))
                                  .map(torch::data::transforms::Stack<torch::data::TensorExample>()),
                              accel::DataLoaderOptions(4).shuffle(false));
  int step = 0;
  for (auto& batch : *loader) {
    const std::string at = fmt::format("accelerator, step {}", step++);
    const auto rows = batch.data;
    const auto x = rows.narrow(1, 0, kIn), y = rows.narrow(1, kIn, kOut);
    const auto group_rows = tp->all_gather(x);
    CHECK_MSG(torch::equal(group_rows.narrow(0, 0, x.size(0)), group_rows.narrow(0, x.size(0), x.size(0))),
              at << ": the ranks of a tensor-parallel group read different batches");
    // The reference: both replicas' batches as one (the loss is a mean over rows, so the mean of the two
    // replicas' losses equals the loss of their union).
    const auto all = dp->all_gather(rows);
    ref_opt.zero_grad();
    opt.zero_grad();
    torch::mse_loss(m.reference->forward(all.narrow(1, 0, kIn)), all.narrow(1, kIn, kOut)).backward();
    if (clip > 0) {
      const double norm = torch::nn::utils::clip_grad_norm_(m.reference->parameters(), clip);
      CHECK_MSG(norm > clip,
                at << ": the reference's norm " << norm << " is not clipped: the test checks nothing");
    }
    acc.backward(torch::mse_loss(m.parallel->forward(x), y));
    compare_parameters(at, m, /*grads=*/true);
    ref_opt.step();
    opt.step();
    compare_parameters(at + " after SGD", m, /*grads=*/false);
  }
  CHECK_MSG(step == 2, "steps " << step);
  if (from_file) return;
  const auto bad = usage_error_of(
      [&] { accel::Accelerator three(accel::AcceleratorOptions().config(config).tensor_parallel_size(3)); });
  CHECK_MSG(contains(bad, "tensor_parallel_size 3 does not divide the 4 process(es)"), bad);
}

void accelerator() {
  accelerator_from(TpFrom::Program);
}
void config_tp() {
  accelerator_from(TpFrom::ParallelismConfig);
}
void megatron_tp() {
  accelerator_from(TpFrom::MegatronLm);
}

std::string shared_temp_dir(Communicator& world);

// The LoRA config of the lora scenarios: both layers of the MLP, r 4.
accel::peft::LoraConfig lora_config() {
  accel::peft::LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = {"0", "2"};
  return c;
}

// Each adapter of the split MLP against its part of the unsplit one's (PEFT's LoraParallelLinear: the column
// layer's B split by rows and A whole, the row layer's A split by columns and B whole).
void compare_adapters(const std::string& what, Mlps& m, bool grads) {
  const auto ref = m.reference->named_parameters();
  const auto par = m.parallel->named_parameters();
  struct Part {
    const char* name;
    int dim;  // -1: whole
    std::int64_t first, count;
  };
  const std::vector<Part> parts{{"0.lora_A.weight", -1, 0, 0},
                                {"0.lora_B.weight", 0, m.column->first_row(), m.column->local_rows()},
                                {"2.lora_A.weight", 1, m.row->first_column(), m.row->local_columns()},
                                {"2.lora_B.weight", -1, 0, 0}};
  for (const auto& p : parts) {
    const auto* mine = par.find(p.name);
    const auto* full = ref.find(p.name);
    REQUIRE((mine != nullptr && full != nullptr));
    auto want = grads ? full->grad() : *full;
    if (p.dim >= 0 && want.defined()) want = want.narrow(p.dim, p.first, p.count);
    const auto got = grads ? mine->grad() : *mine;
    CHECK_MSG(close(got, want), what << ": " << (grads ? "gradient of " : "") << p.name << " differs from "
                                     << "its part of one process's LoRA");
  }
}

// LoRA on a tensor-parallel MLP (Column -> GELU -> Row) against LoRA on the unsplit one, the adapters drawn
// from the same seed: the same outputs and adapter gradients (their parts), through SGD steps; the base
// weights stay frozen; merge gives the same outputs; save_adapter without the whole state is refused (each
// rank holds a part), with it writes PEFT's files of the unsplit adapters, which load_adapter splits again.
void lora() {
  auto comm = communicator();
  auto m = make_mlps(comm);
  torch::manual_seed(20);
  auto ref_peft = accel::peft::get_peft_model(m.reference, lora_config());
  torch::manual_seed(20);
  auto par_peft = accel::peft::get_peft_model(m.parallel, lora_config());
  CHECK_MSG((par_peft->adapted_modules() == std::vector<std::string>{"0", "2"}), "adapted modules");
  compare_adapters("after get_peft_model", m, false);
  std::vector<torch::Tensor> ref_train, par_train;
  for (const auto& p : m.reference->parameters())
    if (p.requires_grad()) ref_train.push_back(p);
  for (const auto& p : m.parallel->parameters())
    if (p.requires_grad()) par_train.push_back(p);
  CHECK_MSG((ref_train.size() == 4 && par_train.size() == 4),
            "trainable tensors: " << ref_train.size() << " and " << par_train.size());
  torch::optim::SGD ref_opt(ref_train, 0.5), opt(par_train, 0.5);
  torch::manual_seed(21);
  const auto x = torch::randn({kBatch, kIn}).to(test_device()),
             y = torch::randn({kBatch, kOut}).to(test_device());
  const auto frozen = m.column->weight.clone(), frozen_row = m.row->weight.clone();
  for (int step = 0; step < 3; ++step) {
    const std::string at = fmt::format("lora, step {}", step);
    ref_opt.zero_grad();
    opt.zero_grad();
    const auto want = m.reference->forward(x), got = m.parallel->forward(x);
    CHECK_MSG(close(got, want), at << ": outputs differ by " << (got - want).abs().max().item<double>());
    torch::mse_loss(want, y).backward();
    torch::mse_loss(got, y).backward();
    compare_adapters(at, m, true);
    ref_opt.step();
    opt.step();
    compare_adapters(at + " after SGD", m, false);
  }
  CHECK_MSG(torch::equal(m.column->weight, frozen), "the column layer's base weight changed");
  CHECK_MSG(torch::equal(m.row->weight, frozen_row), "the row layer's base weight changed");
  {
    torch::NoGradGuard no_grad;
    const auto before = m.parallel->forward(x);
    par_peft->merge();
    CHECK_MSG(close(m.parallel->forward(x), before), "merged outputs differ from the adapted ones");
    ref_peft->merge();
    compare_parameters("merged", m, /*grads=*/false);
    par_peft->unmerge();
    ref_peft->unmerge();
    CHECK_MSG(close(m.parallel->forward(x), before), "unmerged outputs differ");
  }
  const auto dir = shared_temp_dir(*comm);
  if (comm->world_size() > 1) {
    const auto refused = usage_error_of([&] { par_peft->save_adapter(dir + "/refused"); });
    CHECK_MSG(contains(refused, "'0.lora_B.weight' is split over the tensor-parallel group") &&
                  contains(refused, "pass accelerator.get_state_dict(model)"),
              refused);
  }
  // The whole state, as accelerator.get_state_dict gives it: the unsplit model's (equal, checked above).
  std::vector<std::pair<std::string, torch::Tensor>> whole;
  for (const auto& p : m.reference->named_parameters())
    whole.emplace_back(p.key(), p.value().detach());
  if (comm->rank() == 0) par_peft->save_adapter(dir + "/adapter", whole);
  comm->barrier();
  auto fresh = make_mlps(comm);
  torch::manual_seed(99);
  auto loaded = accel::peft::get_peft_model(fresh.parallel, lora_config());
  loaded->load_adapter(dir + "/adapter");
  // The file holds the unsplit adapters (the reference's values): each rank reads exactly its part of them.
  const auto written = m.reference->named_parameters();
  const std::map<std::string, std::tuple<int, std::int64_t, std::int64_t>> part{
      {"0.lora_A.weight", {-1, 0, 0}},
      {"0.lora_B.weight", {0, m.column->first_row(), m.column->local_rows()}},
      {"2.lora_A.weight", {1, m.row->first_column(), m.row->local_columns()}},
      {"2.lora_B.weight", {-1, 0, 0}}};
  for (const auto& [name, where] : part) {
    const auto [dim, first, count] = where;
    auto want = written[name];
    if (dim >= 0) want = want.narrow(dim, first, count);
    CHECK_MSG(torch::equal(fresh.parallel->named_parameters()[name], want),
              "load_adapter: " << name << " is not this rank's part of the file's");
  }
  comm->barrier();
  if (comm->rank() == 0) std::filesystem::remove_all(dir);
}

// LoRA on the tensor-parallel MLP through the Accelerator, 2-way tensor x 2-way data parallel (ddp), against
// one process's LoRA with the whole batch: adapter gradients and steps, clip_grad_norm_ (each split element
// counted once), and save_adapter of get_state_dict writing the unsplit adapters.
void lora_accelerator() {
  REQUIRE(communicator()->world_size() == 4);
  accel::Config config;
  config.backend = "ddp";
  config.use_cpu = true;
  config.num_processes = 4;
  accel::Accelerator acc(accel::AcceleratorOptions().config(config).tensor_parallel_size(2));
  auto m = make_mlps(acc.tensor_parallel_group());
  torch::manual_seed(20);
  auto ref_peft = accel::peft::get_peft_model(m.reference, lora_config());
  torch::manual_seed(20);
  auto par_peft = accel::peft::get_peft_model(m.parallel, lora_config());
  std::vector<torch::Tensor> ref_train, par_train;
  for (const auto& p : m.reference->parameters())
    if (p.requires_grad()) ref_train.push_back(p);
  for (const auto& p : m.parallel->parameters())
    if (p.requires_grad()) par_train.push_back(p);
  torch::optim::SGD ref_opt(ref_train, 0.5), opt(par_train, 0.5);
  acc.prepare(m.parallel, opt);
  auto dp = acc.data_parallel_group();
  torch::manual_seed(22);
  const auto xs = torch::randn({16, kIn}), ys = torch::randn({16, kOut});
  for (int step = 0; step < 4; ++step) {
    const std::string at = fmt::format("lora_accelerator, step {}", step);
    // Rows [4 step, 4 step + 4): replica 0 the first two, replica 1 the other two.
    const auto x = xs.narrow(0, 4 * step, 4), y = ys.narrow(0, 4 * step, 4);
    const auto mine = dp->rank() * 2;
    ref_opt.zero_grad();
    opt.zero_grad();
    torch::mse_loss(m.reference->forward(x), y).backward();
    acc.backward(torch::mse_loss(m.parallel->forward(x.narrow(0, mine, 2)), y.narrow(0, mine, 2)));
    compare_adapters(at, m, true);
    const double want = torch::nn::utils::clip_grad_norm_(ref_train, 0.05);
    const double got = acc.clip_grad_norm_(m.parallel->parameters(), 0.05);
    CHECK_MSG(std::abs(got - want) <= 1e-5 * std::max(1.0, want),
              at << ": clip_grad_norm_ " << got << ", one process " << want);
    compare_adapters(at + " clipped", m, true);
    ref_opt.step();
    opt.step();
    compare_adapters(at + " after SGD", m, false);
  }
  const auto dir = shared_temp_dir(acc.communicator());
  const auto state = acc.get_state_dict(m.parallel);
  if (acc.is_main_process()) {
    par_peft->save_adapter(dir + "/parallel", state);
    ref_peft->save_adapter(dir + "/reference");
    const auto a = accel::safetensors::File::open(dir + "/parallel/adapter_model.safetensors");
    const auto b = accel::safetensors::File::open(dir + "/reference/adapter_model.safetensors");
    REQUIRE(a.names() == b.names());
    const auto tensor = [](const accel::safetensors::File& f, const std::string& name) {
      const auto& info = f.info(name);
      REQUIRE(info.dtype == accel::safetensors::DType::F32);
      return torch::from_blob(const_cast<std::uint8_t*>(f.data(name)), info.shape, torch::kFloat32).clone();
    };
    for (const auto& name : a.names()) {
      CHECK_MSG(close(tensor(a, name), tensor(b, name)),
                "save_adapter: " << name << " differs from one process's file");
    }
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) std::filesystem::remove_all(dir);
}

// accel::Trainer on a tensor-parallel model, 2-way tensor x 2-way data parallel: the layers need the
// Accelerator's tensor-parallel group before the Trainer exists, so the program builds the Accelerator and
// gives it to the Trainer. The run equals, bit for bit, the hand-written accelerated loop of the same
// arguments (accumulation with an uneven last window, clipping over the split layers, warmup then decay),
// which `accelerator` above checks against one process; the samples it reports are the dataset's, each
// counted once although both ranks of a tensor-parallel group read it, and so is each evaluation row.
// Arguments that would change the given Accelerator's config (here its precision) are refused.
void trainer() {
  REQUIRE(communicator()->world_size() == 4);
  accel::Config config;
  config.backend = "ddp";
  config.use_cpu = true;
  config.num_processes = 4;
  config.gradient_accumulation_steps = 2;
  const auto options = accel::AcceleratorOptions().config(config).tensor_parallel_size(2);
  torch::manual_seed(10);
  const auto rows = torch::cat({torch::randn({24, kIn}), torch::randn({24, kOut})}, 1);
  const auto dataset = torch::data::datasets::TensorDataset(rows).map(
      torch::data::transforms::Stack<torch::data::TensorExample>());
  using Rows = std::decay_t<decltype(dataset)>;
  const auto eval_rows = torch::cat({torch::randn({22, kIn}), torch::randn({22, kOut})}, 1);
  const auto eval_set = torch::data::datasets::TensorDataset(eval_rows).map(
      torch::data::transforms::Stack<torch::data::TensorExample>());
  const auto loss_of = [](torch::nn::Sequential& model, const torch::Tensor& batch) {
    return torch::mse_loss(model->forward(batch.narrow(1, 0, kIn)), batch.narrow(1, kIn, kOut));
  };
  auto args = accel::test::small_trainer_args("");
  args.output_dir = (std::filesystem::temp_directory_path() / "accel_tp_trainer_unused").string();
  args.optim = "sgd";
  args.logging_steps = 100;
  args.explicit_keys.push_back("seed");
  args.validate();
  auto unsplit = [](accel::Accelerator& acc, torch::nn::Sequential& model) {
    std::vector<torch::Tensor> out;
    for (const auto& [name, t] : acc.get_state_dict(model))
      out.push_back(t.clone());
    return out;
  };

  std::vector<torch::Tensor> by_trainer;
  std::int64_t samples = 0;
  {
    accel::Accelerator acc(options);
    auto m = make_mlps(acc.tensor_parallel_group());
    {
      accel::Trainer<Rows> t(args, acc, m.parallel, dataset,
                             [&](accel::Trainer<Rows>::Batch& b) { return loss_of(m.parallel, b.data); });
      // Predictions and labels of the 22 evaluation rows (the last round is uneven over the 2 replicas).
      t.set_eval(
          eval_set,
          [&](accel::Trainer<Rows>::Batch& b) {
            accel::EvalOutput o;
            o.predictions = m.parallel->forward(b.data.narrow(1, 0, kIn));
            o.labels = b.data.narrow(1, kIn, kOut);
            o.loss = torch::mse_loss(o.predictions, o.labels);
            return o;
          },
          [](const accel::EvalPrediction& p) {
            return accel::Metrics{{"rows", static_cast<double>(p.predictions.size(0))},
                                  {"mse", torch::mse_loss(p.predictions, p.label_ids).item<double>()}};
          });
      t.train();
      CHECK_MSG(t.state().global_step == 4, "global_step " << t.state().global_step);
      samples = t.state().num_samples_seen;
      by_trainer = unsplit(acc, m.parallel);
      // compute_metrics sees each evaluation row once, although both ranks of a tensor-parallel group read
      // it: the unsplit model with the trained weights gives the same mean loss over the 22 rows.
      const auto metrics = t.evaluate();
      torch::NoGradGuard no_grad;
      auto params = m.reference->parameters();
      REQUIRE(params.size() == by_trainer.size());
      for (std::size_t i = 0; i < params.size(); ++i)
        params[i].copy_(by_trainer[i]);
      const double want = loss_of(m.reference, eval_rows).item<double>();
      CHECK_MSG(metrics.at("eval_rows") == 22,
                "compute_metrics saw " << metrics.at("eval_rows") << " rows of 22");
      CHECK_MSG(std::abs(metrics.at("eval_mse") - want) <= 1e-6 * std::max(1.0, want),
                "eval_mse " << metrics.at("eval_mse") << ", the unsplit model's mean loss over the 22 rows "
                            << want);
    }
    // The Trainer is gone, the Accelerator lives on: the Trainer released what it prepared (its optimizer,
    // schedule and loaders died with it), so the Accelerator holds no optimizer state and saves without
    // reaching into freed objects.
    CHECK_MSG(acc.memory_report().optimizer_state == 0, "after the Trainer, the Accelerator still counts "
                                                            << acc.memory_report().optimizer_state
                                                            << " bytes of optimizer state");
    const auto dir = shared_temp_dir(acc.communicator());
    acc.save_state(dir);
    acc.wait_for_everyone();
    if (acc.is_main_process()) std::filesystem::remove_all(dir);
  }
  CHECK_MSG(samples == 48, "the Trainer saw " << samples << " samples; 2 epochs of 24 rows are 48");

  std::vector<torch::Tensor> by_hand;
  {
    accel::Accelerator acc(options);
    acc.set_seed(args.seed);
    auto m = make_mlps(acc.tensor_parallel_group());
    auto loader = acc.prepare_data_loader(
        dataset, accel::DataLoaderOptions(static_cast<std::size_t>(args.per_device_train_batch_size))
                     .shuffle(true)
                     .seed(args.seed));
    // As the Trainer groups them: weight decay on the weights, none on the biases.
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& p : m.parallel->named_parameters())
      (p.key().find("bias") != std::string::npos ? no_decay : decay).push_back(p.value());
    torch::optim::SGDOptions o(args.learning_rate);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::SGDOptions>(o.weight_decay(args.weight_decay)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::SGDOptions>(o.weight_decay(0.0)));
    torch::optim::SGD opt(groups, o);
    const auto per_epoch = (static_cast<std::int64_t>(loader->size()) + 1) / 2;
    auto schedule = accel::sched::linear_with_warmup(opt, args.warmup_steps, per_epoch * 2);
    acc.prepare(m.parallel, opt, *schedule);
    for (int epoch = 0; epoch < 2; ++epoch) {
      for (auto& batch : *loader) {
        auto window = acc.accumulate(m.parallel);
        m.parallel->train();
        acc.backward(loss_of(m.parallel, batch.data));
        if (acc.sync_gradients()) {
          acc.clip_grad_norm_(args.max_grad_norm);
          opt.step();
          schedule->step();
          opt.zero_grad();
        }
      }
    }
    by_hand = unsplit(acc, m.parallel);

    // The given Accelerator trains in fp32: arguments asking for bf16 would train differently.
    auto other = args;
    other.bf16 = true;
    std::string error;
    try {
      accel::Trainer<Rows> refused(other, acc, m.parallel, dataset, [&](accel::Trainer<Rows>::Batch& b) {
        return loss_of(m.parallel, b.data);
      });
    } catch (const accel::ConfigError& e) {
      error = e.what();
    }
    CHECK_MSG(contains(error,
                       "TrainingArguments bf16 true differs from the Accelerator given to the Trainer "
                       "(mixed_precision no)"),
              (error.empty() ? "no error" : error));
  }
  REQUIRE(by_trainer.size() == by_hand.size());
  for (std::size_t i = 0; i < by_hand.size(); ++i)
    CHECK_MSG(torch::equal(by_trainer[i], by_hand[i]),
              "parameter " << i << ": the Trainer's differs from the hand-written loop's by "
                           << (by_trainer[i] - by_hand[i]).abs().max().item<double>());
}

// The config of one backend row of these tests, for `world` CPU ranks.
accel::Config backend_config(const std::string& backend, int world) {
  accel::Config config;
  config.use_cpu = true;
  config.num_processes = world;
  config.collective_timeout_seconds = 60;
  if (backend == "ddp") {
    config.backend = "ddp";
  } else if (backend == "zero2" || backend == "zero3") {
    config.backend = "zero";
    config.zero.stage = backend[4] - '0';
    config.zero.sub_group_size = 50;  // sub-groups mixing split and replicated parameters
    config.zero.reduce_bucket_size = 100;
  } else if (backend == "fsdp_full_shard") {
    config.backend = "fsdp";
    config.fsdp.sharding_strategy = accel::ShardingStrategy::FullShard;
  } else if (backend == "fsdp_hsdp_tp") {
    // Accelerate's own tp_hsdp example (tests/data/real_configs/accelerate/016): 8 ranks as 2 replicas x 2
    // FSDP2 shards x 2 tensor-parallel ranks, the tensor-parallel size from the file.
    REQUIRE(world == 8);
    config = accel::Config::load_string(
        "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_reshard_after_forward: true\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n",
        "tp_hsdp.yaml");
    REQUIRE(config.tensor_parallel_size == 2);
    REQUIRE(config.fsdp.sharding_strategy == accel::ShardingStrategy::HybridShard);
    REQUIRE(config.fsdp.hybrid_shard_size == 2);
    config.collective_timeout_seconds = 60;
  } else {
    throw std::invalid_argument("unknown backend row " + backend);
  }
  return config;
}

// A fresh directory made by rank 0, named on every rank of `world`.
std::string shared_temp_dir(Communicator& world) {
  std::string dir;
  if (world.rank() == 0) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "accel_tp_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    dir = tmpl;
  }
  return world.exchange(dir)[0];
}

// Accelerator with tensor_parallel_size 2 on `backend` (2 ranks: tp only; 4 ranks: 2-way tp x 2-way dp; 8
// ranks with fsdp_hsdp_tp: 2-way tp x 2 replicas x 2 shards, hybrid sharding over each data-parallel group):
// clip_grad_norm_ gives the norm one process computes over the unsplit model and clips alike (the column
// layer's slices counted on their rank, the row layer's replicated bias once), with the 2-norm and the
// inf-norm; get_state_dict (every rank, and main process only) and save_model give the unsplit model's names,
// shapes and values; load_model cuts this rank's slices back out; a mis-sized export is a CheckpointError.
void export_on(const std::string& backend) {
  const int world = communicator()->world_size();
  const auto config = backend_config(backend, world);
  accel::Accelerator acc(accel::AcceleratorOptions().config(config).tensor_parallel_size(2));
  auto tp = acc.tensor_parallel_group(), dp = acc.data_parallel_group();
  auto m = make_mlps(tp);
  constexpr double kLr = 0.5, kMaxNorm = 0.05;
  torch::optim::SGD ref_opt(m.reference->parameters(), kLr), opt(m.parallel->parameters(), kLr);
  std::int64_t slice_bytes = 0;  // this rank's tensor-parallel slices, whole
  for (const auto& p : m.parallel->parameters())
    slice_bytes += p.numel() * p.element_size();
  acc.prepare(m.parallel, opt);
  if (backend == "fsdp_hsdp_tp") {
    // Hybrid sharding over shard groups of 2 inside each data-parallel group of 4: half of the slices on each
    // rank (FULL_SHARD over the whole group would hold a quarter).
    const auto held = static_cast<std::int64_t>(acc.memory_report().parameters);
    CHECK_MSG(held * 2 == slice_bytes, "rank " << acc.process_index() << " holds " << held << " bytes of its "
                                               << slice_bytes << " bytes of tensor-parallel slices");
  }
  // The unsplit model's state by name, for comparison with what the accelerator gathers.
  const auto compare_state = [&](const std::string& at, const accel::NamedTensors& state) {
    const auto ref = m.reference->named_parameters();
    CHECK_MSG(state.size() == ref.size(), at << ": " << state.size() << " tensors, expected " << ref.size());
    for (const auto& [name, t] : state) {
      const auto* full = ref.find(name);
      CHECK_MSG(full != nullptr, at << ": unexpected entry " << name);
      if (full != nullptr)
        CHECK_MSG(close(t, *full), at << ": " << name << " differs from the unsplit model");
    }
  };
  torch::manual_seed(10);
  const auto rows = kBatch / dp->world_size();
  for (int step = 0; step < 3; ++step) {
    const std::string at = fmt::format("{} step {}", backend, step);
    const double norm_type = step == 2 ? std::numeric_limits<double>::infinity() : 2.0;
    const auto x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
    ref_opt.zero_grad();
    torch::mse_loss(m.reference->forward(x), y).backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(m.reference->parameters(), kMaxNorm, norm_type);
    CHECK_MSG(ref_norm > 2 * kMaxNorm, at << ": the reference norm " << ref_norm << " needs no clipping");
    opt.zero_grad();
    const auto mine = [&](const torch::Tensor& t) { return t.narrow(0, dp->rank() * rows, rows); };
    acc.backward(torch::mse_loss(m.parallel->forward(mine(x)), mine(y)));
    const double norm = acc.clip_grad_norm_(kMaxNorm, norm_type);
    CHECK_MSG(std::abs(norm - ref_norm) <= 1e-5 * ref_norm,
              at << ": clip_grad_norm_ returned " << norm << ", one process " << ref_norm);
    ref_opt.step();
    opt.step();
    compare_state(at + " after the clipped step", acc.get_state_dict(m.parallel));
  }
  const auto on_main = acc.get_state_dict(m.parallel, accel::StateDictOn::MainProcess);
  if (acc.is_main_process()) {
    compare_state("get_state_dict on the main process", on_main);
  } else {
    CHECK_MSG(on_main.empty(), "get_state_dict(MainProcess) gave rank " << acc.process_index() << " "
                                                                        << on_main.size() << " tensors");
  }
  // save_model writes the unsplit model (what a model built with torch::nn::Linear loads); load_model after
  // another step brings the saved weights back.
  const std::string dir = shared_temp_dir(*communicator());
  acc.save_model(m.parallel, dir);
  if (acc.is_main_process()) {
    const auto file = accel::safetensors::File::open(dir + "/model.safetensors");
    accel::NamedTensors saved;
    for (const auto& name : file.names()) {
      const auto& info = file.info(name);
      saved.emplace_back(
          name,
          torch::from_blob(const_cast<std::uint8_t*>(file.data(name)), info.shape, torch::kFloat32).clone());
    }
    compare_state("model.safetensors", saved);
  }
  const auto before = acc.get_state_dict(m.parallel);
  opt.zero_grad();
  acc.backward(m.parallel->forward(torch::ones({2, kIn})).sum());
  opt.step();
  acc.load_model(m.parallel, dir);
  const auto after = acc.get_state_dict(m.parallel);
  REQUIRE(after.size() == before.size());
  for (std::size_t i = 0; i < after.size(); ++i) {
    CHECK_MSG(torch::equal(after[i].second, before[i].second),
              "load_model did not restore " << after[i].first);
  }
  // An export whose column layer is narrower than this one's (written by another program: no manifest, which
  // would refuse the replaced file before its shapes are read). As with Accelerate's load_state, load_model
  // returning on this rank does not mean the others have finished reading the files (with hybrid sharding
  // ranks 4-7 share no group with rank 0 after the load): wait for everyone before changing them.
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    std::filesystem::remove(dir + "/model.safetensors.manifest.json");
    const auto narrow = torch::zeros({kHidden - 2, kIn});
    accel::safetensors::write_file(dir + "/model.safetensors", {{"0.weight",
                                                                 accel::safetensors::DType::F32,
                                                                 {kHidden - 2, kIn},
                                                                 narrow.data_ptr(),
                                                                 static_cast<std::size_t>(narrow.nbytes())}});
  }
  acc.wait_for_everyone();
  std::string error = "no error";
  try {
    acc.load_model(m.parallel, dir);
  } catch (const accel::CheckpointError& e) {
    error = e.what();
  }
  CHECK_MSG(contains(error,
                     "'0.weight' has shape [22, 8] but its tensor-parallel layer is 24 wide along "
                     "dimension 0 (12 on each of 2 ranks)"),
            error);
  acc.wait_for_everyone();
  if (acc.is_main_process()) std::filesystem::remove_all(dir);
}

// save_state / load_state with tensor parallelism on `backend`: a checkpoint of the tensor-parallel run
// resumes it exactly; it is the unsplit model's, so a run without tensor parallelism (same ranks, every one a
// data-parallel replica) resumes from it with the same weights and Adam state, and the tensor-parallel run
// resumes from that run's checkpoint in turn.
void state_on(const std::string& backend) {
  auto world = communicator();
  const auto config = backend_config(backend, world->world_size());
  const std::string dir = shared_temp_dir(*world), tp_dir = dir + "/tp", plain_dir = dir + "/plain";
  // Step `step` on the global batch drawn with that seed, each data-parallel replica taking its rows.
  const auto train = [&](accel::Accelerator& acc, const std::shared_ptr<torch::nn::Module>& model,
                         torch::optim::Optimizer& opt, int step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
    auto dp = acc.data_parallel_group();
    const auto rows = kBatch / dp->world_size();
    const auto mine = [&](const torch::Tensor& t) { return t.narrow(0, dp->rank() * rows, rows); };
    opt.zero_grad();
    auto out = model->as<torch::nn::Sequential>()->forward(mine(x));
    acc.backward(torch::mse_loss(out, mine(y)));
    opt.step();
  };
  const auto same = [](const std::string& at, const accel::NamedTensors& a, const accel::NamedTensors& b) {
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK_MSG((a[i].first == b[i].first && close(a[i].second, b[i].second)),
                at << ": " << a[i].first << " differs");
    }
  };
  accel::NamedTensors at2, at4, at5;
  {  // tensor parallel: steps 0-1, save, steps 2-3; load, steps 2-3 again
    accel::Accelerator acc(accel::AcceleratorOptions().config(config).tensor_parallel_size(2));
    auto m = make_mlps(acc.tensor_parallel_group());
    torch::optim::Adam opt(m.parallel->parameters(), torch::optim::AdamOptions(0.01));
    acc.prepare(m.parallel, opt);
    std::shared_ptr<torch::nn::Module> model = m.parallel.ptr();
    for (int step = 0; step < 2; ++step)
      train(acc, model, opt, step);
    acc.save_state(tp_dir);
    at2 = acc.get_state_dict(m.parallel);
    for (int step = 2; step < 4; ++step)
      train(acc, model, opt, step);
    at4 = acc.get_state_dict(m.parallel);
    acc.load_state(tp_dir);
    same("tp after load_state", acc.get_state_dict(m.parallel), at2);
    for (int step = 2; step < 4; ++step)
      train(acc, model, opt, step);
    same("tp resumed, step 4", acc.get_state_dict(m.parallel), at4);
  }
  {  // without tensor parallelism: resume from the tensor-parallel checkpoint, save at step 4, step 4
    accel::Accelerator acc(accel::AcceleratorOptions().config(config));
    torch::manual_seed(99);  // other initial weights: the checkpoint must replace them
    torch::nn::Sequential plain(torch::nn::Linear(kIn, kHidden), torch::nn::GELU(),
                                torch::nn::Linear(kHidden, kOut));
    torch::optim::Adam opt(plain->parameters(), torch::optim::AdamOptions(0.01));
    acc.prepare(plain, opt);
    acc.load_state(tp_dir);
    same("unsplit model after load_state of the tp checkpoint", acc.get_state_dict(plain), at2);
    for (int step = 2; step < 4; ++step)
      train(acc, plain.ptr(), opt, step);
    same("unsplit model resumed, step 4", acc.get_state_dict(plain), at4);
    acc.save_state(plain_dir);
    train(acc, plain.ptr(), opt, 4);
    at5 = acc.get_state_dict(plain);
  }
  {  // tensor parallel again: resume from the unsplit model's checkpoint
    accel::Accelerator acc(accel::AcceleratorOptions().config(config).tensor_parallel_size(2));
    auto m = make_mlps(acc.tensor_parallel_group());
    torch::optim::Adam opt(m.parallel->parameters(), torch::optim::AdamOptions(0.01));
    acc.prepare(m.parallel, opt);
    acc.load_state(plain_dir);
    same("tp after load_state of the unsplit checkpoint", acc.get_state_dict(m.parallel), at4);
    train(acc, m.parallel.ptr(), opt, 4);
    same("tp resumed from the unsplit checkpoint, step 5", acc.get_state_dict(m.parallel), at5);
  }
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

// Tensor parallelism inside pipeline stages: 2 stages x 2-way tensor parallel (x 2 data-parallel replicas on
// 8 ranks), each stage a Column -> GELU -> Row pair (the second stage behind a Tanh). Every step's loss and
// clipped gradient norm are one process's with the unsplit model and the whole batch, get_state_dict gives
// the whole unsplit model (every stage, slices gathered) equal to that process's, and save_state/load_state
// (SGD momentum) resume exactly. With `megatron`, the layout comes from Accelerate's Megatron-LM file (tp 2,
// pp 2, 2 micro-batches, the distributed optimizer: zero stage 1 over the replicas, activations recomputed in
// each stage, the backend clipping to 0.05 on every step) instead of the program.
void pipeline_from(bool megatron) {
  const int world = communicator()->world_size();
  accel::Config config;
  config.backend = "ddp";
  config.use_cpu = true;
  config.num_processes = world;
  config.pipeline.stages = 2;
  config.pipeline.micro_batches = 2;
  config.pipeline.schedule = accel::pipeline::Schedule::OneFOneB;
  if (megatron) {
    config = accel::Config::load_string(
        fmt::format(
            "distributed_type: MEGATRON_LM\nnum_processes: {}\nuse_cpu: true\nmegatron_lm_config:\n"
            "  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 2\n  megatron_lm_num_micro_batches: 2\n"
            "  megatron_lm_recompute_activations: true\n  megatron_lm_use_distributed_optimizer: true\n"
            "  megatron_lm_gradient_clipping: 0.05\n",
            world),
        "megatron.yaml");
    CHECK_MSG(config.backend == "zero" && config.zero.stage == 1 && config.tensor_parallel_size == 2 &&
                  config.pipeline.stages == 2 && config.pipeline.micro_batches == 2 &&
                  config.zero.activation_checkpointing && config.zero.gradient_clipping == 0.05,
              "megatron.yaml read as " << config.to_yaml());
  }
  config.collective_timeout_seconds = 60;
  config.pipeline.partition = "0,3,7";
  accel::Accelerator acc(megatron ? accel::AcceleratorOptions().config(config)
                                  : accel::AcceleratorOptions().config(config).tensor_parallel_size(2));
  auto tp = acc.tensor_parallel_group();
  const int r = acc.process_index(), lanes = world / 2;
  CHECK_MSG(tp->job_ranks() == std::vector<int>({r / 2 * 2, r / 2 * 2 + 1}),
            "tensor-parallel group " << fmt::format("{}", fmt::join(tp->job_ranks(), ",")));
  auto full1 = seeded_linear(1, kIn, kHidden), full2 = seeded_linear(2, kHidden, kIn),
       full3 = seeded_linear(3, kIn, kHidden), full4 = seeded_linear(4, kHidden, kOut);
  torch::nn::Sequential reference(full1, torch::nn::GELU(), full2, torch::nn::Tanh(), full3,
                                  torch::nn::GELU(), full4);
  torch::nn::Sequential model(
      ColumnParallelLinear(full1, tp), torch::nn::GELU(), RowParallelLinear(full2, tp), torch::nn::Tanh(),
      ColumnParallelLinear(full3, tp), torch::nn::GELU(), RowParallelLinear(full4, tp));
  auto& stage = acc.prepare_pipeline(model);
  CHECK_MSG(stage.stage() == r / lanes, "rank " << r << " runs stage " << stage.stage());
  if (megatron) {
    // megatron_lm_recompute_activations: each layer of the stage recomputes its activations in backward.
    for (const auto& layer : stage.module()->children())
      CHECK_MSG(std::dynamic_pointer_cast<accel::CheckpointedImpl>(layer) != nullptr,
                "a layer of stage " << stage.stage() << " is not checkpointed");
  }
  const auto momentum = torch::optim::SGDOptions(0.2).momentum(0.9);
  torch::optim::SGD opt(stage.parameters(), momentum), ref_opt(reference->parameters(), momentum);
  acc.prepare(opt);
  const auto same_as_reference = [&](const std::string& at) {
    const auto state = acc.get_state_dict(stage.module());
    const auto ref = reference->named_parameters();
    CHECK_MSG(state.size() == ref.size(), at << ": " << state.size() << " tensors of " << ref.size());
    for (const auto& [name, t] : state) {
      const auto* expected = ref.find(name);
      CHECK_MSG((expected != nullptr && close(t, *expected)), at << ": " << name << " differs");
    }
  };
  const auto step = [&](int n, bool reference_too) {
    torch::manual_seed(300 + n);
    const auto x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
    opt.zero_grad();
    const double loss = acc.pipeline_step(x, y, [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::mse_loss(out, target);
    });
    // Under the Megatron-LM file the backend has clipped already: the norm left is at most 0.05.
    const double norm = acc.clip_grad_norm_(megatron ? 1e9 : 0.05);
    opt.step();
    if (!reference_too) return;
    ref_opt.zero_grad();
    const auto ref_loss = torch::mse_loss(reference->forward(x), y);
    ref_loss.backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
    ref_opt.step();
    CHECK_MSG(std::abs(loss - ref_loss.item<double>()) <= 1e-5,
              "step " << n << ": loss " << loss << ", one process " << ref_loss.item<double>());
    // The norm left after clipping is 0.05 x T / (T + 1e-6): within 1e-5 of 0.05 for T >= 0.1.
    if (megatron)
      CHECK_MSG(ref_norm > 0.1, "step " << n << ": the norm " << ref_norm
                                        << " is not clipped enough: the test checks nothing");
    const double expected_norm = megatron ? 0.05 : ref_norm;
    CHECK_MSG(std::abs(norm - expected_norm) <= 1e-5 * expected_norm,
              "step " << n << ": clipped norm " << norm << ", expected " << expected_norm);
  };
  for (int n = 0; n < 3; ++n)
    step(n, true);
  same_as_reference("after 3 steps");
  const std::string dir = shared_temp_dir(*communicator());
  acc.save_state(dir);
  const auto saved = acc.get_state_dict(stage.module());
  step(3, true);
  const auto after = acc.get_state_dict(stage.module());
  acc.load_state(dir);
  const auto loaded = acc.get_state_dict(stage.module());
  for (std::size_t i = 0; i < saved.size(); ++i)
    CHECK_MSG(torch::equal(loaded[i].second, saved[i].second), "load_state: " << saved[i].first);
  step(3, false);
  const auto again = acc.get_state_dict(stage.module());
  for (std::size_t i = 0; i < after.size(); ++i)
    CHECK_MSG(close(again[i].second, after[i].second), "resumed step: " << after[i].first);
  if (!megatron) {
    // A model prepared beside the pipeline, after it, gets its engine over the ranks holding the same
    // tensor-parallel slices (the Accelerator's own group, which prepare_pipeline's narrower one does not
    // replace): DDP broadcasts the weights of that group's first rank, tp rank t's. (Under the file's
    // tp_degree a model without accel::tp layers is refused at prepare.)
    const auto draw = [](int seed) {
      torch::manual_seed(static_cast<std::uint64_t>(seed));
      return torch::nn::Linear(torch::nn::LinearOptions(3, 1).bias(false));
    };
    auto aux = draw(1000 + r);
    const auto expected = draw(1000 + r % 2)->weight.detach().clone();
    acc.prepare(aux);
    CHECK_MSG(torch::equal(aux->weight, expected),
              "rank " << r << ": the aux model was not broadcast from " << r % 2);
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) std::filesystem::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> scenarios{
      {"mlp", mlp},
      {"embedding", embedding},
      {"attention", attention},
      {"count", count},
      {"bad_size", bad_size},
      {"tp_dp", tp_dp},
      {"accelerator", accelerator},
      {"config_tp", config_tp},
      {"trainer", trainer},
      {"lora", lora},
      {"lora_accelerator", lora_accelerator},
      {"export_ddp", [] { export_on("ddp"); }},
      {"export_zero2", [] { export_on("zero2"); }},
      {"export_zero3", [] { export_on("zero3"); }},
      {"export_fsdp_full_shard", [] { export_on("fsdp_full_shard"); }},
      {"export_fsdp_hsdp_tp", [] { export_on("fsdp_hsdp_tp"); }},
      {"state_ddp", [] { state_on("ddp"); }},
      {"state_zero2", [] { state_on("zero2"); }},
      {"state_zero3", [] { state_on("zero3"); }},
      {"megatron_tp", megatron_tp},
      {"pipeline", [] { pipeline_from(false); }},
      {"megatron_pipeline", [] { pipeline_from(true); }}};
  return worker::run_named(
      argc == 2 ? argc : 0, argv, scenarios,
      "usage: tensor_parallel_worker <scenario>[,<scenario>...]; scenarios: mlp, embedding, "
      "count, bad_size, tp_dp, accelerator, trainer, export_<ddp|zero2|zero3|fsdp_full_shard>, "
      "state_<ddp|zero2|zero3>, pipeline, megatron_tp, megatron_pipeline");
}
