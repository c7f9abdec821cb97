#include <catch2/catch.hpp>
#include "build_paths.hpp"

#include "test_support.hpp"

#include <accel/checkpoint/safetensors.hpp>

#include "../../accelerate_cpp/src/checkpoint/manifest.hpp"
#include "../../accelerate_cpp/src/checkpoint/model_export.hpp"
#include "../../accelerate_cpp/src/checkpoint/optimizer_reshard.hpp"
#include "../../accelerate_cpp/src/checkpoint/tensor_io.hpp"
#include "../fault/damage.hpp"

#include <sys/resource.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>

using namespace accel;
using test::Mlp;
using test::Regression;

namespace {

// A run with everything a checkpoint must carry: dropout (RNG), shuffled data (loader position), Adam
// (optimizer state), StepLR (scheduler), fp16 or not (scaler), accumulation (counters).
struct Run {
  explicit Run(MixedPrecision mp, std::uint64_t init_seed)
      : model((torch::manual_seed(init_seed), Mlp(6, 0.2))),
        opt(model->parameters(), torch::optim::AdamOptions(1e-2)),
        sched(opt, 3, 0.5),
        acc(AcceleratorOptions().config(test::make_config(mp, 2))) {
    acc.set_seed(11);
    acc.prepare(model, opt, sched);
    loader = acc.prepare_data_loader(Regression(40).map(torch::data::transforms::Stack<>()),
                                     torch::data::DataLoaderOptions(4));
  }
  // Trains until `stop_after` optimizer steps in total (or to the end of `epochs`); returns true if stopped
  // early.
  bool train(int epochs, std::int64_t stop_after) {
    while (loader->epoch() < static_cast<std::uint64_t>(epochs)) {
      for (auto& batch : *loader) {
        acc.backward(torch::mse_loss(model(batch.data).to(torch::kFloat32), batch.target));
        opt.step();
        if (acc.sync_gradients()) sched.step();
        opt.zero_grad();
        if (acc.sync_gradients() && acc.micro_steps() == stop_after * 2) return true;
      }
    }
    return false;
  }
  Mlp model;
  torch::optim::Adam opt;
  torch::optim::StepLR sched;
  Accelerator acc;
  std::unique_ptr<DataLoader<torch::data::datasets::MapDataset<Regression, torch::data::transforms::Stack<>>>>
      loader;
};

std::string run_command(const std::string& cmd) {
  std::string out;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr)
    out += buf;
  REQUIRE(::pclose(pipe) == 0);
  return out;
}

}  // namespace

TEST_CASE("checkpoint: resuming continues bit-for-bit as if never stopped") {
  for (auto mp : {MixedPrecision::No, MixedPrecision::Fp16}) {
    test::TempDir dir;
    const auto ckpt = (dir.path / "ckpt").string();
    // Reference: 3 epochs straight through.
    Run ref(mp, 1);
    REQUIRE_FALSE(ref.train(3, -1));
    // Interrupted: stop after 7 optimizer steps (mid-epoch 1), save, throw everything away.
    {
      Run first(mp, 1);
      REQUIRE(first.train(3, 7));
      first.acc.save_state(ckpt);
      torch::manual_seed(999);  // disturb the global RNG; load_state must restore it
    }
    // Resumed: different initial weights, everything restored from the checkpoint.
    Run resumed(mp, 2);
    resumed.acc.load_state(ckpt);
    REQUIRE(resumed.acc.micro_steps() == 14);
    REQUIRE_FALSE(resumed.train(3, -1));
    const auto a = test::snapshot(*ref.model), b = test::snapshot(*resumed.model);
    for (std::size_t k = 0; k < a.size(); ++k)
      REQUIRE(torch::equal(a[k], b[k]));
    REQUIRE(ref.opt.param_groups()[0].options().get_lr() == resumed.opt.param_groups()[0].options().get_lr());
    REQUIRE(ref.acc.completed_steps() == resumed.acc.completed_steps());
    if (mp == MixedPrecision::Fp16)
      REQUIRE(ref.acc.scaler()->get_scale() == resumed.acc.scaler()->get_scale());
  }
}

TEST_CASE("checkpoint: a save that fails midway leaves the previous checkpoint intact") {
  test::TempDir dir;
  const auto ckpt = (dir.path / "ckpt").string();
  Run run(MixedPrecision::No, 1);
  run.train(1, 2);
  run.acc.save_state(ckpt);
  const auto saved = safetensors::File::open(ckpt + "/model.safetensors");
  const auto w = saved.info("fc1.weight");
  std::vector<std::uint8_t> before(saved.data("fc1.weight"), saved.data("fc1.weight") + w.nbytes);

  run.train(1, 4);
  // A complex buffer cannot be stored in safetensors: the save throws after writing other files.
  run.model->register_buffer("bad", torch::zeros({2}, torch::kComplexFloat));
  REQUIRE_THROWS_AS(run.acc.save_state(ckpt), CheckpointError);
  const auto after = safetensors::File::open(ckpt + "/model.safetensors");
  REQUIRE(std::vector<std::uint8_t>(after.data("fc1.weight"), after.data("fc1.weight") + w.nbytes) == before);
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    entries += e.path().filename() != "" ? 1 : 0;
  REQUIRE(entries == 1);  // no temporary directory left behind
}

namespace {

// Caps the size of every file this process writes (RLIMIT_FSIZE) while alive: writes past it fail with EFBIG,
// as on a full disk (SIGXFSZ, which would kill the process, is ignored meanwhile).
struct FileSizeLimit {
  explicit FileSizeLimit(rlim_t bytes) {
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit capped = saved;
    capped.rlim_cur = bytes;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &capped) == 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
  }
  rlimit saved{};
  void (*old_handler)(int) = nullptr;
};

}  // namespace

TEST_CASE(
    "checkpoint: a write that fails (disk full) is a CheckpointError, and the previous checkpoint stays") {
  // A larger model than the MLP, so that the checkpoint's files exceed the cap: the parameters (263 kB) fit
  // under it, Adam's state (twice that, in the optimizer's LibTorch .pt file and its safetensors copy) does
  // not. LibTorch's zip writer aborted the process on such a failure (SIGABRT, "unexpected pos").
  test::TempDir dir;
  const auto ckpt = (dir.path / "ckpt").string();
  torch::manual_seed(0);
  torch::nn::Linear model(256, 256);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(model, opt);
  auto step = [&] {
    opt.zero_grad();
    acc.backward(model(torch::randn({4, 256})).pow(2).mean());
    opt.step();
  };
  step();
  acc.save_state(ckpt);
  const auto before = test::snapshot(*model);
  step();
  {
    FileSizeLimit cap(400 * 1024);
    try {
      acc.save_state(ckpt);
      FAIL("save_state succeeded although its files exceed the 400 kB cap");
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find(dir.path.string()) != std::string::npos);  // names the file
      CHECK((what.find("File too large") != std::string::npos || what.find("disk") != std::string::npos));
    }
  }
  // The previous checkpoint is intact and loads; nothing temporary is left beside it.
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    entries.push_back(e.path().filename().string());
  CHECK(entries == std::vector<std::string>{"ckpt"});
  step();
  acc.load_state(ckpt);
  const auto loaded = test::snapshot(*model);
  for (std::size_t k = 0; k < loaded.size(); ++k)
    CHECK(torch::equal(loaded[k], before[k]));
}

