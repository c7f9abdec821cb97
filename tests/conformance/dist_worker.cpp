// One rank of a multi-process test. CTest starts it on 2 or 3 ranks through accel-launch (or with
// torchrun-style variables); each scenario checks its results on every rank and exits non-zero with a message
// on a mismatch.
//
//   dist_worker <scenario>[,<scenario>...] [row]   e.g. `dist_worker equivalence,checkpoint zero2`: every
//   scenario of the list runs in the same process group (scenario_main.hpp); the names are main()'s table.
#define CATCH_CONFIG_RUNNER  // this file's main runs the scenarios as Catch2 test cases
#include <catch2/catch.hpp>

#include <accel/accelerator/accelerator.hpp>
#include <accel/checkpoint/safetensors.hpp>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "dist_common.hpp"
#include "scenario_main.hpp"

#include <accel/checkpoint/objects_archive.hpp>

#include "../fault/damage.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/tensor_io.hpp"

namespace dist {

std::string backend_variant = "ddp";

bool nvme_variant() {
  const std::string suffix = "_nvme";
  return backend_variant.size() > suffix.size() &&
         backend_variant.compare(backend_variant.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// ZeRO-Infinity's parameter offload (offload_param_device: nvme): alone, or with the optimizer state on NVMe.
bool params_on_nvme() {
  return backend_variant == "zero3_params_nvme" || backend_variant == "zero3_infinity_nvme";
}
bool optimizer_on_nvme() {
  return nvme_variant() && backend_variant != "zero3_params_nvme";
}

std::string base_variant() {
  if (backend_variant == "zero3_hpz") return "zero3";  // ZeRO++ hpZ on top of stage 3
  if (params_on_nvme()) return "zero3";
  return nvme_variant() ? backend_variant.substr(0, backend_variant.size() - 5) : backend_variant;
}

bool params_sharded() {
  return base_variant() == "zero3" || backend_variant == "fsdp_full_shard" ||
         backend_variant == "fsdp_hybrid" || backend_variant == "fsdp_hsdp";
}

accel::Config cpu_config(accel::MixedPrecision mp, int accumulation) {
  using namespace accel;
  Config c = test::make_config(mp, accumulation);
  c.backend = "ddp";
  c.collective_timeout_seconds = 60;
  // ACCEL_TEST_DEVICE=cuda: the ranks train on the GPU (real_loops.cpp's scenarios move their rows there and
  // compare on the CPU; tests/gpu/ranks_share_gpu.sh runs them so).
  const char* device = std::getenv("ACCEL_TEST_DEVICE");
  c.use_cpu = device == nullptr || std::string(device) != "cuda";
  const bool peak =
      std::string(std::getenv("ACCEL_TEST_SCENARIO") ? std::getenv("ACCEL_TEST_SCENARIO") : "") == "peak";
  const std::string variant = base_variant();
  if (variant == "zero1" || variant == "zero2" || variant == "zero3" || variant == "zero2_no_overlap" ||
      variant == "zero2_auto") {
    c.backend = "zero";
    c.zero.stage = variant[4] - '0';
    c.zero.overlap_comm = variant != "zero2_no_overlap";
    if (optimizer_on_nvme()) {
      // ZeRO-Infinity: every sub-group's optimizer state in a file between steps (the files under this
      // process's own directory there, removed at exit); few buffers, so that most of it is out at any time.
      c.zero.offload_optimizer_device = OffloadDevice::Nvme;
      c.zero.offload_optimizer_nvme_path = std::filesystem::temp_directory_path().string();
      c.zero.offload_optimizer_buffer_count = 2;
    }
    if (params_on_nvme()) {
      // And each unit's parameter shard in a file between its uses (gathers and the optimizer's step).
      c.zero.offload_param_device = OffloadDevice::Nvme;
      c.zero.offload_param_nvme_path = std::filesystem::temp_directory_path().string();
      c.zero.offload_param_buffer_count = 2;
    }
    // Several buckets and optimizer sub-groups (each its own flat buffer, master slice and all-gather) even
    // for the small test model; the `peak` scenario's model (8.4 MB) gets ~30 of each. reduce_bucket_size
    // counts elements, as DeepSpeed's (75000 fp32 values: 300 kB).
    c.zero.reduce_bucket_size = peak ? 75000 : 150;
    c.zero.sub_group_size = peak ? 75000 : 100;
    // DeepSpeed's "auto": hidden_size² elements from the model at prepare (several buckets here too).
    if (variant == "zero2_auto") c.zero.reduce_bucket_size = std::nullopt;
    // ZeRO++ hpZ: secondary groups of 2 (each machine of 2 machines x 2 ranks, two_machines.sh).
    if (backend_variant == "zero3_hpz") c.zero.hpz_partition_size = 2;
  } else if (backend_variant.rfind("fsdp_", 0) == 0) {
    static const std::map<std::string, ShardingStrategy> kStrategies{
        {"fsdp_grad_op", ShardingStrategy::ShardGradOp},
        {"fsdp_full_shard", ShardingStrategy::FullShard},
        {"fsdp_no_shard", ShardingStrategy::NoShard},
        {"fsdp_hybrid", ShardingStrategy::HybridShard},  // on 2 machines x 2 ranks (two_machines.sh)
        {"fsdp_hybrid_zero2", ShardingStrategy::HybridShardZero2},
        // One machine, 4 ranks: shard groups of 2 consecutive ranks (parallelism_config 2 x 2).
        {"fsdp_hsdp", ShardingStrategy::HybridShard}};
    const auto found = kStrategies.find(backend_variant);
    if (found == kStrategies.end()) throw std::invalid_argument("unknown backend variant " + backend_variant);
    c.backend = "fsdp";
    c.fsdp.sharding_strategy = found->second;
    if (backend_variant == "fsdp_hsdp") c.fsdp.hybrid_shard_size = 2;
    c.fsdp.forward_prefetch = true;
    c.ddp_bucket_cap_mb = peak ? 0.3 : 0.001;
  } else if (backend_variant == "local") {
    c.backend = "local";
  } else if (backend_variant != "ddp") {
    throw std::invalid_argument("unknown backend variant " + backend_variant);
  }
  return c;
}

bool close(const torch::Tensor& a, const torch::Tensor& b, double tol) {
  return a.sizes() == b.sizes() && torch::allclose(a, b, tol, tol);
}

}  // namespace dist

namespace {

using namespace accel;

// A type with LibTorch archive members, gathered through <accel/checkpoint/objects_archive.hpp>.
struct Scores {
  torch::Tensor values;
  void save(torch::serialize::OutputArchive& a) const { a.write("values", values); }
  void load(torch::serialize::InputArchive& a) { a.read("values", values); }
};
using namespace dist;
using test::Mlp;
using test::Regression;

// ZeRO: optimizer state and gradients per rank are exactly ceil(P/N) elements; the model's own gradients are
// freed after the sync; bytes per step equal DDP's all-reduce volume.
void sharding() {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int n = acc.num_processes();
  torch::manual_seed(0);
  Mlp model;
  std::int64_t p_total = 0;
  for (const auto& p : model->parameters())
    p_total += p.numel();
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  acc.prepare(model, opt);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(4 * n * 3).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4));
  // Stages 1-2 shard each optimizer sub-group (whole parameters in order, a new one started where the next
  // parameter would pass sub_group_size elements; FSDP's SHARD_GRAD_OP uses the default) on its own; stage 3
  // / FULL_SHARD each unit (here: each Linear) separately.
  std::int64_t shard = 0;
  std::vector<std::int64_t> unit_shards;  // per optimizer tensor: a sub-group's or a unit's slice
  {
    const auto limit = static_cast<std::int64_t>(
        acc.config().backend == "zero" ? acc.config().zero.sub_group_size : ZeroConfig{}.sub_group_size);
    std::int64_t group = 0;
    for (const auto& p : model->parameters()) {
      if (group > 0 && group + p.numel() > limit) {
        unit_shards.push_back((group + n - 1) / n);
        group = 0;
      }
      group += p.numel();
    }
    unit_shards.push_back((group + n - 1) / n);
    for (auto u : unit_shards)
      shard += u;
  }
  if (params_sharded()) {
    shard = 0;
    unit_shards.clear();
    for (const auto& child : model->children()) {
      std::int64_t u = 0;
      for (const auto& p : child->parameters())
        u += p.numel();
      if (u == 0) continue;
      unit_shards.push_back((u + n - 1) / n);
      shard += unit_shards.back();
    }
    // At rest the model's parameters hold no memory: only the shards exist.
    for (const auto& p : model->parameters())
      CHECK_MSG(p.storage().nbytes() == 0, "stage 3 parameters must be freed at rest");
  }
  for (auto& b : *loader) {
    acc.communicator().reset_counters();
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(b.data), b.target));
    // Full gradients are freed: .grad is at most a placeholder without memory (that throws on access).
    for (const auto& p : model->parameters()) {
      CHECK_MSG(!p.grad().defined() ||
                    p.grad().storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get() == nullptr,
                "full gradients must be freed");
    }
    std::int64_t held = 0, held_grad = 0;
    for (const auto& master : opt.param_groups()[0].params()) {
      held += master.numel();
      held_grad += master.grad().numel();
    }
    CHECK_MSG(held == shard, "optimizer parameters have " << held << " elements, want " << shard);
    CHECK_MSG(held_grad == shard, "gradient shards have " << held_grad << " elements, want " << shard);
    // Stage 3 model parameters are released again after backward.
    if (params_sharded()) {
      for (const auto& p : model->parameters())
        CHECK_MSG(p.storage().nbytes() == 0, "stage 3 parameters must be released after backward");
    }
    opt.step();
    acc.sync_parameters();
    // Reduce (stage 2) or reduce-scatter (stage 1) plus all-gather: (N-1)/N x padded P each, as DDP's
    // all-reduce. Stage 3 all-gathers twice (forward and backward): 1.5 x DDP.
    const auto& c = acc.communicator();
    const auto wire = c.bytes(Collective::Reduce).wire + c.bytes(Collective::ReduceScatter).wire +
                      c.bytes(Collective::AllGather).wire;
    // Within 5% of theory (the difference is the padding to N x ceil(P/N)).
    const double ddp = 2.0 * static_cast<double>(p_total) * 4 * (n - 1) / n;
    const double theory = params_sharded() ? 1.5 * ddp : ddp;
    CHECK_MSG(std::abs(static_cast<double>(wire) - theory) <= 0.05 * theory,
              "wire bytes per step " << wire << " vs theory " << theory << " (DDP's " << ddp << ")");
    if (acc.is_main_process()) {
      std::cout << backend_variant << ": wire bytes per step / DDP's = " << static_cast<double>(wire) / ddp
                << std::endl;
    }
  }
  std::size_t k = 0;
  for (const auto& master : opt.param_groups()[0].params()) {
    const auto want = unit_shards.at(k++);
    const auto& adam =
        static_cast<const torch::optim::AdamParamState&>(*opt.state().at(master.unsafeGetTensorImpl()));
    CHECK_MSG(adam.exp_avg().numel() == want && adam.exp_avg_sq().numel() == want,
              "Adam state per rank must be ceil(P/N) of its sub-group or unit = "
                  << want << " elements per state tensor, has " << adam.exp_avg().numel());
  }
  // get_state_dict(): every parameter whole, by name, equal to what the model computes with.
  const auto state = acc.get_state_dict();
  const auto params = model->named_parameters();
  CHECK_MSG(state.size() == params.size(), "get_state_dict has " << state.size() << " entries");
  for (const auto& [name, t] : state) {
    CHECK_MSG(params.contains(name) && torch::equal(t, params[name].detach()),
              "get_state_dict: '" << name << "' differs from the model's parameter");
  }
  // The model itself is whole and identical on every rank.
  for (const auto& p : model->parameters()) {
    const auto all = acc.gather(p.detach().unsqueeze(0));
    for (int r = 1; r < n; ++r)
      CHECK_MSG(torch::equal(all[r], all[0]), "parameters differ across ranks");
  }
}

