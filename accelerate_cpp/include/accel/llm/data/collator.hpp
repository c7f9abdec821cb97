#pragma once
/// \file
/// Batches of SFT examples as TRL's DataCollatorForLanguageModeling builds them (torch-free: row-major
/// std::vector<int64_t>; a LibTorch view of the same data belongs to the models room).
///
/// - padded (default): every row padded on the right to the longest row (or a multiple of
///   pad_to_multiple_of) with pad_token_id; labels padded with -100; attention_mask 1 on tokens, 0 on
///   padding.
/// - padding-free (TRL's padding_free, on by default with bfd packing): the batch's rows are concatenated
/// into
///   one row; position_ids restart at 0 at every document (from SftExample::seq_lengths), labels are -100 at
///   each document's first token, no attention_mask; cu_seq_lens / max_length / seq_idx describe the
///   documents so attention never crosses a document boundary.

#include <cstdint>
#include <optional>
#include <vector>

#include "accel/llm/data/sft_dataset.hpp"

namespace accel::llm {

struct CollatorOptions {
  int64_t pad_token_id = 0;
  bool padding_free = false;
  /// Also return position_ids in padded mode (TRL's return_position_ids).
  bool return_position_ids = false;
  std::optional<int64_t> pad_to_multiple_of;
};

/// A batch, each tensor row-major with shape [rows, cols]. Empty vectors are fields the mode does not return.
struct SftBatch {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
  std::vector<int64_t> attention_mask;  ///< padded mode
  std::vector<int64_t> position_ids;    ///< padding-free, or return_position_ids
  std::vector<int32_t> cu_seq_lens;     ///< padding-free: document starts and the total length
  int64_t max_seq_len = 0;              ///< padding-free: the longest document
  std::vector<int32_t> seq_idx;         ///< padding-free: the document index of each token
};

/// The collator TRL's SFTTrainer builds for `data`: padding-free with bfd / bfd_split packing (TRL turns it
/// on, since a padded attention mask would let attention cross the packed documents), padded otherwise.
CollatorOptions sft_collator_options(const SftDataOptions& data, int64_t pad_token_id);

/// Collates `examples` (one batch). Throws accel::UsageError for an empty batch.
SftBatch collate(const std::vector<SftExample>& examples, const CollatorOptions& options);

}  // namespace accel::llm
