#pragma once
/// \file objects.hpp
/// How `Accelerator::gather_object` and `broadcast_object_list` turn objects into bytes and back: the
/// `ObjectCodec<T>` trait. Built in: arithmetic types, `std::string`, `std::vector`, `std::pair`, `std::map`
/// of those, and any type with `save(torch::serialize::OutputArchive&) const` and
/// `load(torch::serialize::InputArchive&)` members (as `register_for_checkpointing` takes them). Other types:
/// specialise the trait.
///
/// Example (a struct of one's own):
/// \code
///   struct Score { std::string name; double value; };
///   template <> struct accel::ObjectCodec<Score> {
///     static void write(std::string& out, const Score& s) {
///       accel::encode_object(out, s.name);
///       accel::encode_object(out, s.value);
///     }
///     static Score read(std::string_view& in) {
///       Score s;
///       s.name = accel::decode_object<std::string>(in);
///       s.value = accel::decode_object<double>(in);
///       return s;
///     }
///   };
/// \endcode
/// Bytes are this machine's representation (every rank runs the same build). Nothing here is collective.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel {

/// Specialise for a type to gather or broadcast it: `static void write(std::string& out, const T&)` appends
/// its bytes, `static T read(std::string_view& in)` consumes them.
template <class T, class = void>
struct ObjectCodec;

/// Appends the bytes of `value` to `out`.
template <class T>
void encode_object(std::string& out, const T& value) {
  ObjectCodec<T>::write(out, value);
}

/// Reads a `T` from the front of `in` and advances it. Throws std::runtime_error on truncated input.
template <class T>
T decode_object(std::string_view& in) {
  return ObjectCodec<T>::read(in);
}

namespace detail {
inline std::string_view take_bytes(std::string_view& in, std::size_t n) {
  if (in.size() < n) throw std::runtime_error("object bytes end early: was it encoded as another type?");
  const std::string_view head = in.substr(0, n);
  in.remove_prefix(n);
  return head;
}
inline void put_size(std::string& out, std::uint64_t n) {
  out.append(reinterpret_cast<const char*>(&n), sizeof n);
}
inline std::uint64_t get_size(std::string_view& in) {
  std::uint64_t n = 0;
  std::memcpy(&n, take_bytes(in, sizeof n).data(), sizeof n);
  return n;
}

}  // namespace detail

template <class T>
struct ObjectCodec<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  static void write(std::string& out, const T& v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
  static T read(std::string_view& in) {
    T v{};
    std::memcpy(&v, detail::take_bytes(in, sizeof v).data(), sizeof v);
    return v;
  }
};

template <>
struct ObjectCodec<std::string> {
  static void write(std::string& out, const std::string& s) {
    detail::put_size(out, s.size());
    out += s;
  }
  static std::string read(std::string_view& in) {
    const auto n = detail::get_size(in);
    return std::string(detail::take_bytes(in, n));
  }
};

template <class T>
struct ObjectCodec<std::vector<T>> {
  static void write(std::string& out, const std::vector<T>& v) {
    detail::put_size(out, v.size());
    for (const auto& item : v)
      encode_object(out, item);
  }
  static std::vector<T> read(std::string_view& in) {
    const auto n = detail::get_size(in);
    std::vector<T> v;
    v.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(n, in.size())));
    for (std::uint64_t i = 0; i < n; ++i)
      v.push_back(decode_object<T>(in));
    return v;
  }
};

template <class A, class B>
struct ObjectCodec<std::pair<A, B>> {
  static void write(std::string& out, const std::pair<A, B>& p) {
    encode_object(out, p.first);
    encode_object(out, p.second);
  }
  static std::pair<A, B> read(std::string_view& in) {
    A a = decode_object<A>(in);
    B b = decode_object<B>(in);
    return {std::move(a), std::move(b)};
  }
};

template <class K, class V>
struct ObjectCodec<std::map<K, V>> {
  static void write(std::string& out, const std::map<K, V>& m) {
    detail::put_size(out, m.size());
    for (const auto& [k, v] : m) {
      encode_object(out, k);
      encode_object(out, v);
    }
  }
  static std::map<K, V> read(std::string_view& in) {
    const auto n = detail::get_size(in);
    std::map<K, V> m;
    for (std::uint64_t i = 0; i < n; ++i) {
      K k = decode_object<K>(in);
      m.emplace(std::move(k), decode_object<V>(in));
    }
    return m;
  }
};

}  // namespace accel
