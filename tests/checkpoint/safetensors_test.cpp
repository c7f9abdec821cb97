#include "accel/checkpoint/safetensors.hpp"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "accel/errors.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
namespace st = accel::safetensors;

namespace {

using accel::test::TempDir;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file with the given header (length prefix added, no padding) and data buffer.
std::string make_file(const std::string& header, const std::string& buffer) {
  std::string out;
  for (int i = 0; i < 8; ++i)
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + buffer;
}

template <typename T>
st::TensorView view(const std::string& name, st::DType dtype, std::vector<int64_t> shape,
                    const std::vector<T>& values) {
  return st::TensorView{name, dtype, std::move(shape), values.data(), values.size() * sizeof(T)};
}

template <typename T>
std::vector<T> values_of(const st::File& file, const std::string& name) {
  const st::TensorInfo& info = file.info(name);
  std::vector<T> out(info.nbytes / sizeof(T));
  if (info.nbytes > 0) std::memcpy(out.data(), file.data(name), info.nbytes);
  return out;
}

// The message of the CheckpointError thrown by File::open(path), or "" if none.
std::string open_error(const std::string& path) {
  try {
    st::File::open(path);
  } catch (const accel::CheckpointError& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors: dtype names and sizes") {
  using D = st::DType;
  const std::vector<std::tuple<D, std::string, std::size_t>> expected = {
      {D::F64, "F64", 8},        {D::F32, "F32", 4},        {D::F16, "F16", 2},   {D::BF16, "BF16", 2},
      {D::F8E4M3, "F8_E4M3", 1}, {D::F8E5M2, "F8_E5M2", 1}, {D::I64, "I64", 8},   {D::I32, "I32", 4},
      {D::I16, "I16", 2},        {D::I8, "I8", 1},          {D::U64, "U64", 8},   {D::U32, "U32", 4},
      {D::U16, "U16", 2},        {D::U8, "U8", 1},          {D::Bool, "BOOL", 1},
  };
  for (const auto& [dtype, name, size] : expected) {
    CHECK(st::dtype_name(dtype) == name);
    CHECK(st::dtype_size(dtype) == size);
    CHECK(st::parse_dtype(name) == dtype);
  }
  try {
    st::parse_dtype("f32");
    FAIL("no exception");
  } catch (const accel::CheckpointError& error) {
    REQUIRE(std::string(error.what()) ==
            "unknown safetensors dtype \"f32\"; supported dtypes: F64, F32, F16, BF16, F8_E4M3, F8_E5M2, "
            "I64, I32, "
            "I16, I8, U64, U32, U16, U8, BOOL");
  }
}

TEST_CASE("safetensors: round trip of every dtype, a 0-d scalar, an empty tensor and metadata") {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");

  const std::vector<double> f64 = {0.5, -1.25, 1e300};
  const std::vector<float> f32 = {1, 2, 3, 4, 5, 6.5f};
  const std::vector<std::uint16_t> f16 = {0x3C00, 0xC000, 0x3800};
  const std::vector<std::uint16_t> bf16 = {0x3F80, 0xBF80};
  const std::vector<std::uint8_t> f8a = {0x38, 0xB8};
  const std::vector<std::uint8_t> f8b = {0x3C};
  const std::vector<std::int64_t> i64 = {std::int64_t{1} << 40, -7};
  const std::vector<std::int32_t> i32 = {-1, 2, -3, 4};
  const std::vector<std::int16_t> i16 = {-32768, 32767, 5};
  const std::vector<std::int8_t> i8 = {-128, 127};
  const std::vector<std::uint64_t> u64 = {std::uint64_t{1} << 63};
  const std::vector<std::uint32_t> u32 = {4294967295u, 7};
  const std::vector<std::uint16_t> u16 = {65535};
  const std::vector<std::uint8_t> u8 = {0, 1, 254, 255};
  const std::vector<std::uint8_t> boolean = {1, 0, 1};
  const std::vector<float> scalar = {3.25f};
  const std::vector<float> empty;

  using D = st::DType;
  const std::vector<st::TensorView> tensors = {
      view("f64", D::F64, {3}, f64),        view("f32", D::F32, {2, 3}, f32),
      view("f16", D::F16, {3}, f16),        view("bf16", D::BF16, {1, 2}, bf16),
      view("f8_e4m3", D::F8E4M3, {2}, f8a), view("f8_e5m2", D::F8E5M2, {1}, f8b),
      view("i64", D::I64, {2}, i64),        view("i32", D::I32, {2, 2}, i32),
      view("i16", D::I16, {3}, i16),        view("i8", D::I8, {2}, i8),
      view("u64", D::U64, {1}, u64),        view("u32", D::U32, {2}, u32),
      view("u16", D::U16, {1}, u16),        view("u8", D::U8, {2, 1, 2}, u8),
      view("bool", D::Bool, {3}, boolean),  view("scalar", D::F32, {}, scalar),
      view("empty", D::F32, {0, 4}, empty),
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "quote \" and \xc3\xa9"}};
  st::write_file(path, tensors, metadata);

  const st::File file = st::File::open(path);
  CHECK(file.path() == path);
  CHECK(file.metadata() == metadata);
  CHECK(file.names().size() == tensors.size());
  for (const auto& tensor : tensors) {
    INFO(tensor.name);
    REQUIRE(file.contains(tensor.name));
    const st::TensorInfo& info = file.info(tensor.name);
    CHECK(info.dtype == tensor.dtype);
    CHECK(info.shape == tensor.shape);
    CHECK(info.nbytes == tensor.nbytes);
    // Aligned to the element size, so callers may use the data in place.
    CHECK(reinterpret_cast<std::uintptr_t>(file.data(tensor.name)) % st::dtype_size(tensor.dtype) == 0);
    if (tensor.nbytes > 0) CHECK(std::memcmp(file.data(tensor.name), tensor.data, tensor.nbytes) == 0);
  }
  CHECK(values_of<double>(file, "f64") == f64);
  CHECK(values_of<std::int64_t>(file, "i64") == i64);
  CHECK(values_of<float>(file, "scalar") == scalar);
  CHECK(file.info("scalar").shape.empty());
  CHECK(file.info("empty").nbytes == 0);
  CHECK(!file.contains("missing"));

  std::size_t total = 0;
  for (const auto& tensor : tensors)
    total += tensor.nbytes;
  CHECK(file.data_size() == total);
}

TEST_CASE("safetensors: header bytes match the reference implementation") {
  // Bytes written by Python `safetensors.numpy.save_file` 0.8.0 for the same tensors and metadata.
  const unsigned char expected[] = {
      0x90, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, '{',  '"',  '_', '_', 'm', 'e', 't', 'a', 'd', 'a', 't',
      'a',  '_',  '_',  '"',  ':',  '{',  '"',  'f',  'o',  'r',  'm', 'a', 't', '"', ':', '"', 'p', 't', '"',
      '}',  ',',  '"',  'b',  '"',  ':',  '{',  '"',  'd',  't',  'y', 'p', 'e', '"', ':', '"', 'F', '3', '2',
      '"',  ',',  '"',  's',  'h',  'a',  'p',  'e',  '"',  ':',  '[', '2', ']', ',', '"', 'd', 'a', 't', 'a',
      '_',  'o',  'f',  'f',  's',  'e',  't',  's',  '"',  ':',  '[', '0', ',', '8', ']', '}', ',', '"', 'a',
      '"',  ':',  '{',  '"',  'd',  't',  'y',  'p',  'e',  '"',  ':', '"', 'I', '1', '6', '"', ',', '"', 's',
      'h',  'a',  'p',  'e',  '"',  ':',  '[',  '1',  ']',  ',',  '"', 'd', 'a', 't', 'a', '_', 'o', 'f', 'f',
      's',  'e',  't',  's',  '"',  ':',  '[',  '8',  ',',  '1',  '0', ']', '}', '}', ' ', ' ', ' ', ' ', ' ',
      0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40, 0x03, 0x00,
  };
  TempDir dir;
  const std::string path = dir.file("tiny.safetensors");
  const std::vector<float> b = {1.0f, 2.0f};
  const std::vector<std::int16_t> a = {3};
  st::write_file(path, {view("a", st::DType::I16, {1}, a), view("b", st::DType::F32, {2}, b)},
                 {{"format", "pt"}});
  REQUIRE(read_bytes(path) == std::string(reinterpret_cast<const char*>(expected), sizeof expected));
}

TEST_CASE("safetensors: no tensors and no metadata") {
  TempDir dir;
  const std::string path = dir.file("empty.safetensors");
  st::write_file(path, {});
  REQUIRE(read_bytes(path) == make_file("{}      ", ""));
  const st::File file = st::File::open(path);
  CHECK(file.names().empty());
  CHECK(file.metadata().empty());
  CHECK(file.data_size() == 0);
}

TEST_CASE("safetensors: rewriting a mapped file leaves the mapping's contents whole") {
  // load_model maps an export and copies from the mapping; another process replacing the file meanwhile (the
  // main process writing a new one) must not change or truncate what the mapping reads.
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<float> old_values = {1, 2, 3, 4, 5, 6}, new_values = {9};
  st::write_file(path, {view("w", st::DType::F32, {2, 3}, old_values)});
  const st::File mapped = st::File::map(path);
  st::write_file(path, {view("v", st::DType::F32, {1}, new_values)});
  REQUIRE(mapped.names() == std::vector<std::string>{"w"});
  std::vector<float> seen(6);
  std::memcpy(seen.data(), mapped.data("w"), sizeof(float) * seen.size());
  CHECK(seen == old_values);
  CHECK(st::File::open(path).names() == std::vector<std::string>{"v"});
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path), {}) == 1);  // no temporary left
}

