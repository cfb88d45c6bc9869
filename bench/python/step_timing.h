// What bench/python/overhead.py's C++ workers share: the process's CPU clock and page faults,
// a timed run of steps, the median of its steps after its warm-up, and their arguments.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <optional>

#include <sys/resource.h>
#include <string>
#include <vector>

namespace step_timing {

inline double CpuMs() {  // this process's CPU time, every thread: the transfers' threads count too
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// Minor page faults of the process so far (every thread): first touches of memory, which the
// heap's trimming and re-growing cause and which are slow on these VMs.
inline long MinorFaults() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

// The iterations a run times after its warm-up (the first fifth, at most 10).
inline size_t Kept(size_t n) { return n - std::min<size_t>(n / 5, 10); }

inline double MedianAfterWarmup(const std::vector<double>& v) {
  std::vector<double> kept(v.end() - static_cast<long>(Kept(v.size())), v.end());
  std::nth_element(kept.begin(), kept.begin() + static_cast<long>(kept.size() / 2), kept.end());
  return kept[kept.size() / 2];
}

// "600000,300000" -> {600000, 300000}; empty on a malformed list.
inline std::vector<size_t> ParseSizes(std::string s) {
  std::vector<size_t> sizes;
  while (!s.empty()) {
    const size_t comma = s.find(',');
    const std::string item = s.substr(0, comma);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos) return {};
    sizes.push_back(std::stoul(item));
    s = comma == std::string::npos ? "" : s.substr(comma + 1);
  }
  return sizes;
}

// Times `steps` calls of step() (a bool: false stops the run): wall and CPU ms of each, and
// the minor page faults per step over the run.
struct Timed {
  std::vector<double> ms, cpu;
  double faults = 0;
  template <typename F>
  bool Run(int steps, F&& step) {
    const long f0 = MinorFaults();
    for (int k = 0; k < steps; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = CpuMs();
      if (!step()) return false;
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      cpu.push_back(CpuMs() - c0);
    }
    faults = static_cast<double>(MinorFaults() - f0) / steps;
    return true;
  }
};

struct Args {
  int steps = 0;
  std::vector<size_t> sizes;
};

// PROGRAM STEPS SIZES: the arguments both workers take; a usage message on stderr if wrong.
inline std::optional<Args> ParseArgs(int argc, char** argv, const char* program) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s STEPS SIZES(a,b,..)\n", program);
    return std::nullopt;
  }
  Args args{std::atoi(argv[1]), ParseSizes(argv[2])};
  if (args.steps <= 0 || args.sizes.empty()) {
    std::fprintf(stderr, "%s: STEPS must be > 0 and SIZES a list like 600000,1000\n", program);
    return std::nullopt;
  }
  return args;
}

}  // namespace step_timing
