#include "accel/checkpoint/safetensors.hpp"

#include "checkpoint/safetensors_write.hpp"
#include "config/message_text.hpp"
#include "config/text_distance.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "accel/errors.hpp"

namespace accel::safetensors {
namespace {

using Json = nlohmann::json;

// The reference implementation refuses larger headers; so do we, before allocating anything.
constexpr std::uint64_t kMaxHeaderSize = 100'000'000;

struct DTypeEntry {
  DType dtype;
  const char* name;
  std::size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::F64, "F64", 8},   {DType::F32, "F32", 4},        {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::F8E4M3, "F8_E4M3", 1}, {DType::F8E5M2, "F8_E5M2", 1},
    {DType::I64, "I64", 8},   {DType::I32, "I32", 4},        {DType::I16, "I16", 2},
    {DType::I8, "I8", 1},     {DType::U64, "U64", 8},        {DType::U32, "U32", 4},
    {DType::U16, "U16", 2},   {DType::U8, "U8", 1},          {DType::Bool, "BOOL", 1},
};

const DTypeEntry& entry_of(DType dtype) {
  for (const auto& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  throw CheckpointError("safetensors: invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

std::optional<DType> try_parse_dtype(const std::string& name) {
  for (const auto& entry : kDTypes) {
    if (name == entry.name) return entry.dtype;
  }
  return std::nullopt;
}

std::string supported_dtypes() {
  std::string out;
  for (const auto& entry : kDTypes) {
    if (!out.empty()) out += ", ";
    out += entry.name;
  }
  return out;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string offsets_string(std::size_t begin, std::size_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// product(shape) * element_size, or nullopt on a negative dimension or overflow.
std::optional<std::size_t> byte_size(const std::vector<int64_t>& shape, std::size_t element_size) {
  std::size_t total = element_size;
  for (const int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    const auto d = static_cast<std::uint64_t>(dim);
    if (d != 0 && total > std::numeric_limits<std::size_t>::max() / d) return std::nullopt;
    total *= static_cast<std::size_t>(d);
  }
  return total;
}

// A JSON string literal (quoted, escaped). Throws CheckpointError when `text` is not valid UTF-8.
std::string json_string(const std::string& text, const std::string& what, const std::string& path) {
  try {
    return Json(text).dump();
  } catch (const Json::exception&) {
    throw CheckpointError("cannot write safetensors file '" + path + "': " + what +
                          " is not valid UTF-8; safetensors headers are UTF-8 JSON");
  }
}

std::string errno_text() {
  return std::strerror(errno);
}

class FileCloser {
 public:
  explicit FileCloser(std::FILE* file) : file_(file) {}
  ~FileCloser() {
    if (file_ != nullptr) std::fclose(file_);
  }
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;
  // Closes now and reports failure (a failed close can mean lost data).
  bool close() {
    std::FILE* file = std::exchange(file_, nullptr);
    return std::fclose(file) == 0;
  }

 private:
  std::FILE* file_;
};

// ---------------------------------------------------------------------------------------------------------------
// Reading helpers

// Checks that `path` names a regular file and opens it for reading.
std::FILE* open_for_reading(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    throw CheckpointError("cannot open safetensors file '" + path +
                          "': no such file; check the path (a checkpoint directory holds model.safetensors)");
  }
  if (!std::filesystem::is_regular_file(status)) {
    throw CheckpointError("cannot open safetensors file '" + path + "': not a regular file");
  }
  std::FILE* raw = std::fopen(path.c_str(), "rb");
  if (raw == nullptr) {
    throw CheckpointError("cannot open safetensors file '" + path + "': " + errno_text() +
                          "; check the file permissions");
  }
  return raw;
}

void read_exact(std::FILE* raw, const std::string& path, void* out, std::size_t size) {
  if (size > 0 && std::fread(out, 1, size, raw) != size) {
    throw CheckpointError("cannot read safetensors file '" + path +
                          "': " + (std::ferror(raw) ? errno_text() : std::string("unexpected end of file")) +
                          "; was the file modified while being read?");
  }
}

// Reads the 8-byte little-endian header length and the header, checking the length against the file size
// and kMaxHeaderSize before allocating.
std::string read_header(std::FILE* raw, const std::string& path, const std::string& prefix,
                        std::uintmax_t file_size) {
  if (file_size < 8) {
    throw CheckpointError(prefix + "only " + std::to_string(file_size) +
                          " bytes, too small for the 8-byte header length; the file is truncated or not a "
                          "safetensors file");
  }
  std::uint8_t length[8];
  read_exact(raw, path, length, sizeof length);
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i)
    header_size = (header_size << 8) | length[i];
  if (header_size > file_size - 8) {
    throw CheckpointError(prefix + "the header length is " + std::to_string(header_size) +
                          " bytes but only " + std::to_string(file_size - 8) +
                          " bytes follow it; the file is truncated or not a safetensors file");
  }
  if (header_size > kMaxHeaderSize) {
    throw CheckpointError(prefix + "the header length is " + std::to_string(header_size) +
                          " bytes, more than the limit of " + std::to_string(kMaxHeaderSize) +
                          " bytes; the file is corrupt or not a safetensors file");
  }
  std::string header(static_cast<std::size_t>(header_size), '\0');
  read_exact(raw, path, header.data(), header.size());
  return header;
}

// Parses the header into a JSON object, rejecting duplicate keys.
Json parse_header(const std::string& header, const std::string& prefix) {
  const auto header_size = static_cast<std::uint64_t>(header.size());
  // Parse, recording duplicate keys (nlohmann silently keeps the last one; the format forbids duplicates).
  std::vector<std::set<std::string>> open_objects;
  std::string top_level_key;
  std::string duplicate_message;
  auto on_event = [&](int depth, Json::parse_event_t event, Json& value) {
    // A header is three levels deep (tensor, entry, shape list); a hostile one nested 100,000 deep must not
    // exhaust the stack.
    if (depth > 16) {
      throw CheckpointError(
          prefix + "the header is nested " + std::to_string(depth) +
          " levels deep, a safetensors header is 3; the file is corrupt or not a safetensors file");
    }
    if (event == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == Json::parse_event_t::key && !open_objects.empty()) {
      const std::string key = value.get<std::string>();
      const bool top_level = open_objects.size() == 1;
      if (!open_objects.back().insert(key).second && duplicate_message.empty()) {
        duplicate_message = top_level
                                ? "tensor '" + key + "' appears twice in the header"
                                : "key \"" + key + "\" appears twice in the entry of '" + top_level_key + "'";
      }
      if (top_level) top_level_key = key;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(header, on_event);
  } catch (const Json::exception& error) {
    // A syntax error has a position; a number too large for a double (1e400) does not.
    const auto* syntax = dynamic_cast<const Json::parse_error*>(&error);
    throw CheckpointError(prefix + "the header is not valid JSON (" +
                          (syntax != nullptr ? "error at byte " + std::to_string(syntax->byte) + " of " +
                                                   std::to_string(header_size)
                                             : std::string(error.what())) +
                          "); the file is corrupt or not a safetensors file");
  }
  if (!root.is_object()) {
    throw CheckpointError(prefix + "the header is " + root.type_name() +
                          " but must be a JSON object mapping tensor names to {dtype, shape, data_offsets}");
  }
  if (!duplicate_message.empty()) {
    throw CheckpointError(prefix + duplicate_message + "; names must be unique, re-save the checkpoint");
  }
  return root;
}

// The "__metadata__" entry: an object mapping strings to strings.
std::map<std::string, std::string> parse_metadata(const Json& entry, const std::string& prefix) {
  if (!entry.is_object()) {
    throw CheckpointError(prefix + "\"__metadata__\" is " + entry.type_name() +
                          " but must be an object mapping strings to strings");
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : entry.items()) {
    if (!value.is_string()) {
      throw CheckpointError(prefix + "\"__metadata__\" must map strings to strings, but key \"" + key +
                            "\" has a " + value.type_name() + " value");
    }
    metadata.emplace(key, value.get<std::string>());
  }
  return metadata;
}

// A tensor entry's "dtype" field.
DType parse_dtype_field(const Json& dtype, const std::string& where) {
  std::optional<DType> parsed = dtype.is_string() ? try_parse_dtype(dtype.get<std::string>()) : std::nullopt;
  if (!parsed) {
    throw CheckpointError(where + " has unsupported dtype " + dtype.dump() +
                          "; supported dtypes: " + supported_dtypes());
  }
  return *parsed;
}

// A tensor entry's "shape" field: an array of non-negative integers that fit in int64_t.
std::vector<int64_t> parse_shape_field(const Json& shape, const std::string& where) {
  std::vector<int64_t> dims;
  bool shape_ok = shape.is_array();
  if (shape_ok) {
    for (const Json& dim : shape) {
      if (!dim.is_number_unsigned() || dim.get<std::uint64_t>() > std::numeric_limits<int64_t>::max()) {
        shape_ok = false;
        break;
      }
      dims.push_back(static_cast<int64_t>(dim.get<std::uint64_t>()));
    }
  }
  if (!shape_ok) {
    throw CheckpointError(where + " has shape " + shape.dump() +
                          "; \"shape\" must be an array of non-negative integers");
  }
  return dims;
}

// A tensor entry: its dtype, shape and data_offsets, which must lie in the data buffer and match the size
// that dtype and shape need.
TensorInfo parse_tensor_entry(const Json& entry, const std::string& where, std::size_t buffer_size) {
  if (!entry.is_object()) {
    throw CheckpointError(where + " is " + entry.type_name() +
                          " but must be an object with \"dtype\", \"shape\" and \"data_offsets\"");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      throw CheckpointError(where + " has no \"" + field +
                            "\" field; every tensor needs \"dtype\", \"shape\" and \"data_offsets\"");
    }
  }
  TensorInfo info;
  info.dtype = parse_dtype_field(entry["dtype"], where);
  info.shape = parse_shape_field(entry["shape"], where);
  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    throw CheckpointError(where + " has data_offsets " + offsets.dump() +
                          "; \"data_offsets\" must be two non-negative integers [begin, end]");
  }
  const auto begin = offsets[0].get<std::uint64_t>();
  const auto end = offsets[1].get<std::uint64_t>();
  if (end < begin) {
    throw CheckpointError(where + " has data_offsets " + offsets_string(begin, end) +
                          " with end before begin; the file is corrupt");
  }
  if (end > buffer_size) {
    throw CheckpointError(where + " has data_offsets " + offsets_string(begin, end) +
                          " beyond the end of the " + std::to_string(buffer_size) +
                          "-byte data buffer; the file is truncated");
  }
  const auto expected = byte_size(info.shape, dtype_size(info.dtype));
  if (!expected || *expected != end - begin) {
    throw CheckpointError(
        where + " has data_offsets " + offsets_string(begin, end) + " (" + std::to_string(end - begin) +
        " bytes) but dtype " + dtype_name(info.dtype) + " and shape " + shape_string(info.shape) + " need " +
        (expected ? std::to_string(*expected) : std::string("more")) + " bytes; the file is corrupt");
  }
  info.offset = static_cast<std::size_t>(begin);
  info.nbytes = static_cast<std::size_t>(end - begin);
  return info;
}

struct Span {
  std::size_t begin;
  std::size_t end;
  const std::string* name;
};

// Tensors must tile the buffer exactly, as the reference implementation requires.
void check_tiling(std::vector<Span> spans, std::size_t buffer_size, const std::string& prefix) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::size_t position = 0;
  const Span* previous = nullptr;
  for (const Span& span : spans) {
    if (span.begin < position) {
      throw CheckpointError(prefix + "tensors '" + *previous->name + "' " +
                            offsets_string(previous->begin, previous->end) + " and '" + *span.name + "' " +
                            offsets_string(span.begin, span.end) + " overlap; the file is corrupt");
    }
    if (span.begin > position) {
      throw CheckpointError(prefix + "the " + std::to_string(span.begin - position) +
                            " bytes before tensor '" + *span.name + "' " +
                            offsets_string(span.begin, span.end) +
                            " belong to no tensor; safetensors requires tensors packed without gaps");
    }
    position = span.end;
    previous = &span;
  }
  if (position != buffer_size) {
    throw CheckpointError(prefix + "the data buffer has " + std::to_string(buffer_size) +
                          " bytes but the tensors end at byte " + std::to_string(position) + "; the last " +
                          std::to_string(buffer_size - position) + " bytes belong to no tensor");
  }
}

}  // namespace

std::size_t dtype_size(DType dtype) {
  return entry_of(dtype).size;
}

std::string dtype_name(DType dtype) {
  return entry_of(dtype).name;
}

DType parse_dtype(const std::string& name) {
  if (auto dtype = try_parse_dtype(name)) return *dtype;
  throw CheckpointError("unknown safetensors dtype \"" + name +
                        "\"; supported dtypes: " + supported_dtypes());
}

// ---------------------------------------------------------------------------------------------------------------
// Writing

namespace {

// Names unique and not reserved, shapes valid, byte counts and data pointers matching; in the order given.
void check_tensors_to_write(const std::vector<TensorView>& tensors, const std::string& prefix) {
  std::set<std::string> seen;
  for (const auto& tensor : tensors) {
    if (tensor.name.empty())
      throw CheckpointError(prefix + "a tensor has an empty name; give every tensor a name");
    if (tensor.name == "__metadata__") {
      throw CheckpointError(
          prefix + "\"__metadata__\" is reserved for the metadata and cannot be a tensor name; rename it");
    }
    if (!seen.insert(tensor.name).second) {
      throw CheckpointError(prefix + "tensor '" + tensor.name +
                            "' is given twice; tensor names must be unique");
    }
    const auto expected = byte_size(tensor.shape, dtype_size(tensor.dtype));
    if (!expected) {
      throw CheckpointError(prefix + "tensor '" + tensor.name + "' has invalid shape " +
                            shape_string(tensor.shape) +
                            "; dimensions must be non-negative and the size must fit in memory");
    }
    if (*expected != tensor.nbytes) {
      throw CheckpointError(prefix + "tensor '" + tensor.name + "' has " + std::to_string(tensor.nbytes) +
                            " bytes but dtype " + dtype_name(tensor.dtype) + " and shape " +
                            shape_string(tensor.shape) + " need " + std::to_string(*expected) +
                            " bytes; pass a contiguous tensor and its exact byte size");
    }
    if (tensor.nbytes > 0 && tensor.data == nullptr) {
      throw CheckpointError(prefix + "tensor '" + tensor.name + "' has " + std::to_string(tensor.nbytes) +
                            " bytes but a null data pointer");
    }
  }
}

// Largest elements first, then by name: every tensor starts at a multiple of its element size.
std::vector<const TensorView*> write_order(const std::vector<TensorView>& tensors) {
  std::vector<const TensorView*> order;
  order.reserve(tensors.size());
  for (const auto& tensor : tensors)
    order.push_back(&tensor);
  std::sort(order.begin(), order.end(), [](const TensorView* a, const TensorView* b) {
    const std::size_t size_a = dtype_size(a->dtype);
    const std::size_t size_b = dtype_size(b->dtype);
    if (size_a != size_b) return size_a > size_b;
    return a->name < b->name;
  });
  return order;
}

// Compact JSON as serde_json writes it: no spaces, "__metadata__" first, tensors in offset order.
std::string make_header(const std::vector<const TensorView*>& order,
                        const std::map<std::string, std::string>& metadata, const std::string& path) {
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ",";
      first = false;
      header += json_string(key, "metadata key '" + key + "'", path) + ":" +
                json_string(value, "the value of metadata key '" + key + "'", path);
    }
    header += "}";
  }
  std::size_t offset = 0;
  for (const TensorView* tensor : order) {
    if (header.size() > 1) header += ",";
    header += json_string(tensor->name, "tensor name '" + tensor->name + "'", path);
    header += ":{\"dtype\":\"" + dtype_name(tensor->dtype) + "\",\"shape\":[";
    for (std::size_t i = 0; i < tensor->shape.size(); ++i) {
      if (i > 0) header += ",";
      header += std::to_string(tensor->shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + tensor->nbytes) + "]}";
    offset += tensor->nbytes;
  }
  header += "}";
  // Pad with spaces so the data buffer starts 8-byte aligned, as the reference implementation does.
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}

// The 8-byte little-endian header length, the header, then the tensors' bytes in `order`, written to a
// temporary file beside `path` that then replaces it (a rename): a process that has the old file open or
// mapped (File::open, load_model on another rank still copying its slices) keeps reading the old contents
// whole, never a truncated or half-rewritten file, and a failed write leaves the old file as it was.
accel::detail::FileDigest write_contents(const std::string& path, const std::string& prefix,
                                         const std::string& header,
                                         const std::vector<const TensorView*>& order) {
  std::uint8_t length[8];
  const auto header_size = static_cast<std::uint64_t>(header.size());
  for (int i = 0; i < 8; ++i)
    length[i] = static_cast<std::uint8_t>(header_size >> (8 * i));

  static std::atomic<unsigned> serial{0};
  const std::string temp = path + "." + std::to_string(::getpid()) + "." + std::to_string(serial++) + ".tmp";
  std::FILE* raw = std::fopen(temp.c_str(), "wb");
  if (raw == nullptr) {
    throw CheckpointError(prefix + errno_text() + "; check that the directory exists and is writable");
  }
  accel::detail::Xxh64 hash;  // of every byte written: the checkpoint manifest's checksum, without a re-read
  try {
    FileCloser file(raw);
    auto put = [&](const void* bytes, std::size_t size) {
      hash.update(bytes, size);
      if (size > 0 && std::fwrite(bytes, 1, size, raw) != size) {
        throw CheckpointError(prefix + "write failed after " + std::to_string(hash.size() - size) +
                              " bytes: " + errno_text() + "; check free disk space");
      }
    };
    put(length, sizeof length);
    put(header.data(), header.size());
    for (const TensorView* tensor : order)
      put(tensor->data, tensor->nbytes);
    if (!file.close()) {
      throw CheckpointError(prefix + "closing the file after writing " + std::to_string(hash.size()) +
                            " bytes failed: " + errno_text() + "; check free disk space");
    }
    if (std::rename(temp.c_str(), path.c_str()) != 0) {
      throw CheckpointError(prefix + "replacing it with the written file '" + temp +
                            "' failed: " + errno_text() + "; check that the path is not a directory");
    }
  } catch (...) {
    std::remove(temp.c_str());  // a partial file is never left behind (a full disk would keep it full)
    throw;
  }
  return {hash.size(), hash.digest()};
}

}  // namespace

