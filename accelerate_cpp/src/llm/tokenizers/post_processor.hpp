#pragma once
// Post-processors (tokenizers/src/processors) as they act on one sequence: ids before and after it.

#include <cstdint>
#include <vector>

namespace accel::llm::detail {

/// What the post-processor adds around a single sequence when add_special_tokens is true
/// (TemplateProcessing's `single`, applied in order for a Sequence of processors; ByteLevel adds nothing).
struct PostProcessor {
  std::vector<int64_t> prefix;
  std::vector<int64_t> suffix;
};

/// A Sequence of processors: `next` wraps what the ones before produced.
inline void wrap(PostProcessor& sequence, const PostProcessor& next) {
  sequence.prefix.insert(sequence.prefix.begin(), next.prefix.begin(), next.prefix.end());
  sequence.suffix.insert(sequence.suffix.end(), next.suffix.begin(), next.suffix.end());
}

}  // namespace accel::llm::detail
