// TRL's DataCollatorForLanguageModeling.torch_call on int64 vectors.

#include "accel/llm/data/collator.hpp"

#include <algorithm>

#include "accel/errors.hpp"

namespace accel::llm {
namespace {

int64_t padded_length(int64_t longest, const std::optional<int64_t>& multiple) {
  if (!multiple || *multiple <= 1) return longest;
  return (longest + *multiple - 1) / *multiple * *multiple;
}

// Position ids of one example: restarting at every packed document, else 0..n-1.
std::vector<int64_t> positions(const SftExample& e) {
  std::vector<int64_t> pos;
  pos.reserve(e.input_ids.size());
  if (e.seq_lengths.empty()) {
    for (std::size_t i = 0; i < e.input_ids.size(); ++i)
      pos.push_back(static_cast<int64_t>(i));
    return pos;
  }
  for (int64_t len : e.seq_lengths) {
    for (int64_t i = 0; i < len; ++i)
      pos.push_back(i);
  }
  return pos;
}

void pad_rows(SftBatch& b, const std::vector<const std::vector<int64_t>*>& rows, int64_t pad,
              std::vector<int64_t>& out) {
  out.assign(static_cast<std::size_t>(b.rows * b.cols), pad);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::copy(rows[r]->begin(), rows[r]->end(), out.begin() + static_cast<std::ptrdiff_t>(r * b.cols));
  }
}

SftBatch padding_free(const std::vector<SftExample>& examples, const CollatorOptions& o) {
  SftBatch b;
  std::vector<int64_t> ids, labels, pos;
  for (const auto& e : examples) {
    ids.insert(ids.end(), e.input_ids.begin(), e.input_ids.end());
    labels.insert(labels.end(), e.labels.begin(), e.labels.end());
    const std::vector<int64_t> p = positions(e);
    pos.insert(pos.end(), p.begin(), p.end());
  }
  b.rows = 1;
  b.cols = padded_length(static_cast<int64_t>(ids.size()), o.pad_to_multiple_of);
  pad_rows(b, {&ids}, o.pad_token_id, b.input_ids);
  pad_rows(b, {&labels}, -100, b.labels);
  pad_rows(b, {&pos}, 0, b.position_ids);
  // The first token of each document predicts nothing from the previous document.
  for (std::size_t i = 0; i < b.position_ids.size(); ++i) {
    if (b.position_ids[i] == 0) {
      b.labels[i] = -100;
      b.cu_seq_lens.push_back(static_cast<int32_t>(i));
    }
  }
  b.cu_seq_lens.push_back(static_cast<int32_t>(b.cols));
  for (std::size_t d = 0; d + 1 < b.cu_seq_lens.size(); ++d) {
    const int32_t len = b.cu_seq_lens[d + 1] - b.cu_seq_lens[d];
    b.max_seq_len = std::max<int64_t>(b.max_seq_len, len);
    b.seq_idx.insert(b.seq_idx.end(), static_cast<std::size_t>(len), static_cast<int32_t>(d));
  }
  return b;
}

}  // namespace

CollatorOptions sft_collator_options(const SftDataOptions& data, int64_t pad_token_id) {
  CollatorOptions o;
  o.pad_token_id = pad_token_id;
  o.padding_free = data.packing && (data.packing_strategy == "bfd" || data.packing_strategy == "bfd_split");
  return o;
}

SftBatch collate(const std::vector<SftExample>& examples, const CollatorOptions& o) {
  if (examples.empty()) throw UsageError("collate: the batch is empty");
  for (const auto& e : examples) {
    if (e.labels.size() != e.input_ids.size()) {
      throw UsageError("collate: an example has " + std::to_string(e.input_ids.size()) + " input ids but " +
                       std::to_string(e.labels.size()) + " labels");
    }
  }
  if (o.padding_free) return padding_free(examples, o);
  SftBatch b;
  b.rows = static_cast<int64_t>(examples.size());
  int64_t longest = 0;
  for (const auto& e : examples)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(e.input_ids.size()));
  b.cols = padded_length(longest, o.pad_to_multiple_of);
  std::vector<const std::vector<int64_t>*> ids, labels;
  std::vector<std::vector<int64_t>> ones, pos;
  for (const auto& e : examples) {
    ids.push_back(&e.input_ids);
    labels.push_back(&e.labels);
    ones.emplace_back(e.input_ids.size(), 1);
    pos.push_back(positions(e));
  }
  pad_rows(b, ids, o.pad_token_id, b.input_ids);
  pad_rows(b, labels, -100, b.labels);
  std::vector<const std::vector<int64_t>*> mask_rows, pos_rows;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    mask_rows.push_back(&ones[i]);
    pos_rows.push_back(&pos[i]);
  }
  pad_rows(b, mask_rows, 0, b.attention_mask);
  if (o.return_position_ids) pad_rows(b, pos_rows, 0, b.position_ids);
  return b;
}

}  // namespace accel::llm
