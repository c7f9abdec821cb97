#include "../../accelerate_cpp/src/checkpoint/manifest.hpp"

#include "../../accelerate_cpp/src/checkpoint/safetensors_write.hpp"
#include "accel/errors.hpp"
#include "temp_dir.hpp"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace fs = std::filesystem;
using namespace accel::detail;

namespace {

using accel::test::TempDir;

std::string xxh64_of(const std::string& bytes) {
  Xxh64 h;
  h.update(bytes.data(), bytes.size());
  return hex(h.digest());
}

void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

}  // namespace

TEST_CASE("xxh64: the reference implementation's values, in one piece or streamed") {
  // Values from the xxhash package (Python bindings of the reference implementation), seed 0.
  std::string digits, bytes;
  for (int i = 0; i < 10; ++i)
    digits += "0123456789";
  for (int k = 0; k < 5; ++k) {
    for (int i = 0; i < 256; ++i)
      bytes += static_cast<char>(i);
  }
  CHECK(xxh64_of("") == "ef46db3751d8e999");
  CHECK(xxh64_of("abc") == "44bc2cf5ad770999");
  CHECK(xxh64_of(std::string(31, 'a')) == "fe47067cda802916");
  CHECK(xxh64_of(std::string(32, 'a')) == "856e843298f99ad7");
  CHECK(xxh64_of(digits) == "f80e7b96315afffa");
  CHECK(xxh64_of(bytes) == "afc184ad7938a354");
  for (std::size_t piece : {1, 3, 7, 31, 32, 33, 500}) {
    Xxh64 h;
    for (std::size_t i = 0; i < bytes.size(); i += piece)
      h.update(bytes.data() + i, std::min(piece, bytes.size() - i));
    CHECK(hex(h.digest()) == "afc184ad7938a354");
    CHECK(h.size() == bytes.size());
  }
}

TEST_CASE("manifest: the writer's digest is the file's, and a round trip keeps every entry") {
  TempDir dir;
  const float data[3] = {1.f, 2.f, 3.f};
  accel::safetensors::TensorView v;
  v.name = "w";
  v.shape = {3};
  v.data = data;
  v.nbytes = sizeof data;
  const auto path = (dir.path / "model.safetensors").string();
  const FileDigest written = write_safetensors(path, {v}, {{"format", "pt"}});
  const FileDigest read = digest_file(path);
  CHECK(written.bytes == fs::file_size(path));
  CHECK(written.bytes == read.bytes);
  CHECK(written.xxh64 == read.xxh64);

  write(dir.path / "layers" / "layer_0.safetensors", "hook file");  // not known: hashed by build_manifest
  const auto m = build_manifest(dir.path.string(), new_checkpoint_id(), {{"world_size", "2"}},
                                {{"model.safetensors", written}});
  write_manifest(dir.path.string(), m);
  const auto back = read_manifest(dir.path.string());
  CHECK(back.checkpoint_id == m.checkpoint_id);
  CHECK(back.checkpoint_id.size() == 32);
  CHECK(back.facts.at("world_size") == "2");
  REQUIRE(back.files.size() == 2);
  CHECK(back.files[0].name == "layers/layer_0.safetensors");
  CHECK(back.files[0].digest.xxh64 == digest_file((dir.path / "layers/layer_0.safetensors").string()).xxh64);
  CHECK(back.files[1].name == "model.safetensors");
  for (const auto& e : back.files)
    CHECK(verify_entry(dir.path.string(), back, e).empty());
}

TEST_CASE("manifest: a changed, truncated or missing file is named, and a bad manifest is refused") {
  TempDir dir;
  write(dir.path / "a.bin", std::string(100, 'x'));
  write(dir.path / "b.bin", std::string(40, 'y'));
  write_manifest(dir.path.string(), build_manifest(dir.path.string(), "00112233445566778899aabbccddeeff",
                                                   {{"completed_steps", "7"}}, {}));
  const auto m = read_manifest(dir.path.string());
  write(dir.path / "a.bin", std::string(99, 'x') + "z");  // same size, one byte changed
  CHECK_THAT(
      verify_entry(dir.path.string(), m, m.files[0]),
      Catch::Contains("a.bin does not hold what checkpoint 001122334455 (saved after 7 optimizer steps) "
                      "wrote (XXH64 "));
  write(dir.path / "b.bin", std::string(39, 'y'));
  CHECK_THAT(verify_entry(dir.path.string(), m, m.files[1]),
             Catch::Contains("b.bin has 39 bytes but checkpoint 001122334455 (saved after 7 optimizer steps) "
                             "wrote 40"));
  fs::remove(dir.path / "b.bin");
  CHECK_THAT(verify_entry(dir.path.string(), m, m.files[1]),
             Catch::Contains("b.bin is missing; checkpoint 001122334455"));

  CHECK(inside_directory("layers/layer_3.safetensors"));
  for (const char* bad : {"/etc/passwd", "../x", "a/../../x", "a//b", "./a", ""})
    CHECK_FALSE(inside_directory(bad));
  write(
      dir.path / "manifest.json",
      R"({"checkpoint_id":"ab","facts":{},"files":[{"name":"../../etc/passwd","bytes":1,"xxh64":"0000000000000000"}]})");
  CHECK_THROWS_WITH(read_manifest(dir.path.string()),
                    Catch::Contains("lists '../../etc/passwd', which is not a file inside the checkpoint"));
  write(dir.path / "manifest.json", std::string(200000, '['));
  CHECK_THROWS_WITH(read_manifest(dir.path.string()), Catch::Contains("nested deeper than a manifest is"));
  write(dir.path / "manifest.json", "{\"checkpoint_id\": 3}");
  CHECK_THROWS_AS(read_manifest(dir.path.string()), accel::CheckpointError);
}