namespace {

// Bytes a new file can still take on the file system of `dir`.
std::uint64_t free_bytes(const std::filesystem::path& dir) {
  struct statvfs fs {};
  REQUIRE(::statvfs(dir.c_str(), &fs) == 0);
  return static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
}

// Fills the file system of `dir` until about `keep` bytes are free (a file of zeros); returns its path.
std::filesystem::path fill_until(const std::filesystem::path& dir, std::uint64_t keep) {
  const auto filler = dir / "filler.bin";
  std::filesystem::remove(filler);
  const std::uint64_t available = free_bytes(dir);
  if (available > keep) {
    std::ofstream out(filler, std::ios::binary);
    const std::string block(4096, '\0');
    for (std::uint64_t left = available - keep; left > 0;) {
      const auto n = std::min<std::uint64_t>(left, block.size());
      out.write(block.data(), static_cast<std::streamsize>(n));
      left -= n;
    }
  }
  return filler;
}

std::uint64_t tree_bytes(const std::filesystem::path& dir) {
  std::uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) total += e.file_size();
  return total;
}

std::vector<std::string> entries_of(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

// Run by tests/fault/disk_full.sh on a small tmpfs it mounts (ACCEL_DISK_FULL_DIR), so the disk is really
// full (ENOSPC from the kernel, not the RLIMIT_FSIZE emulation above), at several points of each file format:
// the model's safetensors, the optimizer's LibTorch .pt (whose zip writer aborted the process on a short
// write), the small state files, the manifest; and save_model's shards and index.
TEST_CASE("checkpoint: a really full disk fails save_state and save_model cleanly, at every point",
          "[.disk_full]") {
  const char* root_env = std::getenv("ACCEL_DISK_FULL_DIR");
  REQUIRE(root_env != nullptr);  // set by tests/fault/disk_full.sh
  const std::filesystem::path root(root_env);
  torch::manual_seed(0);
  torch::nn::Linear model(96, 96);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(model, opt);
  auto step = [&] {
    opt.zero_grad();
    acc.backward(model(torch::randn({4, 96})).pow(2).mean());
    opt.step();
  };
  step();
  const auto ckpt = root / "ckpt";
  const auto exported = root / "export";
  acc.save_state(ckpt.string());
  acc.save_model(model, exported.string(), "20KB");  // 37 kB of weights: two shards and an index
  const std::uint64_t state_bytes = tree_bytes(ckpt);
  const std::uint64_t export_bytes = tree_bytes(exported);
  const auto saved = test::snapshot(*model);
  const auto ckpt_files = entries_of(ckpt);
  const auto export_files = entries_of(exported);
  INFO("checkpoint " << state_bytes << " bytes, export " << export_bytes << " bytes");
  step();
  int failures = 0;
  for (const double fraction : {0.02, 0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 0.97}) {
    for (const bool is_export : {false, true}) {
      const std::uint64_t need = is_export ? export_bytes : state_bytes;
      const auto filler = fill_until(root, static_cast<std::uint64_t>(fraction * static_cast<double>(need)));
      INFO((is_export ? "save_model" : "save_state") << " with " << free_bytes(root) << " bytes free");
      try {
        if (is_export) {
          acc.save_model(model, exported.string(), "20KB");
        } else {
          acc.save_state(ckpt.string());
        }
        FAIL("the save succeeded on a full disk");
      } catch (const CheckpointError& e) {
        ++failures;
        const std::string what = e.what();
        INFO(what);
        CHECK(what.find(root.string()) != std::string::npos);  // names the file
        CHECK(what.find("No space left on device") != std::string::npos);
        // and how much it was writing (or the directory it could not create)
        CHECK((what.find(" bytes") != std::string::npos || what.find("creating '") != std::string::npos));
      }
      std::filesystem::remove(filler);
      // Nothing temporary is left, and the earlier checkpoint and export are whole and load.
      CHECK(entries_of(root) == std::vector<std::string>{"ckpt", "export"});
      CHECK(entries_of(ckpt) == ckpt_files);
      CHECK(entries_of(exported) == export_files);
    }
  }
  CHECK(failures == 16);
  acc.load_state(ckpt.string());
  const auto loaded = test::snapshot(*model);
  for (std::size_t k = 0; k < loaded.size(); ++k)
    CHECK(torch::equal(loaded[k], saved[k]));
  const auto weights = accel::detail::read_model_export(exported);
  CHECK(torch::equal(weights.at("weight"), saved[0]));
  // With the space back, both saves succeed in place.
  step();
  acc.save_state(ckpt.string());
  acc.save_model(model, exported.string(), "20KB");
  CHECK(torch::equal(accel::detail::read_model_export(exported).at("weight"), test::snapshot(*model)[0]));
}

// save_model over a save_state checkpoint would replace its model.safetensors (a different layout and no
// place in its manifest), and the checkpoint would no longer load.
TEST_CASE("export: save_model refuses a save_state checkpoint's directory, which stays loadable") {
  test::TempDir dir;
  Run run(MixedPrecision::No, 1);
  run.train(1, 1);
  const auto ckpt = dir.path / "checkpoint";
  run.acc.save_state(ckpt.string());
  const auto before = std::filesystem::file_size(ckpt / "manifest.json");
  std::string error;
  try {
    run.acc.save_model(run.model, ckpt.string());
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::Contains(ckpt.string()) && Catch::Contains("holds a save_state checkpoint") &&
                        Catch::Contains("export to another directory"));
  CHECK(std::filesystem::file_size(ckpt / "manifest.json") == before);
  CHECK_NOTHROW(run.acc.load_state(ckpt.string()));
  // Its own directory, or an earlier export's, is written as before.
  run.acc.save_model(run.model, (dir.path / "export").string());
  run.acc.save_model(run.model, (dir.path / "export").string());
  CHECK(std::filesystem::exists(dir.path / "export" / "model.safetensors"));
}

// save_model replaces an earlier export's weights (the files its manifest lists), never weight files it did
// not write: another tool's export or a user's own model.safetensors in the directory.
TEST_CASE("export: save_model never replaces weight files it did not write") {
  namespace fs = std::filesystem;
  test::TempDir dir;
  Run run(MixedPrecision::No, 1);
  run.train(1, 1);
  const auto target = dir.path / "export";
  fs::create_directories(target);
  const float theirs[2] = {1, 2};
  safetensors::write_file((target / "model.safetensors").string(),
                          {{"w", safetensors::DType::F32, {2}, theirs, sizeof theirs}});
  { std::ofstream(target / "config.json") << "{}"; }
  const auto before = fs::file_size(target / "model.safetensors");
  REQUIRE_THROWS_WITH(
      run.acc.save_model(run.model, target.string()),
      Catch::Contains("already holds model.safetensors, which no earlier save_model export") &&
          Catch::Contains("(nothing was written)"));
  CHECK(fs::file_size(target / "model.safetensors") == before);
  CHECK(safetensors::File::open((target / "model.safetensors").string()).names() ==
        std::vector<std::string>{"w"});
  // Moved away, the export goes in beside the user's other files, and a second export replaces the first.
  fs::rename(target / "model.safetensors", dir.path / "theirs.safetensors");
  run.acc.save_model(run.model, target.string());
  run.acc.save_model(run.model, target.string(), "100");
  CHECK(fs::exists(target / "config.json"));
  CHECK(fs::exists(target / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(target / "model.safetensors"));
}

TEST_CASE("checkpoint: save_state never deletes what it did not write (a log directory, a file)") {
  test::TempDir dir;
  Run run(MixedPrecision::No, 1);
  run.train(1, 1);
  // TensorBoard logs where the checkpoint should go (the example's --log-dir D --save D).
  const auto logs = dir.path / "logs";
  std::filesystem::create_directories(logs / "run1");
  std::ofstream(logs / "run1" / "events.out.tfevents") << "user data";
  std::ofstream(logs / "notes.txt") << "more user data";
  std::string error;
  try {
    run.acc.save_state(logs.string());
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::Contains(logs.string()) && Catch::Contains("not an accelerate-cpp checkpoint") &&
                        Catch::Contains("nothing was written"));
  CHECK(std::filesystem::exists(logs / "run1" / "events.out.tfevents"));
  CHECK(std::filesystem::exists(logs / "notes.txt"));
  // A regular file at the path is kept too.
  const auto file = dir.path / "model.bin";
  std::ofstream(file) << "user file";
  CHECK_THROWS_WITH(run.acc.save_state(file.string()), Catch::Contains("is not a directory"));
  CHECK(std::filesystem::is_regular_file(file));
  // An empty directory and an earlier checkpoint are written over.
  const auto empty = dir.path / "empty";
  std::filesystem::create_directories(empty);
  run.acc.save_state(empty.string());
  run.train(1, 2);
  run.acc.save_state(empty.string());
  CHECK(std::filesystem::exists(empty / "accelerator_state.safetensors"));
  // An earlier checkpoint that a user added files to (the fault campaign's case: notes, a log directory, a
  // backup copy): refused, naming them, and kept.
  std::ofstream(empty / "mine.txt") << "precious";
  std::filesystem::create_directories(empty / "tb" / "logs");
  std::ofstream(empty / "tb" / "logs" / "events") << "x";
  std::ofstream(empty / "model.safetensors.bak") << "backup";
  std::string added;
  try {
    run.acc.save_state(empty.string());
  } catch (const CheckpointError& e) {
    added = e.what();
  }
  CHECK_THAT(added, Catch::Contains("mine.txt") && Catch::Contains("tb") &&
                        Catch::Contains("model.safetensors.bak") && Catch::Contains("did not write") &&
                        Catch::Contains("nothing was written"));
  CHECK(std::filesystem::exists(empty / "mine.txt"));
  CHECK(std::filesystem::exists(empty / "tb" / "logs" / "events"));
  CHECK(std::filesystem::exists(empty / "model.safetensors.bak"));
  std::filesystem::remove_all(empty / "tb");
  std::filesystem::remove(empty / "mine.txt");
  std::filesystem::remove(empty / "model.safetensors.bak");
  run.acc.save_state(empty.string());  // only its own files: written over
  int stray = 0;                       // nothing left beside the directories
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    stray += e.path().filename().string().find(".tmp-") != std::string::npos ? 1 : 0;
  CHECK(stray == 0);
}

TEST_CASE("checkpoint: loading refuses a mismatched setup with a clear message") {
  test::TempDir dir;
  const auto ckpt = (dir.path / "ckpt").string();
  {
    Run run(MixedPrecision::No, 1);
    run.acc.save_state(ckpt);
  }
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  Mlp model;
  acc.prepare(model);
  REQUIRE_THROWS_WITH(acc.load_state(ckpt),
                      ckpt +
                          ": the checkpoint holds 1 optimizers but 0 were prepared; "
                          "prepare the same objects, in the same order, as when saving");
  REQUIRE_THROWS_WITH(acc.load_state((dir.path / "nope").string()),
                      "load_state: '" + (dir.path / "nope").string() +
                          "' is not a directory; pass the directory save_state wrote");
}

namespace {

namespace fs = std::filesystem;

void copy_dir(const fs::path& from, const fs::path& to) {
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

void flip_middle_byte(const fs::path& file) {
  const auto middle = static_cast<std::streamoff>(fs::file_size(file) / 2);
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(middle);
  char c = 0;
  f.get(c);
  f.seekp(middle);
  f.put(static_cast<char>(c ^ 0x10));
}

// A file of a checkpoint rewritten by hand (`edit` changes its tensors), with the manifest recomputed for
// it: what a user editing a checkpoint, or a tool that rewrites one consistently, produces.
void rewrite(const fs::path& file, const std::function<void(std::map<std::string, torch::Tensor>&)>& edit) {
  const auto f = safetensors::File::open(file.string());
  auto tensors = accel::detail::read_tensors(f);
  edit(tensors);
  NamedTensors named(tensors.begin(), tensors.end());
  accel::detail::write_tensors(file.string(), named, f.metadata());
  const auto dir = file.parent_path().string();
  const auto m = accel::detail::read_manifest(dir);
  accel::detail::write_manifest(dir, accel::detail::build_manifest(dir, m.checkpoint_id, m.facts, {}));
}

std::vector<torch::Tensor> adam_state(torch::optim::Adam& opt) {
  std::vector<torch::Tensor> out;
  for (const auto& p : opt.param_groups()[0].params()) {
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(torch::tensor(s.step()));
  }
  return out;
}

torch::Tensor cpu_rng_state() {
  return at::globalContext().defaultGenerator(torch::kCPU).get_state();
}

// An object with its own save/load (as Accelerate's register_for_checkpointing takes state_dict owners).
struct Counter {
  std::int64_t value = 0;
  void save(torch::serialize::OutputArchive& a) const { a.write("value", torch::tensor(value)); }
  void load(torch::serialize::InputArchive& a) {
    torch::Tensor t;
    a.read("value", t);
    value = t.item<std::int64_t>();
  }
};

// Everything of a Run that a failed load_state must leave as it was.
struct Untouched {
  explicit Untouched(Run& r)
      : weights(test::snapshot(*r.model)),
        optimizer(adam_state(r.opt)),
        rng(cpu_rng_state()),
        micro_steps(r.acc.micro_steps()),
        epoch(r.loader->epoch()),
        lr(r.opt.param_groups()[0].options().get_lr()) {}
  void check(Run& r) const {
    const auto w = test::snapshot(*r.model);
    for (std::size_t k = 0; k < w.size(); ++k)
      CHECK(torch::equal(w[k], weights[k]));
    const auto o = adam_state(r.opt);
    REQUIRE(o.size() == optimizer.size());
    for (std::size_t k = 0; k < o.size(); ++k)
      CHECK(torch::equal(o[k], optimizer[k]));
    CHECK(torch::equal(cpu_rng_state(), rng));
    CHECK(r.acc.micro_steps() == micro_steps);
    CHECK(r.loader->epoch() == epoch);
    CHECK(r.opt.param_groups()[0].options().get_lr() == lr);
  }
  std::vector<torch::Tensor> weights, optimizer;
  torch::Tensor rng;
  std::int64_t micro_steps;
  std::uint64_t epoch;
  double lr;
};

}  // namespace

TEST_CASE("checkpoint: a corrupted, truncated, missing or foreign file is named, and nothing is loaded") {
  test::TempDir dir;
  const fs::path a = dir.path / "a", b = dir.path / "b", c = dir.path / "c";
  {
    Run run(MixedPrecision::No, 1);
    run.train(3, 3);
    run.acc.save_state(a.string());
    run.train(3, 5);
    run.acc.save_state(b.string());
  }
  // The manifest lists every file, with the digest computed while writing it, which is the file's.
  const auto manifest = accel::detail::read_manifest(a.string());
  std::vector<std::string> names;
  for (const auto& e : manifest.files) {
    names.push_back(e.name);
    CHECK(accel::detail::digest_file((a / e.name).string()).xxh64 == e.digest.xxh64);
    CHECK(fs::file_size(a / e.name) == e.digest.bytes);
  }
  CHECK(names == std::vector<std::string>{"accelerator_state.safetensors", "model.safetensors",
                                          "optimizer.pt", "optimizer_full.safetensors",
                                          "random_states_0.safetensors"});
  CHECK(manifest.facts.at("completed_steps") == "3");

  Run target(MixedPrecision::No, 2);
  target.train(3, 1);
  const Untouched before(target);
  auto refused = [&](const std::string& expected) {
    try {
      target.acc.load_state(c.string());
      FAIL("load_state accepted a damaged checkpoint, expected: " << expected);
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK_THAT(what, Catch::Contains(expected));
      CHECK_THAT(what, Catch::Contains("nothing was loaded"));
    }
    before.check(target);
  };
  for (const auto& name : names) {
    copy_dir(a, c);
    flip_middle_byte(c / name);  // in every file, also those this run does not read (optimizer_full)
    refused((c / name).string() + " does not hold what checkpoint " + manifest.checkpoint_id.substr(0, 12));
  }
  copy_dir(a, c);
  fs::resize_file(c / "model.safetensors", fs::file_size(c / "model.safetensors") - 4);
  refused((c / "model.safetensors").string() + " has ");
  copy_dir(a, c);
  fs::remove(c / "optimizer.pt");
  refused((c / "optimizer.pt").string() + " is missing");
  copy_dir(a, c);
  fs::copy_file(b / "model.safetensors", c / "model.safetensors", fs::copy_options::overwrite_existing);
  refused("the file is corrupted or was replaced by another checkpoint's or another rank's file");
  copy_dir(a, c);
  fs::copy_file(b / "accelerator_state.safetensors", c / "accelerator_state.safetensors",
                fs::copy_options::overwrite_existing);
  fs::copy_file(b / "manifest.json", c / "manifest.json", fs::copy_options::overwrite_existing);
  refused("does not hold what checkpoint");  // b's manifest, a's model
  copy_dir(a, c);
  fs::remove(c / "manifest.json");
  refused("manifest.json is missing, so the checkpoint's files cannot be verified");
  copy_dir(a, c);
  { std::ofstream(c / "manifest.json") << "{\"checkpoint_id\":"; }
  refused("manifest.json is damaged");

  // Intact, it loads.
  copy_dir(a, c);
  target.acc.load_state(c.string());
  CHECK(target.acc.micro_steps() == 6);
}

TEST_CASE("checkpoint: a load that fails part way leaves every object as it was") {
  test::TempDir dir;
  const fs::path a = dir.path / "a", c = dir.path / "c";
  {
    Run run(MixedPrecision::No, 1);
    Counter saved;
    saved.value = 7;
    run.acc.register_for_checkpointing(saved);
    run.train(3, 3);
    run.acc.save_state(a.string());
  }
  Run target(MixedPrecision::No, 2);
  Counter counter;
  counter.value = 3;
  target.acc.register_for_checkpointing(counter);
  target.train(3, 1);
  const Untouched before(target);
  // A consistent checkpoint (its manifest matches) whose model lacks a tensor: the optimizers, schedulers,
  // loaders, random states and registered objects are loaded before the weights, and must be put back.
  copy_dir(a, c);
  rewrite(c / "model.safetensors", [](auto& t) {
    t["fc9.weight"] = t.at("fc2.weight");
    t.erase("fc2.weight");
  });
  REQUIRE_THROWS_WITH(
      target.acc.load_state(c.string()),
      Catch::Contains("load_state: " + (c / "model.safetensors").string() +
                      ": checkpoint has no tensor 'fc2.weight'") &&
          Catch::Contains("the optimizers, schedulers, loaders, loss scaler, random states and "
                          "registered objects are as they were"));
  before.check(target);
  CHECK(counter.value == 3);
  // An integer tensor where the model has floats (a same-size dtype lie) is refused, not converted.
  copy_dir(a, c);
  rewrite(c / "model.safetensors", [](auto& t) { t["fc1.bias"] = t.at("fc1.bias").view(torch::kInt32); });
  REQUIRE_THROWS_WITH(target.acc.load_state(c.string()),
                      Catch::Contains("checkpoint tensor 'fc1.bias' is Int but the model's is Float"));
  before.check(target);
  // Counters and positions out of range are refused before anything is touched.
  copy_dir(a, c);
  rewrite(c / "accelerator_state.safetensors", [](auto& t) { t["loader.0.epoch"] = torch::tensor(-1L); });
  REQUIRE_THROWS_WITH(target.acc.load_state(c.string()),
                      Catch::Contains("holds loader.0.epoch = -1, outside [0, 4294967295]"));
  before.check(target);
  copy_dir(a, c);
  rewrite(c / "accelerator_state.safetensors",
          [](auto& t) { t["loader.0.next_batch"] = torch::tensor(1000L); });
  REQUIRE_THROWS_WITH(target.acc.load_state(c.string()),
                      Catch::Contains("loader 0 resumes after batch 1000 of epoch ") &&
                          Catch::Contains(", but an epoch of this loader has 10 batches per rank") &&
                          Catch::Contains("are as they were"));
  before.check(target);
  copy_dir(a, c);
  rewrite(c / "accelerator_state.safetensors", [](auto& t) { t["micro_steps"] = torch::tensor({1L, 2L}); });
  REQUIRE_THROWS_WITH(target.acc.load_state(c.string()),
                      Catch::Contains("'micro_steps' is a Long tensor of 2 elements, not one int64"));
  before.check(target);
  // Saved on 3 processes (12 samples a step), resumed on one (4 a step, 10 batches an epoch): 5 steps is 60
  // samples, past the epoch by more than a saved step, refused; 4 steps (48: the epoch's end, its last round
  // padded) finishes that epoch at once.
  auto saved_at = [&](std::int64_t samples_per_step, std::int64_t next_batch) {
    copy_dir(a, c);
    rewrite(c / "accelerator_state.safetensors", [&](auto& t) {
      t["loader.0.samples_per_step"] = torch::tensor(samples_per_step);
      t["loader.0.next_batch"] = torch::tensor(next_batch);
    });
  };
  saved_at(12, 5);
  REQUIRE_THROWS_WITH(target.acc.load_state(c.string()),
                      Catch::Contains("loader 0 resumes after batch 15 of epoch "));
  before.check(target);
  saved_at(12, 4);
  target.acc.load_state(c.string());
  const auto epoch = target.loader->epoch();
  std::size_t batches = 0;
  for (auto& batch : *target.loader) {
    (void)batch;
    ++batches;
  }
  CHECK(batches == 0);
  CHECK(target.loader->epoch() == epoch + 1);
  CHECK(counter.value == 7);  // a load that succeeds loads the registered objects
}

// Two models (a GAN, a teacher and a student): the second one's file not fitting its model must not leave the
// first already overwritten.
TEST_CASE("checkpoint: a load whose second model does not fit leaves the first model as it was") {
  test::TempDir dir;
  torch::manual_seed(5);
  Mlp first(6, 0.0), second(6, 0.0);
  torch::optim::SGD opt_first(first->parameters(), 0.1), opt_second(second->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config(MixedPrecision::No, 1)));
  acc.prepare(first, opt_first);
  acc.prepare(second, opt_second);
  const auto ckpt = dir.path / "two";
  acc.save_state(ckpt.string());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : first->parameters())
      p.add_(1.0);  // what a load would undo
  }
  const auto first_before = test::snapshot(*first), second_before = test::snapshot(*second);
  rewrite(ckpt / "model_1.safetensors", [](auto& t) {
    t["fc9.weight"] = t.at("fc2.weight");
    t.erase("fc2.weight");
  });
  REQUIRE_THROWS_WITH(acc.load_state(ckpt.string()),
                      Catch::Contains((ckpt / "model_1.safetensors").string()) &&
                          Catch::Contains("checkpoint has no tensor 'fc2.weight' for model 1"));
  const auto first_after = test::snapshot(*first), second_after = test::snapshot(*second);
  for (std::size_t k = 0; k < first_after.size(); ++k)
    CHECK(torch::equal(first_after[k], first_before[k]));
  for (std::size_t k = 0; k < second_after.size(); ++k)
    CHECK(torch::equal(second_after[k], second_before[k]));
  // A shape that does not fit is named the same way.
  acc.save_state(ckpt.string());
  rewrite(ckpt / "model_1.safetensors", [](auto& t) { t["fc2.bias"] = torch::zeros({3}); });
  REQUIRE_THROWS_WITH(acc.load_state(ckpt.string()),
                      Catch::Contains("checkpoint tensor 'fc2.bias' has shape [3] but model 1 expects"));
}