TEST_CASE("safetensors: the writer rejects invalid tensors") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "cannot write safetensors file '" + path + "': ";
  const std::vector<float> five = {1, 2, 3, 4, 5};
  auto error_of = [&](const std::vector<st::TensorView>& tensors) -> std::string {
    try {
      st::write_file(path, tensors);
    } catch (const accel::CheckpointError& error) {
      return error.what();
    }
    return "";
  };
  CHECK(error_of({view("w", st::DType::F32, {2, 3}, five)}) ==
        prefix +
            "tensor 'w' has 20 bytes but dtype F32 and shape [2, 3] need 24 bytes; pass a contiguous tensor "
            "and its exact byte size");
  CHECK(error_of({view("w", st::DType::F32, {5}, five), view("w", st::DType::F32, {5}, five)}) ==
        prefix + "tensor 'w' is given twice; tensor names must be unique");
  CHECK(error_of({view("__metadata__", st::DType::F32, {5}, five)}) ==
        prefix + "\"__metadata__\" is reserved for the metadata and cannot be a tensor name; rename it");
  CHECK(error_of({view("", st::DType::F32, {5}, five)}) ==
        prefix + "a tensor has an empty name; give every tensor a name");
  CHECK(error_of({view("w", st::DType::F32, {-1, 5}, five)}) ==
        prefix +
            "tensor 'w' has invalid shape [-1, 5]; dimensions must be non-negative and the size must fit in "
            "memory");
  CHECK(error_of({view("bad\xff", st::DType::F32, {5}, five)}) ==
        prefix + "tensor name 'bad\xff' is not valid UTF-8; safetensors headers are UTF-8 JSON");

  const std::string missing_dir = dir.file("no/such/dir/x.safetensors");
  try {
    st::write_file(missing_dir, {});
    FAIL("no exception");
  } catch (const accel::CheckpointError& error) {
    REQUIRE(std::string(error.what()) ==
            "cannot write safetensors file '" + missing_dir +
                "': No such file or directory; check that the directory exists and "
                "is writable");
  }
}

