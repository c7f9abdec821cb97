#pragma once
/// \file questions.hpp
/// The questions `accel-launch config` can ask, as an interface, so that each backend asks about its own
/// settings (`BackendInfo::ask_settings`) without knowing the terminal. accel-launch's Prompter implements it
/// over a std::istream / std::ostream. Torch-free; nothing here is collective.
///
/// Example (a backend's questions):
/// \code
///   void ask(accel::Questions& q, accel::Config& c) {
///     c.zero.stage = static_cast<int>(q.ask_choice("What ZeRO stage?", {{"0", "like DDP"}, {"1", "..."}},
///     1));
///   }
/// \endcode

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace accel {

/// One entry of a numbered list of choices.
struct QuestionChoice {
  /// The canonical name, matched case-insensitively with `-`, `_` and spaces treated alike.
  std::string name;
  /// Shown after the name in the list; may be empty.
  std::string description;
  /// Other accepted names (same matching rules as `name`).
  std::vector<std::string> aliases = {};
};

/// Extra check on an otherwise well-formed answer: returns the reason it is rejected, or nullopt to accept
/// it.
template <typename T>
using AnswerCheck = std::function<std::optional<std::string>(const T&)>;

/// Asks one question at a time and returns a valid answer (asking again after an invalid one).
class Questions {
 public:
  virtual ~Questions() = default;
  /// A numbered list (numbers start at 0, as in `accelerate config`); accepts the number or a name.
  /// Returns the index of the chosen entry.
  virtual size_t ask_choice(const std::string& question, const std::vector<QuestionChoice>& choices,
                            size_t default_index, const AnswerCheck<size_t>& check = {}) = 0;
  /// A whole number in [min, max].
  virtual int ask_int(const std::string& question, int default_value, int min, int max,
                      const AnswerCheck<int>& check = {}) = 0;
  /// A 64-bit whole number in [min, max].
  virtual int64_t ask_int64(const std::string& question, int64_t default_value, int64_t min, int64_t max) = 0;
  /// yes/no (also y/n, true/false, 1/0; case-insensitive).
  virtual bool ask_bool(const std::string& question, bool default_value) = 0;
  /// Free text (trimmed, must not be empty); `default_value` nullopt means the question must be answered.
  virtual std::string ask_text(const std::string& question, const std::optional<std::string>& default_value,
                               const AnswerCheck<std::string>& check = {}) = 0;
};

}  // namespace accel
