#include "run_metrics.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

extern char** environ;

namespace dsync::train {
namespace {

using nlohmann::json;

json Optional(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }
json Optional(const std::optional<Version>& v) { return v ? json(*v) : json(nullptr); }

json Summary(const RunMetrics& m) {
  return {{"label", m.label},
          {"sync", m.sync},
          {"staleness", m.staleness},
          {"scenario", m.scenario},
          {"workers", m.workers},
          {"servers", m.servers},
          {"batch", m.batch},
          {"ok", m.ok},
          {"seconds", m.seconds},
          {"final_version", m.final_version},
          {"gradients", m.gradients},
          {"final_accuracy", m.final_accuracy},
          {"final_loss", m.final_loss},
          {"target", m.target},
          {"first_reach_s", Optional(m.first_reach_s)},
          {"first_reach_round", Optional(m.first_reach_round)},
          {"stays_from_s", Optional(m.stays_from_s)},
          {"stays_from_round", Optional(m.stays_from_round)},
          {"damped_from_round", Optional(m.damped_from_round)},
          {"growth_peak", Optional(m.growth_peak)}};
}

Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return Error(StatusCode::kInvalidArgument, "cannot write '{}'", path);
  return Status::Ok();
}

std::string Seconds(const std::optional<double>& s) {
  return s ? fmt::format("{:.1f}", *s) : std::string("-");
}
std::string RoundText(const std::optional<Version>& r) {
  return r ? std::to_string(*r) : std::string("-");
}

// Runs `argv` and waits; false if it could not run or failed.
bool RunProgram(const std::vector<std::string>& args, int* status) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return false;
  if (waitpid(pid, status, 0) != pid) return false;
  return WIFEXITED(*status) && WEXITSTATUS(*status) == 0;
}

}  // namespace

void ComputeTargetTimes(RunMetrics& m) {
  m.first_reach_s.reset();
  m.first_reach_round.reset();
  m.stays_from_s.reset();
  m.stays_from_round.reset();
  for (const CurvePoint& p : m.curve) {
    if (p.accuracy >= m.target) {
      m.first_reach_s = p.seconds;
      m.first_reach_round = p.round;
      break;
    }
  }
  // Walk back from the end while the curve stays at or above the target.
  for (size_t i = m.curve.size(); i-- > 0;) {
    if (m.curve[i].accuracy < m.target) break;
    m.stays_from_s = m.curve[i].seconds;
    m.stays_from_round = m.curve[i].round;
  }
}

Status WriteCurveCsv(const RunMetrics& m, const std::string& path) {
  std::string text = "seconds,round,gradients,accuracy,test_loss,train_loss\n";
  for (const CurvePoint& p : m.curve) {
    text += fmt::format("{:.3f},{},{},{:.4f},{:.4f},{:.4f}\n", p.seconds, p.round, p.gradients,
                        p.accuracy, p.test_loss, p.train_loss);
  }
  return WriteText(path, text);
}

std::string SummaryJson(const RunMetrics& m) { return Summary(m).dump(); }

Status WriteSummaryJson(const RunMetrics& m, const std::string& path) {
  json j = Summary(m);
  json curve = json::array();
  for (const CurvePoint& p : m.curve) {
    curve.push_back({{"seconds", p.seconds}, {"round", p.round}, {"gradients", p.gradients},
                     {"accuracy", p.accuracy}, {"test_loss", p.test_loss},
                     {"train_loss", p.train_loss}});
  }
  j["curve"] = std::move(curve);
  return WriteText(path, j.dump(2) + "\n");
}

