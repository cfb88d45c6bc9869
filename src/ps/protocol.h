// The wire format: every message is one frame = a fixed 64-byte header, `meta_len` bytes of
// small metadata, then `payload_len` bytes of tensor data. Payloads are never parsed: the
// receiver learns from the header where they belong and reads them straight there.
//
// Integers are little-endian (every host we target); the header is read and written as a
// struct, so its layout is pinned by static_asserts below.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync::ps {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

constexpr uint32_t kFrameMagic = 0x53505344;  // "DSPS" in memory order
constexpr uint16_t kProtocolVersion = 1;
// Bounds checked before anything is allocated or read (DESIGN.md §6).
constexpr uint32_t kMaxMetaBytes = 64u << 10;
constexpr uint64_t kMaxPayloadBytes = 1ull << 31;

enum class MsgType : uint16_t {
  // any connection
  kHello = 1,      // meta: JSON {role, token, ...}; first frame on every connection
  kHelloAck = 2,   // meta: JSON (job configuration for the joining node)
  kError = 3,      // status = StatusCode, meta = message, request = the refused request
  kHeartbeat = 4,
  // worker <-> scheduler
  kBegin = 10,     // round = clock, aux = base version the worker now computes on
  kCommit = 11,    // round = clock, aux = base; the clock's pushes are all acknowledged;
                   // flags & kFlagEmpty: nothing was pushed for this clock
  kCommitAck = 12, // round = assigned round, aux = min version for the next pull (or kNoGate);
                   // flags & kFlagStop: the job's gradient budget is spent
  kGate = 13,      // round = clock, aux = min version for pulls at that clock (ssp)
  kLeave = 14,
  kLeaveAck = 15,
  // server <-> scheduler
  kRound = 20,      // round = R, meta = RoundMember[]: the gradients round R applies
  kWorkerGone = 21, // sender-independent: tensor = worker id, round = its last committed clock + 1
  kApplied = 22,    // round = R: the server applied round R
  kShutdown = 23,   // scheduler -> server: the job is over; -> observer: training is over,
                    // round = the final version (read it, then leave)
  // worker <-> server
  kInit = 30,      // tensor, slice, meta = InitMeta, payload = initial values
  kInitAck = 31,   // aux = slice version
  kPush = 32,      // tensor, slice, round = clock, aux = base, payload = gradient
  kPushAck = 33,
  kPull = 34,      // tensor, slice, aux = min version
  kPullReply = 35, // tensor, slice, aux = version, payload = parameters
};

std::string_view MsgTypeName(MsgType type);

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kProtocolVersion;
  uint16_t type = 0;
  uint32_t sender = 0;   // node id (informational; receivers trust the authenticated link)
  uint32_t tensor = 0;
  uint32_t slice = 0;
  uint8_t dtype = 0;
  uint8_t flags = 0;
  uint16_t status = 0;   // StatusCode in kError
  uint64_t round = 0;
  uint64_t aux = 0;
  uint64_t request = 0;  // echoed in the reply
  uint32_t meta_len = 0;
  uint32_t reserved = 0;
  uint64_t payload_len = 0;

  MsgType msg_type() const { return static_cast<MsgType>(type); }
};
static_assert(sizeof(FrameHeader) == 64);
static_assert(offsetof(FrameHeader, round) == 24);
static_assert(offsetof(FrameHeader, payload_len) == 56);

constexpr uint64_t kNoGate = ~0ull;
constexpr uint8_t kFlagEmpty = 1;
// kCommitAck: the job's gradient budget (Config::max_gradients) is spent; stop training.
constexpr uint8_t kFlagStop = 2;

inline FrameHeader MakeHeader(MsgType type, NodeId sender) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.sender = sender;
  return h;
}

// Checks what can be checked before reading further: magic, version, length bounds.
// kProtocol for a bad magic (random bytes), kUnimplemented for another protocol version.
Status ValidateHeader(const FrameHeader& header);

// Little binary codec for control metadata, written into a reused buffer.
class MetaWriter {
 public:
  explicit MetaWriter(std::vector<std::byte>& out) : out_(out) { out_.clear(); }
  template <typename T>
  void Put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    Append(&value, sizeof(T));
  }
  void PutString(std::string_view s);

 private:
  void Append(const void* p, size_t n) {
    const size_t at = out_.size();
    out_.resize(at + n);
    std::memcpy(out_.data() + at, p, n);
  }

  std::vector<std::byte>& out_;
};

class MetaReader {
 public:
  explicit MetaReader(std::span<const std::byte> in) : in_(in) {}
  template <typename T>
  bool Get(T* value) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s);
  bool done() const { return pos_ == in_.size(); }

 private:
  std::span<const std::byte> in_;
  size_t pos_ = 0;
};

// kRound metadata: the members, in summation (worker-id) order.
void EncodeMembers(std::span<const RoundMember> members, std::vector<std::byte>& out);
Status DecodeMembers(std::span<const std::byte> meta, std::vector<RoundMember>& out);

// kInit metadata: identifies the tensor so that workers registering different tensors under
// one id are caught.
struct InitMeta {
  std::string name;
  uint64_t tensor_elements = 0;
  uint64_t slice_offset = 0;
};
void EncodeInit(const InitMeta& meta, std::vector<std::byte>& out);
Status DecodeInit(std::span<const std::byte> meta, InitMeta& out);

inline std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
inline std::string_view AsText(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

}  // namespace dsync::ps