TEST_CASE("checkpoint: a checkpoint saved before manifests still loads, with a notice") {
  test::TempDir dir;
  const fs::path a = dir.path / "a";
  Run run(MixedPrecision::No, 1);
  run.train(3, 3);
  run.acc.save_state(a.string());
  // What an older accelerate-cpp wrote: no manifest, no checkpoint id.
  fs::remove(a / "manifest.json");
  const auto state = safetensors::File::open((a / "accelerator_state.safetensors").string());
  auto meta = state.metadata();
  meta.erase("checkpoint_id");
  const auto tensors = accel::detail::read_tensors(state);
  accel::detail::write_tensors((a / "accelerator_state.safetensors").string(),
                               NamedTensors(tensors.begin(), tensors.end()), meta);
  Run resumed(MixedPrecision::No, 2);
  resumed.acc.load_state(a.string());
  CHECK(resumed.acc.micro_steps() == 6);
  const auto w = test::snapshot(*run.model), v = test::snapshot(*resumed.model);
  for (std::size_t k = 0; k < w.size(); ++k)
    CHECK(torch::equal(w[k], v[k]));
}

TEST_CASE("checkpoint: Python's safetensors reads the model weights") {
  const std::string python = accel::test::python();
  if (python.empty())
    FAIL("ACCEL_PYTHON is not set: configure with -DACCEL_PYTHON=<venv python> (scripts/setup.sh does)");
  test::TempDir dir;
  const auto ckpt = (dir.path / "ckpt").string();
  Run run(MixedPrecision::No, 1);
  run.train(1, 2);
  run.acc.save_state(ckpt);
  const auto out = run_command(python + " " + accel::test::tests_dir() + "/python/read_safetensors.py " +
                               ckpt + "/model.safetensors");
  std::map<std::string, std::pair<std::string, double>> seen;
  std::istringstream lines(out);
  std::string name, dtype, shape;
  double sum = 0;
  while (lines >> name) {
    if (name == "__metadata__") {
      std::getline(lines, shape);
      continue;
    }
    lines >> dtype >> shape >> sum;
    seen[name] = {dtype + " " + shape, sum};
  }
  REQUIRE(seen.size() == 4);
  for (const auto& item : run.model->named_parameters()) {
    const auto& t = item.value();
    REQUIRE(seen.count(item.key()) == 1);
    std::string expect_shape = "float32 [";
    for (std::int64_t d = 0; d < t.dim(); ++d)
      expect_shape += (d ? "," : "") + std::to_string(t.size(d));
    REQUIRE(seen[item.key()].first == expect_shape + "]");
    REQUIRE(seen[item.key()].second == Approx(t.to(torch::kFloat64).sum().item<double>()).epsilon(1e-9));
  }
}

