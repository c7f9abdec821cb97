// TRL's pack_dataset (trl/data_utils.py: _pack_bfd, _pack_wrapped) on tokenized examples.

#include <algorithm>
#include <deque>
#include <map>

#include "accel/errors.hpp"
#include "accel/llm/data/sft_dataset.hpp"

namespace accel::llm {
namespace {

// TRL's _SegmentTree: the smallest free space >= a length, among the spaces 1..maxval.
class SegmentTree {
 public:
  explicit SegmentTree(int64_t maxval) : size_(1) {
    while (size_ < maxval)
      size_ <<= 1;
    tree_.assign(static_cast<std::size_t>(2 * size_), 0);
  }
  void add(int64_t val) { update(val, val); }
  void remove(int64_t val) { update(val, 0); }
  int64_t search(int64_t val) const {
    std::size_t i = 1;
    while (i < static_cast<std::size_t>(size_))
      i = tree_[i << 1] >= val ? i << 1 : (i << 1) + 1;
    return tree_[i];
  }

 private:
  void update(int64_t val, int64_t stored) {
    std::size_t i = static_cast<std::size_t>(size_ + val - 1);
    tree_[i] = stored;
    while (i > 1) {
      i >>= 1;
      tree_[i] = std::max(tree_[i << 1], tree_[(i << 1) + 1]);
    }
  }
  int64_t size_;
  std::vector<int64_t> tree_;
};

struct Bin {
  std::vector<std::size_t> ids;
  int64_t length = 0;
};

// Best-fit decreasing over one chunk; `docs` are non-empty and at most seq_length long.
std::vector<SftExample> bfd(const std::vector<SftExample>& docs, int64_t seq_length) {
  std::vector<std::size_t> order(docs.size());
  for (std::size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return docs[a].input_ids.size() > docs[b].input_ids.size();
  });
  SegmentTree tree(seq_length);
  tree.add(seq_length);  // a fresh bin is always available
  std::map<int64_t, std::deque<std::size_t>> space_to_bin;
  std::vector<Bin> bins;
  for (std::size_t idx : order) {
    const auto length = static_cast<int64_t>(docs[idx].input_ids.size());
    int64_t space = tree.search(length);
    std::size_t bin = 0;
    if (space < seq_length) {
      bin = space_to_bin[space].front();
      space_to_bin[space].pop_front();
    } else {
      bin = bins.size();
      bins.emplace_back();
    }
    bins[bin].ids.push_back(idx);
    bins[bin].length += length;
    if (space < seq_length && space_to_bin[space].empty()) tree.remove(space);
    space -= length;
    space_to_bin[space].push_back(bin);
    if (space > 0) tree.add(space);
  }
  std::vector<SftExample> out;
  out.reserve(bins.size());
  for (const Bin& b : bins) {
    SftExample row;
    for (std::size_t idx : b.ids) {
      const SftExample& d = docs[idx];
      row.input_ids.insert(row.input_ids.end(), d.input_ids.begin(), d.input_ids.end());
      row.labels.insert(row.labels.end(), d.labels.begin(), d.labels.end());
      row.seq_lengths.push_back(static_cast<int64_t>(d.input_ids.size()));
    }
    out.push_back(std::move(row));
  }
  return out;
}

std::vector<SftExample> pack_chunk(const std::vector<SftExample>& chunk, int64_t seq_length,
                                   const std::string& strategy) {
  const auto n = static_cast<std::size_t>(seq_length);
  if (strategy == "wrapped") {
    SftExample all;
    for (const auto& e : chunk) {
      all.input_ids.insert(all.input_ids.end(), e.input_ids.begin(), e.input_ids.end());
      all.labels.insert(all.labels.end(), e.labels.begin(), e.labels.end());
    }
    std::vector<SftExample> out;
    for (std::size_t at = 0; at < all.input_ids.size(); at += n) {
      const std::size_t len = std::min(n, all.input_ids.size() - at);
      SftExample row;
      row.input_ids.assign(all.input_ids.begin() + static_cast<std::ptrdiff_t>(at),
                           all.input_ids.begin() + static_cast<std::ptrdiff_t>(at + len));
      row.labels.assign(all.labels.begin() + static_cast<std::ptrdiff_t>(at),
                        all.labels.begin() + static_cast<std::ptrdiff_t>(at + len));
      out.push_back(std::move(row));
    }
    return out;
  }
  std::vector<SftExample> docs;
  for (const auto& e : chunk) {
    if (e.input_ids.empty()) continue;
    // bfd: cut to seq_length; bfd_split: the overflow becomes further documents of at most seq_length.
    const std::size_t limit = strategy == "bfd" ? n : e.input_ids.size();
    for (std::size_t at = 0; at < limit; at += n) {
      const std::size_t len = std::min({n, e.input_ids.size() - at, limit - at});
      SftExample d;
      d.input_ids.assign(e.input_ids.begin() + static_cast<std::ptrdiff_t>(at),
                         e.input_ids.begin() + static_cast<std::ptrdiff_t>(at + len));
      d.labels.assign(e.labels.begin() + static_cast<std::ptrdiff_t>(at),
                      e.labels.begin() + static_cast<std::ptrdiff_t>(at + len));
      docs.push_back(std::move(d));
    }
  }
  return bfd(docs, seq_length);
}

}  // namespace

std::vector<SftExample> pack_examples(const std::vector<SftExample>& examples, int64_t seq_length,
                                      const std::string& strategy, int64_t packing_batch_size) {
  if (seq_length <= 0)
    throw ConfigError("packing needs a positive max_length, got " + std::to_string(seq_length));
  if (strategy != "bfd" && strategy != "bfd_split" && strategy != "wrapped") {
    throw ConfigError("packing_strategy '" + strategy + "' is unknown: use bfd, bfd_split or wrapped", "", 0,
                      "packing_strategy");
  }
  if (packing_batch_size <= 0) throw UsageError("pack_examples: packing_batch_size must be positive");
  std::vector<SftExample> out;
  const auto chunk = static_cast<std::size_t>(packing_batch_size);
  for (std::size_t at = 0; at < examples.size(); at += chunk) {
    const std::vector<SftExample> part(
        examples.begin() + static_cast<std::ptrdiff_t>(at),
        examples.begin() + static_cast<std::ptrdiff_t>(std::min(at + chunk, examples.size())));
    for (auto& row : pack_chunk(part, seq_length, strategy))
      out.push_back(std::move(row));
  }
  return out;
}

}  // namespace accel::llm