Result<RunMetrics> ReadSummaryJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error(StatusCode::kNotFound, "cannot read '{}'", path);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Error(StatusCode::kInvalidArgument, "'{}' is not a JSON object", path);
  }
  RunMetrics m;
  // Numbers of the wrong type or missing fields read as their defaults; only the curve is
  // required, since everything that is compared comes from it.
  auto num = [&](const json& o, const char* key, double fallback) {
    auto it = o.find(key);
    return it != o.end() && it->is_number() ? it->get<double>() : fallback;
  };
  auto text = [&](const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  m.label = text("label");
  m.sync = text("sync");
  m.staleness = text("staleness");
  if (m.staleness.empty()) m.staleness = "none";  // written before the policy existed
  m.scenario = text("scenario");
  m.workers = static_cast<uint32_t>(num(j, "workers", 0));
  m.servers = static_cast<uint32_t>(num(j, "servers", 0));
  m.batch = static_cast<uint32_t>(num(j, "batch", 0));
  m.ok = j.value("ok", false);
  m.seconds = num(j, "seconds", 0);
  m.final_version = static_cast<Version>(num(j, "final_version", 0));
  m.gradients = static_cast<uint64_t>(num(j, "gradients", 0));
  m.final_accuracy = num(j, "final_accuracy", 0);
  m.final_loss = num(j, "final_loss", 0);
  m.target = num(j, "target", 0.85);
  if (auto d = j.find("damped_from_round"); d != j.end() && d->is_number_unsigned()) {
    m.damped_from_round = d->get<Version>();
  }
  if (auto g = j.find("growth_peak"); g != j.end() && g->is_number()) {
    m.growth_peak = g->get<double>();
  }
  auto curve = j.find("curve");
  if (curve == j.end() || !curve->is_array() || curve->empty()) {
    return Error(StatusCode::kInvalidArgument,
                 "'{}' has no curve (a summary.json written with --out has one)", path);
  }
  for (const json& p : *curve) {
    if (!p.is_object()) return Error(StatusCode::kInvalidArgument, "'{}': a curve point is not an object", path);
    m.curve.push_back({num(p, "seconds", 0), static_cast<Version>(num(p, "round", 0)),
                       static_cast<uint64_t>(num(p, "gradients", 0)), num(p, "accuracy", 0),
                       num(p, "test_loss", 0), num(p, "train_loss", 0)});
  }
  if (m.label.empty()) m.label = m.sync.empty() ? path : m.sync;
  ComputeTargetTimes(m);
  return m;
}

std::string CompareTable(const std::vector<RunMetrics>& runs) {
  const std::string pct =
      runs.empty() ? std::string("target") : fmt::format("{:.0f}%", 100 * runs[0].target);
  // Times relative to bsp's, when bsp is among the runs: the speed-up in one number.
  const RunMetrics* bsp = nullptr;
  for (const RunMetrics& m : runs) {
    if (m.label == "bsp") bsp = &m;
  }
  auto ratio = [](const std::optional<double>& a, const RunMetrics* b,
                  std::optional<double> RunMetrics::*field) {
    if (!a || !b || !(b->*field) || *(b->*field) <= 0) return std::string("-");
    return fmt::format("{:.2f}", *a / *(b->*field));
  };
  // The mode column fits the longest label ("dsync:auto/exp:0.5").
  size_t width = 14;
  for (const RunMetrics& m : runs) width = std::max(width, m.label.size());
  std::string out = fmt::format(
      "{:<{}} {:>8} {:>7} {:>9} {:>8} {:>8} {:>9} {:>10} {:>10} {:>10}\n", "mode", width,
      "time_s", "rounds", "final_acc", "reach_s", "stays_s", "reach/bsp", "stays/bsp",
      "reach_rnd", "stays_rnd");
  for (const RunMetrics& m : runs) {
    out += fmt::format("{:<{}} {:>8.1f} {:>7} {:>9.4f} {:>8} {:>8} {:>9} {:>10} {:>10} {:>10}{}\n",
                       m.label, width, m.seconds, m.final_version, m.final_accuracy,
                       Seconds(m.first_reach_s), Seconds(m.stays_from_s),
                       ratio(m.first_reach_s, bsp, &RunMetrics::first_reach_s),
                       ratio(m.stays_from_s, bsp, &RunMetrics::stays_from_s),
                       RoundText(m.first_reach_round), RoundText(m.stays_from_round),
                       m.ok ? "" : "  (job FAILED)");
  }
  out += fmt::format("reach: first test accuracy >= {}; stays: >= {} from then on (seconds "
                     "from launch)\n",
                     pct, pct);
  return out;
}

