#pragma once
// "Did you mean" suggestions, written once for config keys and values, and safetensors tensor names.

#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace accel::detail {

/// Optimal-string-alignment distance (Levenshtein with adjacent transpositions, so `mixed_precison` is one
/// edit from `mixed_precision`); case-insensitive unless `case_sensitive`. A distance above `max_distance` is
/// returned as `max_distance + 1`, found without filling the table where the lengths or a row already rule
/// it out (a fuzzed 100 kB key costs nothing against the known keys).
std::size_t edit_distance(const std::string& a, const std::string& b, bool case_sensitive = false,
                          std::size_t max_distance = std::numeric_limits<std::size_t>::max());

/// The candidate closest to `word` when it is a plausible typo (about one edit per three characters), so
/// that unrelated words get the full list instead of a misleading guess. Case-insensitive.
std::optional<std::string> closest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace accel::detail
