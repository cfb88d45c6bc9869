#include "train_job.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <signal.h>
#include <sys/wait.h>

#include <cblas.h>

#include <atomic>
#include <charconv>
#include <cmath>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>

#include "dsync/worker.h"
#include "evaluator.h"
#include "fashion_mnist.h"
#include "launcher.h"
#include "mlp.h"
#include "mlp_train.h"
#include "progress_view.h"
#include "worker_io.h"

namespace dsync::app {
namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr uint32_t kTrainImages = 60000;  // Fashion-MNIST's training set
constexpr uint32_t kReportEvery = 10;     // iterations between a worker's @progress lines
const std::vector<uint32_t> kHidden = {256, 128};

double Since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// What the workers report (main thread) and the monitor reads when it takes a snapshot.
class JobCounters {
 public:
  void Report(uint32_t worker, uint64_t iterations, double loss) {
    std::lock_guard lock(mu_);
    Entry& e = workers_[worker];
    e.iterations = iterations;
    e.loss = loss;
  }
  void Exited(uint32_t worker) {
    std::lock_guard lock(mu_);
    workers_[worker].running = false;
  }
  void Started(uint32_t worker) {
    std::lock_guard lock(mu_);
    workers_[worker].running = true;
  }
  uint64_t gradients() const {
    std::lock_guard lock(mu_);
    uint64_t n = 0;
    for (const auto& [w, e] : workers_) n += e.iterations;
    return n;
  }
  // Mean of the running workers' latest minibatch losses (0: none reported yet).
  double loss() const {
    std::lock_guard lock(mu_);
    double sum = 0;
    int n = 0;
    for (const auto& [w, e] : workers_) {
      if (e.running && e.loss > 0) {
        sum += e.loss;
        ++n;
      }
    }
    return n ? sum / n : 0;
  }
  uint32_t running() const {
    std::lock_guard lock(mu_);
    uint32_t n = 0;
    for (const auto& [w, e] : workers_) n += e.running ? 1 : 0;
    return n;
  }

 private:
  struct Entry {
    uint64_t iterations = 0;
    double loss = 0;
    bool running = false;
  };
  mutable std::mutex mu_;
  std::map<uint32_t, Entry> workers_;
};

// The observer: pulls the model's version often (one small tensor) and full snapshots every
// eval interval, and hands them to a low-priority evaluator; when the scheduler says
// training is over it pulls the final model and leaves.
class Monitor {
 public:
  Monitor(const train::Dataset& test, const TrainSpec& spec, const JobCounters& counters,
          SteadyClock::time_point t0)
      : spec_(spec), counters_(counters), t0_(t0),
        sizes_(train::LayerSizes(test, kHidden)),
        evaluator_(test, sizes_, 0, train::SnapshotEvaluator::Policy::kQueueAll,
                   /*low_priority=*/true,
                   /*max_backlog=*/4) {}

  ~Monitor() { Stop(); }

  void Start(const std::map<std::string, std::string>& env) {
    auto cfg = Config::FromEnvironment(env);
    if (!cfg.ok()) {
      error_ = cfg.status().ToString();
      return;
    }
    cfg->role = Role::kWorker;
    cfg->observer = true;
    thread_ = std::thread([this, c = *cfg] { Loop(c); });
  }

  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  Version round() const { return round_.load(); }
  bool saw_final() const { return saw_final_.load(); }
  std::string error() const {
    std::lock_guard lock(mu_);
    return error_;
  }

  // Evaluated points so far, completed with what the workers had done by then.
  std::vector<train::CurvePoint> TakePoints() {
    std::vector<train::CurvePoint> out;
    for (const train::EvalPoint& e : evaluator_.Take()) {
      std::lock_guard lock(mu_);
      const Taken& t = taken_.at(e.iteration);
      out.push_back({e.seconds, e.version, t.gradients, e.eval.accuracy, e.eval.loss, t.loss});
    }
    return out;
  }
  void Drain() { evaluator_.Drain(); }

 private:
  struct Taken {
    uint64_t gradients;
    double loss;
  };