Status WriteCompareCsv(const std::vector<RunMetrics>& runs, const std::string& path) {
  std::string text =
      "mode,ok,seconds,final_version,gradients,final_accuracy,target,first_reach_s,"
      "stays_from_s,first_reach_round,stays_from_round\n";
  auto opt = [](const auto& v) { return v ? fmt::format("{}", *v) : std::string(); };
  for (const RunMetrics& m : runs) {
    // dsync:K,Q holds a comma: quote it (RFC 4180).
    const std::string label =
        m.label.find(',') == std::string::npos ? m.label : "\"" + m.label + "\"";
    text += fmt::format("{},{},{:.3f},{},{},{:.4f},{},{},{},{},{}\n", label, m.ok ? 1 : 0,
                        m.seconds, m.final_version, m.gradients, m.final_accuracy, m.target,
                        opt(m.first_reach_s), opt(m.stays_from_s), opt(m.first_reach_round),
                        opt(m.stays_from_round));
  }
  return WriteText(path, text);
}

std::string FileSafe(const std::string& label) {
  std::string out = label;
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') c = '_';
  }
  return out;
}

Result<std::vector<std::string>> WritePlots(const std::vector<RunMetrics>& runs,
                                            const std::string& dir, const std::string& title) {
  std::string time_plot, round_plot;
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string csv = FileSafe(runs[i].label) + ".csv";
    DSYNC_RETURN_IF_ERROR(WriteCurveCsv(runs[i], dir + "/" + csv));
    const std::string sep = i ? ", \\\n     " : "";
    time_plot += fmt::format("{}'{}' using 1:4 with lines lw 2 title '{}'", sep, csv,
                             runs[i].label);
    round_plot += fmt::format("{}'{}' using 2:4 with lines lw 2 title '{}'", sep, csv,
                              runs[i].label);
  }
  const double target = runs.empty() ? 0.85 : runs[0].target;
  // Paths in the script are relative to `dir`: gnuplot runs there (cd below).
  const std::string script = fmt::format(
      "# Generated by dsyncps compare; render with: gnuplot plot.gp (in this folder)\n"
      "set datafile separator ','\n"
      "set key bottom right\n"
      "set grid\n"
      "set yrange [0.5:0.95]\n"
      "set ylabel 'test accuracy'\n"
      "set terminal svg size 900,560 dynamic background rgb 'white'\n"
      "set title '{}'\n"
      "set output 'accuracy_time.svg'\n"
      "set xlabel 'wall-clock time (s)'\n"
      "plot {} , \\\n     {} with lines dt 2 lc rgb 'gray' title '{:.0f}%'\n"
      "set output 'accuracy_rounds.svg'\n"
      "set xlabel 'round (model version)'\n"
      "plot {} , \\\n     {} with lines dt 2 lc rgb 'gray' title '{:.0f}%'\n",
      title, time_plot, target, 100 * target, round_plot, target, 100 * target);
  DSYNC_RETURN_IF_ERROR(WriteText(dir + "/plot.gp", script));
  int status = 0;
  if (!RunProgram({"sh", "-c", fmt::format("cd '{}' && gnuplot plot.gp", dir)}, &status)) {
    return Error(StatusCode::kUnavailable,
                 "gnuplot did not render the plots (exit status {}); install it (apt-get "
                 "install gnuplot-nox) and run 'gnuplot plot.gp' in {}",
                 status, dir);
  }
  return std::vector<std::string>{dir + "/accuracy_time.svg", dir + "/accuracy_rounds.svg"};
}

}  // namespace dsync::train
