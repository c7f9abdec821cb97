#include <accel/distributed/env_contract.hpp>
#include <accel/monitor/progress.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>

namespace accel {
namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string clock_text(double seconds) {
  const auto s = static_cast<long long>(std::max(0.0, seconds));
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{:02}:{:02}", s / 60, s % 60);
}

ProgressMode default_mode(int rank) {
  if (rank != 0) return ProgressMode::Off;
  if (::isatty(STDERR_FILENO)) return ProgressMode::Terminal;
  const char* tty = std::getenv(env::kConsoleTty);
  return tty != nullptr && std::string(tty) == "1" ? ProgressMode::Lines : ProgressMode::Off;
}

int rank_from(const ProgressOptions& options) {
  if (options.rank >= 0) return options.rank;
  const char* r = std::getenv(env::kRank);
  return r != nullptr && *r != '\0' ? std::atoi(r) : 0;
}

}  // namespace

ProgressBar::ProgressBar(std::size_t total, ProgressOptions options)
    : ProgressBar(total, std::move(options), std::cerr, steady_seconds) {
  if (!options_.mode) mode_ = default_mode(rank_from(options_));
}

ProgressBar::ProgressBar(std::size_t total, ProgressOptions options, std::ostream& out,
                         std::function<double()> clock)
    : total_(total),
      options_(std::move(options)),
      mode_(options_.mode.value_or(ProgressMode::Off)),
      out_(&out),
      clock_(std::move(clock)) {
  if (rank_from(options_) != 0) mode_ = ProgressMode::Off;
  start_ = clock_();
}

ProgressBar::~ProgressBar() {
  close();
}

std::string ProgressBar::render(const std::string& description, std::size_t done, std::size_t total,
                                double elapsed, const std::string& unit, const std::string& postfix) {
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  std::string line = description.empty() ? "" : description + ": ";
  if (total > 0) {
    constexpr int kWidth = 20;
    const double fraction = std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
    const int filled = static_cast<int>(fraction * kWidth);
    const double remaining = rate > 0 ? static_cast<double>(total - std::min(done, total)) / rate : 0.0;
    line += fmt::format("{:3d}%|{}{}| {}/{} [{}<{}, {:.2f} {}/s]", static_cast<int>(fraction * 100),
                        std::string(static_cast<std::size_t>(filled), '#'),
                        std::string(static_cast<std::size_t>(kWidth - filled), ' '), done, total,
                        clock_text(elapsed), rate > 0 ? clock_text(remaining) : "?", rate, unit);
  } else {
    line += fmt::format("{} [{}, {:.2f} {}/s]", done, clock_text(elapsed), rate, unit);
  }
  return postfix.empty() ? line : line + " " + postfix;
}

void ProgressBar::update(std::size_t n) {
  done_ += n;
  if (mode_ == ProgressMode::Off || closed_) return;
  const double now = clock_();
  const double interval = mode_ == ProgressMode::Terminal ? 0.1 : options_.line_interval_seconds;
  if (now - last_draw_ >= interval) draw(false);
}

void ProgressBar::set_postfix(std::string text) {
  postfix_ = std::move(text);
}

void ProgressBar::close() {
  if (closed_) return;
  closed_ = true;
  if (mode_ != ProgressMode::Off) draw(true);
}

void ProgressBar::draw(bool final) {
  const double now = clock_();
  last_draw_ = now;
  const std::string line = render(options_.description, done_, total_, now - start_, options_.unit, postfix_);
  if (mode_ == ProgressMode::Terminal) {
    // Redraw in place; pad with spaces over a longer previous line.
    *out_ << '\r' << line << std::string(last_width_ > line.size() ? last_width_ - line.size() : 0, ' ');
    last_width_ = line.size();
    if (final) *out_ << '\n';
  } else {
    *out_ << line << '\n';
  }
  out_->flush();
}

}  // namespace accel