void collectives() {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int n = acc.num_processes(), r = acc.process_index();
  const auto mine = torch::arange(n, torch::kFloat32) + 1 + n * r;
  CHECK_MSG(torch::equal(acc.gather(mine), torch::arange(n * n, torch::kFloat32) + 1), acc.gather(mine));
  // reduce: element i is sum_r (i + 1 + n r) = n(i+1) + n^2(n-1)/2
  const auto i = torch::arange(n, torch::kFloat32);
  const auto sum = n * (i + 1) + n * n * (n - 1) / 2.0;
  CHECK_MSG(torch::equal(acc.reduce(mine, ReduceOp::Sum), sum), acc.reduce(mine, ReduceOp::Sum));
  CHECK_MSG(torch::allclose(acc.reduce(mine, ReduceOp::Mean), sum / n), acc.reduce(mine, ReduceOp::Mean));
  CHECK_MSG(torch::equal(acc.reduce(mine, ReduceOp::Max), i + 1 + n * (n - 1)),
            acc.reduce(mine, ReduceOp::Max));
  CHECK_MSG(torch::equal(acc.broadcast(mine, n - 1), i + 1 + n * (n - 1)), "broadcast from the last rank");
  // Different sizes per rank: rank r holds r+1 rows.
  const auto rows = torch::full({r + 1, 2}, static_cast<float>(r));
  const auto g = acc.gather(rows);
  CHECK_MSG(g.size(0) == n * (n + 1) / 2, g.sizes());
  CHECK_MSG(acc.pad_across_processes(rows).size(0) == n, "pad to the longest");
  CHECK_MSG(acc.pad_across_processes(rows, 0, -1, true)[0][0].item<float>() == (r == n - 1 ? r : -1),
            "pad first");
  const auto scalar = acc.gather(torch::tensor(static_cast<float>(r)));
  CHECK_MSG(scalar.size(0) == n, "a 0-d tensor gathers as one row each");
  // split_between_processes: 7 items over n ranks, contiguous, covering each once.
  std::vector<int> items{0, 1, 2, 3, 4, 5, 6};
  const auto share = acc.split_between_processes(items);
  const auto all =
      acc.gather(torch::tensor(std::vector<std::int64_t>(share.begin(), share.end()), torch::kInt64));
  CHECK_MSG(torch::equal(all, torch::arange(7)), all);
  CHECK_MSG(acc.split_between_processes(items, true).size() == (7 + n - 1) / static_cast<std::size_t>(n),
            "padding");
  // main_process_first: rank 0 writes a file inside the block; the others must see it when they enter.
  const auto marker =
      std::filesystem::temp_directory_path() /
      ("accel-mpf-" + std::string(std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : "0"));
  {
    auto guard = acc.main_process_first();
    if (acc.is_main_process()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::ofstream(marker) << "done";
    } else {
      CHECK_MSG(std::filesystem::exists(marker), "the main process ran its block first");
    }
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) std::filesystem::remove(marker);

  // Objects: gather_object (one per rank, and lists concatenated as Accelerate does), broadcast_object_list,
  // archive-serialisable types, and the early-stop trigger raised on one rank.
  const auto names = acc.gather_object("rank " + std::to_string(r));
  CHECK_MSG(names.size() == static_cast<std::size_t>(n) && names.back() == "rank " + std::to_string(n - 1),
            "gather_object of strings: " << names.size() << " entries");
  std::vector<std::pair<std::string, double>> mine_list;
  for (int k = 0; k <= r; ++k)
    mine_list.emplace_back("r" + std::to_string(r), 0.5 * k);
  const auto flat = acc.gather_object(mine_list);  // rank r contributes r + 1 entries
  CHECK_MSG(flat.size() == static_cast<std::size_t>(n * (n + 1) / 2) && flat.front().first == "r0" &&
                flat.back() == std::make_pair("r" + std::to_string(n - 1), 0.5 * (n - 1)),
            "gather_object of lists concatenates in rank order: " << flat.size() << " entries");
  const auto metrics_by_rank =
      acc.gather_object(std::map<std::string, std::int64_t>{{"rank", r}, {"seen", 10 * r}});
  for (int k = 0; k < n; ++k)
    CHECK_MSG(metrics_by_rank[static_cast<std::size_t>(k)].at("seen") == 10 * k, "gather_object of maps");
  Scores scores;
  scores.values = torch::full({2}, static_cast<float>(r));
  const auto all_scores = acc.gather_object(scores);
  for (int k = 0; k < n; ++k)
    CHECK_MSG(
        torch::equal(all_scores[static_cast<std::size_t>(k)].values, torch::full({2}, static_cast<float>(k))),
        "gather_object of an archive-serialisable type");
  std::vector<std::string> files = {"only on the last rank"};
  if (r != n - 1) files = {"stale", "values"};
  acc.broadcast_object_list(files, n - 1);
  CHECK_MSG(files == std::vector<std::string>{"only on the last rank"},
            "broadcast_object_list from the last rank");
  CHECK_MSG(!acc.check_trigger(), "no rank set the trigger");
  if (r == n - 1) acc.set_trigger();
  CHECK_MSG(acc.check_trigger(), "the trigger set on the last rank is seen on rank " << r);
  CHECK_MSG(!acc.check_trigger(), "check_trigger resets it");
  int ran = 0;
  acc.on_main_process([&] { ++ran; });
  acc.on_process(n - 1, [&] { ran += 10; });
  CHECK_MSG(ran == (r == 0 ? 1 : 0) + (r == n - 1 ? 10 : 0), "on_main_process / on_process ran " << ran);
  std::string error;
  try {
    acc.on_process(n, [] {});
  } catch (const UsageError& e) {
    error = e.what();
  }
  CHECK_MSG(error.find("process " + std::to_string(n) + " does not exist") != std::string::npos,
            "on_process of a missing process: '" << error << "'");
}

// Reduce-scatter, all-gather and reduce of CPU tensors with both algorithms (Gloo's built-in ones and the
// Communicator's point-to-point ones): exact results (small integers), several chunks, an empty tensor, the
// synchronous forms, and the same byte counts either way.
void cpu_collectives() {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  auto comm = Communicator::create(ProcessState::from_environment(), torch::kCPU);
  const int n = comm->world_size(), r = comm->rank();
  const auto base = comm->options();
  // 600,001 elements per rank: three chunks of the point-to-point reduce-scatter, the last one short.
  for (std::int64_t shard : {std::int64_t{0}, std::int64_t{5}, std::int64_t{600001}}) {
    // Rank q contributes q + 1 + (element index modulo 7): the sum is exact in fp32.
    const auto pattern = torch::arange(n * shard, torch::kInt64).remainder(7).to(torch::kFloat32);
    const auto input = pattern + (r + 1);
    const auto expected = n * pattern.narrow(0, r * shard, shard) + n * (n + 1) / 2;
    const auto part = torch::arange(shard, torch::kFloat32) + 1000 * r;
    auto gathered_expected = torch::cat([&] {
      std::vector<torch::Tensor> parts;
      for (int q = 0; q < n; ++q)
        parts.push_back(torch::arange(shard, torch::kFloat32) + 1000 * q);
      return parts;
    }());
    for (auto algorithm : {CpuCollectives::Builtin, CpuCollectives::PointToPoint}) {
      auto o = base;
      o.cpu_collectives = algorithm;
      comm->set_options(o);
      comm->reset_counters();
      const char* name = algorithm == CpuCollectives::Builtin ? "builtin" : "p2p";
      auto rs = torch::full({shard}, -1.0f);
      auto ag = torch::full({n * shard}, -1.0f);
      // Both in flight at once, waited in the opposite order.
      auto h1 = comm->reduce_scatter_async(rs, input);
      auto h2 = comm->all_gather_async(ag, part);
      h2->wait();
      h1->wait();
      CHECK_MSG(torch::equal(rs, expected), name << " reduce_scatter_async of " << shard << " per rank");
      CHECK_MSG(torch::equal(ag, gathered_expected), name << " all_gather_async of " << shard << " per rank");
      // reduce to the last rank: the sum of every rank's whole input there.
      auto reduced = input.clone();
      comm->reduce_async(reduced, n - 1)->wait();
      if (r == n - 1) {
        CHECK_MSG(torch::equal(reduced, n * pattern + n * (n + 1) / 2),
                  name << " reduce_async of " << n * shard);
      }
      if (shard > 0) {
        CHECK_MSG(torch::equal(comm->reduce_scatter(input, ReduceOp::Sum), expected),
                  name << " reduce_scatter");
        CHECK_MSG(torch::allclose(comm->reduce_scatter(input, ReduceOp::Mean), expected / n),
                  name << " reduce_scatter mean");
        CHECK_MSG(
            torch::equal(comm->all_gather(part.view({shard, 1})), gathered_expected.view({n * shard, 1})),
            name << " all_gather");
      }
      const auto full = static_cast<std::uint64_t>(n * shard * 4);
      CHECK_MSG(comm->bytes(Collective::ReduceScatter).wire == (shard > 0 ? 3 : 1) * full / n * (n - 1),
                name << " reduce_scatter wire bytes " << comm->bytes(Collective::ReduceScatter).wire);
      CHECK_MSG(comm->bytes(Collective::AllGather).wire == (shard > 0 ? 2 : 1) * full / n * (n - 1),
                name << " all_gather wire bytes " << comm->bytes(Collective::AllGather).wire);
    }
  }
  // Reduces of more chunks than the point-to-point root receives at once (8 chunks of 262,144 elements; it
  // posts a later chunk's receives as it adds an earlier one), one to each rank in flight together and waited
  // in order (ZeRO-2's parts of a bucket), the last chunk short: exact sums on every root.
  for (auto algorithm : {CpuCollectives::Builtin, CpuCollectives::PointToPoint}) {
    auto o = base;
    o.cpu_collectives = algorithm;
    comm->set_options(o);
    const std::int64_t len = 11 * 262144 + 3;
    const auto pattern = torch::arange(len, torch::kInt64).remainder(5).to(torch::kFloat32);
    std::vector<torch::Tensor> mine;
    std::vector<std::unique_ptr<CollectiveHandle>> works;
    for (int root = 0; root < n; ++root) {
      mine.push_back(pattern * (root + 1) + r);
      works.push_back(comm->reduce_async(mine.back(), root));
    }
    for (auto& w : works)
      w->wait();
    CHECK_MSG(torch::equal(mine[static_cast<std::size_t>(r)], n * (r + 1) * pattern + n * (n - 1) / 2),
              (algorithm == CpuCollectives::Builtin ? "builtin" : "p2p")
                  << " reduce_async of " << len << " elements to rank " << r);
  }
  comm->set_options(base);
  // Several tensors in one all_reduce_async (two views of one buffer, as a bucket hands them): each is summed
  // on its own. Handed to Gloo as a list, they were taken for one buffer's copies and summed into each other.
  auto flat = torch::zeros({6});
  flat.narrow(0, 0, 3).fill_(r + 1.0);
  flat.narrow(0, 3, 3).fill_(10.0 * (r + 1));
  comm->all_reduce_async({flat.narrow(0, 0, 3), flat.narrow(0, 3, 3)})->wait();
  const double sum = n * (n + 1) / 2.0;
  CHECK_MSG(torch::equal(flat, torch::cat({torch::full({3}, sum), torch::full({3}, 10 * sum)})),
            "all_reduce_async of two tensors gave " << flat);
}

// ddp_comm_hook: fp16 and bf16 gradient compression halve the bytes of every gradient reduction (DDP's
// all-reduce, ZeRO's reduce / reduce-scatter, FSDP's reduce-scatter) and change the result only by the cast's
// rounding; the parameter all-gathers stay fp32.
void comm_hook() {
  struct Run {
    std::uint64_t grad_wire = 0, gather_wire = 0;
    torch::Tensor weights;
  };
  auto train = [](CommHook hook) {
    auto config = cpu_config();
    config.ddp_comm_hook = hook;
    Accelerator acc(AcceleratorOptions().config(config));
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    acc.prepare(model, opt);
    Regression data(8 * acc.num_processes() * 3);
    auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
        std::move(data).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(8));
    Run run;
    for (auto& b : *loader) {
      auto& c = acc.communicator();
      c.reset_counters();
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(b.data), b.target));
      opt.step();
      acc.sync_parameters();
      run.grad_wire += c.bytes(Collective::AllReduce).wire + c.bytes(Collective::ReduceScatter).wire +
                       c.bytes(Collective::Reduce).wire;
      run.gather_wire += c.bytes(Collective::AllGather).wire;
    }
    std::vector<torch::Tensor> flat;
    for (const auto& [name, t] : acc.get_state_dict())
      flat.push_back(t.reshape({-1}).to(torch::kFloat32));
    run.weights = torch::cat(flat);
    return run;
  };
  const auto plain = train(CommHook::No);
  CHECK_MSG(plain.grad_wire > 0, "gradients were reduced");
  for (auto hook : {CommHook::Fp16, CommHook::Bf16}) {
    const auto run = train(hook);
    const auto name = to_string(hook);
    CHECK_MSG(2 * run.grad_wire == plain.grad_wire,
              name << ": gradient wire bytes " << run.grad_wire << ", uncompressed " << plain.grad_wire);
    CHECK_MSG(run.gather_wire == plain.gather_wire, name << ": parameter all-gathers stay fp32");
    const double diff = (run.weights - plain.weights).abs().max().item<double>();
    CHECK_MSG(diff > 0, name << ": compression must change the result (rounding)");
    CHECK_MSG(diff < (hook == CommHook::Fp16 ? 2e-3 : 2e-2), name << ": weights differ by " << diff);
    if (std::getenv("RANK") == nullptr || std::string(std::getenv("RANK")) == "0") {
      std::cout << backend_variant << " " << name << ": gradient bytes " << run.grad_wire << " vs "
                << plain.grad_wire << ", max weight difference " << diff << std::endl;
    }
  }
}

// ddp_comm_hook: power_sgd (PyTorch's powerSGD_hook). A weight gradient of Linear(16, 32) over a global batch
// of 2 has rank <= 2, so rank-2 factors reproduce the exact mean gradient (and error feedback stays exact):
// weights equal one process's with the whole batch, while the all-reduce carries P (32 x 2) + Q (16 x 2) +
// the bias (32) floats instead of 544, from step start_iter on. Rank 1 approximates: the weights differ.
void power_sgd() {
  struct Run {
    torch::Tensor weights;
    std::vector<std::uint64_t> payload;  // all-reduce bytes per step
  };
  const auto data_x = torch::randn({8, 16}, at::make_generator<at::CPUGeneratorImpl>(3));
  const auto data_y = torch::randn({8, 32}, at::make_generator<at::CPUGeneratorImpl>(4));
  auto train = [&](int rank) {
    auto config = cpu_config();
    config.ddp_comm_hook = CommHook::PowerSgd;
    config.ddp_comm_powersgd_rank = rank;
    config.ddp_comm_powersgd_start_iter = 1;
    Accelerator acc(AcceleratorOptions().config(config));
    REQUIRE(acc.num_processes() == 2);
    torch::manual_seed(0);
    torch::nn::Linear model(16, 32);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    acc.prepare(model, opt);
    Run run;
    for (int step = 0; step < 4; ++step) {
      const auto row = 2 * step + acc.process_index();  // global batch rows 2 step, 2 step + 1
      auto& c = acc.communicator();
      c.reset_counters();
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(data_x.slice(0, row, row + 1)), data_y.slice(0, row, row + 1)));
      opt.step();
      run.payload.push_back(c.bytes(Collective::AllReduce).payload);
    }
    run.weights = torch::cat({model->weight.detach().reshape({-1}), model->bias.detach()});
    return run;
  };
  torch::manual_seed(0);
  torch::nn::Linear reference(16, 32);
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 4; ++step) {
    opt.zero_grad();
    torch::mse_loss(reference(data_x.slice(0, 2 * step, 2 * step + 2)),
                    data_y.slice(0, 2 * step, 2 * step + 2))
        .backward();
    opt.step();
  }
  const auto want = torch::cat({reference->weight.detach().reshape({-1}), reference->bias.detach()});
  const auto exact = train(2);
  const auto approx = train(1);
  const double exact_diff = (exact.weights - want).abs().max().item<double>();
  const double approx_diff = (approx.weights - want).abs().max().item<double>();
  CHECK_MSG(exact_diff < 1e-5, "rank 2 on a rank-2 gradient must be exact; weights differ by " << exact_diff);
  CHECK_MSG(approx_diff > 1e-4,
            "rank 1 must approximate (the result cannot equal the exact one); differs by " << approx_diff);
  const std::uint64_t full = (32 * 16 + 32) * 4;
  for (int step = 0; step < 4; ++step) {
    const std::uint64_t want2 = step < 1 ? full : (32 * 2 + 16 * 2 + 32) * 4;
    const std::uint64_t want1 = step < 1 ? full : (32 + 16 + 32) * 4;
    CHECK_MSG(exact.payload[step] == want2,
              "rank 2, step " << step << ": all-reduce bytes " << exact.payload[step] << ", want " << want2);
    CHECK_MSG(approx.payload[step] == want1,
              "rank 1, step " << step << ": all-reduce bytes " << approx.payload[step] << ", want " << want1);
  }
  if (std::getenv("RANK") == nullptr || std::string(std::getenv("RANK")) == "0") {
    std::cout << "power_sgd: all-reduce bytes per step " << exact.payload.back() << " (rank 2), "
              << approx.payload.back() << " (rank 1), uncompressed " << full << "; max weight difference "
              << exact_diff << " (rank 2), " << approx_diff << " (rank 1)" << std::endl;
  }
}

