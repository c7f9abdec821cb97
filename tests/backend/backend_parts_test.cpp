// The pieces every backend shares, tested without ranks: bucket planning and release order, the chunk
// pipeline, unit planning of the fully sharded backends, and the parameter trigger.
#include <catch2/catch.hpp>

#include "../../backends/common/buckets.hpp"
#include "../../backends/common/chunk_pipeline.hpp"
#include "../../backends/common/grad_reduce.hpp"
#include "../../backends/common/nvme_tier.hpp"
#include "../../backends/common/param_trigger.hpp"
#include "../../backends/common/unit_plan.hpp"
#include "temp_dir.hpp"

#include <accel/nn/quant4bit.hpp>

#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace accel::backends;
using namespace accel::backends::detail;

TEST_CASE("buckets: planned in reverse order, never splitting a tensor, first bucket capped apart") {
  // Tensors 0..4 of 100, 300, 50, 400, 20 bytes.
  const std::vector<std::uint64_t> bytes = {100, 300, 50, 400, 20};
  SECTION("one cap") {
    // 20 + 400 fit 450, + 50 would not; 50 + 300 + 100 fill the next one exactly (the cap is inclusive).
    REQUIRE(plan_buckets(bytes, 450, 450) == std::vector<std::vector<std::size_t>>{{4, 3}, {2, 1, 0}});
    REQUIRE(plan_buckets(bytes, 449, 449) == std::vector<std::vector<std::size_t>>{{4, 3}, {2, 1}, {0}});
  }
  SECTION("a small first bucket starts communication early") {
    const auto b = plan_buckets(bytes, 30, 1000);
    REQUIRE(b == std::vector<std::vector<std::size_t>>{{4}, {3, 2, 1, 0}});
  }
  SECTION("a tensor above the cap gets a bucket of its own") {
    const auto b = plan_buckets(bytes, 10, 10);
    REQUIRE(b.size() == 5);
    for (std::size_t k = 0; k < 5; ++k)
      REQUIRE(b[k] == std::vector<std::size_t>{4 - k});
  }
  SECTION("nothing to plan") {
    REQUIRE(plan_buckets({}, 10, 10).empty());
  }
}

TEST_CASE("buckets: released strictly in bucket order, whatever order members become ready") {
  BucketClock clock({2, 1, 2});
  REQUIRE(clock.mark(2).empty());  // bucket 2 half ready, 0 not yet
  REQUIRE(clock.mark(1).empty());  // bucket 1 complete but waits for bucket 0
  REQUIRE(clock.mark(0).empty());
  REQUIRE(clock.mark(0) == std::vector<std::size_t>{0, 1});
  REQUIRE_FALSE(clock.done());
  REQUIRE(clock.mark(2) == std::vector<std::size_t>{2});
  REQUIRE(clock.done());
  REQUIRE_THROWS_WITH(clock.mark(2), Catch::Contains("more often than it has members"));
  clock.reset();
  REQUIRE_FALSE(clock.done());
  REQUIRE(clock.mark(1).empty());
}

TEST_CASE("chunk pipeline: at most `depth` chunks in flight, completed in order, covering the range once") {
  std::vector<std::string> events;
  int in_flight = 0, most = 0;
  std::int64_t covered = 0;
  pipelined_chunks(10, 3, 2, [&](std::int64_t at, std::int64_t len) -> std::function<void()> {
    events.push_back("start " + std::to_string(at) + "+" + std::to_string(len));
    most = std::max(most, ++in_flight);
    return [&, at, len] {
      events.push_back("finish " + std::to_string(at));
      covered += len;
      --in_flight;
    };
  });
  REQUIRE(events == std::vector<std::string>{"start 0+3", "start 3+3", "finish 0", "start 6+3", "finish 3",
                                             "start 9+1", "finish 6", "finish 9"});
  REQUIRE(most == 2);
  REQUIRE(covered == 10);
  int calls = 0;
  pipelined_chunks(0, 4, 2, [&](std::int64_t, std::int64_t) -> std::function<void()> {
    ++calls;
    return [] {};
  });
  REQUIRE(calls == 0);
}

