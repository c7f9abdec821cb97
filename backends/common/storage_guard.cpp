#include "storage_guard.hpp"

#include <c10/core/StorageImpl.h>

namespace accel::backends::detail {
namespace {

// LibTorch can make a storage throw on data access (release_data_and_set_meta_custom_data_ptr_error_msg_,
// public) but not lift it again: the flag is private. An explicit template instantiation may name a private
// member (C++17 [temp.explicit]/14), which gives us a member pointer to it; the flag is re-read through the
// public set_data_ptr_noswap, which refreshes StorageImpl's combined check. Checked on LibTorch 2.11; the
// storage_guard test fails if the layout of this API changes.
template <class Tag, typename Tag::type Member>
struct Steal {
  friend typename Tag::type get(Tag) { return Member; }
};
struct ThrowOnAccess {
  using type = bool c10::StorageImpl::*;
  friend type get(ThrowOnAccess);
};
template struct Steal<ThrowOnAccess, &c10::StorageImpl::throw_on_immutable_data_ptr_>;

c10::StorageImpl* storage_of(const torch::Tensor& p) {
  return p.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

}  // namespace

void poison_storage(const torch::Tensor& p, const std::string& message) {
  storage_of(p)->release_data_and_set_meta_custom_data_ptr_error_msg_(message);
}

void unpoison_storage(const torch::Tensor& p) {
  auto* s = storage_of(p);
  if (!(s->*get(ThrowOnAccess{}))) return;
  s->*get(ThrowOnAccess{}) = false;
  s->set_data_ptr_noswap(std::move(s->_mutable_data_ptr_no_checks()));  // refreshes the combined check
}

bool storage_poisoned(const torch::Tensor& p) {
  return storage_of(p)->*get(ThrowOnAccess{});
}

void release_storage(const torch::Tensor& p, const std::string& message) {
  auto* s = storage_of(p);
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
  s->set_nbytes(0);
  poison_storage(p, message);
}

void mark_memoryless(const torch::Tensor& p, const std::string& message) {
  auto* s = storage_of(p);
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
  s->set_nbytes(static_cast<std::size_t>(p.numel()) * p.element_size());
  poison_storage(p, message);
}

void point_storage_into(const torch::Tensor& p, const torch::Tensor& buffer, std::int64_t offset) {
  auto* s = storage_of(p);
  auto* base = static_cast<char*>(buffer.data_ptr()) + offset * static_cast<std::int64_t>(p.element_size());
  s->*get(ThrowOnAccess{}) = false;
  // The context keeps the buffer alive as long as the storage points into it.
  s->set_data_ptr_noswap(c10::DataPtr(
      base, new torch::Tensor(buffer), [](void* ctx) { delete static_cast<torch::Tensor*>(ctx); },
      p.device()));
  s->set_nbytes(static_cast<std::size_t>(p.numel()) * p.element_size());
}

}  // namespace accel::backends::detail