TEST_CASE("export: max_shard_size strings as transformers reads them") {
  CHECK(accel::detail::parse_shard_size("10GB") == 10000000000ULL);
  CHECK(accel::detail::parse_shard_size("500MB") == 500000000ULL);
  CHECK(accel::detail::parse_shard_size("2GiB") == 2147483648ULL);
  CHECK(accel::detail::parse_shard_size("64kib") == 65536ULL);
  CHECK(accel::detail::parse_shard_size("1.5KB") == 1500ULL);
  CHECK(accel::detail::parse_shard_size("1234") == 1234ULL);
  CHECK_THROWS_WITH(accel::detail::parse_shard_size("10 gigs"),
                    Catch::Contains("max_shard_size '10 gigs' is not a size"));
  CHECK_THROWS_AS(accel::detail::parse_shard_size("0"), UsageError);
}

TEST_CASE("export: shards are cut as huggingface_hub cuts them, and a failed export keeps the earlier one") {
  test::TempDir dir;
  const auto out = dir.path / "export";
  auto f32 = [](std::int64_t n) { return torch::arange(n, torch::kFloat32); };
  {
    accel::detail::ShardedExportWriter writer(out, 100);
    writer.add("a", f32(30));  // 120 bytes > 100: a shard of its own, written at once
    writer.add("b", f32(10));  // 40
    writer.add("c", f32(10));  // 80
    writer.add("d", f32(10));  // 120 > 100: b and c close a shard
    CHECK(writer.held_bytes() == 40);
    const ModelExport e = writer.finish();
    CHECK(e.files ==
          std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                   "model-00003-of-00003.safetensors", "model.safetensors.index.json"});
    CHECK(e.total_bytes == 240);
  }
  const auto state = accel::detail::read_model_export(out);
  REQUIRE(state.size() == 4);
  CHECK(torch::equal(state.at("a"), f32(30)));
  CHECK(torch::equal(state.at("d"), f32(10)));
  const auto shard1 = safetensors::File::open((out / "model-00001-of-00003.safetensors").string());
  CHECK(shard1.names() == std::vector<std::string>{"a"});
  CHECK(shard1.metadata().at("format") == "pt");
  {
    accel::detail::ShardedExportWriter writer(out, 100);
    writer.add("x", f32(3));
    // Destroyed before finish (an error while exporting): the shards above stay, nothing new appears.
  }
  CHECK(accel::detail::read_model_export(out).size() == 4);
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(out))
    ++files;
  CHECK(files == 5);  // 3 shards, the index, the manifest
  {
    accel::detail::ShardedExportWriter writer(out, 1000);
    writer.add("x", f32(3));
    CHECK(writer.finish().files == std::vector<std::string>{"model.safetensors"});
  }
  CHECK(accel::detail::read_model_export(out).size() == 1);  // the earlier shards and index are gone
  std::filesystem::remove(out / "model.safetensors");
  CHECK_THROWS_WITH(accel::detail::read_model_export(out),  // the export's manifest lists it
                    Catch::Contains("model.safetensors is missing") && Catch::Contains("nothing was loaded"));
  std::filesystem::remove(out / "model.safetensors.manifest.json");
  CHECK_THROWS_WITH(accel::detail::read_model_export(out),
                    Catch::Contains("has neither model.safetensors nor"));
}

