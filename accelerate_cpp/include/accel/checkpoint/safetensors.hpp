#pragma once
/// \file safetensors.hpp
/// Torch-free reader and writer for the safetensors format (https://github.com/huggingface/safetensors), the
/// format accelerate-cpp uses for model weights so that Python tools can read them.
///
/// Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
/// `{"__metadata__": {"k": "v"}, "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}}`
/// padded with spaces to a multiple of 8 bytes, then the data buffer. Offsets are relative to the start of
/// the buffer; tensors are packed in offset order with no gaps or overlaps; data is little-endian, row-major.
///
/// Every failure throws `accel::CheckpointError` naming the file, the tensor and the fix.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace accel::safetensors {

/// Element types of the safetensors format. The names in the file are those of `dtype_name`.
enum class DType {
  F64,     ///< "F64"
  F32,     ///< "F32"
  F16,     ///< "F16" (IEEE half)
  BF16,    ///< "BF16" (bfloat16)
  F8E4M3,  ///< "F8_E4M3"
  F8E5M2,  ///< "F8_E5M2"
  I64,     ///< "I64"
  I32,     ///< "I32"
  I16,     ///< "I16"
  I8,      ///< "I8"
  U64,     ///< "U64"
  U32,     ///< "U32"
  U16,     ///< "U16"
  U8,      ///< "U8"
  Bool,    ///< "BOOL" (one byte per element, 0 or 1)
};

/// Size of one element of `dtype`, in bytes.
std::size_t dtype_size(DType dtype);

/// The name of `dtype` as written in a safetensors header, e.g. "F32", "BOOL", "F8_E4M3".
std::string dtype_name(DType dtype);

/// Inverse of `dtype_name` (exact, case-sensitive). Throws `CheckpointError` listing the supported names.
DType parse_dtype(const std::string& name);

/// A tensor to write: a borrowed, contiguous, little-endian, row-major buffer. `shape` empty means a 0-d
/// scalar (one element); a zero anywhere in `shape` means an empty tensor (`nbytes == 0`, `data` may be
/// null).
struct TensorView {
  std::string name;            ///< unique, non-empty, not "__metadata__"
  DType dtype = DType::F32;    ///< element type
  std::vector<int64_t> shape;  ///< dimensions, each >= 0
  const void* data = nullptr;  ///< first byte of the tensor data
  std::size_t nbytes = 0;      ///< must equal product(shape) * dtype_size(dtype)
};

/// Writes `tensors` and `metadata` to `path`. The bytes go to a temporary file beside it
/// (`<path>.<pid>.<n>.tmp`, same directory) that is then renamed over `path`: a reader that has the old file
/// open or mapped keeps the old contents whole (never a truncated or half-written file), and a failed write
/// leaves the old file as it was (the temporary file is removed). Because `path` is replaced, not written
/// through: a symlink at `path` is replaced by a regular file (the link is not followed; its target is left
/// unchanged), hard links to the old file keep the old contents (the link is broken), and the new file has
/// a new file's owner and mode (umask), not the old one's. The directory must be writable. Not synced to
/// disk (no fsync): for crash safety write into an `accel::detail::AtomicDirectory` or use
/// `write_file_atomic`.
/// Tensors are laid out by element size (largest first) then by name, so every tensor is aligned to its
/// element size when the buffer is (the same order as the reference implementation, up to ties). The header
/// lists
/// `__metadata__` first (omitted when `metadata` is empty), then the tensors in offset order.
/// Throws `CheckpointError` on an invalid tensor (naming it) or an I/O error (naming the file).
void write_file(const std::string& path, const std::vector<TensorView>& tensors,
                const std::map<std::string, std::string>& metadata = {});

/// Where a tensor lives inside a `File`.
struct TensorInfo {
  DType dtype = DType::F32;    ///< element type
  std::vector<int64_t> shape;  ///< dimensions (empty for a 0-d scalar)
  std::size_t offset = 0;      ///< start of the tensor in the data buffer, in bytes
  std::size_t nbytes = 0;      ///< size of the tensor, in bytes
};

/// A safetensors file read fully into memory (`open`) or memory-mapped (`map`) and validated. Read-only,
/// move-only. The data buffer of `open` is 8-byte aligned, that of `map` starts 8 + header bytes into the
/// file (8-byte aligned too when the header is padded as `write_file` and the reference implementation pad
/// it); tensors are then aligned to their element size. Data is little-endian, as stored.
class File {
 public:
  /// Reads and validates `path`. Throws `CheckpointError` if the file cannot be read or is not a valid
  /// safetensors file (truncated, bad JSON, missing field, unknown dtype, size mismatch, overlap, gap, ...).
  static File open(const std::string& path);
  /// Validates `path` as `open` does but maps it read-only instead of reading it: pages are read when a
  /// tensor's bytes are touched and can be dropped again by the kernel, so a multi-gigabyte shard costs no
  /// resident memory of its own (Hugging Face's `safe_open`). The file must not be truncated while mapped.
  static File map(const std::string& path);

  File(File&&) noexcept = default;
  File& operator=(File&&) noexcept = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() = default;

  /// The path given to `open`.
  const std::string& path() const noexcept { return path_; }
  /// The `__metadata__` entries (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /// All tensor names, sorted.
  std::vector<std::string> names() const;
  /// Whether the file has a tensor called `name`.
  bool contains(const std::string& name) const;
  /// Dtype, shape and location of `name`. Throws `CheckpointError` naming close matches if it is missing.
  const TensorInfo& info(const std::string& name) const;
  /// First byte of tensor `name` (valid while this `File` lives; `info(name).nbytes` bytes).
  /// Throws like `info`.
  const std::uint8_t* data(const std::string& name) const;
  /// Size of the data buffer, in bytes (the sum of all tensor sizes).
  std::size_t data_size() const noexcept { return data_size_; }

 private:
  File() = default;

  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorInfo> tensors_;
  std::unique_ptr<std::uint64_t[]> buffer_;      // uint64_t for 8-byte alignment (open)
  std::shared_ptr<const std::uint8_t> mapping_;  // the whole file, unmapped when the last owner goes (map)
  const std::uint8_t* base_ = nullptr;           // first byte of the data buffer (either way)
  std::size_t data_size_ = 0;
};

}  // namespace accel::safetensors
