// Fuzzing of what load_model reads besides safetensors files (issue 30, item 3): a sharded export's
// model.safetensors.index.json (as transformers writes it: no manifest) and save_model's export manifest.
// Every mutant must load or be refused with an accel:: error (see fuzz_support.hpp): no crash, no hang, no
// read outside the export directory, no other exception.
#include "../../accelerate_cpp/src/checkpoint/model_export.hpp"
#include "fuzz_support.hpp"

#include <torch/types.h>

using namespace accel_fuzz;

namespace {

// A three-shard export of four small tensors in `dir`.
void write_export(const fs::path& dir) {
  accel::detail::ShardedExportWriter writer(dir, 64);
  writer.add("fc1.weight", torch::arange(12, torch::kFloat32));
  writer.add("fc1.bias", torch::arange(3, torch::kFloat32));
  writer.add("fc2.weight", torch::arange(6, torch::kFloat32));
  writer.add("fc2.bias", torch::ones({2}, torch::kInt64));
  writer.finish();
}

}  // namespace

TEST_CASE("fuzz: export indexes (model.safetensors.index.json) load or are refused with a CheckpointError") {
  TempDir dir;
  write_export(dir.path);
  fs::remove(dir.path / "model.safetensors.manifest.json");  // as transformers' exports: the index decides
  const auto index = dir.path / "model.safetensors.index.json";
  const std::string seed = read(index);
  const auto outcome = fuzz(
      "export_index", {seed},
      [&](const std::string& text) {
        write(index, text);
        const auto state = accel::detail::read_model_export(dir.path);
        for (const auto& [name, t] : state)
          REQUIRE(t.numel() <= 12);  // only tensors of this export's shards
      },
      dir.path.string());
  CHECK(outcome.parsed > 0);  // some mutants (whitespace, key order) still name the same shards
}

TEST_CASE("fuzz: export manifests are verified or refused with a CheckpointError") {
  TempDir dir;
  write_export(dir.path);
  const auto manifest = dir.path / "model.safetensors.manifest.json";
  const std::string seed = read(manifest);
  fuzz(
      "export_manifest", {seed},
      [&](const std::string& text) {
        write(manifest, text);
        accel::detail::read_model_export(dir.path);
      },
      dir.path.string());
}