TEST_CASE("safetensors: malformed files give a CheckpointError naming the problem") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "safetensors file '" + path + "': ";
  const std::string f32x2 = R"("dtype":"F32","shape":[2])";
  const std::string eight(8, '\0');

  SECTION("missing file") {
    REQUIRE(open_error(path) == "cannot open safetensors file '" + path +
                                    "': no such file; check the path (a checkpoint directory holds "
                                    "model.safetensors)");
  }
  SECTION("directory instead of a file") {
    REQUIRE(open_error(dir.file("")) ==
            "cannot open safetensors file '" + dir.file("") + "': not a regular file");
  }
  SECTION("shorter than the length prefix") {
    write_bytes(path, "abc");
    REQUIRE(open_error(path) ==
            prefix +
                "only 3 bytes, too small for the 8-byte header length; the file is truncated "
                "or not a safetensors file");
  }
  SECTION("header length beyond the end of the file") {
    write_bytes(path, make_file("{}", "").substr(0, 9));
    REQUIRE(open_error(path) == prefix +
                                    "the header length is 2 bytes but only 1 bytes follow it; the file is "
                                    "truncated or not a safetensors file");
  }
  SECTION("huge header length") {
    std::string bytes = make_file("", "");
    bytes[4] = 1;  // 2^32
    bytes += std::string(16, ' ');
    write_bytes(path, bytes);
    REQUIRE(open_error(path) ==
            prefix +
                "the header length is 4294967296 bytes but only 16 bytes follow it; the file "
                "is truncated or not a safetensors file");
  }
  SECTION("header length over the limit") {
    write_bytes(path, make_file(std::string(200, ' '), ""));
    fs::resize_file(path, 100'000'016);  // sparse: cheap
    std::fstream patch(path, std::ios::binary | std::ios::in | std::ios::out);
    const std::uint64_t length = 100'000'001;
    for (int i = 0; i < 8; ++i)
      patch.put(static_cast<char>((length >> (8 * i)) & 0xff));
    patch.close();
    REQUIRE(open_error(path) ==
            prefix +
                "the header length is 100000001 bytes, more than the limit of 100000000 bytes; "
                "the file is corrupt or not a safetensors file");
  }
  SECTION("invalid JSON") {
    write_bytes(path, make_file(R"({"a": {)", ""));
    REQUIRE(open_error(path) ==
            prefix +
                "the header is not valid JSON (error at byte 8 of 7); the file is corrupt or "
                "not a safetensors file");
  }
  SECTION("invalid UTF-8 in the header") {
    write_bytes(path, make_file("{\"\xff\":1}", ""));
    REQUIRE(open_error(path) ==
            prefix +
                "the header is not valid JSON (error at byte 3 of 7); the file is corrupt or "
                "not a safetensors file");
  }
  SECTION("header is not an object") {
    write_bytes(path, make_file("[1, 2]", ""));
    REQUIRE(open_error(path) == prefix +
                                    "the header is array but must be a JSON object mapping tensor names to "
                                    "{dtype, shape, data_offsets}");
  }
  SECTION("duplicate tensor name") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[0,8]},"a":{)" + f32x2 +
                                    R"(,"data_offsets":[8,16]}})",
                                eight + eight));
    REQUIRE(open_error(path) ==
            prefix + "tensor 'a' appears twice in the header; names must be unique, re-save the checkpoint");
  }
  SECTION("duplicate field in an entry") {
    write_bytes(path, make_file(R"({"a":{"dtype":"F32",)" + f32x2 + R"(,"data_offsets":[0,8]}})", eight));
    REQUIRE(open_error(path) ==
            prefix +
                "key \"dtype\" appears twice in the entry of 'a'; names must be unique, re-save "
                "the checkpoint");
  }
  SECTION("missing field") {
    write_bytes(path, make_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", eight));
    REQUIRE(open_error(path) ==
            prefix +
                "tensor 'a' has no \"shape\" field; every tensor needs \"dtype\", \"shape\" and "
                "\"data_offsets\"");
  }
  SECTION("entry is not an object") {
    write_bytes(path, make_file(R"({"a":[0,8]})", eight));
    REQUIRE(open_error(path) ==
            prefix +
                "tensor 'a' is array but must be an object with \"dtype\", \"shape\" and \"data_offsets\"");
  }
  SECTION("unknown dtype") {
    write_bytes(path,
                make_file(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", std::string(1, '\0')));
    REQUIRE(open_error(path) ==
            prefix +
                "tensor 'a' has unsupported dtype \"F4\"; supported dtypes: F64, F32, F16, "
                "BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL");
  }
  SECTION("negative dimension") {
    write_bytes(path, make_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight));
    REQUIRE(open_error(path) ==
            prefix + "tensor 'a' has shape [-2]; \"shape\" must be an array of non-negative integers");
  }
  SECTION("bad data_offsets") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[0]}})", eight));
    REQUIRE(open_error(path) ==
            prefix +
                "tensor 'a' has data_offsets [0]; \"data_offsets\" must be two non-negative "
                "integers [begin, end]");
  }
  SECTION("end before begin") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[8,0]}})", eight));
    REQUIRE(open_error(path) ==
            prefix + "tensor 'a' has data_offsets [8, 0] with end before begin; the file is corrupt");
  }
  SECTION("offsets beyond the buffer (truncated file)") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[0,8]}})", "1234"));
    REQUIRE(open_error(path) ==
            prefix +
                "tensor 'a' has data_offsets [0, 8] beyond the end of the 4-byte data buffer; "
                "the file is truncated");
  }
  SECTION("size does not match dtype and shape") {
    write_bytes(path, make_file(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,8]}})", eight));
    REQUIRE(open_error(path) ==
            prefix +
                "tensor 'a' has data_offsets [0, 8] (8 bytes) but dtype F32 and shape [2, 3] "
                "need 24 bytes; the file is corrupt");
  }
  SECTION("overlapping tensors") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[0,8]},"b":{)" + f32x2 +
                                    R"(,"data_offsets":[4,12]}})",
                                eight + "1234"));
    REQUIRE(open_error(path) == prefix + "tensors 'a' [0, 8] and 'b' [4, 12] overlap; the file is corrupt");
  }
  SECTION("gap between tensors") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[4,12]}})", eight + "1234"));
    REQUIRE(open_error(path) == prefix +
                                    "the 4 bytes before tensor 'a' [4, 12] belong to no tensor; safetensors "
                                    "requires tensors packed without gaps");
  }
  SECTION("trailing bytes after the last tensor") {
    write_bytes(path, make_file(R"({"a":{)" + f32x2 + R"(,"data_offsets":[0,8]}})", eight + "12"));
    REQUIRE(open_error(path) ==
            prefix +
                "the data buffer has 10 bytes but the tensors end at byte 8; the last 2 bytes "
                "belong to no tensor");
  }
  SECTION("metadata value that is not a string") {
    write_bytes(path, make_file(R"({"__metadata__":{"epoch":3}})", ""));
    REQUIRE(open_error(path) ==
            prefix +
                "\"__metadata__\" must map strings to strings, but key \"epoch\" has a number "
                "value");
  }
  SECTION("metadata that is not an object") {
    write_bytes(path, make_file(R"({"__metadata__":"x"})", ""));
    REQUIRE(open_error(path) ==
            prefix + "\"__metadata__\" is string but must be an object mapping strings to strings");
  }
}

