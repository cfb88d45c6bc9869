#include "ps/audit_log.h"

#include <iterator>

namespace dsync::ps {

AuditLog::~AuditLog() {
  if (file_) std::fclose(file_);
}

Status AuditLog::Open(const std::string& path) {
  if (path.empty()) return Status::Ok();
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) return Error(StatusCode::kInvalidArgument, "cannot write the audit log '{}'", path);
  return Status::Ok();
}

void AuditLog::Round(const RoundRecord& rec) {
  if (!file_) return;
  fmt::memory_buffer line;
  fmt::format_to(std::back_inserter(line),
                 "{{\"round\":{},\"live\":{},\"quorum\":{},\"members\":[", rec.round,
                 rec.live_workers, rec.quorum_needed);
  for (size_t i = 0; i < rec.members.size(); ++i) {
    const RoundMember& m = rec.members[i];
    fmt::format_to(std::back_inserter(line), "{}[{},{},{}]", i ? "," : "", m.worker, m.clock,
                   m.base);
  }
  fmt::format_to(std::back_inserter(line), "]}}\n");
  Write(line);
}

void AuditLog::Policy(dsync::Round from_round, uint32_t quorum,
                      const std::map<WorkerId, uint32_t>& allowance) {
  if (!file_) return;
  fmt::memory_buffer line;
  fmt::format_to(std::back_inserter(line),
                 "{{\"policy\":{{\"from_round\":{},\"quorum\":{},\"allowance\":{{", from_round,
                 quorum);
  bool first = true;
  for (const auto& [id, rounds] : allowance) {
    fmt::format_to(std::back_inserter(line), "{}\"{}\":{}", first ? "" : ",", id, rounds);
    first = false;
  }
  fmt::format_to(std::back_inserter(line), "}}}}}}\n");
  Write(line);
}

void AuditLog::Write(const fmt::memory_buffer& line) {
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

}  // namespace dsync::ps