  void Loop(const Config& cfg) {
    // In attempts of at most 2 s: a job that fails before the observer got in (Stop) must
    // not hold the command for the whole connect timeout.
    Config attempt = cfg;
    attempt.connect_timeout_ms = std::min<uint32_t>(cfg.connect_timeout_ms, 2000);
    const auto deadline = SteadyClock::now() + std::chrono::milliseconds(cfg.connect_timeout_ms);
    Result<std::unique_ptr<Worker>> started = Worker::Start(attempt);
    while (!started.ok() && !stop_ && SteadyClock::now() < deadline &&
           (started.status().code() == StatusCode::kUnavailable ||
            started.status().code() == StatusCode::kDeadlineExceeded)) {
      started = Worker::Start(attempt);
    }
    if (!started.ok()) {
      std::lock_guard lock(mu_);
      error_ = started.status().ToString();
      return;
    }
    Worker& w = **started;
    const train::Mlp model(sizes_, 1);
    std::vector<std::vector<float>> params = model.Initialize(spec_.seed);
    std::vector<TensorId> ids;
    std::vector<float*> out;
    std::vector<std::span<const float>> views;
    for (size_t i = 0; i < params.size(); ++i) {
      auto id = w.Register(model.params()[i].name, params[i]);
      if (!id.ok()) {
        std::lock_guard lock(mu_);
        error_ = id.status().ToString();
        return;
      }
      ids.push_back(*id);
      out.push_back(params[i].data());
      views.emplace_back(params[i]);
    }
    std::vector<float> probe(params.back().size());  // the smallest tensor: the last bias
    auto next_eval = SteadyClock::now();
    const auto interval = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(spec_.eval_interval_s));
    while (!stop_) {
      if (auto final_version = w.final_version()) {
        Version v = 0;
        if (train::PullAll(w, ids, out, &v).ok()) {
          round_ = v;
          Snapshot(views, v, /*final=*/true);
          saw_final_ = true;
        }
        (void)w.Leave();
        return;
      }
      Version v = 0;
      if (!w.Wait(w.Pull(ids.back(), probe.data()), &v).ok()) return;  // the job is gone
      round_ = v;
      if (SteadyClock::now() >= next_eval) {
        if (!train::PullAll(w, ids, out, &v).ok()) return;
        Snapshot(views, v);
        next_eval += interval;
        if (next_eval < SteadyClock::now()) next_eval = SteadyClock::now() + interval;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    w.Abandon();
  }

  void Snapshot(std::span<const std::span<const float>> views, Version v, bool final = false) {
    std::lock_guard lock(mu_);
    const auto seq = static_cast<uint32_t>(taken_.size());
    if (evaluator_.Offer(views, seq, v, Since(t0_), final)) {
      taken_.push_back({counters_.gradients(), counters_.loss()});
    }
  }

  const TrainSpec& spec_;
  const JobCounters& counters_;
  const SteadyClock::time_point t0_;
  const std::vector<uint32_t> sizes_;
  train::SnapshotEvaluator evaluator_;
  std::atomic<bool> stop_{false};
  std::atomic<Version> round_{0};
  std::atomic<bool> saw_final_{false};
  mutable std::mutex mu_;
  std::vector<Taken> taken_;
  std::string error_;
  std::thread thread_;
};

// Lines worth showing while the progress line runs: trouble from anyone, scenario events
// from the workers, membership and policy decisions from the scheduler.
bool Interesting(int worker, std::string_view line) {
  auto has = [&](std::initializer_list<std::string_view> keys) {
    for (std::string_view k : keys) {
      if (line.find(k) != std::string_view::npos) return true;
    }
    return false;
  };
  if (has({"[warning]", "[error]", "error:"})) return true;
  if (worker >= 0) return has({"leaving at round", "injected failure"});
  return has({"scheduler: worker", "dsync:auto", "budget", "runs as bsp",
              "scheduler: staleness policy", "never damped"});
}

// spdlog's "[2026-12-02 17:14:35.963] " prefix: the progress line already tells the time.
std::string_view StripTimestamp(std::string_view line) {
  if (line.size() > 26 && line[0] == '[' && line[25] == ']' && line[5] == '-') {
    return line.substr(27);
  }
  return line;
}

// "" for the CPU (the default says nothing); else what the workers will run, auto resolved
// here as they will resolve it (they run on this machine).
std::string WorkerMathNote(const std::string& text) {
  if (text == "cpu") return "";
  auto kind = train::ParseMlpMath(text);
  if (!kind.ok() || *kind != train::MlpMathKind::kAuto) return "; worker math " + text;
  auto resolved = train::ResolveMlpMath(*kind);
  return fmt::format("; worker math auto ({})",
                     resolved.ok() ? train::MlpMathName(*resolved) : std::string_view("?"));
}

std::vector<std::string> WorkerArgs(const TrainSpec& spec, uint32_t i) {
  std::vector<std::string> a = {"--model",        "mlp",
                                "--iters",        "0",
                                "--batch",        std::to_string(spec.batch),
                                "--shards",       std::to_string(spec.workers),
                                "--seed",         std::to_string(spec.seed),
                                "--data-dir",     spec.data_dir,
                                "--eval-every",   "0",
                                "--log-every",    "0",
                                "--report-every", std::to_string(kReportEvery),
                                "--compute-ms",   fmt::format("{}", spec.compute_ms),
                                "--worker-math",  spec.worker_math};
  const Scenario& s = spec.scenario;
  if (auto it = s.slow.find(i); it != s.slow.end()) {
    a.insert(a.end(), {"--slow", fmt::format("{}", it->second)});
  }
  if (auto it = s.leave_round.find(i); it != s.leave_round.end()) {
    a.insert(a.end(), {"--leave-at-round", std::to_string(it->second)});
  }
  if (auto it = s.kill_round.find(i); it != s.kill_round.end()) {
    a.insert(a.end(), {"--kill-at-round", std::to_string(it->second)});
  }
  return a;
}

}  // namespace

Status MakeDirectories(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Error(StatusCode::kInvalidArgument, "cannot create the output folder '{}': {}", dir,
                 ec.message());
  }
  return Status::Ok();
}