void write_file(const std::string& path, const std::vector<TensorView>& tensors,
                const std::map<std::string, std::string>& metadata) {
  accel::detail::write_safetensors(path, tensors, metadata);
}

}  // namespace accel::safetensors

namespace accel::detail {

FileDigest write_safetensors(const std::string& path, const std::vector<safetensors::TensorView>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  using namespace accel::safetensors;
  const std::string prefix = "cannot write safetensors file '" + path + "': ";
  check_tensors_to_write(tensors, prefix);
  const std::vector<const TensorView*> order = write_order(tensors);
  return write_contents(path, prefix, make_header(order, metadata, path), order);
}

}  // namespace accel::detail

namespace accel::safetensors {

// ---------------------------------------------------------------------------------------------------------------
// Reading

namespace {

// The header's metadata and tensor entries, checked to tile a data buffer of `buffer_size` bytes.
void parse_layout(const std::string& header, const std::string& prefix, std::size_t buffer_size,
                  std::map<std::string, std::string>& metadata, std::map<std::string, TensorInfo>& tensors) {
  const Json root = parse_header(header, prefix);
  std::vector<Span> spans;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      metadata = parse_metadata(entry, prefix);
      continue;
    }
    TensorInfo info = parse_tensor_entry(entry, prefix + "tensor '" + name + "'", buffer_size);
    const std::size_t begin = info.offset;
    const std::size_t end = info.offset + info.nbytes;
    auto inserted = tensors.emplace(name, std::move(info));
    spans.push_back({begin, end, &inserted.first->first});
  }
  check_tiling(std::move(spans), buffer_size, prefix);
}

