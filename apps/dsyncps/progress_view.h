// Live progress of a training job on the terminal: one status line redrawn in place
// (round, loss, test accuracy, samples/s, ETA) with log lines scrolling above it; when
// stdout is not a terminal (CI logs, pipes) it degrades to a plain line every few seconds.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

#include "dsync/types.h"

namespace dsync::app {

struct ProgressStatus {
  std::string label;             // e.g. the sync mode
  double seconds = 0;
  Version round = 0;
  uint64_t gradients = 0;
  uint64_t budget = 0;           // gradients the job will run (0: unknown)
  double train_loss = 0;         // 0: none yet
  std::optional<double> accuracy;
  Version accuracy_round = 0;
  double samples_per_s = 0;
  uint32_t workers_running = 0;
};

class ProgressView {
 public:
  // interactive: redraw in place (a terminal); otherwise plain lines every `plain_every`.
  ProgressView(bool interactive, std::chrono::milliseconds plain_every);
  static bool StdoutIsTerminal();

  void Update(const ProgressStatus& status);  // cheap: draws at most every 200 ms
  void Log(std::string_view line);            // a line above the status line
  void Finish();                              // leaves the last status on its own line

  static std::string Format(const ProgressStatus& s);

 private:
  void Draw();

  const bool interactive_;
  const std::chrono::milliseconds plain_every_;
  ProgressStatus last_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace dsync::app