TEST_CASE("export: save_model then load_model on one process, and a missing shard is named") {
  test::TempDir dir;
  const auto out = (dir.path / "m").string();
  torch::manual_seed(1);
  Mlp model, other;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(model, opt, other);
  const ModelExport e = acc.save_model(model, out, "100");
  CHECK(e.files.size() == 4);  // fc1.weight (384 bytes) alone, then fc1.bias, then fc2.*; and the index
  CHECK(e.total_bytes == (96 + 16 + 16 + 1) * 4);
  acc.load_model(other, out);
  const auto got = acc.get_state_dict(other);
  const auto want = acc.get_state_dict(model);
  REQUIRE(got.size() == want.size());
  for (std::size_t k = 0; k < got.size(); ++k)
    CHECK(torch::equal(got[k].second, want[k].second));
  std::filesystem::remove(std::filesystem::path(out) / "model-00002-of-00003.safetensors");
  CHECK_THROWS_WITH(acc.load_model(other, out), Catch::Contains("model-00002-of-00003.safetensors"));
  CHECK_THROWS_WITH(acc.save_model(model, out, "lots"), Catch::Contains("max_shard_size 'lots'"));
  // An index may only name shards inside the export, and is bounded (checked without a manifest, as an
  // export transformers wrote has none).
  acc.save_model(model, out, "100");
  std::filesystem::remove(std::filesystem::path(out) / "model.safetensors.manifest.json");
  const auto index = std::filesystem::path(out) / "model.safetensors.index.json";
  std::stringstream text;
  text << std::ifstream(index).rdbuf();
  const std::string original = text.str();
  const auto shard = original.find("model-00001-of-00003.safetensors");
  REQUIRE(shard != std::string::npos);
  for (const std::string outside : {"/etc/passwd", "../m/model-00001-of-00003.safetensors"}) {
    std::string edited = original;
    edited.replace(shard, std::string("model-00001-of-00003.safetensors").size(), outside);
    std::ofstream(index) << edited;
    CHECK_THROWS_WITH(acc.load_model(other, out),
                      Catch::Contains("'" + outside + "', which is not a file inside the export directory"));
  }
  std::filesystem::remove(index);
  std::filesystem::create_symlink("/dev/zero", index);
  CHECK_THROWS_WITH(acc.load_model(other, out), Catch::Contains("is not a file; an index save_model writes"));
  std::filesystem::remove(index);
  std::ofstream(index) << std::string(100000, '[');
  CHECK_THROWS_WITH(acc.load_model(other, out), Catch::Contains("nested deeper than an index is"));
}