// The sharded engines reduce gradients to their owners, which low-rank factors cannot do: refused at prepare.
void power_sgd_refused() {
  auto config = cpu_config();
  config.ddp_comm_hook = CommHook::PowerSgd;
  try {
    Accelerator acc(AcceleratorOptions().config(config));
    torch::nn::Linear model(16, 32);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    acc.prepare(model, opt);
    FAIL("power_sgd was accepted by " << backend_variant);
  } catch (const UsageError& e) {
    const std::string text = e.what();
    CHECK_MSG(text.find("ddp_comm_hook: power_sgd") != std::string::npos &&
                  text.find("set ddp_comm_hook: fp16 or bf16") != std::string::npos,
              text);
  }
}

void metrics() {
  // 22 samples, batch 4, 2 ranks: the last round wraps around, gather_for_metrics drops the duplicates.
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  Regression data(22);
  data.x = torch::arange(22, torch::kFloat32).unsqueeze(1);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(data).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4));
  std::vector<torch::Tensor> seen;
  for (auto& batch : *loader)
    seen.push_back(acc.gather_for_metrics(batch.data.squeeze(1)));
  const auto all = torch::cat(seen);
  CHECK_MSG(all.size(0) == 22, "gather_for_metrics returned " << all.size(0) << " rows");
  CHECK_MSG(torch::equal(std::get<0>(all.sort()), torch::arange(22, torch::kFloat32)), all);
}

// Trains `steps` optimizer steps on the ranks with per-rank batch `batch` and returns the final parameters;
// `reference` does the same in one process with batch world*batch*accumulation.
template <class Opt>
std::vector<torch::Tensor> train_distributed(Accelerator& acc, int steps, std::size_t batch, Opt make_opt) {
  torch::manual_seed(0);
  Mlp model;
  auto opt = make_opt(model->parameters());
  acc.prepare(model, *opt);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(static_cast<std::int64_t>(batch) * acc.num_processes() * acc.gradient_accumulation_steps() *
                 steps)
          .map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions(batch));
  std::int64_t p_total = 0;
  for (const auto& p : model->parameters())
    p_total += p.numel();
  for (auto& b : *loader) {
    opt->zero_grad();
    acc.backward(torch::mse_loss(model(b.data).to(torch::kFloat32), b.target));
    if (!acc.sync_gradients() && params_sharded()) {
      // Between micro-steps ZeRO-3 keeps only reduced slices (it reduce-scatters every micro-step); FSDP
      // keeps the whole unsharded gradient, as PyTorch's no_sync does.
      const auto held = acc.memory_report().gradients;
      std::uint64_t shards = 0;
      for (const auto& master : opt->param_groups()[0].params())
        shards += static_cast<std::uint64_t>(master.numel()) * 4;
      if (base_variant() == "zero3") {
        CHECK_MSG(held <= shards,
                  "zero3 holds " << held << " gradient bytes between micro-steps, shards are " << shards);
      } else {
        CHECK_MSG(held >= static_cast<std::uint64_t>(p_total) * 4,
                  "FSDP no_sync must keep the whole gradient, holds " << held);
      }
    }
    if (acc.sync_gradients()) {
      // After the sync every rank holds the same gradients (sharded backends hold them in the optimizer's
      // shards: the model's .grad is a placeholder that throws on access).
      for (const auto& p : model->parameters()) {
        if (!p.grad().defined() || acc.capabilities().shards_optimizer_state) continue;
        const auto all = acc.gather(p.grad().unsqueeze(0));
        for (int r = 1; r < acc.num_processes(); ++r) {
          CHECK_MSG(torch::equal(all[r], all[0]), "gradients differ across ranks after sync");
        }
      }
    }
    opt->step();
  }
  return test::snapshot(*model);
}

template <class Opt>
std::vector<torch::Tensor> reference(int world, int steps, std::size_t batch, int accumulation,
                                     MixedPrecision mp, Opt make_opt) {
  torch::manual_seed(0);
  Mlp model;
  auto opt = make_opt(model->parameters());
  const auto big = static_cast<std::int64_t>(batch) * world * accumulation;
  Regression data(big * steps);
  at::autocast::set_autocast_dtype(torch::kCPU, torch::kBFloat16);
  at::autocast::set_autocast_enabled(torch::kCPU, mp == MixedPrecision::Bf16);
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    auto x = data.x.slice(0, s * big, (s + 1) * big), y = data.y.slice(0, s * big, (s + 1) * big);
    torch::mse_loss(model(x).to(torch::kFloat32), y).backward();
    at::autocast::clear_cache();
    opt->step();
  }
  at::autocast::set_autocast_enabled(torch::kCPU, false);
  return test::snapshot(*model);
}

void equivalence_case(const char* name, MixedPrecision mp, int accumulation, double tol) {
  auto sgd = [](std::vector<torch::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, 0.05); };
  auto adamw = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2));
  };
  for (int which = 0; which < 2; ++which) {
    std::vector<torch::Tensor> ref, got;
    int world = 0;
    {
      Accelerator acc(AcceleratorOptions().config(cpu_config(mp, accumulation)));
      world = acc.num_processes();
      got = which == 0 ? train_distributed(acc, 4, 4, sgd) : train_distributed(acc, 4, 4, adamw);
    }
    ref = which == 0 ? reference(world, 4, 4, accumulation, mp, sgd)
                     : reference(world, 4, 4, accumulation, mp, adamw);
    for (std::size_t k = 0; k < ref.size(); ++k) {
      const double diff = (ref[k] - got[k]).abs().max().item<double>();
      CHECK_MSG(close(ref[k], got[k], tol), name << (which == 0 ? " SGD" : " AdamW") << ": parameter " << k
                                                 << " differs from the single-process run by " << diff
                                                 << " (tolerance " << tol << ")");
    }
    std::cout << backend_variant << " " << name << (which == 0 ? " SGD" : " AdamW")
              << ": matches one process with batch " << world * 4 * accumulation << std::endl;
  }
}

// fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap (what `accelerate
// config` writes for a Hugging Face model): FULL_SHARD wraps the block type repeated in the model's
// ModuleList, and N ranks with batch B equal one process with batch N*B. A model that repeats no block type
// is refused on every rank (no rank is left waiting), naming its types.
struct StackBlockImpl : torch::nn::Module {
  StackBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 8))),
        fc2(register_module("fc2", torch::nn::Linear(8, 6))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(StackBlock);

// With `embed`, the parameters outside the blocks (the root unit's) are used both before and after them, as
// a transformer's embedding and head are: accel-launch test's check model found FULL_SHARD wrong there.
struct StackImpl : torch::nn::Module {
  explicit StackImpl(bool with_embed = false) {
    if (with_embed) embed = register_module("embed", torch::nn::Linear(6, 6));
    layers = register_module("layers", torch::nn::ModuleList(StackBlock(), StackBlock(), StackBlock()));
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (embed) x = torch::tanh(embed(x));
    for (const auto& layer : *layers)
      x = layer->as<StackBlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::Linear embed{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

void auto_wrap_blocks_case(bool with_embed) {
  const std::string what = with_embed ? "blocks between an embedding and a head" : "blocks then a head";
  Config c = cpu_config();
  c.fsdp.auto_wrap_policy = AutoWrapPolicy::TransformerBasedWrap;
  c.fsdp.transformer_layer_cls_to_wrap.clear();
  constexpr int kSteps = 4;
  constexpr std::int64_t kBatch = 4;
  std::map<std::string, torch::Tensor> got;
  int world = 0;
  {
    Accelerator acc(AcceleratorOptions().config(c));
    world = acc.num_processes();
    torch::manual_seed(0);
    Stack model(with_embed);
    torch::optim::SGD opt(model->parameters(), 0.05);
    acc.prepare(model, opt);
    Regression data(kBatch * world * kSteps);
    const auto r = acc.process_index();
    for (int s = 0; s < kSteps; ++s) {
      const auto at = (s * world + r) * kBatch;
      opt.zero_grad();
      acc.backward(
          torch::mse_loss(model(data.x.slice(0, at, at + kBatch)), data.y.slice(0, at, at + kBatch)));
      opt.step();
    }
    std::vector<std::string> order, want_order;
    for (const auto& [name, t] : acc.get_state_dict(model)) {
      got[name] = t.clone();
      order.push_back(name);
    }
    // In the model's own order (named_parameters), as one process lists it: never unit by unit.
    for (const auto& p : model->named_parameters())
      want_order.push_back(p.key());
    auto joined = [](const std::vector<std::string>& names) {
      std::string out;
      for (const auto& n : names)
        out += (out.empty() ? "" : ", ") + n;
      return out;
    };
    CHECK_MSG(order == want_order, backend_variant << " (" << what << "): get_state_dict lists "
                                                   << joined(order) << " instead of the model's order "
                                                   << joined(want_order));
  }
  {
    // No repeated block: every rank refuses at prepare, naming the model's types.
    Accelerator acc(AcceleratorOptions().config(c));
    Mlp flat;
    torch::optim::SGD flat_opt(flat->parameters(), 0.05);
    std::string message;
    try {
      acc.prepare(flat, flat_opt);
    } catch (const UsageError& e) {
      message = e.what();
    }
    CHECK_MSG(
        message.find("repeats none") != std::string::npos && message.find("LinearImpl") != std::string::npos,
        "a model without a repeated block: '" << message << "'");
  }
  torch::manual_seed(0);
  Stack ref(with_embed);
  torch::optim::SGD ref_opt(ref->parameters(), 0.05);
  Regression data(kBatch * world * kSteps);
  for (int s = 0; s < kSteps; ++s) {
    const auto big = kBatch * world;
    ref_opt.zero_grad();
    torch::mse_loss(ref(data.x.slice(0, s * big, (s + 1) * big)), data.y.slice(0, s * big, (s + 1) * big))
        .backward();
    ref_opt.step();
  }
  CHECK_MSG(got.size() == ref->named_parameters().size(), got.size() << " tensors in get_state_dict");
  for (const auto& p : ref->named_parameters()) {
    const auto it = got.find(p.key());
    CHECK_MSG(it != got.end(), "get_state_dict has no '" << p.key() << "'");
    if (it == got.end()) continue;
    const double diff = (p.value() - it->second).abs().max().item<double>();
    CHECK_MSG(diff <= 2e-5, backend_variant << " (" << what << "): auto-wrapped '" << p.key()
                                            << "' differs from one process by " << diff);
  }
}

void auto_wrap_blocks() {
  auto_wrap_blocks_case(false);
  auto_wrap_blocks_case(true);
}

// deepspeed_config.gradient_clipping: backward clips each model's gradients to it on sync steps, as
// DeepSpeed's engine does before its step. N ranks with accumulation 2 must equal one process with the whole
// batch that clips with LibTorch's clip_grad_norm_ before each step (the norms exceed the bound, so clipping
// bites).
void config_clipping() {
  const double max_norm = 0.05;
  Config c = cpu_config(MixedPrecision::No, 2);
  c.zero.gradient_clipping = max_norm;
  std::vector<torch::Tensor> got;
  int world = 0;
  constexpr int kSteps = 3;
  {
    Accelerator acc(AcceleratorOptions().config(c));
    world = acc.num_processes();
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    acc.prepare(model, opt);
    auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
        Regression(4 * world * 2 * kSteps).map(torch::data::transforms::Stack<>()),
        torch::data::DataLoaderOptions(4));
    for (auto& b : *loader) {
      acc.backward(torch::mse_loss(model(b.data), b.target));
      opt.step();
      opt.zero_grad();
    }
    CHECK_MSG(acc.completed_steps() == kSteps, "completed " << acc.completed_steps() << " steps");
    got = test::snapshot(*model);
  }
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  const std::int64_t big = 4 * world;
  Regression data(big * 2 * kSteps);
  double largest = 0;
  for (int s = 0; s < kSteps; ++s) {
    for (int m = 0; m < 2; ++m) {
      const auto k = s * 2 + m;
      (torch::mse_loss(model(data.x.slice(0, k * big, (k + 1) * big)),
                       data.y.slice(0, k * big, (k + 1) * big)) /
       2)
          .backward();
    }
    largest = std::max(largest, torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm));
    opt.step();
    opt.zero_grad();
  }
  CHECK_MSG(largest > 2 * max_norm, "the test must clip: the largest norm was " << largest);
  const auto want = test::snapshot(*model);
  for (std::size_t k = 0; k < want.size(); ++k) {
    CHECK_MSG(close(want[k], got[k], 2e-5), "gradient_clipping "
                                                << max_norm << ": parameter " << k
                                                << " differs from one process clipping by "
                                                << (want[k] - got[k]).abs().max().item<double>());
  }
}

// Hybrid sharding (2 machines x 2 ranks): clip_grad_norm_ returns one process's norm and clips as it does
// (each shard is held once per machine and must count once), and the gradient traffic across machines is one
// all-reduce of this rank's shard per step: the machine's ranks together all-reduce one whole replica, as
// DDP with one process per machine would.
// The 4-rank scenarios' data (hybrid, hpz): each rank's batches of 4 rows, in order, `steps` of them.
auto four_rank_batches(Accelerator& acc, int steps) {
  return acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(4 * 4 * steps).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4));
}

