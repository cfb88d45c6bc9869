// Counts a listener's inbound connections against the AdmissionLimits (ps/transport.h), for
// the transports. Not thread-safe: the transport's own lock guards it.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "ps/transport.h"

namespace dsync::ps {

class InboundCounter {
 public:
  explicit InboundCounter(const AdmissionLimits& limits) : limits_(limits) {}

  // A stranger from `source` (an address without the port) connects: counted as open and
  // pending when the limits let it in; otherwise *why says which limit it met.
  bool Admit(const std::string& source, std::string* why);
  // A pending connection from `source` authenticated, or ended before it did.
  void NoLongerPending(const std::string& source);
  // An admitted connection ended (after NoLongerPending if it was still pending).
  void Closed() { --open_; }

 private:
  const AdmissionLimits limits_;
  uint32_t open_ = 0;
  uint32_t pending_ = 0;
  std::unordered_map<std::string, uint32_t> pending_by_source_;
};

}  // namespace dsync::ps