namespace {

Status ParseMap(const std::vector<std::string>& specs, uint32_t workers, const char* flag,
                const char* what, const std::function<Status(uint32_t, const std::string&)>& put) {
  for (const std::string& spec : specs) {
    const auto eq = spec.find('=');
    char* end = nullptr;
    const unsigned long i = std::strtoul(spec.c_str(), &end, 10);
    if (eq == std::string::npos || end != spec.c_str() + eq || i >= workers) {
      return Error(StatusCode::kInvalidArgument, "{} '{}' is not WORKER={} with WORKER < {}",
                   flag, spec, what, workers);
    }
    DSYNC_RETURN_IF_ERROR(put(static_cast<uint32_t>(i), spec.substr(eq + 1)));
  }
  return Status::Ok();
}

}  // namespace

Status ParseScenario(const std::vector<std::string>& straggler, const std::vector<std::string>& join,
                     const std::vector<std::string>& leave, const std::vector<std::string>& kill,
                     const std::vector<std::string>& latency, uint32_t workers, Scenario* s) {
  auto number = [](const char* flag, const std::string& v, double lo) -> Result<double> {
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(x >= lo) || !std::isfinite(x)) {
      return Error(StatusCode::kInvalidArgument, "{}: '{}' is not a number >= {}", flag, v, lo);
    }
    return x;
  };
  auto put_double = [&](const char* flag, double lo, std::map<uint32_t, double>& m) {
    return [&, flag, lo](uint32_t i, const std::string& v) -> Status {
      DSYNC_ASSIGN_OR_RETURN(double x, number(flag, v, lo));
      m[i] = x;
      return Status::Ok();
    };
  };
  auto put_round = [&](const char* flag, std::map<uint32_t, uint64_t>& m) {
    return [&, flag](uint32_t i, const std::string& v) -> Status {
      DSYNC_ASSIGN_OR_RETURN(double x, number(flag, v, 0));
      // Converting a double past the largest uint64_t is undefined behaviour.
      if (!(x < 0x1p64)) {
        return Error(StatusCode::kInvalidArgument, "{}: round '{}' is too large", flag, v);
      }
      m[i] = static_cast<uint64_t>(x);
      return Status::Ok();
    };
  };
  DSYNC_RETURN_IF_ERROR(ParseMap(straggler, workers, "--straggler", "FACTOR",
                                 put_double("--straggler", 1, s->slow)));
  DSYNC_RETURN_IF_ERROR(
      ParseMap(join, workers, "--join", "ROUND", put_round("--join", s->join_round)));
  DSYNC_RETURN_IF_ERROR(
      ParseMap(leave, workers, "--leave", "ROUND", put_round("--leave", s->leave_round)));
  DSYNC_RETURN_IF_ERROR(
      ParseMap(kill, workers, "--kill", "ROUND", put_round("--kill", s->kill_round)));
  DSYNC_RETURN_IF_ERROR(ParseMap(latency, workers, "--latency", "MILLISECONDS",
                                 put_double("--latency", 0, s->latency_ms)));
  if (s->join_round.size() >= workers) {
    return Error(StatusCode::kInvalidArgument,
                 "at least one worker must start the job (every worker has --join)");
  }
  return Status::Ok();
}

