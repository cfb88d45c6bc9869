// Plain identifiers and records shared by the public API.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace dsync {

using NodeId = uint32_t;    // scheduler 0, servers 1..S, workers from kFirstWorkerId on,
                            // observers from kFirstObserverId on
using WorkerId = uint32_t;
using TensorId = uint32_t;
using Version = uint64_t;   // number of rounds a slice has applied
using Round = uint64_t;     // round R turns version R into R + 1
using Clock = uint64_t;     // a worker's gradient counter

constexpr NodeId kSchedulerId = 0;
constexpr NodeId kFirstServerId = 1;
constexpr NodeId kFirstWorkerId = 1000;
// Observers (read-only clients: evaluators, monitors) pull the model but never count as
// workers; their ids come from a range of their own so worker ids stay 1000, 1001, ...
constexpr NodeId kFirstObserverId = 0x40000000;

enum class DType : uint8_t { kFloat32 = 1, kFloat64 = 2, kFloat16 = 3, kInt32 = 4 };
std::string_view DTypeName(DType dtype);
inline uint32_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
  }
  return 0;
}

// One gradient named in a round: worker w's gradient number `clock`, computed on `base`.
struct RoundMember {
  WorkerId worker = 0;
  Clock clock = 0;
  Version base = 0;
  bool operator==(const RoundMember&) const = default;
};

// How many rounds a gradient computed on `base` and applied in `round` is behind
// (docs/contract.md, "The delay bound D and staleness"); an empty commit, whose base is its
// round, has none.
inline uint64_t Staleness(Round round, Version base) { return round > base ? round - base : 0; }

// What the scheduler decided for one round (docs/contract.md), kept for audits and tests.
struct RoundRecord {
  Round round = 0;
  std::vector<RoundMember> members;  // sorted by worker id: the summation order
  uint32_t live_workers = 0;         // live workers counted toward quorum for this round
  uint32_t quorum_needed = 0;        // min(Q, live_workers)
  uint32_t live_members = 0;         // members from live workers
};

}  // namespace dsync