TEST_CASE(
    "export: the manifest save_model writes catches a damaged, missing or foreign file before loading") {
  test::TempDir dir;
  const auto out = dir.path / "m";
  const auto other_out = dir.path / "other";
  torch::manual_seed(1);
  Mlp model, other;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(test::make_config()));
  acc.prepare(model, opt, other);
  acc.save_model(model, out.string(), "100");
  acc.save_model(other, other_out.string(), "100");  // another export with the same file names
  const auto manifest = out / "model.safetensors.manifest.json";
  REQUIRE(std::filesystem::exists(manifest));
  const auto before = test::snapshot(*other);
  auto refused = [&](const std::string& expect) {
    try {
      acc.load_model(other, out.string());
      FAIL("load_model accepted a damaged export");
    } catch (const CheckpointError& e) {
      CHECK_THAT(e.what(), Catch::Contains(expect) && Catch::Contains("nothing was loaded"));
    }
    const auto after = test::snapshot(*other);  // nothing was loaded
    for (std::size_t k = 0; k < after.size(); ++k)
      CHECK(torch::equal(after[k], before[k]));
  };
  const auto shard = out / "model-00002-of-00003.safetensors";
  std::stringstream original;
  original << std::ifstream(shard, std::ios::binary).rdbuf();
  const std::string bytes = original.str();
  // One flipped bit in the tensor data (the header still parses: without the manifest it would load).
  std::string flipped = bytes;
  flipped[flipped.size() - 1] = static_cast<char>(flipped.back() ^ 0x01);
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << flipped;
  refused(shard.string() + " does not hold what export");
  // The same shard from another export.
  std::filesystem::copy_file(other_out / shard.filename(), shard,
                             std::filesystem::copy_options::overwrite_existing);
  refused("does not hold what export");
  // Truncated, then missing.
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 4);
  refused("the file was truncated, extended or replaced");
  std::filesystem::remove(shard);
  refused(shard.string() + " is missing");
  // The original bytes back: it loads, and equals the model.
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  acc.load_model(other, out.string());
  const auto got = acc.get_state_dict(other);
  const auto want = acc.get_state_dict(model);
  for (std::size_t k = 0; k < got.size(); ++k)
    CHECK(torch::equal(got[k].second, want[k].second));
  // A damaged manifest is named.
  std::ofstream(manifest, std::ios::trunc) << "{\"checkpoint_id\": 3}";
  CHECK_THROWS_WITH(acc.load_model(other, out.string()),
                    Catch::Contains("the export manifest " + manifest.string() + " is damaged") &&
                        Catch::Contains("so it is not loaded"));
}

namespace {}  // namespace

TEST_CASE("checkpoints: automatic naming, rotation after commit, resume from the newest, custom state") {
  test::TempDir dir;
  ProjectConfiguration project;
  project.project_dir = (dir.path / "run").string();
  project.automatic_checkpoint_naming = true;
  project.total_limit = 2;
  Regression data(8);
  torch::manual_seed(0);
  Mlp model, ema;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Counter counter;
  double best = 0;
  std::vector<std::string> hook_dirs;
  Accelerator acc(AcceleratorOptions().config(test::make_config()).project_config(project));
  acc.prepare(model, opt);
  acc.register_for_checkpointing(ema);
  acc.register_for_checkpointing(counter);
  acc.register_for_checkpointing(
      [&](torch::serialize::OutputArchive& a) { a.write("best", torch::tensor(best)); },
      [&](torch::serialize::InputArchive& a) {
        torch::Tensor t;
        a.read("best", t);
        best = t.item<double>();
      });
  acc.register_save_state_pre_hook([&](const std::string& d) {
    std::ofstream(std::filesystem::path(d) / "notes.txt") << "best " << best << "\n";
  });
  acc.register_load_state_pre_hook([&](const std::string& d) { hook_dirs.push_back(d); });
  const auto checkpoints = std::filesystem::path(project.project_dir) / "checkpoints";
  auto listing = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(checkpoints))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  std::vector<torch::Tensor> at_save_2;
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(data.x), data.y));
    opt.step();
    {
      torch::NoGradGuard no_grad;
      for (std::size_t k = 0; k < ema->parameters().size(); ++k)
        ema->parameters()[k].mul_(0.5).add_(model->parameters()[k], 0.5);
    }
    counter.value = 10 + i;
    best = 0.5 * i;
    const std::string written = acc.save_state();
    CHECK(written == (checkpoints / ("checkpoint_" + std::to_string(i))).string());
    if (i == 2) at_save_2 = test::snapshot(*ema);
  }
  // total_limit 2: the oldest went once the third was complete.
  CHECK(listing() == std::vector<std::string>{"checkpoint_1", "checkpoint_2"});
  CHECK(std::filesystem::exists(checkpoints / "checkpoint_2" / "notes.txt"));  // written by the save hook
  CHECK(std::filesystem::exists(checkpoints / "checkpoint_2" / "custom_checkpoint_2.pt"));
  CHECK(acc.project_configuration().iteration == 3);

  // Everything changes, then load_state() brings back the newest checkpoint and continues the numbering.
  counter.value = -1;
  best = -1;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : ema->parameters())
      p.zero_();
  }
  CHECK(acc.load_state() == (checkpoints / "checkpoint_2").string());
  CHECK(hook_dirs == std::vector<std::string>{(checkpoints / "checkpoint_2").string()});
  CHECK(counter.value == 12);
  CHECK(best == 1.0);
  const auto restored = test::snapshot(*ema);
  for (std::size_t k = 0; k < restored.size(); ++k)
    CHECK(torch::equal(restored[k], at_save_2[k]));
  CHECK(acc.project_configuration().iteration == 3);
  acc.save_state();
  CHECK(listing() == std::vector<std::string>{"checkpoint_2", "checkpoint_3"});

  // A half-written checkpoint (a crash before commit) is never the newest; a taken name is refused.
  std::filesystem::create_directories(checkpoints / "checkpoint_9");  // no state file: incomplete
  std::filesystem::create_directories(checkpoints / "checkpoint_7.tmp-1-abc");
  CHECK(acc.load_state() == (checkpoints / "checkpoint_3").string());
  CHECK(acc.project_configuration().iteration == 4);
  std::filesystem::create_directories(checkpoints / "checkpoint_4");
  CHECK_THROWS_WITH(acc.save_state(), Catch::Contains("checkpoint_4' already exists"));
}

TEST_CASE("checkpoints: misuse of automatic naming and of registered objects is named") {
  test::TempDir dir;
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  {
    Accelerator acc(AcceleratorOptions().config(test::make_config()));
    acc.prepare(model, opt);
    CHECK_THROWS_WITH(acc.save_state(), Catch::Contains("needs automatic checkpoint naming"));
    CHECK_THROWS_WITH(acc.load_state(), Catch::Contains("pass the directory: load_state(dir)"));
    Counter counter;
    acc.register_for_checkpointing(counter);
    acc.save_state((dir.path / "one").string());
  }
  {
    ProjectConfiguration project;
    project.project_dir = (dir.path / "empty").string();
    project.automatic_checkpoint_naming = true;
    Accelerator acc(AcceleratorOptions().config(test::make_config()).project_config(project));
    acc.prepare(model, opt);
    CHECK_THROWS_WITH(acc.load_state(), Catch::Contains("holds no complete checkpoint"));
    CHECK_THROWS_WITH(acc.load_state((dir.path / "one").string()),
                      Catch::Contains("holds 1 objects registered for checkpointing but 0 are registered"));
  }
  ProjectConfiguration negative;
  negative.total_limit = -1;
  CHECK_THROWS_AS(Accelerator(AcceleratorOptions().config(test::make_config()).project_config(negative)),
                  UsageError);
}

