#pragma once
// Parameter memory that engines take away and give back while the tensor object, its shape and autograd
// metadata stay: stage 3 releases a unit's parameters at rest, and every sharded engine marks parameters
// whose values are stale (the optimizer stepped the shards, the model is not refreshed yet). Reading such a
// parameter's memory without an operator (torch::save, data_ptr) then throws a c10::Error carrying our
// message, which names the call to use, instead of reading nothing or stale values silently.

#include <torch/types.h>

#include <string>

namespace accel::backends::detail {

/// Frees `p`'s memory (its storage keeps no data, 0 bytes) and makes data access throw `message`.
void release_storage(const torch::Tensor& p, const std::string& message);
/// Gives `p`'s storage the size `p` needs but no memory (a null data pointer: memory reports count it as 0
/// bytes) and makes data access throw `message`; views of `p` still work.
void mark_memoryless(const torch::Tensor& p, const std::string& message);
/// Makes `p`'s storage point at `numel(p)` elements of `buffer` starting at element `offset` (the buffer is
/// kept alive by the storage) and lifts the access error.
void point_storage_into(const torch::Tensor& p, const torch::Tensor& buffer, std::int64_t offset);
/// Makes data access of `p`'s storage throw `message`; its memory stays.
void poison_storage(const torch::Tensor& p, const std::string& message);
/// Lifts the access error of `p`'s storage.
void unpoison_storage(const torch::Tensor& p);
/// True when `p`'s storage currently throws on data access.
bool storage_poisoned(const torch::Tensor& p);

}  // namespace accel::backends::detail
