#include "heap.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace dsyncps_py {
namespace {

std::mutex g_mu;
std::string g_state = "not asked yet (no worker or observer has started)";

// A heap setting the user made: theirs wins.
const char* UserHeapSetting() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return name;
  }
  if (const char* t = std::getenv("GLIBC_TUNABLES"); t != nullptr && std::strstr(t, "glibc.malloc.")) {
    return "GLIBC_TUNABLES";
  }
  return nullptr;
}

}  // namespace

void PinHeap(bool wanted) {
  std::lock_guard lock(g_mu);
#if defined(__GLIBC__)
  if (!wanted) {
    g_state = "left to glibc (DSYNC_PIN_HEAP=0)";
  } else if (const char* name = UserHeapSetting()) {
    g_state = fmt::format("left to glibc ({} is set)", name);
  } else if (mallopt(M_MMAP_THRESHOLD, kPinnedMmapThreshold) != 1) {
    g_state = "left to glibc (mallopt refused the mmap threshold)";
  } else if (mallopt(M_TRIM_THRESHOLD, kPinnedTrimThreshold) != 1) {
    // The mmap threshold alone still keeps large blocks out of mmap; say what is missing.
    g_state = "mmap threshold pinned, trim threshold refused by mallopt";
  } else {
    g_state = fmt::format("pinned (mmap threshold {} MiB, trim threshold {} MiB)",
                          kPinnedMmapThreshold >> 20, kPinnedTrimThreshold >> 20);
  }
#else
  g_state = wanted ? "left alone (the C library is not glibc)" : "left alone (DSYNC_PIN_HEAP=0)";
#endif
}

std::string HeapState() {
  std::lock_guard lock(g_mu);
  return g_state;
}

}  // namespace dsyncps_py
