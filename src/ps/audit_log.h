// The scheduler's audit log: one JSON line per decision, flushed at once, so that the log
// holds every decision even if the job dies right after (Config::audit_log).
#pragma once

#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/auto_policy.h"

namespace dsync::ps {

class AuditLog {
 public:
  AuditLog() = default;
  ~AuditLog();
  AuditLog(const AuditLog&) = delete;
  AuditLog& operator=(const AuditLog&) = delete;

  // An empty path keeps no log. `append`: a restarted scheduler's, which goes on with the
  // log it kept before (last_round() says which round it ends with).
  Status Open(const std::string& path, bool append = false);
  bool enabled() const { return file_ != nullptr; }
  // The newest round of the log opened to append to, if it has any.
  std::optional<dsync::Round> last_round() const { return last_round_; }

  // {"round":R,"live":L,"quorum":Q,"members":[[worker,clock,base,staleness],...]}, where a
  // member's staleness is R - base: how many rounds its gradient's model is behind, what the
  // staleness policy weighs it by.
  void Round(const RoundRecord& rec);
  // {"member":{"event":E,"role":"server"|"worker","id":N,"address":"HOST:PORT"}} with E
  // registered (a server: the address workers reach it at), joined (a worker: the address
  // it connected from; "round": the first round it counts in), left, failed ("why").
  void Member(std::string_view event, std::string_view role, NodeId id, std::string_view address,
              std::string_view why = {}, std::optional<dsync::Round> round = std::nullopt);
  // {"policy":{"from_round":R,"quorum":Q,"allowance":{"worker":rounds,...}}}: the workers
  // delayed (every other one's allowance is 0).
  void Policy(dsync::Round from_round, uint32_t quorum, const Allowances& allowance);
  // {"lr":{"from_round":R,"value":LR,"worker":W}}: worker W set the learning rate of every
  // tensor to LR from round R on (Worker::SetLearningRate).
  void LearningRate(dsync::Round from_round, float lr, WorkerId worker);
  // {"damp":{"from_round":R,"policy":P,"why":W}}: the staleness policy damp found the job's
  // gradients growing (W) and every server applies P from round R on.
  void Damp(dsync::Round from_round, std::string_view policy, std::string_view why);

 private:
  void Write(const fmt::memory_buffer& line);
  std::FILE* file_ = nullptr;
  std::optional<dsync::Round> last_round_;
};

}  // namespace dsync::ps