namespace {

// Two Adam steps on a small model; the last bias gets no gradient, so it has no optimizer state (a parameter
// unused in the forward pass).
struct SteppedAdam {
  torch::nn::Sequential model{torch::nn::Linear(3, 2), torch::nn::Linear(2, 1)};
  torch::optim::Adam opt{model->parameters(), torch::optim::AdamOptions(0.1)};
  SteppedAdam() {
    torch::manual_seed(5);
    for (int step = 0; step < 2; ++step) {
      for (auto& item : model->named_parameters()) {
        if (item.key() != "1.bias") item.value().mutable_grad() = torch::randn_like(item.value());
      }
      opt.step();
    }
    opt.param_groups()[0].options().set_lr(0.123);
  }
  std::vector<torch::nn::Module*> modules() { return {model.ptr().get()}; }
};

// The flat layout a sharding backend gives one optimizer tensor on rank `rank` of 2: every parameter of the
// model concatenated, padded to 12 elements, each rank holding 6.
OptimizerTensorLayout flat_layout(int rank) {
  OptimizerTensorLayout l;
  l.pieces = {{"0.weight", 0, 6}, {"0.bias", 6, 2}, {"1.weight", 8, 2}, {"1.bias", 10, 1}};
  l.flat_numel = 12;
  l.begin = 6 * rank;
  l.length = 6;
  return l;
}

torch::Tensor flat_state(torch::optim::Adam& opt, const std::string& name) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : opt.param_groups()[0].params()) {
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it == opt.state().end()) {
      parts.push_back(torch::zeros({p.numel()}));
      continue;
    }
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    parts.push_back((name == "exp_avg" ? s.exp_avg() : s.exp_avg_sq()).reshape({-1}));
  }
  parts.push_back(torch::zeros({1}));  // padding
  return torch::cat(parts);
}

std::function<torch::Tensor(const std::string&)> lookup_in(const NamedTensors& state) {
  return [state](const std::string& key) {
    for (const auto& [name, t] : state) {
      if (name == key) return t;
    }
    return torch::Tensor();
  };
}

}  // namespace

TEST_CASE("optimizer_reshard: state saved by one process is split onto 2 flat shards and joined again") {
  SteppedAdam saved;
  const auto layouts = accel::detail::identity_layouts(saved.opt, saved.modules());
  REQUIRE(layouts.size() == 4);
  const auto shapes = accel::detail::parameter_shapes(saved.modules());
  const auto never = [](const torch::Tensor&) -> torch::Tensor {
    FAIL("no tensor of an unsharded layout is gathered");
    return {};
  };
  const auto full = accel::detail::consolidate_optimizer_state(saved.opt, layouts, shapes, never, true);
  // lr, then step/exp_avg/exp_avg_sq of the three parameters that stepped; none for the unused bias.
  CHECK(full.size() == 1 + 3 * 3);
  CHECK(lookup_in(full)("1.bias/exp_avg").defined() == false);
  CHECK(lookup_in(full)("0.weight/exp_avg").sizes() == torch::IntArrayRef({2, 3}));

  // Restore onto the two shards of a flat layout (what a sharded backend's optimizer holds).
  std::vector<torch::Tensor> shard_params;
  std::vector<std::unique_ptr<torch::optim::Adam>> shards;
  for (int r = 0; r < 2; ++r) {
    shard_params.push_back(torch::zeros({6}, torch::requires_grad()));
    shards.push_back(std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{shard_params.back()},
                                                          torch::optim::AdamOptions(1.0)));
    accel::detail::restore_optimizer_state(*shards[r], {flat_layout(r)}, lookup_in(full));
    CHECK(shards[r]->param_groups()[0].options().get_lr() == Approx(0.123));
    auto& s = static_cast<torch::optim::AdamParamState&>(
        *shards[r]->state().at(shard_params[r].unsafeGetTensorImpl()));
    CHECK(s.step() == 2);
    for (const char* name : {"exp_avg", "exp_avg_sq"}) {
      const auto expected = flat_state(saved.opt, name).narrow(0, 6 * r, 6);
      const auto got = std::string(name) == "exp_avg" ? s.exp_avg() : s.exp_avg_sq();
      CHECK(torch::equal(got, expected));  // the unused bias and the padding start from zero
    }
  }

  // Join the shards again: rank 1's slices are recorded first, then rank 0 gathers [its own, rank 1's].
  std::vector<torch::Tensor> from_rank1;
  const auto record = [&](const torch::Tensor& t) {
    from_rank1.push_back(t.clone());
    return torch::zeros({12});
  };
  const auto ignored =
      accel::detail::consolidate_optimizer_state(*shards[1], {flat_layout(1)}, shapes, record, false);
  CHECK(ignored.empty());
  REQUIRE(from_rank1.size() == 2);
  std::size_t k = 0;
  const auto gather = [&](const torch::Tensor& t) { return torch::cat({t, from_rank1.at(k++)}); };
  const auto joined =
      accel::detail::consolidate_optimizer_state(*shards[0], {flat_layout(0)}, shapes, gather, true);
  CHECK(k == 2);
  for (const auto& [name, t] : full) {
    INFO(name);
    const auto other = lookup_in(joined)(name);
    REQUIRE(other.defined());
    CHECK(torch::allclose(other.to(torch::kFloat64), t.to(torch::kFloat64)));
  }
  // The unused bias comes back as zeros (it is part of a stepped flat tensor now).
  CHECK(torch::equal(lookup_in(joined)("1.bias/exp_avg"), torch::zeros({1})));
}

TEST_CASE("optimizer_reshard: fingerprints tell layouts apart, and foreign tensors block conversion") {
  CHECK(accel::detail::layout_fingerprint({flat_layout(0)}) ==
        accel::detail::layout_fingerprint({flat_layout(0)}));
  CHECK(accel::detail::layout_fingerprint({flat_layout(0)}) !=
        accel::detail::layout_fingerprint({flat_layout(1)}));
  auto other = flat_layout(0);
  other.pieces[1].param = "0.bias_renamed";
  CHECK(accel::detail::layout_fingerprint({other}) != accel::detail::layout_fingerprint({flat_layout(0)}));

  SteppedAdam saved;
  auto extra = torch::zeros({3}, torch::requires_grad());
  saved.opt.param_groups()[0].params().push_back(extra);
  CHECK(accel::detail::identity_layouts(saved.opt, saved.modules()).empty());
  CHECK(accel::detail::qualified_name(0, "w") == "w");
  CHECK(accel::detail::qualified_name(2, "w") == "2:w");
}

