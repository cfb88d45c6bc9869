// A static NVTX injection for tests: the same mechanism a profiler such as nsys uses to
// receive NVTX calls, linked into the test binary, recording what the program emitted.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dsync::testing {

struct NvtxRecord {
  std::string name;
  uint32_t category = 0;
  uint64_t payload = 0;
  bool has_payload = false;
};

struct NvtxSnapshot {
  std::vector<std::string> domains;              // names given to nvtxDomainCreateA
  std::map<uint32_t, std::string> categories;    // nvtxDomainNameCategoryA
  std::vector<std::string> registered;          // nvtxDomainRegisterStringA
  std::vector<NvtxRecord> pushed;                // push/pop ranges, in call order
  std::vector<NvtxRecord> started;               // start/end ranges, in call order
  int64_t unbalanced_pops = 0;   // pops on a thread with nothing pushed
  int64_t open_pushes = 0;       // pushed and not yet popped, over all threads
  int64_t open_starts = 0;       // started and not yet ended
  int64_t unknown_ends = 0;      // ends of ids never started (or ended twice)
  bool injected = false;         // NVTX called our initialization
};

NvtxSnapshot NvtxRecorded();

}  // namespace dsync::testing