// The 4-rank scenarios' reference (hybrid, hpz): one process on the 4 ranks' batches of 4 rows as one batch
// of 16 a step, SGD 0.1, clipped to `max_norm` when given (each step's norm into `norms`); `got` must be
// within 2e-5 of its weights.
void check_one_process(const std::vector<torch::Tensor>& got, int steps, double max_norm = 0,
                       std::vector<double>* norms = nullptr) {
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Regression data(16 * steps);
  for (int s = 0; s < steps; ++s) {
    torch::mse_loss(model(data.x.slice(0, s * 16, (s + 1) * 16)), data.y.slice(0, s * 16, (s + 1) * 16))
        .backward();
    if (max_norm > 0) {
      const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
      if (norms != nullptr) norms->push_back(norm);
    }
    opt.step();
    opt.zero_grad();
  }
  const auto want = test::snapshot(*model);
  REQUIRE(want.size() == got.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    CHECK_MSG(close(want[k], got[k], 2e-5), "parameter " << k << " differs from one process by "
                                                         << (want[k] - got[k]).abs().max().item<double>());
  }
}

void hybrid() {
  const auto state = ProcessState::from_environment();
  REQUIRE(state.world_size == 4);
  // Shard groups of 2: each machine of 2 x 2 ranks, or fsdp_hybrid_shard_size 2 on one machine of 4.
  const int group =
      cpu_config().fsdp.hybrid_shard_size > 0 ? cpu_config().fsdp.hybrid_shard_size : state.local_world_size;
  REQUIRE(group == 2);
  const double max_norm = 0.05;
  constexpr int kSteps = 3;
  std::vector<torch::Tensor> got;
  std::vector<double> got_norms;
  {
    Accelerator acc(AcceleratorOptions().config(cpu_config()));
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    acc.prepare(model, opt);
    std::int64_t shard_bytes = 0;  // this rank's master slices: the shard it holds
    for (const auto& group : opt.param_groups()) {
      for (const auto& t : group.params())
        shard_bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
    }
    std::int64_t model_bytes = 0;
    for (const auto& p : model->parameters())
      model_bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
    CHECK_MSG(2 * shard_bytes >= model_bytes && 2 * shard_bytes < model_bytes + 64 * 4,
              "a rank holds " << shard_bytes << " bytes of a " << model_bytes
                              << "-byte model: half of it (the shard group's 2 ranks share it)");
    auto loader = four_rank_batches(acc, kSteps);
    for (auto& b : *loader) {
      acc.communicator().reset_counters();
      acc.backward(torch::mse_loss(model(b.data), b.target));
      const auto across = acc.communicator().bytes(Collective::AllReduce);
      // The shard, less the flat vectors' padding at its end under SHARD_GRAD_OP (whose buckets hold only
      // the parameters' elements).
      CHECK_MSG(across.payload <= static_cast<std::uint64_t>(shard_bytes) &&
                    across.payload + 64 * 4 >= static_cast<std::uint64_t>(shard_bytes),
                "all-reduce payload " << across.payload << " bytes in a step, want this rank's shard, "
                                      << shard_bytes << " bytes (all-reduced across the 2 shard groups)");
      CHECK_MSG(acc.communicator().bytes(Collective::ReduceScatter).calls +
                        acc.communicator().bytes(Collective::Reduce).calls >
                    0,
                "the gradients must be reduce-scattered inside the shard group");
      got_norms.push_back(acc.clip_grad_norm_(max_norm));
      opt.step();
      opt.zero_grad();
    }
    got = test::snapshot(*model);
  }
  std::vector<double> norms;
  check_one_process(got, kSteps, max_norm, &norms);
  for (int s = 0; s < kSteps; ++s) {
    const double norm = norms.at(static_cast<std::size_t>(s));
    CHECK_MSG(norm > 2 * max_norm, "the test must clip: step " << s << " norm " << norm);
    CHECK_MSG(std::abs(norm - got_norms.at(static_cast<std::size_t>(s))) < 1e-5 * norm,
              "step " << s << ": clip_grad_norm_ returned " << got_norms.at(static_cast<std::size_t>(s))
                      << ", one process " << norm);
  }
}

// ZeRO++ hpZ (zero3_hpz, 2 machines x 2 ranks, secondary groups = the machines): the same steps with and
// without it give the same weights bit for bit (backward gathers the very values forward gathered), one
// process's within 2e-5; and backward's all-gathers run inside the machine: every unit is gathered once in
// forward over the 4 ranks (3/4 of it on the wire) and once in backward over the machine's 2 (1/2 of it),
// against 3/4 twice without: 5/6 of the all-gather wire bytes of each step, exactly.
void hpz() {
  const auto state = ProcessState::from_environment();
  REQUIRE(state.world_size == 4);
  REQUIRE(cpu_config().zero.hpz_partition_size == 2);
  constexpr int kSteps = 3;
  const auto run = [&](int hpz, std::vector<std::uint64_t>& wire) {
    Config config = cpu_config();
    config.zero.hpz_partition_size = hpz;
    Accelerator acc(AcceleratorOptions().config(config));
    torch::manual_seed(0);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    acc.prepare(model, opt);
    auto loader = four_rank_batches(acc, kSteps);
    for (auto& b : *loader) {
      acc.communicator().reset_counters();
      acc.backward(torch::mse_loss(model(b.data), b.target));
      wire.push_back(acc.communicator().bytes(Collective::AllGather).wire);
      opt.step();
      opt.zero_grad();
    }
    return test::snapshot(*model);
  };
  std::vector<std::uint64_t> with_wire, without_wire;
  const auto with = run(2, with_wire);
  const auto without = run(1, without_wire);
  REQUIRE(with.size() == without.size());
  for (std::size_t k = 0; k < with.size(); ++k) {
    CHECK_MSG(torch::equal(with[k], without[k]), "parameter "
                                                     << k << " differs with hpZ by "
                                                     << (with[k] - without[k]).abs().max().item<double>());
  }
  REQUIRE(with_wire.size() == static_cast<std::size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    const auto w = with_wire[static_cast<std::size_t>(s)], wo = without_wire[static_cast<std::size_t>(s)];
    CHECK_MSG(wo > 0 && w * 6 == wo * 5, "step " << s << ": all-gather wire bytes " << w << " with hpZ, "
                                                 << wo << " without (want 5/6)");
  }
  check_one_process(with, kSteps);
}

void sync_pattern() {
  // Accumulation 2 over 5 batches per rank: syncs on 2, 4 and the last batch; micro-steps send nothing; the
  // gradients differ across ranks during a micro-step (each saw its own data).
  Accelerator acc(AcceleratorOptions().config(cpu_config(MixedPrecision::No, 2)));
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.05);
  acc.prepare(model, opt);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(4 * 5 * acc.num_processes()).map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions(4));
  std::vector<bool> pattern;
  const std::uint64_t param_bytes = [&] {
    std::uint64_t b = 0;
    for (const auto& p : model->parameters())
      b += p.nbytes();
    return b;
  }();
  for (auto& b : *loader) {
    const auto before = acc.communicator().bytes(Collective::AllReduce);
    acc.backward(torch::mse_loss(model(b.data), b.target));
    const auto after = acc.communicator().bytes(Collective::AllReduce);
    pattern.push_back(acc.sync_gradients());
    if (!acc.sync_gradients()) {
      CHECK_MSG(after.calls == before.calls, "a micro-step communicated");
    } else {
      CHECK_MSG(after.payload - before.payload == param_bytes,
                "a sync step all-reduced " << after.payload - before.payload << " bytes, parameters hold "
                                           << param_bytes);
      const auto wire = after.wire - before.wire;
      const auto theory = 2 * param_bytes * (acc.num_processes() - 1) / acc.num_processes();
      CHECK_MSG(wire == theory, "wire bytes " << wire << " vs ring all-reduce " << theory);
    }
    opt.step();
    opt.zero_grad();
  }
  CHECK_MSG((pattern == std::vector<bool>{false, true, false, true, true}), "sync pattern");
}

void micro_step_grads_differ() {
  // Plain backward on different data: before any sync, the ranks' gradients differ; after sync they agree.
  Accelerator acc(AcceleratorOptions().config(cpu_config(MixedPrecision::No, 2)));
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.05);
  acc.prepare(model, opt);
  Regression data(8, 6, 100 + static_cast<std::uint64_t>(acc.process_index()));
  acc.backward(torch::mse_loss(model(data.x), data.y));  // micro-step: gradients set aside, not synced
  CHECK_MSG(!acc.sync_gradients(), "first micro-step must not sync");
  // Read the set-aside gradient through a second micro-step's restore: run a zero loss so nothing is added.
  acc.backward(0.0 * model(data.x).sum());
  CHECK_MSG(acc.sync_gradients(), "second micro-step syncs");
  const auto all = acc.gather(model->fc2->weight.grad().unsqueeze(0));
  for (int r = 1; r < acc.num_processes(); ++r)
    CHECK_MSG(torch::equal(all[r], all[0]), "synced gradients");
  // Same data without accumulation: local gradients before sync differ across ranks.
  torch::manual_seed(0);
  Mlp plain;
  torch::mse_loss(plain(data.x), data.y).backward();
  const auto local = acc.gather(plain->fc2->weight.grad().unsqueeze(0));
  CHECK_MSG(!torch::equal(local[0], local[1]), "local gradients of different data should differ");
}

void debug_mismatch() {
  Config c = cpu_config();
  c.debug = true;
  c.collective_timeout_seconds = 20;
  Accelerator acc(AcceleratorOptions().config(c));
  auto t = torch::ones({acc.process_index() == 0 ? 4 : 3});
  try {
    acc.reduce(t);
    CHECK_MSG(false, "a shape mismatch must raise DistributedError");
  } catch (const DistributedError& e) {
    const std::string msg = e.what();
    std::cout << "caught as expected: " << msg << std::endl;
    CHECK_MSG(msg.find("differs across ranks") != std::string::npos, msg);
    CHECK_MSG(msg.find("rank 0: all_reduce(shape=[4], dtype=Float, device=cpu, op=sum)") != std::string::npos,
              msg);
    CHECK_MSG(msg.find("rank 1: all_reduce(shape=[3], dtype=Float, device=cpu, op=sum)") != std::string::npos,
              msg);
  }
}

// Debug mode: a rank that skips a collective is named by the others within the timeout, instead of a hang.
void debug_missing() {
  Config c = cpu_config();
  c.debug = true;
  c.collective_timeout_seconds = 5;
  Accelerator acc(AcceleratorOptions().config(c));
  acc.wait_for_everyone();
  if (acc.process_index() == 1) return;  // rank 1 "forgets" the next collective and finishes
  const auto start = std::chrono::steady_clock::now();
  try {
    acc.reduce(torch::ones({2}));
    CHECK_MSG(false, "a missing rank must raise DistributedError");
  } catch (const DistributedError& e) {
    const std::string msg = e.what();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "caught as expected after " << waited << " s: " << msg << std::endl;
    // The collective's number counts every collective of the process (earlier scenarios of the launch too).
    CHECK_MSG(
        std::regex_search(
            msg, std::regex(R"(rank\(s\) 1 did not reach collective #[0-9]+ \(all_reduce\(shape=\[2\])")),
        msg);
    CHECK_MSG(waited < 30, "the error must come within the timeout, took " << waited << " s");
  }
}

void unused() {
  struct TwoHeadsImpl : torch::nn::Module {
    TwoHeadsImpl()
        : a(register_module("a", torch::nn::Linear(6, 1))),
          b(register_module("b", torch::nn::Linear(6, 1))) {}
    torch::Tensor forward(torch::Tensor x) { return a(x); }  // b never takes part
    torch::nn::Linear a, b;
  };
  TORCH_MODULE(TwoHeads);
  Regression data(8);
  for (bool tolerate : {false, true}) {
    Config c = cpu_config();
    c.ddp_find_unused_parameters = tolerate;
    Accelerator acc(AcceleratorOptions().config(c));
    TwoHeads model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    acc.prepare(model, opt);
    try {
      acc.backward(torch::mse_loss(model(data.x), data.y));
      CHECK_MSG(tolerate, "unused parameters must be an error without ddp_find_unused_parameters");
      if (params_sharded()) {
        // The optimizer's shards of b hold zero gradients.
        for (const auto& master : opt.param_groups()[0].params())
          CHECK_MSG(master.grad().defined(), "every shard has a gradient");
      } else {
        CHECK_MSG(model->b->weight.grad().abs().sum().item<float>() == 0, "unused gradients are zero");
      }
    } catch (const UsageError& e) {
      CHECK_MSG(!tolerate, "unexpected error: " << e.what());
      CHECK_MSG(std::string(e.what()).find("parameter(s) b.weight, b.bias received no gradient") !=
                    std::string::npos,
                e.what());
    }
  }
}

