// Corpus-driven fuzzing of every parser that reads user or checkpoint files (issue 30, item 3): Accelerate
// YAML configs, DeepSpeed JSON files, safetensors headers and checkpoint manifests. Each seed file is mutated
// many times (byte flips, inserted structure characters and NULs, cut and doubled ranges, huge and negative
// numbers, deep nesting, truncation) by a fixed-seed generator, and every mutant must either parse or be
// refused with an accel:: error whose message is bounded and printable: no crash, no hang, no other
// exception (std::bad_alloc, a JSON library's exception, std::out_of_range), no memory bomb (the process is
// capped at 4 GiB of address space while it runs).
//
// ACCEL_FUZZ_ITERATIONS (mutants per seed; default about 2,400 per parser) and ACCEL_FUZZ_SEED (default 1)
// make longer or other runs.
#include "../../accelerate_cpp/src/checkpoint/manifest.hpp"
#include "build_paths.hpp"
#include "fuzz_support.hpp"

#include "accel/checkpoint/safetensors.hpp"
#include "accel/config/config.hpp"

using namespace accel_fuzz;

TEST_CASE("fuzz: Accelerate YAML configs parse or are refused with a ConfigError") {
  auto seeds = files_in(accel::test::config_template_dir(), ".yaml");
  for (auto& s : files_in(fs::path(accel::test::test_data_dir()) / "config", ".yaml"))
    seeds.push_back(std::move(s));
  REQUIRE(seeds.size() > 20);
  fuzz(
      "yaml", seeds, [](const std::string& text) { accel::Config::load_string(text, "fuzz.yaml"); },
      "fuzz.yaml");
}

TEST_CASE("fuzz: DeepSpeed JSON files parse or are refused with a ConfigError") {
  TempDir dir;
  const auto json = dir.path / "ds.json";
  const std::string yaml =
      "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: " +
      json.string() + "\n";
  const auto seeds = files_in(fs::path(accel::test::test_data_dir()) / "config" / "deepspeed", ".json");
  REQUIRE(!seeds.empty());
  fuzz(
      "deepspeed_json", seeds,
      [&](const std::string& text) {
        write(json, text);
        accel::Config::load_string(yaml, "fuzz.yaml");
      },
      "ds.json");
}

TEST_CASE("fuzz: safetensors files open or are refused with a CheckpointError") {
  TempDir dir;
  const auto file = dir.path / "t.safetensors";
  const float a[6] = {1, 2, 3, 4, 5, 6};
  const std::int64_t b[2] = {7, 8};
  accel::safetensors::TensorView va{"fc1.weight", accel::safetensors::DType::F32, {2, 3}, a, sizeof a};
  accel::safetensors::TensorView vb{"step", accel::safetensors::DType::I64, {2}, b, sizeof b};
  accel::safetensors::write_file(file.string(), {va, vb}, {{"format", "pt"}, {"checkpoint_id", "abc"}});
  const std::string seed = read(file);
  fuzz(
      "safetensors", {seed},
      [&](const std::string& bytes) {
        write(file, bytes);
        const auto f = accel::safetensors::File::open(file.string());
        for (const auto& name : f.names()) {
          const auto& info = f.info(name);
          volatile std::uint8_t sink = 0;
          for (std::size_t k = 0; k < info.nbytes; ++k)
            sink = static_cast<std::uint8_t>(sink + f.data(name)[k]);  // every byte it claims is readable
        }
      },
      "t.safetensors");
}

TEST_CASE("fuzz: checkpoint manifests read or are refused with a CheckpointError") {
  TempDir dir;
  std::ofstream(dir.path / "model.safetensors") << "weights";
  accel::detail::write_manifest(
      dir.path.string(), accel::detail::build_manifest(dir.path.string(), accel::detail::new_checkpoint_id(),
                                                       {{"completed_steps", "3"}}, {}));
  const std::string seed = read(dir.path / "manifest.json");
  fuzz(
      "manifest", {seed},
      [&](const std::string& text) {
        write(dir.path / "manifest.json", text);
        const auto m = accel::detail::read_manifest(dir.path.string());
        for (const auto& e : m.files)
          accel::detail::verify_entry(dir.path.string(), m, e);
      },
      dir.path.string());
}