// Maps `size` bytes of `path` read-only; the result unmaps when its last owner goes.
std::shared_ptr<const std::uint8_t> map_whole_file(const std::string& path, std::size_t size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw CheckpointError("cannot open safetensors file '" + path + "': " + errno_text() +
                          "; check the file permissions");
  }
  void* address = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file open
  if (address == MAP_FAILED) {
    throw CheckpointError("cannot map safetensors file '" + path + "': " + std::strerror(map_errno) +
                          "; the file system may not support mmap: read it with safetensors::File::open");
  }
  return std::shared_ptr<const std::uint8_t>(
      static_cast<const std::uint8_t*>(address),
      [size](const std::uint8_t* p) { ::munmap(const_cast<std::uint8_t*>(p), size); });
}

}  // namespace

File File::map(const std::string& path) {
  const auto read = [&]() -> File {
    const std::string prefix = "safetensors file '" + path + "': ";
    std::FILE* raw = open_for_reading(path);  // the same checks and messages as open()
    FileCloser closer(raw);
    std::error_code ec;
    const std::uintmax_t file_size = std::filesystem::file_size(path, ec);
    if (ec) throw CheckpointError("cannot read safetensors file '" + path + "': " + ec.message());
    const std::string header = read_header(raw, path, prefix, file_size);
    const auto buffer_size = static_cast<std::size_t>(file_size - 8 - header.size());

    File file;
    file.path_ = path;
    file.data_size_ = buffer_size;
    parse_layout(header, prefix, buffer_size, file.metadata_, file.tensors_);
    if (buffer_size > 0) {
      file.mapping_ = map_whole_file(path, static_cast<std::size_t>(file_size));
      file.base_ = file.mapping_.get() + 8 + header.size();
    }
    return file;
  };
  try {
    return read();
  } catch (const CheckpointError& e) {
    throw CheckpointError(accel::detail::bounded_message(e.what()));
  }
}

