#include "checkpoint/xxh64.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace accel::detail {
namespace {

constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

constexpr std::uint64_t rotl(std::uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

// Little-endian loads (the algorithm is defined on little-endian words).
std::uint64_t load64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

std::uint64_t load32(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 3; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

std::uint64_t round(std::uint64_t acc, std::uint64_t input) {
  acc += input * kPrime2;
  return rotl(acc, 31) * kPrime1;
}

std::uint64_t merge(std::uint64_t h, std::uint64_t acc) {
  h ^= round(0, acc);
  return h * kPrime1 + kPrime4;
}

void stripe(std::array<std::uint64_t, 4>& acc, const unsigned char* p) {
  for (int i = 0; i < 4; ++i)
    acc[i] = round(acc[i], load64(p + 8 * i));
}

}  // namespace

void Xxh64::update(const void* data, std::size_t n) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (buffered_ > 0) {
    const std::size_t take = std::min(n, buffer_.size() - buffered_);
    std::memcpy(buffer_.data() + buffered_, p, take);
    buffered_ += take;
    p += take;
    n -= take;
    if (buffered_ < buffer_.size()) return;
    stripe(acc_, buffer_.data());
    buffered_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32)
    stripe(acc_, p);
  if (n > 0) {
    std::memcpy(buffer_.data(), p, n);
    buffered_ = n;
  }
}

std::uint64_t Xxh64::digest() const noexcept {
  std::uint64_t h = 0;
  if (total_ >= 32) {
    h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
    for (const auto a : acc_)
      h = merge(h, a);
  } else {
    h = acc_[2] + kPrime5;  // acc_[2] is the seed (0) until a stripe is consumed
  }
  h += total_;
  const unsigned char* p = buffer_.data();
  std::size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8)
    h = rotl(h ^ round(0, load64(p)), 27) * kPrime1 + kPrime4;
  if (n >= 4) {
    h = rotl(h ^ (load32(p) * kPrime1), 23) * kPrime2 + kPrime3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n)
    h = rotl(h ^ (*p * kPrime5), 11) * kPrime1;
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

std::string hex(std::uint64_t xxh64) {
  return fmt::format("{:016x}", xxh64);
}

FileDigest digest_file(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) throw CheckpointError(fmt::format("cannot read '{}': {}", path, std::strerror(errno)));
  Xxh64 hash;
  std::vector<unsigned char> buffer(1 << 20);
  for (;;) {
    const std::size_t n = std::fread(buffer.data(), 1, buffer.size(), file.get());
    hash.update(buffer.data(), n);
    if (n < buffer.size()) {
      if (std::ferror(file.get()) != 0) {
        throw CheckpointError(
            fmt::format("reading '{}' failed after {} bytes: {}", path, hash.size(), std::strerror(errno)));
      }
      break;
    }
  }
  return {hash.size(), hash.digest()};
}

}  // namespace accel::detail