namespace {

struct PlanBlockImpl : torch::nn::Module {
  PlanBlockImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 2));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(PlanBlock);

struct PlanNetImpl : torch::nn::Module {
  PlanNetImpl() {
    scale = register_parameter("scale", torch::ones({1}));
    first = register_module("first", PlanBlock());
    second = register_module("second", PlanBlock());
    head = register_module("head", torch::nn::Linear(2, 1));
  }
  torch::Tensor scale;
  PlanBlock first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(PlanNet);

std::vector<std::string> names_of(const std::vector<PlannedUnit>& units) {
  std::vector<std::string> out;
  for (const auto& u : units)
    out.push_back(u.name);
  return out;
}

}  // namespace

TEST_CASE("unit plan: every policy assigns each parameter to exactly one unit") {
  PlanNet net;
  const auto total = net->named_parameters().size();  // scale + 2 x (2 x 2) + 2 = 11
  REQUIRE(total == 11);
  auto check_partition = [&](const std::vector<PlannedUnit>& units) {
    std::vector<int> count(total, 0);
    for (const auto& u : units) {
      REQUIRE(std::is_sorted(u.params.begin(), u.params.end()));
      for (auto i : u.params)
        count.at(i) += 1;
    }
    for (auto c : count)
      REQUIRE(c == 1);
  };
  UnitPlanOptions o;
  SECTION("per module: each leaf module, then the root's own parameters") {
    o.policy = UnitPolicy::PerModule;
    const auto units = plan_units(*net, o);
    check_partition(units);
    REQUIRE(names_of(units) ==
            std::vector<std::string>{"first.a", "first.b", "second.a", "second.b", "head", "<root>"});
    REQUIRE(units.back().params == std::vector<std::size_t>{0});  // "scale"
  }
  SECTION("per child of the root") {
    o.policy = UnitPolicy::PerChild;
    const auto units = plan_units(*net, o);
    check_partition(units);
    REQUIRE(names_of(units) == std::vector<std::string>{"first", "second", "head", "<root>"});
    REQUIRE(units[0].params.size() == 4);
  }
  SECTION("by size: a subtree with at least min_num_params") {
    o.policy = UnitPolicy::SizeBased;
    o.min_num_params = 25;  // a PlanBlock has 20 + 10 = 30, a Linear(4, 4) 20
    const auto units = plan_units(*net, o);
    check_partition(units);
    REQUIRE(names_of(units) == std::vector<std::string>{"first", "second", "<root>"});
  }
  SECTION("by class, with or without namespace and Impl") {
    o.policy = UnitPolicy::ClassBased;
    for (const std::string name : {"PlanBlock", "PlanBlockImpl"}) {
      o.wrap_classes = {name};
      const auto units = plan_units(*net, o);
      check_partition(units);
      REQUIRE(names_of(units) == std::vector<std::string>{"first", "second", "<root>"});
    }
    o.wrap_classes = {"torch::nn::LinearImpl"};
    REQUIRE(names_of(plan_units(*net, o)) ==
            std::vector<std::string>{"first.a", "first.b", "second.a", "second.b", "head", "<root>"});
    // A class the model does not use is refused, as Accelerate does (it used to make the whole model one
    // unit, silently).
    o.wrap_classes = {"PlanBlock", "LlamaDecoderLayer"};
    REQUIRE_THROWS_WITH(
        plan_units(*net, o),
        Catch::Contains("fsdp_transformer_layer_cls_to_wrap names 'LlamaDecoderLayer', but the "
                        "model has no module of that class") &&
            Catch::Contains("PlanBlockImpl"));
  }
  SECTION("by class with an empty list (TRANSFORMER_BASED_WRAP alone): the model's repeated block type") {
    o.policy = UnitPolicy::ClassBased;
    // PlanNet holds its blocks as plain members, in no ModuleList or Sequential: nothing repeats there, and
    // the error names the model's types instead of making the whole model one unit.
    REQUIRE_THROWS_WITH(plan_units(*net, o), Catch::Contains("TRANSFORMER_BASED_WRAP without") &&
                                                 Catch::Contains("repeats none") &&
                                                 Catch::Contains("PlanBlockImpl"));
    // Blocks in a ModuleList (a transformer's layers) beside a Sequential of two Linear(2, 2): the blocks
    // hold more parameters, so each block is a unit; the rest is the root's.
    struct StackImpl : torch::nn::Module {
      StackImpl() {
        layers = register_module("layers", torch::nn::ModuleList(PlanBlock(), PlanBlock(), PlanBlock()));
        head =
            register_module("head", torch::nn::Sequential(torch::nn::Linear(4, 2), torch::nn::Linear(2, 2)));
      }
      torch::nn::ModuleList layers{nullptr};
      torch::nn::Sequential head{nullptr};
    };
    auto stack = std::make_shared<StackImpl>();
    CHECK(accel::backends::detail::repeated_block_class(*stack) == PlanBlockImpl().name());
    const auto units = plan_units(*stack, o);
    REQUIRE(names_of(units) == std::vector<std::string>{"layers.0", "layers.1", "layers.2", "<root>"});
    REQUIRE(units.back().params.size() == 4);  // the head's two Linear layers
  }
  SECTION("whole model") {
    o.policy = UnitPolicy::Whole;
    const auto units = plan_units(*net, o);
    check_partition(units);
    REQUIRE(names_of(units) == std::vector<std::string>{"<root>"});
  }
}