// Every file of the checkpoint in `dir` (every rank's), damaged in turn in a copy, is refused on every rank
// with a message naming it, before anything is loaded; so are the ranks' optimizer files swapped.
void refuses_damaged_copies(Accelerator& acc, torch::nn::Module& model, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const auto before = test::snapshot(model);
  const fs::path damaged = dir.string() + "-damaged";
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().filename() != "manifest.json")
      names.push_back(e.path().lexically_relative(dir).string());
  }
  std::sort(names.begin(), names.end());
  auto refused = [&](const std::string& what, const std::function<void()>& damage, const std::string& named) {
    if (acc.is_main_process()) {
      fs::remove_all(damaged);
      fs::copy(dir, damaged, fs::copy_options::recursive);
      damage();
    }
    acc.wait_for_everyone();
    try {
      acc.load_state(damaged.string());
      CHECK_MSG(false, "load_state accepted a checkpoint with " << what);
    } catch (const CheckpointError& e) {
      const std::string message = e.what();
      CHECK_MSG(
          message.find(named) != std::string::npos && message.find("nothing was loaded") != std::string::npos,
          what << ": the message does not name " << named << ": " << message);
    }
    acc.wait_for_everyone();
  };
  for (const auto& name : names) {
    refused(
        "a damaged " + name,
        [&] {
          const auto middle = static_cast<std::streamoff>(fs::file_size(damaged / name) / 2);
          std::fstream f(damaged / name, std::ios::in | std::ios::out | std::ios::binary);
          f.seekg(middle);
          char c = 0;
          f.get(c);
          f.seekp(middle);
          f.put(static_cast<char>(c ^ 0x01));
        },
        (damaged / name).string());
  }
  if (fs::exists(dir / "optimizer_rank1.pt")) {
    refused(
        "rank 0's and rank 1's optimizer files swapped",
        [&] {
          fs::rename(damaged / "optimizer_rank0.pt", damaged / "swap");
          fs::rename(damaged / "optimizer_rank1.pt", damaged / "optimizer_rank0.pt");
          fs::rename(damaged / "swap", damaged / "optimizer_rank1.pt");
        },
        "optimizer_rank");
  }
  // A consistent checkpoint (its manifest rebuilt) whose model file lacks a tensor: it passes verification
  // and is refused while loading, after the other objects (put back) and, where parameters are sharded, with
  // units gathered (released again: the scenario trains on after this).
  const auto model_file = std::find_if(names.begin(), names.end(), [](const std::string& n) {
    return n.rfind("model", 0) == 0 && n.size() > 12 && n.substr(n.size() - 12) == ".safetensors";
  });
  CHECK_MSG(model_file != names.end(), "the checkpoint has no model file");
  if (model_file != names.end()) {
    if (acc.is_main_process()) {
      fs::remove_all(damaged);
      fs::copy(dir, damaged, fs::copy_options::recursive);
      const auto path = (damaged / *model_file).string();
      const auto file = safetensors::File::open(path);
      auto tensors = accel::detail::read_tensors(file);
      const auto first = tensors.begin()->first;
      tensors[first + "_renamed"] = tensors.begin()->second;
      tensors.erase(first);
      accel::detail::write_tensors(path, NamedTensors(tensors.begin(), tensors.end()), file.metadata());
      const auto m = accel::detail::read_manifest(damaged.string());
      accel::detail::write_manifest(
          damaged.string(), accel::detail::build_manifest(damaged.string(), m.checkpoint_id, m.facts, {}));
    }
    acc.wait_for_everyone();
    try {
      acc.load_state(damaged.string());
      CHECK_MSG(false, "load_state accepted a model file without one of its tensors");
    } catch (const CheckpointError& e) {
      const std::string message = e.what();
      CHECK_MSG(message.find("are as they were") != std::string::npos ||
                    message.find("nothing was loaded") != std::string::npos,
                "a model file without one of its tensors: " << message);
      if (acc.is_main_process())
        std::cout << "checkpoint: " << *model_file << " without one of its tensors: refused: "
                  << message.substr(
                         message.find(*model_file) == std::string::npos ? 0 : message.find(*model_file), 160)
                  << std::endl;
    }
    acc.wait_for_everyone();
  }
  const auto after = test::snapshot(model);
  for (std::size_t k = 0; k < after.size(); ++k)
    CHECK_MSG(torch::equal(before[k], after[k]), "a refused load_state changed the model");
  if (acc.is_main_process()) fs::remove_all(damaged);
  CHECK_MSG(names.size() >= 5, "the checkpoint has " << names.size() << " files");
}

// The multi-rank corrupted-checkpoint campaign (issue 30), in every row's checkpoint scenario: every file of
// the row's checkpoint damaged once each of the eight ways of tests/fault/damage.hpp
// (ACCEL_DAMAGE_CAMPAIGN=N: N times each of the random ones, for a longer campaign; 0: off). Every rank must
// refuse the copy with an accel:: error naming it and keep its weights, or load exactly the intact
// checkpoint; the ranks must agree. Prints "damage campaign on <row>, <N> ranks: ..." on the main process.
// ACCEL_FUZZ_SEED picks the mutants.
void damage_campaign(Accelerator& acc, Mlp& model, const std::filesystem::path& dir, std::size_t per_kind) {
  namespace fs = std::filesystem;
  const fs::path other = dir.string() + "-other", damaged = dir.string() + "-campaign";
  auto weights = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& [name, t] : acc.get_state_dict(model))
      out.push_back(t.clone());
    return out;
  };
  auto same = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t k = 0; k < a.size(); ++k)
      if (!torch::equal(a[k], b[k])) return false;
    return true;
  };
  acc.save_state(other.string());  // this run's state: another checkpoint of the same layout
  acc.load_state(dir.string());
  const auto intact = weights();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  const char* seed = std::getenv("ACCEL_FUZZ_SEED");
  std::mt19937_64 rng(seed != nullptr ? std::stoull(seed) : 1);
  std::size_t mutants = 0, refused = 0, harmless = 0, silent = 0, partial = 0, unclear = 0, disagree = 0;
  for (const auto& name : names) {
    for (int kind = 0; kind < accel_fault::kDamageKinds; ++kind) {
      const std::size_t repeats = kind >= 4 && kind != 6 ? 1 : per_kind;
      for (std::size_t i = 0; i < repeats; ++i) {
        std::string what;
        if (acc.is_main_process()) {
          fs::remove_all(damaged);
          fs::copy(dir, damaged, fs::copy_options::recursive);
          const fs::path from_other = fs::exists(other / name) ? other / name : other / names.front();
          what = name + " " + accel_fault::damage(damaged, damaged / name, from_other, kind, rng);
        }
        acc.wait_for_everyone();
        ++mutants;
        char outcome = 'A';
        std::string message;
        try {
          acc.load_state(damaged.string());
        } catch (const accel::Error& e) {
          outcome = 'R';
          message = e.what();
        } catch (const std::exception& e) {
          outcome = 'U';
          message = e.what();
        }
        const auto outcomes = acc.communicator().exchange(std::string(1, outcome));
        const bool agreed = std::all_of(outcomes.begin(), outcomes.end(),
                                        [&](const std::string& o) { return o == outcomes[0]; });
        const auto now = weights();
        std::string problem;
        if (!agreed) {
          ++disagree;
          problem = "the ranks disagree";
        } else if (outcome == 'R') {
          ++refused;
          if (!same(now, intact)) {
            ++partial;
            problem = "refused, but the weights changed: " + message.substr(0, 200);
          } else if (message.find(damaged.string()) == std::string::npos) {
            ++unclear;
            problem = "the message names no path of the checkpoint: " + message.substr(0, 300);
          }
        } else if (outcome == 'U') {
          ++unclear;
          problem = "not an accel:: error: " + message.substr(0, 300);
        } else if (same(now, intact)) {
          ++harmless;
        } else {
          ++silent;
          problem = "loaded, and the weights differ from the intact checkpoint's";
        }
        CHECK_MSG(problem.empty(), "damage campaign: " << what << ": " << problem);
        if (!problem.empty() && !agreed)
          throw std::runtime_error("the ranks disagree; stopping the campaign");
        if (!same(now, intact)) acc.load_state(dir.string());
      }
    }
  }
  if (acc.is_main_process()) {
    std::cout << "damage campaign on " << backend_variant << ", " << acc.num_processes()
              << " ranks: " << mutants << " mutants, " << refused << " refused, " << harmless
              << " loaded the intact state, " << silent << " silent wrong loads, " << partial
              << " partial loads, " << unclear << " unclear, " << disagree << " disagreeing" << std::endl;
    fs::remove_all(damaged);
    fs::remove_all(other);
  }
  acc.wait_for_everyone();
}

void checkpoint() {
  // Save at step 3 on every rank, keep training, then resume from the checkpoint: identical end state.
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("accel-dist-ckpt-" + std::string(std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : "0"));
  auto run = [&](bool save, bool load) {
    Accelerator acc(AcceleratorOptions().config(cpu_config()));
    acc.set_seed(5);
    torch::manual_seed(load ? 77 : 0);
    Mlp model(6, 0.3);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    acc.prepare(model, opt);
    auto loader = acc.prepare_data_loader(Regression(64).map(torch::data::transforms::Stack<>()),
                                          torch::data::DataLoaderOptions(4));
    const char* per_kind = std::getenv("ACCEL_DAMAGE_CAMPAIGN");
    if (load && (per_kind == nullptr || *per_kind == '\0' || std::stoull(per_kind) > 0))
      damage_campaign(acc, model, dir, per_kind == nullptr || *per_kind == '\0' ? 1 : std::stoull(per_kind));
    if (load) refuses_damaged_copies(acc, *model, dir);
    if (load) acc.load_state(dir.string());
    for (int epoch = 0; epoch < 2; ++epoch) {
      for (auto& b : *loader) {
        opt.zero_grad();
        acc.backward(torch::mse_loss(model(b.data), b.target));
        opt.step();
        if (save && acc.completed_steps() == 3) acc.save_state(dir.string());
      }
    }
    if (load) {  // every rank has read it: the next launch on this port must not meet a stale checkpoint
      acc.wait_for_everyone();
      if (acc.is_main_process()) std::filesystem::remove_all(dir);
    }
    return test::snapshot(*model);
  };
  const auto full = run(true, false);
  const auto resumed = run(false, true);
  for (std::size_t k = 0; k < full.size(); ++k)
    CHECK_MSG(torch::equal(full[k], resumed[k]), "resume differs");
}

// ZeRO-Infinity (offload_optimizer_device: nvme; on zero3_params_nvme offload_param_device: nvme instead, on
// zero3_infinity_nvme both) on the *_nvme rows: the run equals, bit for bit, the same stage and ranks with
// everything in memory (weights every step, and the optimizer state and parameter shards at the end); between
// steps no offloaded tensor holds memory and this process's swap directory holds one file per sub-group and
// shard; when the accelerator ends, the files are gone and an optimizer that outlives it holds its state and
// parameters in memory again.
std::filesystem::path nvme_swap_dir() {
  std::filesystem::path found;
  const std::string suffix = "_" + std::to_string(::getpid());
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path())) {
    const auto name = e.path().filename().string();
    if (name.rfind("accel_nvme_", 0) == 0 && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      found = e.path();
  }
  return found;
}

void nvme() {
  if (!nvme_variant()) throw std::invalid_argument("nvme runs on the *_nvme rows, not " + backend_variant);
  struct Run {
    std::vector<std::vector<torch::Tensor>> weights;  // after every step
    std::vector<torch::Tensor> state;                 // the optimizer's, at the end
  };
  auto run = [](bool offload) {
    Run out;
    torch::manual_seed(0);
    Mlp model(6, 0.0);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    {
      Config c = cpu_config();
      if (!offload) {
        c.zero.offload_optimizer_device = OffloadDevice::None;
        c.zero.offload_param_device = OffloadDevice::None;
      }
      Accelerator acc(AcceleratorOptions().config(c));
      acc.set_seed(5);
      acc.prepare(model, opt);
      auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
          Regression(48).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4));
      for (int epoch = 0; epoch < 2; ++epoch) {
        for (auto& b : *loader) {
          opt.zero_grad();
          acc.backward(torch::mse_loss(model(b.data), b.target));
          opt.step();
          acc.wait_for_everyone();  // a step boundary: the model is refreshed, the last sub-group written
          out.weights.push_back(test::snapshot(*model));
          if (!offload) continue;
          std::size_t held = 0, tensors = 0;
          for (const auto& [key, st] : opt.state()) {
            const auto& a = static_cast<const torch::optim::AdamWParamState&>(*st);
            for (const auto& t : {a.exp_avg(), a.exp_avg_sq()}) {
              ++tensors;
              held += t.storage().nbytes();
            }
          }
          std::size_t shards = 0, shard_bytes = 0;  // the optimizer's parameters: the engine's shards
          for (const auto& group : opt.param_groups()) {
            for (const auto& p : group.params()) {
              ++shards;
              shard_bytes += p.storage().nbytes();
            }
          }
          if (optimizer_on_nvme()) {
            CHECK_MSG(tensors > 2 && held == 0,
                      held << " bytes of " << tensors << " optimizer state tensors in memory between steps");
          }
          if (params_on_nvme()) {
            CHECK_MSG(shards > 1 && shard_bytes == 0,
                      shard_bytes << " bytes of " << shards << " parameter shards in memory between steps");
          }
          const std::size_t want_files =
              (optimizer_on_nvme() ? tensors / 2 : 0) + (params_on_nvme() ? shards : 0);
          // The last sub-group's file is written behind the step by the tier's I/O thread (its memory is
          // released once the write is queued): wait for it, bounded, rather than race it (a CI run here saw
          // 1 of 2 files at this point).
          const auto dir = nvme_swap_dir();
          std::size_t files = 0;
          for (int attempt = 0; attempt < 300 && files != want_files; ++attempt) {
            if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
            files = 0;
            if (!dir.empty()) {
              for (const auto& f : std::filesystem::recursive_directory_iterator(dir))
                files += f.is_regular_file() ? 1 : 0;
            }
          }
          CHECK_MSG(files == want_files, "swap directory '" << dir.string() << "' holds " << files
                                                            << " files, want " << want_files);
        }
      }
    }
    if (offload) CHECK_MSG(nvme_swap_dir().empty(), "the swap directory outlived the accelerator");
    for (const auto& group : opt.param_groups()) {
      for (const auto& p : group.params()) {
        const auto it = opt.state().find(p.unsafeGetTensorImpl());
        if (it == opt.state().end()) continue;
        const auto& a = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        out.state.push_back(a.exp_avg().clone());  // throws if it was left on disk
        out.state.push_back(a.exp_avg_sq().clone());
        out.state.push_back(p.detach().clone());  // the shard, in memory again (throws if left on disk)
      }
    }
    return out;
  };
  const Run memory = run(false), offloaded = run(true);
  REQUIRE(memory.weights.size() == offloaded.weights.size());
  for (std::size_t s = 0; s < memory.weights.size(); ++s) {
    for (std::size_t k = 0; k < memory.weights[s].size(); ++k)
      CHECK_MSG(torch::equal(memory.weights[s][k], offloaded.weights[s][k]),
                "step " << s + 1 << ": weight " << k << " differs with the optimizer state on NVMe");
  }
  REQUIRE(memory.state.size() == offloaded.state.size());
  for (std::size_t k = 0; k < memory.state.size(); ++k)
    CHECK_MSG(torch::equal(memory.state[k], offloaded.state[k]),
              "optimizer state tensor " << k << " differs");
}