// ---- The corrupted-checkpoint campaign (issue 30's fault campaign, rerun as a test)
// -------------------------- Mutants of a one-process checkpoint (every file and the manifest: bit flips,
// overwritten ranges, truncation, appended bytes, zeroed, deleted, swapped with another of its files,
// replaced by another checkpoint's) and of a sharded save_model export. Each must be refused with an accel::
// error naming the checkpoint and leaving every object as it was, or load exactly what the intact one loads
// (a mutation the format ignores: the manifest's informational facts). The multi-rank rows' files are damaged
// the same way by every row's `checkpoint` scenario. ACCEL_FUZZ_ITERATIONS (mutants per kind and file;
// default 4) and ACCEL_FUZZ_SEED run longer campaigns.
namespace {

using accel_fault::damage;
using accel_fault::kDamageKinds;

struct CampaignCount {
  std::size_t mutants = 0, refused = 0, named_file = 0, harmless = 0, silent = 0, partial = 0, unclear = 0;
  std::vector<std::string> problems;
  void problem(const std::string& p) {
    if (problems.size() < 10) problems.push_back(p);
  }
};

// One mutant's outcome: `load` refused (named, nothing changed) or accepted (the intact result).
void classify(CampaignCount& count, const std::string& what, const fs::path& dir, const fs::path& file,
              const std::function<void()>& load, const std::function<bool()>& untouched,
              const std::function<bool()>& equals_intact, const std::function<void()>& reset) {
  ++count.mutants;
  try {
    load();
  } catch (const accel::Error& e) {
    ++count.refused;
    const std::string message = e.what();
    if (message.find(file.filename().string()) != std::string::npos) ++count.named_file;
    if (message.find(dir.string()) == std::string::npos) {
      ++count.unclear;
      count.problem(what + ": the message names no path of the checkpoint: " + message.substr(0, 300));
    }
    if (!untouched()) {
      ++count.partial;
      count.problem(what + ": refused, but the objects changed: " + message.substr(0, 200));
      reset();
    }
    return;
  } catch (const std::exception& e) {
    ++count.unclear;
    count.problem(what + ": not an accel:: error: " + std::string(e.what()).substr(0, 300));
    if (!untouched()) reset();
    return;
  }
  if (equals_intact()) {
    ++count.harmless;
  } else {
    ++count.silent;
    count.problem(what + ": loaded, and the state differs from the intact checkpoint's");
  }
  reset();
}

void report(const char* what, const CampaignCount& c) {
  std::cout << what << ": " << c.mutants << " mutants, " << c.refused << " refused (" << c.named_file
            << " naming the damaged file, the rest the checkpoint), " << c.harmless
            << " loaded the intact state, " << c.silent << " silent wrong loads, " << c.partial
            << " partial loads, " << c.unclear << " unclear" << std::endl;
  for (const auto& p : c.problems)
    std::cout << "  " << p << std::endl;
}

std::vector<torch::Tensor> run_state(Run& r) {
  auto out = test::snapshot(*r.model);
  for (auto& t : adam_state(r.opt))
    out.push_back(t);
  out.push_back(cpu_rng_state());
  out.push_back(torch::tensor({r.acc.micro_steps(), static_cast<std::int64_t>(r.loader->epoch())}));
  out.push_back(torch::tensor(r.opt.param_groups()[0].options().get_lr()));
  return out;
}

bool same_tensors(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k)
    if (!a[k].sizes().equals(b[k].sizes()) || !torch::equal(a[k], b[k])) return false;
  return true;
}

}  // namespace

TEST_CASE("fault: corrupted checkpoints and exports are refused whole or load the intact state (campaign)") {
  const std::size_t per_kind =
      std::getenv("ACCEL_FUZZ_ITERATIONS") != nullptr
          ? static_cast<std::size_t>(std::stoull(std::getenv("ACCEL_FUZZ_ITERATIONS")))
          : 4;
  std::mt19937_64 rng(std::getenv("ACCEL_FUZZ_SEED") != nullptr ? std::stoull(std::getenv("ACCEL_FUZZ_SEED"))
                                                                : 1);
  test::TempDir dir;
  const fs::path a = dir.path / "a", b = dir.path / "b", c = dir.path / "c";
  const fs::path ea = dir.path / "export_a", eb = dir.path / "export_b";
  {
    Run run(MixedPrecision::No, 1);
    run.train(3, 3);
    run.acc.save_state(a.string());
    run.acc.save_model(run.model, ea.string(), "1KB");
    run.train(3, 5);
    run.acc.save_state(b.string());
    run.acc.save_model(run.model, eb.string(), "1KB");
  }
  // What the intact checkpoint loads into a run of another seed, one step in.
  auto fresh = [] {
    auto r = std::make_unique<Run>(MixedPrecision::No, 2);
    r->train(3, 1);
    return r;
  };
  std::vector<torch::Tensor> intact;
  {
    auto r = fresh();
    r->acc.load_state(a.string());
    intact = run_state(*r);
  }
  auto target = fresh();
  auto before = run_state(*target);

  CampaignCount state;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(a))
    files.push_back(e.path().filename());
  std::sort(files.begin(), files.end());
  for (const auto& name : files) {
    for (int kind = 0; kind < kDamageKinds; ++kind) {
      for (std::size_t i = 0; i < (kind >= 4 && kind != 6 ? 1 : per_kind); ++i) {
        copy_dir(a, c);
        const std::string what = name.string() + " " + damage(c, c / name, b / name, kind, rng);
        classify(
            state, what, c, c / name, [&] { target->acc.load_state(c.string()); },
            [&] { return same_tensors(run_state(*target), before); },
            [&] { return same_tensors(run_state(*target), intact); },
            [&] {
              target = fresh();
              before = run_state(*target);
            });
      }
    }
  }
  report("checkpoint campaign (save_state, one process)", state);

  // save_model exports: load_model into a model of another seed.
  CampaignCount exports;
  std::vector<torch::Tensor> exported;
  {
    auto r = fresh();
    r->acc.load_model(r->model, ea.string());
    exported = test::snapshot(*r->model);
  }
  std::vector<fs::path> export_files;
  for (const auto& e : fs::directory_iterator(ea))
    export_files.push_back(e.path().filename());
  std::sort(export_files.begin(), export_files.end());
  auto weights_before = test::snapshot(*target->model);
  for (const auto& name : export_files) {
    for (int kind = 0; kind < kDamageKinds; ++kind) {
      for (std::size_t i = 0; i < (kind >= 4 && kind != 6 ? 1 : per_kind); ++i) {
        copy_dir(ea, c);
        const fs::path other = fs::exists(eb / name) ? eb / name : eb / export_files.front();
        const std::string what = name.string() + " " + damage(c, c / name, other, kind, rng);
        classify(
            exports, what, c, c / name, [&] { target->acc.load_model(target->model, c.string()); },
            [&] { return same_tensors(test::snapshot(*target->model), weights_before); },
            [&] { return same_tensors(test::snapshot(*target->model), exported); },
            [&] {
              target = fresh();
              weights_before = test::snapshot(*target->model);
            });
      }
    }
  }
  report("export campaign (save_model, 1 KB shards)", exports);

  for (const auto* count : {&state, &exports}) {
    CHECK(count->mutants > 0);
    CHECK(count->silent == 0);
    CHECK(count->partial == 0);
    CHECK(count->unclear == 0);
    CHECK(count->refused + count->harmless == count->mutants);
  }
}

// Issue 49: one path rule for save_state and load_state ("odd/a/../b" is "odd/b" for both, "odd/a" absent),
// and a name too long for the temporary sibling is refused saying so, not blamed on permissions.
TEST_CASE("checkpoint: save_state and load_state read a path by one rule; a too-long name says why") {
  test::TempDir dir;
  const auto odd = (dir.path / "odd" / "a" / ".." / "b").string();
  Run first(MixedPrecision::No, 1);
  REQUIRE(first.train(1, 3));
  first.acc.save_state(odd);
  CHECK(std::filesystem::is_directory(dir.path / "odd" / "b"));
  CHECK_FALSE(std::filesystem::exists(dir.path / "odd" / "a"));
  Run resumed(MixedPrecision::No, 2);
  resumed.acc.load_state(odd);
  CHECK(resumed.acc.micro_steps() == first.acc.micro_steps());

  const std::string name(240, 'c');
  try {
    first.acc.save_state((dir.path / name).string());
    FAIL("no exception");
  } catch (const CheckpointError& e) {
    CHECK_THAT(e.what(),
               Catch::Contains("is 240 bytes") && Catch::Contains("use a name of at most 234 bytes"));
  }
  CHECK_FALSE(std::filesystem::exists(dir.path / name));
}
