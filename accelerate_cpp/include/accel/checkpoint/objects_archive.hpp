#pragma once
/// \file objects_archive.hpp
/// `ObjectCodec` for types with `save(torch::serialize::OutputArchive&) const` and
/// `load(torch::serialize::InputArchive&)` members (LibTorch's archive format inside), so that
/// `gather_object` and `broadcast_object_list` take them. Separate from objects.hpp because LibTorch's
/// archive headers are heavy to compile.

#include <accel/checkpoint/objects.hpp>

#include <sstream>

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace accel {
namespace detail {
template <class T, class = void>
struct has_archive_members : std::false_type {};
template <class T>
struct has_archive_members<
    T, std::void_t<decltype(std::declval<const T&>().save(std::declval<torch::serialize::OutputArchive&>())),
                   decltype(std::declval<T&>().load(std::declval<torch::serialize::InputArchive&>()))>>
    : std::is_default_constructible<T> {};
}  // namespace detail

/// Types with `save(OutputArchive&) const` / `load(InputArchive&)` (LibTorch's archive format inside).
template <class T>
struct ObjectCodec<T, std::enable_if_t<detail::has_archive_members<T>::value && !std::is_arithmetic_v<T>>> {
  static void write(std::string& out, const T& value) {
    torch::serialize::OutputArchive archive;
    value.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    encode_object(out, bytes.str());
  }
  static T read(std::string_view& in) {
    const std::string bytes = decode_object<std::string>(in);
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size());
    T value{};
    value.load(archive);
    return value;
  }
};

}  // namespace accel