TEST_CASE("safetensors: a missing tensor name suggests close names") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<float> one = {1};
  st::write_file(
      path, {view("layer.0.weight", st::DType::F32, {1}, one), view("layer.0.bias", st::DType::F32, {1}, one),
             view("layer.1.weight", st::DType::F32, {1}, one), view("head", st::DType::F32, {1}, one)});
  const st::File file = st::File::open(path);
  try {
    file.info("layer.0.weigth");
    FAIL("no exception");
  } catch (const accel::CheckpointError& error) {
    REQUIRE(std::string(error.what()) ==
            "safetensors file '" + path +
                "' has no tensor named 'layer.0.weigth' (it has 4 tensors); did you "
                "mean 'layer.0.weight', 'layer.1.weight'?");
  }
  try {
    file.data("zzz");
    FAIL("no exception");
  } catch (const accel::CheckpointError& error) {
    REQUIRE(std::string(error.what()) ==
            "safetensors file '" + path + "' has no tensor named 'zzz' (it has 4 tensors)");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Cross-checks with the Python reference implementation (hidden: run by CTest with the paths in the
// environment).

TEST_CASE("safetensors: write the file read by tests/python/read_safetensors.py", "[.crosscheck]") {
  const char* out = std::getenv("ACCEL_SAFETENSORS_CROSSCHECK_OUT");
  REQUIRE(out != nullptr);
  const std::vector<double> f64 = {0.5, -1.25, 1e10};
  const std::vector<float> f32 = {1, 2, 3, 4, 5, 6.5f};
  const std::vector<std::uint16_t> f16 = {0x3C00, 0xC000, 0x3800, 0x7BFF};  // 1, -2, 0.5, 65504
  const std::vector<std::int64_t> i64 = {std::int64_t{1} << 40, -7};
  const std::vector<std::int32_t> i32 = {-1, 2, -3, 4};
  const std::vector<std::int16_t> i16 = {-32768, 32767, 5};
  const std::vector<std::int8_t> i8 = {-128, 127};
  const std::vector<std::uint64_t> u64 = {std::uint64_t{1} << 63, 1};
  const std::vector<std::uint32_t> u32 = {4294967295u};
  const std::vector<std::uint16_t> u16 = {65535, 1};
  const std::vector<std::uint8_t> u8 = {0, 1, 254, 255};
  const std::vector<std::uint8_t> boolean = {1, 0, 1};
  const std::vector<float> scalar = {3.25f};
  const std::vector<float> empty;
  using D = st::DType;
  st::write_file(
      out,
      {view("f64", D::F64, {3}, f64), view("f32", D::F32, {2, 3}, f32), view("f16", D::F16, {4}, f16),
       view("i64", D::I64, {2}, i64), view("i32", D::I32, {2, 2}, i32), view("i16", D::I16, {3}, i16),
       view("i8", D::I8, {2}, i8), view("u64", D::U64, {2}, u64), view("u32", D::U32, {1}, u32),
       view("u16", D::U16, {2}, u16), view("u8", D::U8, {2, 1, 2}, u8), view("bool", D::Bool, {3}, boolean),
       view("scalar", D::F32, {}, scalar), view("empty", D::F32, {0, 4}, empty)},
      {{"format", "pt"}, {"note", "written by accelerate-cpp"}});
}

TEST_CASE("safetensors: read the file written by tests/python/write_safetensors.py", "[.crosscheck]") {
  const char* in = std::getenv("ACCEL_SAFETENSORS_CROSSCHECK_IN");
  REQUIRE(in != nullptr);
  const st::File file = st::File::open(in);
  CHECK(file.metadata() ==
        std::map<std::string, std::string>{{"format", "np"}, {"source", "write_safetensors.py"}});
  CHECK(file.names() ==
        std::vector<std::string>{"bias", "bytes", "d", "i8", "ids", "mask", "step", "u16", "weight"});

  CHECK(file.info("weight").dtype == st::DType::F32);
  CHECK(file.info("weight").shape == std::vector<int64_t>{2, 3});
  CHECK(values_of<float>(file, "weight") == std::vector<float>{0, 0.5f, 1, 1.5f, 2, 2.5f});
  CHECK(file.info("bias").dtype == st::DType::F16);
  CHECK(values_of<std::uint16_t>(file, "bias") == std::vector<std::uint16_t>{0x3C00, 0xBC00, 0x3800});
  CHECK(file.info("step").dtype == st::DType::I64);
  CHECK(file.info("step").shape.empty());
  CHECK(values_of<std::int64_t>(file, "step") == std::vector<std::int64_t>{42});
  CHECK(file.info("mask").dtype == st::DType::Bool);
  CHECK(values_of<std::uint8_t>(file, "mask") == std::vector<std::uint8_t>{1, 0, 0, 1});
  CHECK(file.info("ids").dtype == st::DType::I32);
  CHECK(file.info("ids").shape == std::vector<int64_t>{0});
  CHECK(file.info("ids").nbytes == 0);
  CHECK(file.info("bytes").dtype == st::DType::U8);
  CHECK(file.info("bytes").shape == std::vector<int64_t>{2, 2});
  CHECK(values_of<std::uint8_t>(file, "bytes") == std::vector<std::uint8_t>{1, 2, 3, 250});
  CHECK(file.info("i8").dtype == st::DType::I8);
  CHECK(values_of<std::int8_t>(file, "i8") == std::vector<std::int8_t>{-5, 7});
  CHECK(file.info("d").dtype == st::DType::F64);
  CHECK(values_of<double>(file, "d") == std::vector<double>{1e-3, 2.0});
  CHECK(file.info("u16").dtype == st::DType::U16);
  CHECK(values_of<std::uint16_t>(file, "u16") == std::vector<std::uint16_t>{65535});
}