// Resharded checkpoints of a GAN-shaped loop (two models, two optimizers, the first model also receiving
// gradients through the second's loss): `reshard_save` trains on the ranks it runs on (global batch 12) and
// saves at step 3 and at the end; `reshard_load` (another number of ranks and/or another backend) resumes
// from step 3, checks that re-saving at once reproduces every model and optimizer file bitwise, then finishes
// the run and compares the end state with the saved run's (tolerance: the N*B equivalence one).
std::map<std::string, torch::Tensor> read_all(const std::filesystem::path& path) {
  const auto f = safetensors::File::open(path.string());
  std::map<std::string, torch::Tensor> out;
  for (const auto& name : f.names()) {
    const auto& info = f.info(name);
    const auto dtype = info.dtype == safetensors::DType::F32   ? torch::kFloat32
                       : info.dtype == safetensors::DType::F64 ? torch::kFloat64
                                                               : torch::kInt64;
    out[name] = torch::from_blob(const_cast<std::uint8_t*>(f.data(name)), info.shape, dtype).clone();
  }
  return out;
}

std::filesystem::path reshard_dir() {
  const char* d = std::getenv("ACCEL_TEST_CKPT_DIR");
  if (d == nullptr) throw std::runtime_error("set ACCEL_TEST_CKPT_DIR");
  return d;
}

void reshard(bool load) {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int n = acc.num_processes();
  acc.set_seed(5);
  torch::manual_seed(load ? 77 : 0);   // resuming must not depend on the initial weights
  Mlp model;                           // the discriminator: model 0
  auto gen = torch::nn::Linear(6, 6);  // the generator: model 1
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt_g(gen->parameters(), torch::optim::AdamOptions(1e-2));
  acc.prepare(model, opt, gen, opt_g);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(60).map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions(static_cast<std::size_t>(12 / n)));
  const auto dir = reshard_dir();
  const std::vector<std::string> files = {"model.safetensors", "optimizer_full.safetensors",
                                          "model_1.safetensors", "optimizer_1_full.safetensors"};
  if (load) {
    acc.load_state((dir / "ckpt").string());
    const auto again = dir / fmt::format("reloaded_{}", n);
    acc.save_state(again.string());
    if (acc.is_main_process()) {
      for (const auto& file : files) {
        const auto want = read_all(dir / "ckpt" / file), got = read_all(again / file);
        CHECK_MSG(!want.empty() && want.size() == got.size(),
                  file << ": " << got.size() << " tensors, saved " << want.size());
        for (const auto& [name, t] : want) {
          CHECK_MSG(got.count(name) != 0 && torch::equal(got.at(name), t),
                    file << ": '" << name << "' differs after resuming on " << n << " ranks with "
                         << backend_variant);
        }
      }
    }
  }
  for (auto& b : *loader) {
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(b.data), b.target) + 0.1 * model(gen(b.data).detach()).pow(2).mean());
    opt.step();
    opt_g.zero_grad();
    acc.backward((model(gen(b.data)) - b.target).pow(2).mean());
    opt_g.step();
    if (!load && acc.completed_steps() == 3) acc.save_state((dir / "ckpt").string());
  }
  CHECK_MSG(acc.completed_steps() == 5, "completed " << acc.completed_steps() << " steps, want 5");
  const auto end = dir / fmt::format("final_{}", load ? std::to_string(n) : std::string("saved"));
  acc.save_state(end.string());
  if (load && acc.is_main_process()) {
    for (const auto& file : files) {
      const auto want = read_all(dir / "final_saved" / file), got = read_all(end / file);
      CHECK_MSG(!want.empty(), file << " is empty");
      for (const auto& [name, t] : want) {
        const bool ok = got.count(name) != 0 && got.at(name).sizes() == t.sizes() &&
                        (t.scalar_type() == torch::kInt64 ? torch::equal(got.at(name), t)
                                                          : torch::allclose(got.at(name), t, 2e-5, 2e-5));
        CHECK_MSG(ok, file << ": '" << name << "' after finishing on " << n << " ranks differs from the "
                           << "uninterrupted run");
      }
    }
    std::cout << "resumed on " << n << " rank(s) with " << backend_variant
              << ": identical state of both models and optimizers after loading, same end state as the "
                 "uninterrupted run"
              << std::endl;
  }
}

// The optimizer's parameter groups for a model (empty: one group of every parameter).
template <class Model>
using AdamGroups = std::function<std::vector<torch::optim::OptimizerParamGroup>(Model&)>;

// What the 2- or 3-rank runs of `frozen` and `view_parameter` must reproduce: three Adam steps in one process
// on the whole batch of Regression(4 x world x 3), 4 rows per rank per step; returns the parameters after.
template <class Model>
std::vector<torch::Tensor> one_process_adam(Model model, int world, const AdamGroups<Model>& groups = {}) {
  torch::optim::Adam opt(
      groups ? groups(model)
             : std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                   model->parameters())},
      torch::optim::AdamOptions(1e-2));
  Regression data(4 * world * 3);
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    const auto big = 4 * world;
    torch::mse_loss(model(data.x.slice(0, s * big, (s + 1) * big)), data.y.slice(0, s * big, (s + 1) * big))
        .backward();
    opt.step();
  }
  return test::snapshot(*model);
}

// The same through an Accelerator on this run's ranks (a prepared loader of 4 rows per rank); `inspect` sees
// the trained model while the Accelerator still lives, with the counting allocator's bytes just before
// prepare. With `trainable_only` the optimizer gets only the parameters that require gradients (as PEFT's
// recipes and the Trainer build it); `groups`, when given, makes the optimizer's groups instead. Returns the
// world size and the parameters after.
template <class Model>
std::pair<int, std::vector<torch::Tensor>> accelerated_adam(
    Model model, const std::function<void(Model&, Accelerator&, std::uint64_t)>& inspect,
    bool trainable_only = false, const AdamGroups<Model>& groups = {}) {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int world = acc.num_processes();
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad() || !trainable_only) params.push_back(p);
  }
  torch::optim::Adam opt(
      groups ? groups(model)
             : std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(params)},
      torch::optim::AdamOptions(1e-2));
  const auto before_prepare = CpuMemoryCounter::current();
  acc.prepare(model, opt);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(4 * world * 3).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4));
  for (auto& b : *loader) {
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(b.data), b.target));
    opt.step();
  }
  acc.wait_for_everyone();  // refreshes the model on the sharding engines
  inspect(model, acc, before_prepare);
  return {world, test::snapshot(*model)};
}

// A frozen layer (requires_grad false) whose parameters are still handed to the optimizer, as
// `model->parameters()` after freezing gives them: it trains, the frozen layer stays as it was, and the
// result matches one process with batch N*B.
void frozen_in_optimizer() {
  auto build = [] {
    torch::manual_seed(0);
    Mlp model;
    for (auto& p : model->fc1->parameters())
      p.set_requires_grad(false);
    return model;
  };
  auto model = build();
  const auto initial = test::snapshot(*model);
  const auto [world, got] = accelerated_adam<Mlp>(model, [](Mlp&, Accelerator&, std::uint64_t) {});
  const auto want = one_process_adam(build(), world);
  CHECK_MSG(torch::equal(got[0], initial[0]) && torch::equal(got[1], initial[1]), "the frozen layer changed");
  CHECK_MSG(!torch::equal(got[2], initial[2]), "the trainable layer did not train");
  for (std::size_t k = 0; k < want.size(); ++k)
    CHECK_MSG(close(want[k], got[k], 2e-5), "parameter " << k << " differs from the single-process run");
}

// The shape of a LoRA model: a frozen base (two layers, 264 KiB) under a small trainable head.
struct FrozenBaseImpl : torch::nn::Module {
  FrozenBaseImpl()
      : base(register_module("base", torch::nn::Sequential(torch::nn::Linear(6, 256), torch::nn::ReLU(),
                                                           torch::nn::Linear(256, 256)))),
        head(register_module("head", torch::nn::Linear(256, 1))) {
    for (auto& p : base->parameters())
      p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(base->forward(x))); }
  torch::nn::Sequential base;
  torch::nn::Linear head;
};
TORCH_MODULE(FrozenBase);

// Bytes of memory `t`'s storage holds (0 for a sharded engine's released parameter).
std::uint64_t held_bytes(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  return s->_mutable_data_ptr_no_checks().get() == nullptr ? 0 : s->nbytes();
}

// The frozen base outside the optimizer (only the trainable parameters in it): where the backend shards
// parameters (ZeRO-3, FULL_SHARD), it shards the frozen ones too, as DeepSpeed's ZeRO-3 and FSDP do: at rest
// (between steps) each rank holds about 1/N of their bytes, counted by the allocator (not the engine's own
// report), and none in the parameters themselves; the run still equals one process with batch N*B.
void frozen_base_sharded() {
  CpuMemoryCounter::install();  // before the model is built: its bytes are counted
  auto build = [] {
    torch::manual_seed(0);
    return FrozenBase();
  };
  auto model = build();
  std::uint64_t frozen_bytes = 0, all_bytes = 0;
  for (const auto& p : model->parameters()) {
    all_bytes += p.nbytes();
    if (!p.requires_grad()) frozen_bytes += p.nbytes();
  }
  const auto initial = test::snapshot(*model);
  auto inspect = [&](FrozenBase& m, Accelerator& acc, std::uint64_t before_prepare) {
    if (!acc.capabilities().shards_parameters) return;  // DDP and ZeRO-1/2 keep every parameter whole
    const auto rest = CpuMemoryCounter::current();
    const double n = acc.num_processes();
    std::uint64_t in_parameters = 0;
    for (const auto& p : m->parameters()) {
      if (!p.requires_grad()) in_parameters += held_bytes(p);
    }
    // Prepare and training freed the (N-1)/N of the model's bytes no rank keeps; Adam's state and the
    // gradient of the head (3/N of its bytes), the loader and padding fit in 2% of the frozen bytes.
    const double freed = static_cast<double>(before_prepare) - static_cast<double>(rest);
    const double want_freed = static_cast<double>(frozen_bytes) * (1.0 - 1.0 / n);
    const auto reported = acc.memory_report().parameters;
    if (acc.is_main_process()) {
      std::cout
          << fmt::format(
                 "frozen base on {} ({} ranks): {} frozen bytes; at rest the frozen parameters hold {}, "
                 "the allocator freed {:.0f} (want >= {:.0f}); memory_report parameters {} (all/N {:.0f})",
                 backend_variant, acc.num_processes(), frozen_bytes, in_parameters, freed, want_freed,
                 reported, static_cast<double>(all_bytes) / n)
          << std::endl;
    }
    CHECK_MSG(in_parameters == 0, backend_variant << ": at rest the frozen parameters hold " << in_parameters
                                                  << " bytes of memory (whole on every rank)");
    CHECK_MSG(freed >= want_freed - 0.02 * static_cast<double>(frozen_bytes),
              backend_variant << ": at rest this rank's allocations are " << freed
                              << " bytes below what it held before prepare, want at least the frozen base's "
                                 "(N-1)/N, "
                              << want_freed << " of " << frozen_bytes
                              << " bytes: the frozen base is not sharded");
    CHECK_MSG(std::abs(static_cast<double>(reported) - static_cast<double>(all_bytes) / n) <=
                  0.02 * static_cast<double>(all_bytes) / n,
              backend_variant << ": memory_report counts " << reported << " parameter bytes, want about "
                              << static_cast<double>(all_bytes) / n << " (all parameters / N)");
  };
  const auto [world, got] = accelerated_adam<FrozenBase>(model, inspect, /*trainable_only=*/true);
  const auto want = one_process_adam(build(), world);
  for (std::size_t k = 0; k < 4; ++k)
    CHECK_MSG(torch::equal(got[k], initial[k]), "frozen parameter " << k << " changed");
  CHECK_MSG(!torch::equal(got[4], initial[4]), "the trainable head did not train");
  for (std::size_t k = 0; k < want.size(); ++k)
    CHECK_MSG(close(want[k], got[k], 2e-5), "parameter " << k << " differs from the single-process run");
}

// A frozen first unit (a LoRA model's embedding: no operator of backward reads it) before a trainable gate
// whose backward reads it (g * g) and a trainable head. In backward, ZeRO-3 prefetches the unit before the
// one in use in forward order, skipping what the first backward never used and nothing in it trains: the
// frozen first unit is not gathered in backward after the first step (before, it was gathered at the end of
// every backward for nothing: Qwen2.5-1.5B's 0.93 GB embedding; issue 51), and the run still equals one
// process.
struct FrozenFirstImpl : torch::nn::Module {
  FrozenFirstImpl()
      : first(register_module("first", torch::nn::Linear(6, 1024))),
        head(register_module("head", torch::nn::Linear(1024, 1))) {
    gate = register_parameter("gate", torch::full({1024}, 0.5));  // the model's own: a unit of its own
    for (auto& p : first->parameters())
      p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(first(x)) * gate * gate); }
  torch::nn::Linear first, head;
  torch::Tensor gate;
};
TORCH_MODULE(FrozenFirst);

