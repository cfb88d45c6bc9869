// Slurm's host lists (SLURM_JOB_NODELIST): "node[01-04,07],gpu3,rack[1-2]-n[1-2]".
// Written here rather than linked from libslurm: the job's processes must not need Slurm's
// libraries (nor its version) to read one environment variable.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "dsync/status.h"

namespace dsync::ps {

// Hosts a list may expand to before it is refused (a typo like n[1-999999999]).
inline constexpr size_t kMaxHostListHosts = 1 << 16;

// Every host of `list` in order. Ranges keep the lower bound's zero padding (01-10 gives
// 01 … 10); several bracket groups in one name multiply out, the leftmost varying slowest.
// A list that cannot be parsed is an error naming the position and what was expected.
Result<std::vector<std::string>> ExpandHostList(std::string_view list);

}  // namespace dsync::ps
