// What one training run measured, and the files it becomes: an accuracy curve (CSV), a
// summary (JSON), and for several runs a comparison table and plots of test accuracy
// against wall-clock time and against rounds (gnuplot, SVG).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync::train {

struct CurvePoint {
  double seconds = 0;      // since the job was launched
  Version round = 0;       // model version evaluated
  uint64_t gradients = 0;  // gradients the workers had completed by then (approximate)
  double accuracy = 0;     // on the test set
  double test_loss = 0;
  double train_loss = 0;   // recent minibatch loss, averaged over workers (0: none yet)
};

struct RunMetrics {
  std::string label;       // e.g. the sync mode
  std::string sync;
  std::string staleness;   // the servers' staleness policy ("none" unless set)
  std::string scenario;    // human-readable
  uint32_t workers = 0;
  uint32_t servers = 0;
  uint32_t batch = 0;
  bool ok = false;         // the job finished cleanly
  double seconds = 0;      // launch to end of the job
  Version final_version = 0;
  uint64_t gradients = 0;
  double final_accuracy = 0;
  double final_loss = 0;
  double target = 0.85;
  std::vector<CurvePoint> curve;  // in time order; the last point is the final model
  // The staleness policy damp: the round the scheduler damped the job from, if it did.
  std::optional<Version> damped_from_round;
  // Where it never damped: the largest ratio its growth watch saw (it damps past
  // GrowthWatchOptions::ratio).
  std::optional<double> growth_peak;

  // Filled by ComputeTargetTimes.
  std::optional<double> first_reach_s;
  std::optional<Version> first_reach_round;
  std::optional<double> stays_from_s;  // from here on every evaluation is >= target
  std::optional<Version> stays_from_round;
};

// First time the curve reaches the target, and the time from which it never drops below
// it again (the final model included); both empty when the final model misses it.
void ComputeTargetTimes(RunMetrics& m);

// CSV of the curve: seconds,round,gradients,accuracy,test_loss,train_loss.
Status WriteCurveCsv(const RunMetrics& m, const std::string& path);
std::string SummaryJson(const RunMetrics& m);  // one line, without the curve
Status WriteSummaryJson(const RunMetrics& m, const std::string& path);  // with the curve
// Reads what WriteSummaryJson wrote (or another program wrote in its format, such as
// examples/pytorch/fmnist_cnn.py); the target times are recomputed from the curve.
Result<RunMetrics> ReadSummaryJson(const std::string& path);

// Comparison of runs (one per sync mode): a table as text, as CSV, and gnuplot plots.
std::string CompareTable(const std::vector<RunMetrics>& runs);
Status WriteCompareCsv(const std::vector<RunMetrics>& runs, const std::string& path);
// Writes <dir>/<file>.csv per run, <dir>/plot.gp, and renders accuracy_time.svg and
// accuracy_rounds.svg with gnuplot. Returns what was rendered, or an error that says what to
// install (the script and data stay for later).
Result<std::vector<std::string>> WritePlots(const std::vector<RunMetrics>& runs,
                                            const std::string& dir, const std::string& title);

// "dsync:4,3" -> "dsync_4_3": a file name for a label.
std::string FileSafe(const std::string& label);

}  // namespace dsync::train