void frozen_unit_not_gathered_in_backward() {
  if (base_variant() != "zero3") return;  // ZeRO-3's units: each module's own parameters
  auto build = [] {
    torch::manual_seed(0);
    return FrozenFirst();
  };
  auto model = build();
  const auto first_bytes = static_cast<double>((6 * 1024 + 1024) * 4);
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  const int world = acc.num_processes();
  std::vector<torch::Tensor> trainable;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::Adam opt(trainable, torch::optim::AdamOptions(1e-2));
  acc.prepare(model, opt);
  auto loader = acc.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      Regression(4 * world * 3).map(torch::data::transforms::Stack<>()), torch::data::DataLoaderOptions(4));
  int step = 0;
  for (auto& b : *loader) {
    opt.zero_grad();
    const auto loss = torch::mse_loss(model(b.data), b.target);
    acc.communicator().reset_counters();
    acc.backward(loss);
    const auto wire = static_cast<double>(acc.communicator().bytes(Collective::AllGather).wire);
    opt.step();
    const double first_wire = first_bytes * (world - 1) / world;
    if (acc.is_main_process()) {
      std::cout << fmt::format(
                       "{}: step {}: backward all-gathered {:.0f} wire bytes; the frozen unit is {:.0f}",
                       backend_variant, step, wire, first_wire)
                << std::endl;
    }
    CHECK_MSG(step == 0 || wire < first_wire, backend_variant
                                                  << ": step " << step << ": backward all-gathered " << wire
                                                  << " wire bytes, the frozen first unit " << first_wire
                                                  << " alone: it was gathered");
    ++step;
  }
  acc.wait_for_everyone();
  const auto got = test::snapshot(*model);
  const auto want = one_process_adam(build(), world);
  for (std::size_t k = 0; k < want.size(); ++k)
    CHECK_MSG(close(want[k], got[k], 2e-5), "parameter " << k << " differs from the single-process run");
}

// Float32 and bf16 trainable parameters in one model, as PEFT makes a bf16 model with modules_to_save (the
// saved modules stay bf16 beside float32 adapters): DDP buckets each dtype apart (as PyTorch's DDP), and the
// Trainer's optimizer groups are one dtype each (the sharding backends flatten a group into one buffer).
// Three Adam steps equal one process with batch N*B within bf16 rounding (the bf16 gradients are averaged in
// bf16).
struct MixedDtypeImpl : torch::nn::Module {
  MixedDtypeImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 1))) {
    fc2->to(torch::kBFloat16);
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc2(torch::relu(fc1(x)).to(torch::kBFloat16)).to(torch::kFloat32);
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MixedDtype);

std::vector<torch::optim::OptimizerParamGroup> groups_by_dtype(MixedDtype& model) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model->fc1->parameters(), std::make_unique<torch::optim::AdamOptions>(1e-2));
  groups.emplace_back(model->fc2->parameters(), std::make_unique<torch::optim::AdamOptions>(1e-2));
  return groups;
}

void mixed_dtypes() {
  auto build = [] {
    torch::manual_seed(0);
    return MixedDtype();
  };
  auto model = build();
  const auto initial = test::snapshot(*model);
  const auto [world, got] = accelerated_adam<MixedDtype>(
      model, [](MixedDtype&, Accelerator&, std::uint64_t) {}, false, groups_by_dtype);
  const auto want = one_process_adam<MixedDtype>(build(), world, groups_by_dtype);
  REQUIRE(got.size() == 4);
  CHECK_MSG(got[2].scalar_type() == torch::kBFloat16 && got[0].scalar_type() == torch::kFloat32,
            "the dtypes changed: " << got[0].scalar_type() << ", " << got[2].scalar_type());
  for (std::size_t k = 0; k < want.size(); ++k) {
    CHECK_MSG(!torch::equal(got[k], initial[k]), "parameter " << k << " did not train");
    // Adam's steps are about lr = 1e-2 each: the bf16 layer within a few bf16 ulps of values below 1.
    const double tol = got[k].scalar_type() == torch::kBFloat16 ? 2e-2 : 1e-4;
    CHECK_MSG(close(want[k].to(torch::kFloat32), got[k].to(torch::kFloat32), tol),
              "parameter " << k << " (" << got[k].scalar_type() << ") differs from the single-process run");
  }
}

void frozen() {
  frozen_in_optimizer();
  mixed_dtypes();
  frozen_base_sharded();
  frozen_unit_not_gathered_in_backward();
}

// A parameter that is a view into a larger tensor (it cannot move into a sharded engine's flat buffer, so it
// is copied after each gather) trains like in one process beside ordinary ones, which (FSDP SHARD_GRAD_OP,
// one sub-group here) live side by side in the flat buffer the parameter all-gather writes.
struct ViewParamImpl : torch::nn::Module {
  ViewParamImpl() : fc1(register_module("fc1", torch::nn::Linear(6, 16))) {
    base = torch::randn({40});
    scale = register_parameter("scale", base.narrow(0, 8, 16));  // storage offset 8: a view
  }
  torch::Tensor forward(torch::Tensor x) { return (torch::relu(fc1(x)) * scale).sum(1, true); }
  torch::nn::Linear fc1;
  torch::Tensor base, scale;
};
TORCH_MODULE(ViewParam);

// deepspeed_config.reduce_bucket_size counts gradient elements, as DeepSpeed's (stage_1_and_2.py: a bucket
// is full when elements_in_ipg_bucket + numel > reduce_bucket_size), not bytes: with B = 1024 elements over 8
// layers of 256, each reduce call of stage 1 (a chunk) or stage 2 (a bucket's part per owner) carries between
// B/2 and B fp32 values, 2-4 kB. Read as bytes, the calls would carry a quarter of that and be 4x as many.
void bucket_elements() {
  constexpr std::uint64_t kBucket = 1024;
  auto config = cpu_config();
  if (config.backend != "zero" || config.zero.stage < 1 || config.zero.stage > 2)
    throw std::invalid_argument("bucket_elements runs on the zero1 and zero2 rows, not " + backend_variant);
  config.zero.reduce_bucket_size = kBucket;
  config.zero.sub_group_size = 1u << 30;  // one flat group: chunks and buckets only
  Accelerator acc(AcceleratorOptions().config(config));
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < 8; ++l)
    model->push_back(torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)));
  torch::optim::SGD opt(model->parameters(), 0.1);
  acc.prepare(model, opt);
  auto& c = acc.communicator();
  c.reset_counters();
  opt.zero_grad();
  acc.backward(model->forward(torch::randn({4, 16})).pow(2).mean());
  opt.step();
  std::uint64_t calls = 0, payload = 0;
  for (auto kind : {Collective::Reduce, Collective::ReduceScatter, Collective::AllReduce}) {
    calls += c.bytes(kind).calls;
    payload += c.bytes(kind).payload;
  }
  CHECK_MSG(calls > 0, "gradients were reduced");
  const auto per_call = calls == 0 ? 0 : payload / calls;
  CHECK_MSG(per_call >= 2 * kBucket && per_call <= 4 * kBucket,
            "reduce_bucket_size " << kBucket << " (elements): " << calls << " reduce call(s) of " << per_call
                                  << " bytes on average; want 2-4 kB each (" << kBucket
                                  << " fp32 values at most, half of them at least)");
}

void view_parameter() {
  auto build = [] {
    torch::manual_seed(0);
    return ViewParam();
  };
  auto model = build();
  REQUIRE(model->scale.storage_offset() == 8);
  const auto [world, got] =
      accelerated_adam<ViewParam>(model, [](ViewParam& model, Accelerator&, std::uint64_t) {
        CHECK_MSG(model->scale.storage_offset() == 8 &&
                      model->scale.data_ptr() == static_cast<float*>(model->base.data_ptr()) + 8,
                  "the view parameter must stay a view of its base tensor");
        if (backend_variant == "fsdp_grad_op") {
          CHECK_MSG(model->fc1->bias.data_ptr() == static_cast<float*>(model->fc1->weight.data_ptr()) + 96,
                    "fc1's weight and bias must be adjacent in the flat parameter buffer");
        }
      });
  const auto want = one_process_adam(build(), world);
  for (std::size_t k = 0; k < want.size(); ++k)
    CHECK_MSG(close(want[k], got[k], 2e-5), "parameter " << k << " differs from the single-process run");
}

// memory_report() after a sync backward and step matches estimate_memory() within 5%.
void memory() {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  torch::manual_seed(0);
  // Large enough that bucket rounding and biases are noise: ~0.5 M parameters.
  torch::nn::Sequential model(torch::nn::Linear(512, 512), torch::nn::ReLU(), torch::nn::Linear(512, 512),
                              torch::nn::ReLU(), torch::nn::Linear(512, 1));
  std::uint64_t p_total = 0;
  for (const auto& p : model->parameters())
    p_total += static_cast<std::uint64_t>(p.numel());
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  acc.prepare(model, opt);
  const auto x = torch::randn({8, 512}), y = torch::randn({8, 1});
  opt.zero_grad();
  acc.backward(torch::mse_loss(model->forward(x), y));
  opt.step();
  const auto measured = acc.memory_report();
  MemoryEstimateInput in;
  in.num_parameters = p_total;
  in.num_processes = acc.num_processes();
  in.backend = backend_variant == "ddp" ? "ddp" : backend_variant.rfind("zero", 0) == 0 ? "zero" : "fsdp";
  in.zero_stage = backend_variant == "zero1" ? 1 : backend_variant == "zero3" ? 3 : 2;
  in.fsdp_sharding_strategy = backend_variant == "fsdp_grad_op"        ? "SHARD_GRAD_OP"
                              : backend_variant == "fsdp_full_shard"   ? "FULL_SHARD"
                              : backend_variant == "fsdp_hybrid"       ? "HYBRID_SHARD"
                              : backend_variant == "fsdp_hsdp"         ? "HYBRID_SHARD"
                              : backend_variant == "fsdp_hybrid_zero2" ? "HYBRID_SHARD_ZERO2"
                                                                       : "NO_SHARD";
  const auto state = ProcessState::from_environment();
  in.num_machines = state.world_size / std::max(state.local_world_size, 1);
  in.hybrid_shard_size = cpu_config().fsdp.hybrid_shard_size;
  in.optimizer = "adam";
  const auto predicted = estimate_memory(in);
  auto within = [](std::uint64_t m, std::uint64_t p) {
    return std::abs(static_cast<double>(m) - static_cast<double>(p)) <= 0.05 * static_cast<double>(p);
  };
  CHECK_MSG(within(measured.parameters, predicted.parameters),
            "parameters measured " << measured.parameters << " predicted " << predicted.parameters);
  CHECK_MSG(within(measured.gradients, predicted.gradients),
            "gradients measured " << measured.gradients << " predicted " << predicted.gradients);
  CHECK_MSG(
      within(measured.optimizer_state, predicted.optimizer_state),
      "optimizer state measured " << measured.optimizer_state << " predicted " << predicted.optimizer_state);
  if (acc.is_main_process()) {
    std::cout << backend_variant << " on " << acc.num_processes() << " ranks, measured:\n"
              << measured.to_string() << "\npredicted:\n"
              << predicted.to_string() << std::endl;
  }
}

// Peak CPU bytes added during backward, measured by the counting allocator: DDP holds every gradient
// (P floats), stage 2 only its slice plus a bucket (the model is large next to its activations here).
// Samples something at the start of every operator the main thread runs (a RecordFunction callback of the
// test's own, independent of the backends' bookkeeping): the bytes parameters and gradients hold at each
// point.
class OperatorProbe {
 public:
  explicit OperatorProbe(std::function<void()> sample) {
    sample_ = std::move(sample);
    main_ = std::this_thread::get_id();
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&start).scopes({at::RecordScope::FUNCTION}));
  }
  ~OperatorProbe() {
    at::removeCallback(handle_);
    sample_ = nullptr;
  }

 private:
  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& /*fn*/) {
    if (busy_ || !sample_ || std::this_thread::get_id() != main_) return nullptr;
    busy_ = true;
    {
      at::DisableRecordFunctionGuard quiet;
      sample_();
    }
    busy_ = false;
    return nullptr;
  }
  static inline std::function<void()> sample_;
  static inline std::thread::id main_;
  static inline thread_local bool busy_ = false;
  at::CallbackHandle handle_ = 0;
};

// ddp_gradient_as_bucket_view: false (PyTorch's default) keeps each gradient apart from its bucket (two
// copies after a sync backward); the gradients are the same as with the view (the default), bit for bit,
// whether zero_grad() drops them or zeroes them in place.
void ddp_without_bucket_view() {
  std::vector<torch::Tensor> grads[2];
  std::uint64_t held[2] = {0, 0}, p_bytes = 0;
  for (int view = 0; view < 2; ++view) {
    auto config = cpu_config();
    config.ddp_gradient_as_bucket_view = view == 1;
    Accelerator acc(AcceleratorOptions().config(config));
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    acc.prepare(model, opt);
    torch::manual_seed(1 + acc.process_index());
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad(step == 0);  // dropped, then zeroed where they are
      const auto x = torch::randn({4, 64}), y = torch::randn({4, 1});
      acc.backward(torch::mse_loss(model->forward(x), y));
      if (step == 0) opt.step();
    }
    held[view] = acc.memory_report().gradients;
    p_bytes = 0;
    for (const auto& p : model->parameters()) {
      grads[view].push_back(p.grad().clone());
      p_bytes += p.nbytes();
    }
  }
  for (std::size_t k = 0; k < grads[0].size(); ++k)
    CHECK_MSG(torch::equal(grads[0][k], grads[1][k]),
              "ddp_gradient_as_bucket_view false: gradient " << k << " differs from the bucket view's");
  CHECK_MSG(held[1] == p_bytes,
            "with the bucket view the gradients hold " << held[1] << " bytes, want " << p_bytes);
  CHECK_MSG(held[0] == 2 * p_bytes, "without the bucket view gradients and buckets hold "
                                        << held[0] << " bytes, want " << 2 * p_bytes);
}