namespace {
struct Recorder : TriggerClient {
  std::vector<std::vector<std::size_t>> starts, ends;
  void on_operator_start(const std::vector<std::size_t>& tags) noexcept override { starts.push_back(tags); }
  void on_operator_end(const std::vector<std::size_t>& tags) noexcept override { ends.push_back(tags); }
};
}  // namespace

TEST_CASE("parameter trigger: reports operators on watched storages (views too), never inside Quiet") {
  Recorder rec;
  auto w = torch::randn({3, 3}), v = torch::randn({3}), other = torch::randn({3});
  {
    ParameterTrigger trigger(rec);
    trigger.watch(w, 7);
    trigger.watch(v, 9);
    (void)(other * 2);
    REQUIRE(rec.starts.empty());  // not started
    trigger.start();
    (void)(other * 2);
    REQUIRE(rec.starts.empty());  // no watched input
    (void)torch::mv(w, v);        // may dispatch to nested operators: the first report is mv's own
    REQUIRE(!rec.starts.empty());
    REQUIRE(rec.starts[0] == std::vector<std::size_t>{7, 9});
    REQUIRE(rec.ends.size() == rec.starts.size());
    const auto before = rec.starts.size();
    (void)(w.select(0, 1) + 1);  // a view shares the storage
    REQUIRE(rec.starts.size() > before);
    REQUIRE(rec.starts.back() == std::vector<std::size_t>{7});
    const auto quiet_before = rec.starts.size();
    {
      Quiet quiet;
      (void)(w * 3);
    }
    REQUIRE(rec.starts.size() == quiet_before);
    trigger.stop();
    (void)(w * 3);
    REQUIRE(rec.starts.size() == quiet_before);
  }
  (void)(w * 3);  // destroyed: nothing reported, no crash
  REQUIRE(rec.ends.size() == rec.starts.size());
}

namespace {

// A LoRA-like model of a QLoRA run: a 4-bit projection beside a module with a running statistic.
struct QuantNetImpl : torch::nn::Module {
  QuantNetImpl() {
    register_module("proj", torch::nn::Linear(64, 64));  // no member handle: quantize_linears swaps it
    register_module("norm", torch::nn::BatchNorm1d(64));
  }
};
TORCH_MODULE(QuantNet);

}  // namespace

