#pragma once
/// \file questionnaire.hpp
/// The question engine and the questions of `accel-launch config`, separate from the CLI11 glue so that tests
/// drive them through std::istream / std::ostream. Torch-free; nothing here is collective.
///
/// Example:
/// \code
///   std::istringstream answers("\nfsdp\n\n4\n");  // one answer per line; empty = default
///   std::ostringstream log;
///   accel::Config config = accel::launcher::run_questionnaire(answers, log);
/// \endcode

#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "accel/config/config.hpp"
#include "accel/config/questions.hpp"

namespace accel::launcher {

/// How a Prompter reads answers.
struct QuestionnaireOptions {
  /// The input is a terminal, which echoes what the user types: answers are then not echoed again. When false
  /// (answers piped on stdin), every answer is echoed after its prompt so that logs read like a session.
  bool interactive = false;
  /// Invalid answers accepted per question before ConfigError "no valid answer for ..."; 0 means unlimited
  /// (the sensible value for a terminal).
  int max_attempts = 5;
};

/// One entry of a numbered list of choices (see accel::QuestionChoice).
using Choice = accel::QuestionChoice;
using accel::AnswerCheck;

/// Asks questions one line at a time. Each question shows its default in brackets; an empty answer takes the
/// default; an invalid answer prints `Error: <reason>` and the question is asked again. When the input ends,
/// every further question takes its default (and says so in the output); a question without a default then
/// throws UsageError "stdin ended before question '<q>' was answered".
class Prompter final : public Questions {
 public:
  /// Reads answers from `in`, writes questions, echoes and errors to `out`. Both must outlive the Prompter.
  Prompter(std::istream& in, std::ostream& out, QuestionnaireOptions options = {});

  /// A numbered list (numbers start at 0, as in `accelerate config`); accepts the number or a name.
  /// Returns the index of the chosen entry.
  size_t ask_choice(const std::string& question, const std::vector<Choice>& choices, size_t default_index,
                    const AnswerCheck<size_t>& check = {}) override;
  /// A whole number in [min, max].
  int ask_int(const std::string& question, int default_value, int min, int max,
              const AnswerCheck<int>& check = {}) override;
  /// A 64-bit whole number in [min, max].
  int64_t ask_int64(const std::string& question, int64_t default_value, int64_t min, int64_t max) override;
  /// yes/no (also y/n, true/false, 1/0; case-insensitive).
  bool ask_bool(const std::string& question, bool default_value) override;
  /// Free text (trimmed, must not be empty); `default_value` nullopt means the question must be answered.
  std::string ask_text(const std::string& question, const std::optional<std::string>& default_value,
                       const AnswerCheck<std::string>& check = {}) override;

  /// True once the input has ended (all later questions take their defaults).
  bool input_ended() const { return ended_; }

 private:
  // Reads one answer for `prompt`, retrying until `parse` returns a value. `parse` gets the trimmed,
  // non-empty answer and returns the accepted value's text form for the echo, or sets `error`.
  std::string ask(const std::string& question, const std::string& prompt,
                  const std::optional<std::string>& default_text,
                  const std::function<bool(const std::string& answer, std::string& error)>& accept);

  std::istream& in_;
  std::ostream& out_;
  QuestionnaireOptions options_;
  bool ended_ = false;
};

/// Asks the `accel-launch config` questions in the order of `accelerate config`, skipping those that do not
/// apply: compute environment (and for several machines: count, this machine's rank, main process IP and
/// port), backend (the list of `config_backends()`), CPU only, number of processes, the chosen backend's own
/// questions (`BackendInfo::ask_settings`: FSDP or ZeRO settings), gradient accumulation steps, mixed
/// precision, debug checks of collectives, and with several processes pipeline parallelism (stages, which
/// must divide num_processes; micro-batches; schedule; partition; refused for backends that shard gradients
/// or parameters). Returns a validated Config. Throws ConfigError when a question gets no valid answer within
/// `options.max_attempts`, UsageError when the input ends before a question that has no default.
Config run_questionnaire(std::istream& in, std::ostream& out, const QuestionnaireOptions& options = {});

/// The config `accel-launch config default` writes: the `local` backend for one process, `ddp` for more.
/// Throws ConfigError when `num_processes` < 1.
Config default_config(int num_processes = 1, MixedPrecision mixed_precision = MixedPrecision::No);

}  // namespace accel::launcher
