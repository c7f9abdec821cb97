#pragma once
// XXH64 (https://github.com/Cyan4973/xxHash, 64-bit variant, seed 0), streaming: the checksum a checkpoint's
// manifest keeps for each file. Computed while the file is written (update() on every buffer the writer
// hands to the OS), so saving reads nothing back. Not cryptographic: it detects corruption and mix-ups,
// not tampering.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace accel::detail {

class Xxh64 {
 public:
  /// Adds `n` bytes at `data`.
  void update(const void* data, std::size_t n) noexcept;
  /// The hash of every byte added so far (the state is unchanged: more may be added).
  std::uint64_t digest() const noexcept;
  /// Bytes added so far.
  std::uint64_t size() const noexcept { return total_; }

 private:
  std::array<std::uint64_t, 4> acc_{0x9E3779B185EBCA87ULL + 0xC2B2AE3D27D4EB4FULL, 0xC2B2AE3D27D4EB4FULL, 0,
                                    0 - 0x9E3779B185EBCA87ULL};
  std::array<unsigned char, 32> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_ = 0;
};

/// What a writer reports about a file it wrote: its size and XXH64.
struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint64_t xxh64 = 0;
};

/// The XXH64 as 16 lowercase hex digits (the manifest's spelling).
std::string hex(std::uint64_t xxh64);

/// Reads `path` and returns its size and XXH64. Throws CheckpointError naming the file if it cannot be read.
FileDigest digest_file(const std::string& path);

}  // namespace accel::detail
