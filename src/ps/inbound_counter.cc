#include "ps/inbound_counter.h"

#include <fmt/format.h>

namespace dsync::ps {

bool InboundCounter::Admit(const std::string& source, std::string* why) {
  auto it = pending_by_source_.find(source);
  const uint32_t from_source = it == pending_by_source_.end() ? 0 : it->second;
  if (open_ >= limits_.max_connections) {
    *why = fmt::format("{} connections are open, the most this listener takes", open_);
  } else if (pending_ >= limits_.max_pending) {
    *why = fmt::format("{} connections have not authenticated yet, the most it waits for",
                       pending_);
  } else if (from_source >= limits_.max_pending_per_source) {
    *why = fmt::format("{} connections from {} have not authenticated yet, the most it takes "
                       "from one address",
                       from_source, source);
  } else {
    ++open_;
    ++pending_;
    ++pending_by_source_[source];
    return true;
  }
  return false;
}

void InboundCounter::NoLongerPending(const std::string& source) {
  --pending_;
  if (auto it = pending_by_source_.find(source);
      it != pending_by_source_.end() && --it->second == 0) {
    pending_by_source_.erase(it);
  }
}

}  // namespace dsync::ps