File File::open(const std::string& path) {
  // A lambda of a member function: it may build a File (private constructor).
  const auto read = [&]() -> File {
    const std::string prefix = "safetensors file '" + path + "': ";

    std::FILE* raw = open_for_reading(path);
    FileCloser closer(raw);
    std::error_code ec;
    const std::uintmax_t file_size = std::filesystem::file_size(path, ec);
    if (ec) throw CheckpointError("cannot read safetensors file '" + path + "': " + ec.message());

    const std::string header = read_header(raw, path, prefix, file_size);
    const auto buffer_size = static_cast<std::size_t>(file_size - 8 - header.size());
    File file;
    file.path_ = path;
    file.data_size_ = buffer_size;
    parse_layout(header, prefix, buffer_size, file.metadata_, file.tensors_);

    file.buffer_.reset(new std::uint64_t[(buffer_size + 7) / 8]);
    read_exact(raw, path, file.buffer_.get(), buffer_size);
    file.base_ = reinterpret_cast<const std::uint8_t*>(file.buffer_.get());
    return file;
  };
  try {
    return read();
  } catch (const CheckpointError& e) {
    // Names and values come from the file: keep the message short and printable whatever they hold.
    throw CheckpointError(accel::detail::bounded_message(e.what()));
  }
}

std::vector<std::string> File::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& entry : tensors_)
    out.push_back(entry.first);
  return out;
}

bool File::contains(const std::string& name) const {
  return tensors_.count(name) != 0;
}

const TensorInfo& File::info(const std::string& name) const {
  auto found = tensors_.find(name);
  if (found != tensors_.end()) return found->second;

  std::vector<std::pair<std::size_t, const std::string*>> close;
  for (const auto& entry : tensors_) {
    const std::size_t distance = accel::detail::edit_distance(name, entry.first, /*case_sensitive=*/true);
    if (distance <= std::max<std::size_t>(2, name.size() / 3)) close.emplace_back(distance, &entry.first);
  }
  std::stable_sort(close.begin(), close.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string message = "safetensors file '" + path_ + "' has no tensor named '" + name + "' (it has " +
                        std::to_string(tensors_.size()) + " tensors)";
  if (!close.empty()) {
    message += "; did you mean ";
    for (std::size_t i = 0; i < close.size() && i < 3; ++i) {
      if (i > 0) message += ", ";
      message += "'" + *close[i].second + "'";
    }
    message += "?";
  }
  throw CheckpointError(message);
}

const std::uint8_t* File::data(const std::string& name) const {
  const TensorInfo& tensor = info(name);
  return base_ + tensor.offset;
}

}  // namespace accel::safetensors