TEST_CASE("broadcast buffers: DDP skips a Linear4bit's constant codes and keeps every other buffer") {
  QuantNet net;
  const auto before = broadcast_buffer_list(*net);
  // BatchNorm's running mean, variance and step count.
  REQUIRE(before.size() == 3);
  const auto swapped = accel::quant::quantize_linears(*net, {});
  REQUIRE(swapped == std::vector<std::string>{"proj"});
  // The 4-bit layer holds buffers of its own (codes, absmax), and the model's buffers() lists them...
  std::size_t all = 0;
  for (const auto& b : net->buffers())
    all += b.defined() && b.numel() > 0 ? 1 : 0;
  CHECK(all > before.size());
  // ...but they are not rebroadcast after every step: the same three BatchNorm buffers, the same tensors.
  const auto after = broadcast_buffer_list(*net);
  REQUIRE(after.size() == before.size());
  for (std::size_t i = 0; i < after.size(); ++i)
    CHECK(after[i].is_same(before[i]));
}

TEST_CASE("auto bucket sizes: hidden size is the most common input width of the model's matrices") {
  using namespace torch::nn;
  Sequential mlp(Linear(784, 512), ReLU(), Linear(512, 512), ReLU(), Linear(512, 10));
  CHECK(accel::backends::model_hidden_size(*mlp) == 512);
  // A transformer block of width 64: embedding, q/k/v, output and first feed-forward matrices read 64 wide,
  // the second feed-forward matrix 256 wide.
  Sequential block(Embedding(1000, 64), Linear(64, 192), Linear(64, 64), Linear(64, 256), Linear(256, 64));
  CHECK(accel::backends::model_hidden_size(*block) == 64);
  Sequential tie(Linear(8, 4), Linear(16, 4));
  CHECK(accel::backends::model_hidden_size(*tie) == 16);  // the larger on a tie
  Sequential no_matrix(LayerNorm(LayerNormOptions({8})));
  CHECK(accel::backends::model_hidden_size(*no_matrix) == 0);
  // Accelerate: reduce_bucket_size = hidden² elements; not below 1 MiB.
  CHECK(accel::backends::auto_bucket_bytes(*mlp, 1.0, 4) == 512u * 512u * 4u);
  Sequential wide(Linear(1024, 1024), Linear(1024, 1024));
  CHECK(accel::backends::auto_bucket_bytes(*wide, 0.9, 2) ==
        static_cast<std::uint64_t>(0.9 * 1024 * 1024) * 2u);
  CHECK(accel::backends::auto_bucket_bytes(*block, 1.0, 4) == 1u << 20);  // 64² x 4 B = 16 KiB: the floor
  CHECK(accel::backends::auto_bucket_bytes(*no_matrix, 1.0, 4) == 500000000u);  // DeepSpeed's default
}

// --- the NVMe tier of ZeRO-Infinity (backends/common/nvme_tier.hpp) ---

namespace {

namespace fs = std::filesystem;
using accel::test::TempDir;

std::size_t count_entries(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  return static_cast<std::size_t>(std::distance(fs::directory_iterator(dir), fs::directory_iterator()));
}

}  // namespace

