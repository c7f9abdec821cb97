#pragma once
/// \file progress.hpp
/// A progress bar for long loops, drawn by the main process only (as tqdm with Accelerate's
/// `disable=not accelerator.is_local_main_process`):
///
///     epoch 0:  42%|########            | 420/1000 [00:03<00:04, 128.50 batches/s] loss 0.3141
///
/// On a terminal it is redrawn in place (at most 10 times a second); under accel-launch, whose console is a
/// terminal, it prints a line at most every 5 seconds (the launcher prefixes lines, so it cannot redraw);
/// otherwise (output to a file or a pipe, CI) it prints nothing. Torch-free.

#include <cstddef>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>

namespace accel {

enum class ProgressMode {
  Off,       ///< draws nothing
  Terminal,  ///< redrawn in place with '\r'
  Lines      ///< one line at most every `line_interval_seconds`, and one at the end
};

struct ProgressOptions {
  /// Text before the bar ("epoch 3").
  std::string description;
  /// What is counted ("batches", "samples"): the rate is `<n> <unit>/s`.
  std::string unit = "it";
  /// The process's rank; only rank 0 draws. -1 reads `RANK` (0 when unset).
  int rank = -1;
  /// Where to draw; unset decides from the process: rank 0 and standard error a terminal -> Terminal; rank 0
  /// under accel-launch on a terminal -> Lines; else Off.
  std::optional<ProgressMode> mode;
  double line_interval_seconds = 5.0;
};

class ProgressBar {
 public:
  /// A bar of `total` steps (0: unknown, shown without percentage and ETA) on standard error.
  explicit ProgressBar(std::size_t total, ProgressOptions options = {});
  /// The same, drawing on `out` with time from `clock` (seconds): for tests.
  ProgressBar(std::size_t total, ProgressOptions options, std::ostream& out, std::function<double()> clock);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  /// `n` more steps done.
  void update(std::size_t n = 1);
  /// Text after the bar, such as "loss 0.3141"; shown from the next draw.
  void set_postfix(std::string text);
  /// Draws the final state and ends the line; later calls do nothing. The destructor calls it.
  void close();

  ProgressMode mode() const noexcept { return mode_; }
  std::size_t done() const noexcept { return done_; }

  /// One line of the bar (no '\r' or '\n'); `elapsed` in seconds.
  static std::string render(const std::string& description, std::size_t done, std::size_t total,
                            double elapsed, const std::string& unit, const std::string& postfix);

 private:
  void draw(bool final);

  std::size_t total_;
  ProgressOptions options_;
  ProgressMode mode_;
  std::ostream* out_;
  std::function<double()> clock_;
  double start_ = 0, last_draw_ = -1e300;
  std::size_t done_ = 0;
  std::string postfix_;
  std::size_t last_width_ = 0;
  bool closed_ = false;
};

}  // namespace accel
