#include "config/text_distance.hpp"

#include <algorithm>
#include <cctype>
#include <limits>
#include <vector>

namespace accel::detail {

std::size_t edit_distance(const std::string& a_in, const std::string& b_in, bool case_sensitive,
                          std::size_t max_distance) {
  auto fold = [case_sensitive](std::string s) {
    if (!case_sensitive) {
      std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    }
    return s;
  };
  const std::size_t over =
      max_distance == std::numeric_limits<std::size_t>::max() ? max_distance : max_distance + 1;
  // The lengths' difference is a lower bound: a 100 kB string against a key is answered without a table.
  const std::size_t gap = a_in.size() > b_in.size() ? a_in.size() - b_in.size() : b_in.size() - a_in.size();
  if (gap > max_distance) return over;
  const std::string a = fold(a_in), b = fold(b_in);
  // Three rows of the table (the transposition reads two rows back): rows i-2, i-1 and i.
  std::vector<std::size_t> before(b.size() + 1), previous(b.size() + 1), row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j)
    previous[j] = j;
  std::size_t previous_min = 0;  // of row i-1
  for (std::size_t i = 1; i <= a.size(); ++i) {
    row[0] = i;
    std::size_t row_min = row[0];
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      row[j] = std::min({previous[j] + 1, row[j - 1] + 1, previous[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        row[j] = std::min(row[j], before[j - 2] + 1);
      }
      row_min = std::min(row_min, row[j]);
    }
    // Every path to the end crosses this row or the one before it (a transposition skips one): once both are
    // above the limit, so is the distance.
    if (row_min > max_distance && previous_min > max_distance) return over;
    previous_min = row_min;
    std::swap(before, previous);
    std::swap(previous, row);
  }
  return std::min(previous[b.size()], over);
}

std::optional<std::string> closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const std::string& candidate : candidates) {
    const std::size_t limit = std::max<std::size_t>(1, std::min(word.size(), candidate.size()) / 3);
    const std::size_t distance = edit_distance(word, candidate, /*case_sensitive=*/false, limit);
    if (distance <= limit && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace accel::detail
