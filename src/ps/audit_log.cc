#include "ps/audit_log.h"

#include <algorithm>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

namespace dsync::ps {

AuditLog::~AuditLog() {
  if (file_) std::fclose(file_);
}

Status AuditLog::Open(const std::string& path, bool append) {
  if (path.empty()) return Status::Ok();
  if (append) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("round") && j["round"].is_number_unsigned()) {
        last_round_ = std::max(last_round_.value_or(0), j["round"].get<dsync::Round>());
      }
    }
  }
  // fwrite and fflush lock the stream (stdio is thread-safe): a restartable scheduler's
  // rounds are written from the thread that sends them, the rest under its lock.
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
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
    fmt::format_to(std::back_inserter(line), "{}[{},{},{},{}]", i ? "," : "", m.worker, m.clock,
                   m.base, Staleness(rec.round, m.base));
  }
  fmt::format_to(std::back_inserter(line), "]}}\n");
  Write(line);
}

void AuditLog::Member(std::string_view event, std::string_view role, NodeId id,
                      std::string_view address, std::string_view why,
                      std::optional<dsync::Round> round) {
  if (!file_) return;
  // JSON strings (a server's advertised host is what its hello said: escaped, bytes that are
  // not UTF-8 replaced).
  auto quote = [](std::string_view text) {
    return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  fmt::memory_buffer line;
  fmt::format_to(std::back_inserter(line),
                 "{{\"member\":{{\"event\":{},\"role\":{},\"id\":{},\"address\":{}",
                 quote(event), quote(role), id, quote(address));
  if (round) fmt::format_to(std::back_inserter(line), ",\"round\":{}", *round);
  if (!why.empty()) fmt::format_to(std::back_inserter(line), ",\"why\":{}", quote(why));
  fmt::format_to(std::back_inserter(line), "}}}}\n");
  Write(line);
}

void AuditLog::Policy(dsync::Round from_round, uint32_t quorum, const Allowances& allowance) {
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

void AuditLog::LearningRate(dsync::Round from_round, float lr, WorkerId worker) {
  if (!file_) return;
  fmt::memory_buffer line;
  // {} prints the shortest text that reads back to the same float: the log is exact.
  fmt::format_to(std::back_inserter(line), "{{\"lr\":{{\"from_round\":{},\"value\":{},\"worker\":{}}}}}\n",
                 from_round, lr, worker);
  Write(line);
}

void AuditLog::Damp(dsync::Round from_round, std::string_view policy, std::string_view why) {
  if (!file_) return;
  const nlohmann::json j = {
      {"damp", {{"from_round", from_round}, {"policy", policy}, {"why", why}}}};
  fmt::memory_buffer line;
  fmt::format_to(std::back_inserter(line), "{}\n", j.dump());
  Write(line);
}

void AuditLog::Write(const fmt::memory_buffer& line) {
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

}  // namespace dsync::ps
