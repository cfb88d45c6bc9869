// `dsyncps train` and `dsyncps compare`: the command-line ends of the main job.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "mlp_math.h"
#include "roles.h"
#include "train_job.h"

namespace dsync::app {
namespace {

Status CheckSpec(const TrainSpec& s) {
  if (s.workers == 0 || s.servers == 0) {
    return Error(StatusCode::kInvalidArgument, "--workers and --servers must be at least 1");
  }
  if (s.batch == 0 || !(s.epochs > 0) || !std::isfinite(s.epochs)) {
    return Error(StatusCode::kInvalidArgument, "--batch and --epochs must be positive");
  }
  DSYNC_RETURN_IF_ERROR(CheckComputeMs("--compute-ms", s.compute_ms));
  for (const auto& [worker, factor] : s.scenario.slow) {
    if (factor > kMaxSlowdown) {
      return Error(StatusCode::kInvalidArgument, "--straggler {}={}: the factor is at most {}",
                   worker, factor, kMaxSlowdown);
    }
  }
  if (!(s.eval_interval_s >= 0.05)) {
    return Error(StatusCode::kInvalidArgument, "--eval-interval must be at least 0.05 s");
  }
  if (!(s.target > 0 && s.target <= 1)) {
    return Error(StatusCode::kInvalidArgument, "--target is a fraction in (0, 1], e.g. 0.85");
  }
  // The nodes would refuse it one by one; say it once, before any process starts.
  Config job = s.job;
  job.role = Role::kScheduler;
  job.num_servers = s.servers;
  job.num_workers = s.workers;
  DSYNC_RETURN_IF_ERROR(job.Validate());
  // Every worker runs on this machine: a GPU missing here fails now, before any process starts.
  DSYNC_ASSIGN_OR_RETURN(const train::MlpMathKind math, train::ParseMlpMath(s.worker_math));
  DSYNC_RETURN_IF_ERROR(train::ResolveMlpMath(math).status());
  return Status::Ok();
}

int Fail(const Status& s) {
  std::fprintf(stderr, "dsyncps: error: %s\n", s.ToString().c_str());
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int RunTrainCommand(const std::string& self, const TrainSpec& spec) {
  if (Status s = CheckSpec(spec); !s.ok()) return Fail(s);
  auto m = RunTrainJob(self, spec);
  if (!m.ok()) return Fail(m.status());
  PrintRunSummary(*m);
  if (!spec.out_dir.empty()) {
    std::printf("  metrics: %s/metrics.csv, %s/summary.json\n", spec.out_dir.c_str(),
                spec.out_dir.c_str());
  }
  return m->ok ? 0 : 1;
}

int RunCompareCommand(const std::string& self, TrainSpec spec, const std::string& modes,
                      const std::string& title) {
  if (Status s = CheckSpec(spec); !s.ok()) return Fail(s);
  // A mode may name its staleness policy after a slash: "dsync:4,3/inverse".
  std::vector<std::pair<SyncMode, StalenessPolicy>> parsed;
  std::vector<std::string> labels;
  std::stringstream in(modes);
  // Modes are separated by commas, but dsync:K,Q has one inside: a piece that is only a
  // number belongs to the mode before it.
  for (std::string piece; std::getline(in, piece, ',');) {
    if (!piece.empty() && std::isdigit(static_cast<unsigned char>(piece[0])) && !labels.empty()) {
      labels.back() += "," + piece;
    } else {
      labels.push_back(piece);
    }
  }
  for (const std::string& l : labels) {
    const size_t slash = l.find('/');
    auto mode = SyncMode::Parse(l.substr(0, slash));
    if (!mode.ok()) return Fail(mode.status());
    StalenessPolicy policy = spec.job.staleness;
    if (slash != std::string::npos) {
      auto p = StalenessPolicy::Parse(l.substr(slash + 1));
      if (!p.ok()) return Fail(p.status().WithContext(fmt::format("--modes '{}'", l)));
      policy = *p;
    }
    parsed.emplace_back(*mode, policy);
  }
  if (parsed.empty()) return Fail(Error(StatusCode::kInvalidArgument, "--modes names no mode"));
  const std::string dir = spec.out_dir.empty() ? std::string("dsyncps-compare") : spec.out_dir;
  if (Status s = MakeDirectories(dir); !s.ok()) return Fail(s);
  std::vector<train::RunMetrics> runs;
  for (size_t i = 0; i < parsed.size(); ++i) {
    TrainSpec one = spec;
    one.job.sync = parsed[i].first;
    one.job.staleness = parsed[i].second;
    one.label = labels[i];
    one.out_dir.clear();
    std::printf("\n=== dsyncps compare: %s (%zu/%zu) ===\n", labels[i].c_str(), i + 1,
                parsed.size());
    auto m = RunTrainJob(self, one);
    if (!m.ok()) return Fail(m.status());
    PrintRunSummary(*m);
    runs.push_back(std::move(*m));
  }
  return ReportComparison(runs, dir, title);
}

int RunCompareFiles(const std::vector<std::string>& paths, const std::string& out_dir,
                    const std::string& title, std::optional<double> target) {
  std::vector<train::RunMetrics> runs;
  for (const std::string& p : paths) {
    const std::string file =
        std::filesystem::is_directory(p) ? (std::filesystem::path(p) / "summary.json").string() : p;
    auto m = train::ReadSummaryJson(file);
    if (!m.ok()) return Fail(m.status());
    if (target) {
      m->target = *target;
      train::ComputeTargetTimes(*m);
    }
    runs.push_back(std::move(*m));
  }
  if (runs.empty()) return Fail(Error(StatusCode::kInvalidArgument, "--runs names no run"));
  const std::string dir = out_dir.empty() ? std::string("dsyncps-compare") : out_dir;
  if (Status s = MakeDirectories(dir); !s.ok()) return Fail(s);
  return ReportComparison(runs, dir, title);
}

int ReportComparison(const std::vector<train::RunMetrics>& runs, const std::string& dir,
                     const std::string& title) {
  const std::string scenario = runs.front().scenario;
  std::printf("\n=== dsyncps compare: %u workers, %s; time to %.0f %% test accuracy ===\n",
              runs.front().workers, scenario.c_str(), 100 * runs.front().target);
  std::printf("%s", train::CompareTable(runs).c_str());
  bool all_ok = true;
  for (const train::RunMetrics& m : runs) all_ok = all_ok && m.ok;
  if (Status s = train::WriteCompareCsv(runs, dir + "/compare.csv"); !s.ok()) return Fail(s);
  {
    std::ofstream json(dir + "/compare.json");
    json << "[";
    for (size_t i = 0; i < runs.size(); ++i) json << (i ? ",\n " : "") << train::SummaryJson(runs[i]);
    json << "]\n";
  }
  std::printf("@compare {\"scenario\":\"%s\",\"dir\":\"%s\",\"runs\":%zu,\"ok\":%s}\n",
              scenario.c_str(), dir.c_str(), runs.size(), all_ok ? "true" : "false");
  auto plots = train::WritePlots(
      runs, dir,
      title.empty() ? fmt::format("{} workers, {}", runs.front().workers, scenario) : title);
  if (plots.ok()) {
    std::printf("plots: %s, %s; table: %s/compare.csv\n", (*plots)[0].c_str(),
                (*plots)[1].c_str(), dir.c_str());
  } else {
    std::printf("plots not rendered: %s\n", plots.status().message().c_str());
  }
  std::fflush(stdout);
  return all_ok ? 0 : 1;
}

}  // namespace dsync::app