TEST_CASE(
    "nvme tier: a sub-group's state goes to its file and comes back bit for bit, memory freed between") {
  TempDir root;
  std::string dir;
  {
    namespace d = accel::backends::detail;
    d::NvmeOptions options;
    options.path = root.path.string();
    options.buffer_count = 2;
    d::NvmeTier tier(options, "test");
    dir = tier.directory();
    CHECK(fs::is_directory(dir));
    torch::manual_seed(0);
    // Three sub-groups of odd sizes and two dtypes (offsets aligned per tensor).
    std::vector<std::vector<torch::Tensor>> groups = {
        {torch::randn({1000}), torch::randn({1000})},
        {torch::randn({7}), torch::randn({3, 5}).to(torch::kFloat64)},
        {torch::randn({4097})}};
    std::vector<std::vector<torch::Tensor>> copies;
    for (const auto& g : groups) {
      copies.emplace_back();
      for (const auto& t : g)
        copies.back().push_back(t.clone());
    }
    for (std::size_t g = 0; g < groups.size(); ++g)
      tier.evict(g, groups[g]);
    tier.drain();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      CHECK(tier.evicted(g));
      for (const auto& t : groups[g]) {
        CHECK(t.storage().nbytes() == 0);  // no memory held
        CHECK_THROWS_WITH(t.data_ptr(), Catch::Contains("lives on NVMe between steps"));
      }
    }
    CHECK(count_entries(dir) == 3);
    // Read ahead, then load: every value as it was; an update then survives another round trip.
    tier.prefetch(1);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      tier.load(g);
      for (std::size_t k = 0; k < groups[g].size(); ++k)
        CHECK(torch::equal(groups[g][k], copies[g][k]));
      groups[g][0].add_(1.0);
      tier.evict(g, groups[g]);
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      tier.load(g);
      CHECK(torch::equal(groups[g][0], copies[g][0] + 1.0));
    }
    CHECK(tier.bytes_written() >= 6u * 4096u);
    CHECK(tier.bytes_read() > 0);
    // Two buffers: the one loaded and one more; never the whole state at once while it moves.
    CHECK(tier.slab_bytes_peak() < 3u * (8192u + 4096u + 20480u));
  }
  CHECK_FALSE(fs::exists(dir));          // the files are scratch space: gone with the tier
  CHECK(count_entries(root.path) == 0);  // and the process's directory, which it was the last tier of
}

TEST_CASE("nvme tier: the swap directory of a killed process is removed, a live one's is kept") {
  TempDir root;
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string h = host;
  for (auto& c : h) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') c = '-';
  }
  const fs::path stale = root.path / ("accel_nvme_" + h + "_" + std::to_string(child));
  fs::create_directories(stale);
  std::ofstream(stale / "group_0.swp") << std::string(5000, 'x');
  const fs::path live = root.path / ("accel_nvme_" + h + "_1");  // init: alive
  fs::create_directories(live);
  const fs::path other_host = root.path / ("accel_nvme_elsewhere_" + std::to_string(child));
  fs::create_directories(other_host);
  accel::backends::detail::NvmeOptions options;
  options.path = root.path.string();
  accel::backends::detail::NvmeTier tier(options, "test");
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(live));
  CHECK(fs::exists(other_host));
  CHECK_THAT(tier.notice(), Catch::Contains("removed 1 swap directory of killed runs"));
}

TEST_CASE("nvme tier: an nvme_path that cannot be a directory is a clear error naming it") {
  TempDir root;
  const auto file = root.path / "a_file";
  std::ofstream(file) << "x";
  accel::backends::detail::NvmeOptions options;
  options.path = (file / "sub").string();
  CHECK_THROWS_WITH(accel::backends::detail::NvmeTier(options, "zero rank 0"),
                    Catch::Contains("zero rank 0: cannot use nvme_path '" + options.path + "'"));
}

// Run by tests/fault/disk_full.sh on the small tmpfs it mounts (ACCEL_DISK_FULL_DIR): a sub-group's state
// that does not fit the disk is refused before anything is written or freed, naming the directory and the
// bytes.
TEST_CASE("nvme tier: a full disk is refused before the state leaves memory", "[.disk_full]") {
  const char* root = std::getenv("ACCEL_DISK_FULL_DIR");
  REQUIRE(root != nullptr);
  accel::backends::detail::NvmeOptions options;
  options.path = (fs::path(root) / "nvme").string();
  {
    accel::backends::detail::NvmeTier tier(options, "zero rank 0");
    const auto state = torch::randn({1 << 20});  // 4 MiB on a 2 MiB disk
    const auto copy = state.clone();
    CHECK_THROWS_WITH(tier.evict(0, {state}),
                      Catch::Contains("zero rank 0: NVMe offload needs 4194304 more bytes") &&
                          Catch::Contains("under '" + options.path + "'") &&
                          Catch::Contains("bytes are free there"));
    CHECK(torch::equal(state, copy));  // still in memory, unchanged
    CHECK_FALSE(tier.evicted(0));
  }
  fs::remove_all(options.path);
}