std::string Scenario::Describe() const {
  std::vector<std::string> parts;
  for (const auto& [w, f] : slow) parts.push_back(fmt::format("worker {} {}x slower", w, f));
  for (const auto& [w, r] : join_round) parts.push_back(fmt::format("worker {} joins at round {}", w, r));
  for (const auto& [w, r] : leave_round) parts.push_back(fmt::format("worker {} leaves at round {}", w, r));
  for (const auto& [w, r] : kill_round) parts.push_back(fmt::format("worker {} killed at round {}", w, r));
  for (const auto& [w, ms] : latency_ms) parts.push_back(fmt::format("worker {} +{} ms link latency", w, ms));
  if (parts.empty()) return "balanced";
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

Result<train::RunMetrics> RunTrainJob(const std::string& self, const TrainSpec& spec) {
  // The dataset first: a missing package is reported before any process starts (workers
  // read the training set the same way and fail with the same message).
  DSYNC_ASSIGN_OR_RETURN(train::Dataset test, train::LoadFashionMnist(spec.data_dir, "t10k"));
  if (!spec.out_dir.empty()) DSYNC_RETURN_IF_ERROR(MakeDirectories(spec.out_dir));
  const uint64_t budget = static_cast<uint64_t>(
      std::ceil(spec.epochs * kTrainImages / static_cast<double>(spec.batch)));

  LaunchPlan plan;
  plan.servers = spec.servers;
  plan.timeout_s = spec.timeout_s;
  plan.scheduler_env["DSYNC_MAX_GRADIENTS"] = std::to_string(budget);
  for (uint32_t i = 0; i < spec.workers; ++i) {
    WorkerLaunch w;
    w.args = WorkerArgs(spec, i);
    if (auto it = spec.scenario.latency_ms.find(i); it != spec.scenario.latency_ms.end()) {
      w.env["DSYNC_LINK_DELAY_MS"] = fmt::format("{}", it->second);
    }
    w.on_demand = spec.scenario.join_round.contains(i);
    plan.workers.push_back(std::move(w));
  }

  // This process's own log lines (the observer's) would only repeat what the progress says.
  // One BLAS thread: the machine's cores belong to the job being measured.
  openblas_set_num_threads(1);
  const auto log_level = spdlog::get_level();
  if (!spec.verbose) spdlog::set_level(spdlog::level::warn);
  const auto t0 = SteadyClock::now();
  JobCounters counters;
  Monitor monitor(test, spec, counters, t0);
  ProgressView view(ProgressView::StdoutIsTerminal(), std::chrono::seconds(2));
  train::RunMetrics m;
  m.label = spec.label.empty() ? spec.job.sync.ToString() : spec.label;
  m.sync = spec.job.sync.ToString();
  m.staleness = spec.job.staleness.ToString();
  m.scenario = spec.scenario.Describe();
  m.workers = spec.workers;
  m.servers = spec.servers;
  m.batch = spec.batch;
  m.target = spec.target;
  std::deque<std::pair<double, uint64_t>> rate_window;  // (seconds, gradients)

  LaunchHooks hooks;
  hooks.on_started = [&](const std::map<std::string, std::string>& env) { monitor.Start(env); };
  hooks.on_line = [&](int worker, std::string_view line) {
    // "scheduler: staleness policy P from round R: why" (the staleness policy damp).
    constexpr std::string_view kDamped = "scheduler: staleness policy ";
    if (const size_t at = line.find(kDamped); worker < 0 && at != std::string_view::npos) {
      const size_t from = line.find(" from round ", at);
      Version round = 0;
      const std::string_view rest =
          from == std::string_view::npos ? std::string_view{} : line.substr(from + 12);
      if (std::from_chars(rest.data(), rest.data() + rest.size(), round).ec == std::errc{}) {
        m.damped_from_round = round;
      }
    }
    // "..., never damped (the gradients' growth peaked at X at round R)": the job's end.
    constexpr std::string_view kPeak = "growth peaked at ";
    if (const size_t at = line.find(kPeak); worker < 0 && at != std::string_view::npos) {
      const std::string_view rest = line.substr(at + kPeak.size());
      double peak = 0.0;
      if (std::from_chars(rest.data(), rest.data() + rest.size(), peak).ec == std::errc{}) {
        m.growth_peak = peak;
      }
    }
    if (worker >= 0 && line.starts_with("@progress ")) {
      // A worker counts as running from its first report until its process ends.
      counters.Started(static_cast<uint32_t>(worker));
      auto j = nlohmann::json::parse(line.substr(10), nullptr, false);
      if (j.is_object()) {
        counters.Report(static_cast<uint32_t>(worker), j.value("it", uint64_t{0}),
                        j.value("loss", 0.0));
      }
      return false;
    }
    return spec.verbose || Interesting(worker, line);
  };
  hooks.print = [&](const std::string& name, std::string_view line) {
    view.Log(fmt::format("[{}] {}", name, StripTimestamp(line)));
  };
  hooks.start_worker = [&](uint32_t i) {
    const bool go = monitor.round() >= spec.scenario.join_round.at(i);
    if (go) view.Log(fmt::format("dsyncps train: starting worker {} at round {}", i, monitor.round()));
    return go;
  };
  std::optional<double> accuracy;
  Version accuracy_round = 0;
  std::vector<train::CurvePoint> curve;
  auto take_points = [&] {
    for (const train::CurvePoint& p : monitor.TakePoints()) {
      curve.push_back(p);
      if (!accuracy || p.round >= accuracy_round) {  // the newest model evaluated so far
        accuracy = p.accuracy;
        accuracy_round = p.round;
      }
    }
  };
  ProgressStatus st;
  hooks.on_tick = [&] {
    take_points();
    const double now = Since(t0);
    const uint64_t g = counters.gradients();
    rate_window.emplace_back(now, g);
    while (rate_window.size() > 2 && now - rate_window.front().first > 3.0) rate_window.pop_front();
    const double dt = now - rate_window.front().first;
    st.label = spec.label;
    st.seconds = now;
    st.round = monitor.round();
    st.gradients = g;
    st.budget = budget;
    st.train_loss = counters.loss();
    st.accuracy = accuracy;
    st.accuracy_round = accuracy_round;
    st.samples_per_s =
        dt > 0.2 ? static_cast<double>((g - rate_window.front().second) * spec.batch) / dt : 0;
    st.workers_running = counters.running();
    view.Update(st);
  };
  hooks.on_worker_exit = [&](uint32_t i, int status, bool stopped_by_launcher) {
    counters.Exited(i);
    if (WIFSIGNALED(status) && !stopped_by_launcher) {
      view.Log(fmt::format("dsyncps train: worker {} was killed (signal {}); the job goes on", i,
                           WTERMSIG(status)));
    }
  };

  std::printf("dsyncps train: %u worker(s), %u server(s), sync %s%s, %s %s lr %g, %.3g epochs "
              "(%llu gradients of %u samples); scenario: %s%s\n",
              spec.workers, spec.servers, m.sync.c_str(),
              m.staleness == "none" ? "" : (" (staleness policy " + m.staleness + ")").c_str(),
              std::string(OptimizerName(spec.job.optimizer.kind)).c_str(),
              spec.job.optimizer.kind == OptimizerKind::kMomentum
                  ? fmt::format("{}", spec.job.optimizer.momentum).c_str()
                  : "",
              static_cast<double>(spec.job.optimizer.lr), spec.epochs,
              static_cast<unsigned long long>(budget), spec.batch, m.scenario.c_str(),
              WorkerMathNote(spec.worker_math).c_str());
  std::fflush(stdout);
  const LaunchOutcome outcome = RunCluster(self, spec.job, plan, hooks);
  m.seconds = Since(t0);
  spdlog::set_level(log_level);
  monitor.Stop();
  monitor.Drain();
  take_points();
  // Evaluated newest first while training ran: back into time order.
  std::sort(curve.begin(), curve.end(),
            [](const auto& a, const auto& b) { return a.seconds < b.seconds; });
  st.seconds = m.seconds;
  st.round = monitor.round();
  st.gradients = counters.gradients();
  st.accuracy = accuracy;
  st.accuracy_round = accuracy_round;
  st.workers_running = 0;
  st.train_loss = 0;
  view.Update(st);
  view.Finish();
  if (!monitor.error().empty()) {
    std::fprintf(stderr, "dsyncps train: the observer failed: %s\n", monitor.error().c_str());
  }
  m.curve = std::move(curve);
  m.gradients = counters.gradients();
  m.ok = outcome.ok && monitor.saw_final();
  if (!m.curve.empty()) {
    m.final_version = m.curve.back().round;
    m.final_accuracy = m.curve.back().accuracy;
    m.final_loss = m.curve.back().test_loss;
  }
  train::ComputeTargetTimes(m);
  if (!outcome.ok) PrintLaunchSummary(outcome, "dsyncps train");
  if (!spec.out_dir.empty()) {
    DSYNC_RETURN_IF_ERROR(train::WriteCurveCsv(m, spec.out_dir + "/metrics.csv"));
    DSYNC_RETURN_IF_ERROR(train::WriteSummaryJson(m, spec.out_dir + "/summary.json"));
  }
  return m;
}

void PrintRunSummary(const train::RunMetrics& m) {
  auto opt_s = [](const std::optional<double>& s) {
    return s ? fmt::format("{:.1f} s", *s) : std::string("never");
  };
  auto opt_r = [](const std::optional<Version>& r) {
    return r ? fmt::format(" (round {})", *r) : std::string();
  };
  std::printf("dsyncps train: %s in %.1f s: sync %s, %u workers, %s\n",
              m.ok ? "finished" : "FAILED", m.seconds, m.sync.c_str(), m.workers,
              m.scenario.c_str());
  std::printf("  final test accuracy %.2f %% (loss %.4f) at round %llu, %llu gradients of %u "
              "samples\n",
              100 * m.final_accuracy, m.final_loss,
              static_cast<unsigned long long>(m.final_version),
              static_cast<unsigned long long>(m.gradients), m.batch);
  std::printf("  %.0f %% first reached at %s%s; stays >= %.0f %% from %s%s\n", 100 * m.target,
              opt_s(m.first_reach_s).c_str(), opt_r(m.first_reach_round).c_str(), 100 * m.target,
              opt_s(m.stays_from_s).c_str(), opt_r(m.stays_from_round).c_str());
  std::printf("@train %s\n", train::SummaryJson(m).c_str());
  std::fflush(stdout);
}

}  // namespace dsync::app
