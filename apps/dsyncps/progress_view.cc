#include "progress_view.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

namespace dsync::app {

ProgressView::ProgressView(bool interactive, std::chrono::milliseconds plain_every)
    : interactive_(interactive), plain_every_(plain_every) {}

bool ProgressView::StdoutIsTerminal() { return isatty(STDOUT_FILENO) == 1; }

std::string ProgressView::Format(const ProgressStatus& s) {
  std::string out = fmt::format("{}{:6.1f}s  round {:5}", s.label.empty() ? "" : s.label + "  ",
                                s.seconds, s.round);
  out += s.train_loss > 0 ? fmt::format("  loss {:.3f}", s.train_loss) : "  loss   -  ";
  out += s.accuracy ? fmt::format("  test acc {:5.1f}% (r{})", 100 * *s.accuracy,
                                  s.accuracy_round)
                    : "  test acc   -  ";
  out += fmt::format("  {:6.0f} samples/s  {} workers", s.samples_per_s, s.workers_running);
  if (s.budget > 0) {
    const double done = static_cast<double>(s.gradients) / static_cast<double>(s.budget);
    out += fmt::format("  {:3.0f}%", 100 * std::min(1.0, done));
    if (done > 0.02 && done < 1) {
      out += fmt::format("  ETA {:.0f}s", s.seconds * (1 - done) / done);
    }
  }
  return out;
}

void ProgressView::Update(const ProgressStatus& status) {
  last_ = status;
  const auto now = std::chrono::steady_clock::now();
  const auto every = interactive_ ? std::chrono::milliseconds(200) : plain_every_;
  if (drawn_ && now - last_draw_ < every) return;
  last_draw_ = now;
  Draw();
}

void ProgressView::Draw() {
  const std::string line = Format(last_);
  if (interactive_) {
    // \r and "erase line" (ECMA-48 EL, CSI K) redraw in place.
    std::printf("\r\033[K%s", line.c_str());
  } else {
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
  drawn_ = true;
}

void ProgressView::Log(std::string_view line) {
  if (interactive_ && drawn_) std::printf("\r\033[K");
  std::printf("%.*s\n", static_cast<int>(line.size()), line.data());
  if (interactive_ && drawn_) {
    std::printf("%s", Format(last_).c_str());
  }
  std::fflush(stdout);
}

void ProgressView::Finish() {
  Draw();
  if (interactive_) std::printf("\n");
  std::fflush(stdout);
}

}  // namespace dsync::app