void peak() {
  CpuMemoryCounter::install();
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  torch::manual_seed(0);
  // 32 layers of 256x256: buckets (one layer each, ~260 kB) are small next to the model (8.4 MB).
  torch::nn::Sequential model;
  for (int l = 0; l < 32; ++l) {
    model->push_back(torch::nn::Linear(256, 256));
    model->push_back(torch::nn::ReLU());
  }
  model->push_back(torch::nn::Linear(256, 1));
  std::uint64_t p_bytes = 0;
  for (const auto& p : model->parameters())
    p_bytes += p.nbytes();
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  const auto x = torch::randn({4, 256}), y = torch::randn({4, 1});
  // Activations of one forward (what a forward adds besides gathered parameters), measured unprepared.
  std::uint64_t activations = 0;
  {
    const auto before = CpuMemoryCounter::current();
    CpuMemoryCounter::reset_peak();
    auto loss = torch::mse_loss(model->forward(x), y);
    activations = CpuMemoryCounter::peak() - before;
  }
  const auto held_before_prepare = CpuMemoryCounter::current();
  acc.prepare(model, opt);
  const auto held_after_prepare = CpuMemoryCounter::current();
  std::uint64_t extra = 0, forward_extra = 0;
  // Parameter and gradient bytes from memory_report() before every operator of the second step: the model's
  // storages, the optimizer's slices and the backend's buffers holding parameters (a unit being gathered)
  // or gradients (a bucket or unit gradient being reduced).
  std::uint64_t max_param_bytes = 0, max_grad_bytes = 0;
  bool probing = false;
  auto probe_sample = [&] {
    if (!probing) return;
    const auto report = acc.memory_report();
    const auto params = report.parameters;
    max_param_bytes = std::max(max_param_bytes, params);
    max_grad_bytes = std::max(max_grad_bytes, report.gradients);
  };
  OperatorProbe probe(probe_sample);
  for (int step = 0; step < 2; ++step) {  // the second step runs with every buffer in place (and prefetch)
    probing = step == 1;
    opt.zero_grad();
    const auto before_forward = CpuMemoryCounter::current();
    CpuMemoryCounter::reset_peak();
    auto loss = torch::mse_loss(model->forward(x), y);
    forward_extra = CpuMemoryCounter::peak() - before_forward;
    const auto before = CpuMemoryCounter::current();
    CpuMemoryCounter::reset_peak();
    acc.backward(loss);
    extra = CpuMemoryCounter::peak() - before;
    opt.step();
    acc.sync_parameters();
  }
  const auto n = static_cast<std::uint64_t>(acc.num_processes());
  const std::uint64_t shard = (p_bytes / 4 + n - 1) / n * 4;  // ceil(P/N) fp32 elements
  probing = false;
  if (acc.is_main_process()) {
    std::cout << backend_variant << ": per operator, parameters held at most " << max_param_bytes
              << " bytes and gradients at most " << max_grad_bytes << " bytes" << std::endl;
    std::cout << backend_variant << ": peak bytes added by forward " << forward_extra << " (activations "
              << activations << "), by backward " << extra << " (parameters " << p_bytes << ", shard "
              << shard << "); prepare changed the bytes held by "
              << static_cast<std::int64_t>(held_after_prepare) -
                     static_cast<std::int64_t>(held_before_prepare)
              << std::endl;
  }
  // Largest unit: one 256x256 layer with its bias. Largest stage-2 bucket (buckets never split a parameter
  // and are filled in reverse order up to 300,000 bytes): Linear(256, 1), the last 256x256 layer and the
  // bias of the one before.
  const std::uint64_t unit = 256 * 256 * 4 + 256 * 4;
  const std::uint64_t bucket = unit + 257 * 4 + 256 * 4;
  // The bounds follow from the row's capabilities, so every row gets one set of checks (printed).
  const auto caps = acc.capabilities();
  const char* kind = caps.shards_parameters  ? "parameters sharded (stage 3)"
                     : caps.shards_gradients ? "gradients sharded (stage 2)"
                                             : "whole gradients (DDP, stage 1)";
  if (acc.is_main_process()) std::cout << backend_variant << ": checked as " << kind << std::endl;
  if (!caps.shards_gradients && !caps.shards_parameters) {
    if (caps.shards_optimizer_state) {
      CHECK_MSG(extra >= p_bytes * 9 / 10, "backward must hold every gradient, measured " << extra);
    } else {
      // DDP (and FSDP's NO_SHARD, its engine) with ddp_gradient_as_bucket_view, the default: each gradient
      // is its bucket slice from the moment backward writes it, so the gradients exist once (the buckets,
      // allocated at prepare) plus, for a moment, the one parameter's gradient autograd made before it moves
      // into its slice.
      CHECK_MSG(max_grad_bytes >= p_bytes && max_grad_bytes <= p_bytes + unit + 4096,
                "DDP gradients reached " << max_grad_bytes << " bytes; want every gradient once (" << p_bytes
                                         << ") + one parameter's (" << unit << ")");
      CHECK_MSG(extra <= p_bytes / 4, "DDP backward added " << extra << " bytes besides the buckets of "
                                                            << p_bytes << ": a second copy of the gradients");
      ddp_without_bucket_view();
    }
    // Every parameter, plus (stage 1) the fp32 master slice of this rank's 1/N the optimizer updates.
    const std::uint64_t masters = caps.shards_optimizer_state ? shard : 0;
    CHECK_MSG(max_param_bytes >= p_bytes + masters * 99 / 100 && max_param_bytes <= p_bytes + masters + 4096,
              "parameters held: " << max_param_bytes << ", want every parameter " << p_bytes
                                  << " + master slices " << masters);
  } else if (!caps.shards_parameters) {
    // The reduced slice (allocated during backward), plus buckets in flight: the gradients of the bucket
    // being filled, the bucket buffer, the one being reduced, and the process group's temporaries
    // (timing-dependent).
    CHECK_MSG(extra <= shard + 10 * bucket, "stage 2 backward added " << extra << " bytes; want <= shard "
                                                                      << shard << " + 10 buckets of "
                                                                      << bucket);
    CHECK_MSG(extra < p_bytes,
              "stage 2 must hold less than DDP's whole gradient " << p_bytes << ", got " << extra);
    // Gradient bytes at every operator of backward: the slice (P/N) plus the bucket being filled (gradients
    // are copied in as they arrive and freed at once) and, with overlap_comm (the default), the one being
    // reduced meanwhile: two buckets. With overlap_comm: false each bucket is reduced before backward
    // continues: one bucket at most.
    const std::uint64_t buckets = acc.config().zero.overlap_comm ? 2 : 1;
    CHECK_MSG(max_grad_bytes <= shard + buckets * bucket,
              "stage 2 gradients reached " << max_grad_bytes << " bytes; want <= shard " << shard << " + "
                                           << buckets << " bucket(s) of " << bucket);
  } else {
    // Parameter bytes at every operator: the slices (P/N, padded per unit) plus at most the two largest
    // units (the one computing and the one prefetched).
    const std::uint64_t slices = 33 * 4 * 2;  // per-unit padding: at most N - 1 elements per unit
    CHECK_MSG(max_param_bytes <= shard + slices + 2 * unit, "stage 3 parameters reached "
                                                                << max_param_bytes << " bytes; want <= P/N "
                                                                << shard << " + 2 units of " << unit);
    CHECK_MSG(max_param_bytes >= shard + unit, "the probe must see a gathered unit, saw " << max_param_bytes);
    // Gradient bytes at every operator: the slices plus the unit gradient being filled and the one being
    // reduce-scattered.
    CHECK_MSG(max_grad_bytes <= shard + slices + 2 * unit, "stage 3 gradients reached "
                                                               << max_grad_bytes << " bytes; want <= P/N "
                                                               << shard << " + 2 units of " << unit);
    // At rest: the parameters (P) were freed and the slices (P/N) allocated.
    CHECK_MSG(held_before_prepare - held_after_prepare >= (p_bytes - shard) * 95 / 100,
              "prepare must free the parameters down to the shard: held " << held_before_prepare << " -> "
                                                                          << held_after_prepare);
    // Forward: activations plus at most two gathered units (the current one and the prefetched one), plus
    // unit-sized transients of the collectives: the flat buffer Gloo's all-gather works in, and a gathered
    // buffer whose last reference the process group's worker thread drops after wait() returned (timing
    // dependent: measured 2.9 to 3.8 units in all).
    CHECK_MSG(forward_extra <= activations + (2 + 2) * unit + 64 * 1024,
              "forward added " << forward_extra << " bytes; want <= activations " << activations
                               << " + 2 units of " << unit << " + 2 collective transients");
    // Backward: the gradient slices (P/N) plus a bounded number of unit-sized buffers: two gathered units
    // and Gloo's all-gather temporary, the parameter gradient autograd produced, the unit gradient being
    // filled, the one being reduce-scattered and Gloo's reduce-scatter temporary. Far below DDP's P.
    CHECK_MSG(extra <= shard + 8 * unit + activations, "stage 3 backward added "
                                                           << extra << " bytes; want <= shard " << shard
                                                           << " + 8 units of " << unit);
    CHECK_MSG(extra < p_bytes, "stage 3 backward must add less than the whole gradient " << p_bytes);
  }
}

// A rank that stops (here rank 0 leaves at once, as a crash or an error would make it) makes the others' next
// collective fail at once with a message that says so and points at that rank's own error, never with
// Gloo's bare "Connection reset by peer".
void peer_gone() {
  Accelerator acc(AcceleratorOptions().config(cpu_config()));
  acc.wait_for_everyone();
  if (acc.process_index() == 0) {
    std::cout << std::flush;
    std::_Exit(0);  // no destructor: the sockets close as a crashed process's do
  }
  try {
    for (int i = 0; i < 50; ++i)  // the first may still complete in flight; the peer is gone by the next ones
      acc.reduce(torch::ones({1024}), ReduceOp::Sum);
    CHECK_MSG(false, "collectives succeeded although rank 0 was gone");
  } catch (const DistributedError& e) {
    const std::string message = e.what();
    CHECK_MSG(message.find("closed its connection") != std::string::npos &&
                  message.find("its own message, printed before this one, is the cause") != std::string::npos,
              "the message does not say that a peer stopped: " << message);
    std::cout << "peer_gone: rank " << acc.process_index() << " got: " << message << std::endl;
  }
}

void process() {
  Accelerator acc;  // from the environment and $ACCEL_CONFIG_FILE, as a user's program would
  std::cout << "rank " << acc.process_index() << " of " << acc.num_processes() << ", local "
            << acc.local_process_index() << ", backend " << acc.backend_name() << ", launcher "
            << ProcessState::from_environment().launcher << std::endl;
  const auto all = acc.gather(torch::tensor({acc.process_index()}));
  // Every rank sees every rank's index once, in rank order, and the layout the launcher described.
  CHECK_MSG(torch::equal(all, torch::arange(acc.num_processes(), all.options())), all);
  const auto state = ProcessState::from_environment();
  CHECK_MSG(state.rank == acc.process_index() && state.world_size == acc.num_processes() &&
                state.local_rank == acc.local_process_index(),
            "rank " << state.rank << "/" << state.world_size << " local " << state.local_rank);
  CHECK_MSG(acc.num_processes() == 1 || acc.backend_name() != "local", acc.backend_name());
  CHECK_MSG(state.launcher != "none", "no launcher detected");
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::function<void()>> scenarios{
      {"collectives", collectives},
      {"cpu_collectives", cpu_collectives},
      {"comm_hook", comm_hook},
      {"metrics", metrics},
      {"equivalence", [] { equivalence_case("fp32", MixedPrecision::No, 1, 2e-5); }},
      {"accumulation", [] { equivalence_case("fp32 + accumulation 2", MixedPrecision::No, 2, 2e-5); }},
      {"bf16", [] { equivalence_case("bf16", MixedPrecision::Bf16, 1, 2e-2); }},
      {"sync",
       [] {
         sync_pattern();
         micro_step_grads_differ();
       }},
      {"config_clipping", config_clipping},
      {"hybrid", hybrid},
      {"hpz", hpz},
      {"auto_wrap_blocks", auto_wrap_blocks},
      {"debug_mismatch", debug_mismatch},
      {"debug_missing", debug_missing},
      {"unused", unused},
      {"checkpoint", checkpoint},
      {"nvme", nvme},
      {"process", process},
      {"peer_gone", peer_gone},
      {"sharding", sharding},
      {"memory", memory},
      {"peak", peak},
      {"frozen", frozen},
      {"power_sgd", power_sgd},
      {"power_sgd_refused", power_sgd_refused},
      {"view_parameter", view_parameter},
      {"bucket_elements", bucket_elements},
      {"reshard_save", [] { reshard(false); }},
      {"reshard_load", [] { reshard(true); }}};
  for (const auto& [name, f] : dist::real_loop_scenarios())
    scenarios.emplace(name, f);
  for (const auto& [name, f] : dist::trainer_scenarios())
    scenarios.emplace(name, f);
  for (const auto& [name, f] : dist::llm_scenarios())
    scenarios.emplace(name, f);
  if (argc > 3) argc = 0;  // usage
  if (argc == 3) backend_variant = argv[2];
  // Every scenario of the comma-separated list runs in this process group, each as a Catch2 test case.
  return worker::run_named(
      argc, argv, scenarios,
      "usage: dist_worker <scenario>[,<scenario>...] "
      "[local|ddp|zero1|zero2|zero2_no_overlap|zero2_auto|zero3|"
      "fsdp_full_shard|fsdp_grad_op|fsdp_no_shard|fsdp_hybrid|fsdp_hybrid_zero2|fsdp_hsdp|zero3_hpz]",
      argc == 3 ? backend_variant : "");
}
