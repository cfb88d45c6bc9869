// The wire format: every message is one frame = a fixed 64-byte header, `meta_len` bytes of
// small metadata, then `payload_len` bytes of tensor data. Payloads are never parsed: the
// receiver learns from the header where they belong and reads them straight there.
//
// Integers are little-endian (every host we target); the header is read and written as a
// struct, so its layout is pinned by static_asserts below.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <initializer_list>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync::ps {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

constexpr uint32_t kFrameMagic = 0x53505344;  // "DSPS" in memory order
// 2: node credentials, push receipts and proved commits; per-message header fields.
// 3: learning-rate changes (kSetLearningRate, kLearningRate), per-tensor optimizers in kInit.
// 4: checkpoints (kCheckpoint, kCheckpointDone; a restore in servers' welcomes).
// 5: replicated slices (kInit's replica(), kCommit's losses(), kServerGone).
// 6: lost copies recreated on a server that takes a lost rank's place (kServerBack,
//    kServerBackAck, kServerServes, kCopyOut, kCopy, kCopied; kInit's kFlagLayout; welcome
//    fields).
// 7: damping (kDamp, the welcome's damp_from, kCommit's gradient size in CommitProof).
constexpr uint16_t kProtocolVersion = 7;
// Bounds checked before anything is allocated or read (docs/contract.md, "Trust").
constexpr uint32_t kMaxMetaBytes = 64u << 10;
constexpr uint64_t kMaxPayloadBytes = 1ull << 31;
// What a peer that has not proved who it is may send: one hello of at most this much
// metadata and no payload. Nothing more is read from it.
constexpr uint32_t kMaxHelloMetaBytes = 4096;

enum class MsgType : uint16_t {
  // any connection
  kHello = 1,      // meta: JSON {role, token, node, credential, ...}; first frame everywhere
  kHelloAck = 2,   // scheduler: meta = JSON welcome; server: meta = its proof (Tag)
  kError = 3,      // status = StatusCode, meta = message, refused() = the refused type
  kHeartbeat = 4,
  kPending = 5,    // scheduler -> joining node: hello accepted, admission waits; meta = why
  // worker <-> scheduler
  kBegin = 10,     // clock(), base(): the worker now computes that clock on that version
  kCommit = 11,    // clock(), base(), losses(): the server losses its receipts leave out;
                   // meta = CommitProof (receipts, tensors pushed);
                   // flags & kFlagEmpty: nothing was pushed for this clock
  kCommitAck = 12, // round(): where it lands; min_version(): gate of the next pulls (or
                   // kNoGate); flags & kFlagStop: the job's gradient budget is spent
  kGate = 13,      // clock(), min_version(): the gate for pulls at that clock (ssp)
  kLeave = 14,
  kLeaveAck = 15,
  kSetLearningRate = 16,     // meta = the new lr (LearningRateMeta); workers only
  kSetLearningRateAck = 17,  // round(): the first round the new lr applies to
  kServerBackAck = 18,  // backs(): the back it answers; next_clock(): the first clock this
                        // worker pushes to that server (status != 0: it cannot reach it;
                        // meta = why)
  kServerServes = 19,   // scheduler -> worker: gone_server(), which took a lost rank over,
                        // holds its copies: pulls may go to it
  // server <-> scheduler
  kRound = 20,      // round(); meta = RoundMember[] with their tensors, in summation order
  kWorkerGone = 21, // gone_worker(), next_clock(): anything it staged from there on is void
  kApplied = 22,    // round(): the server applied it; meta (dsync:auto, a round with fresh
                    // and stale gradients): Agreement
  kShutdown = 23,   // scheduler -> server: the job is over; -> observer: training is over,
                    // final_version() (read it, then leave)
  kReady = 24,      // server -> scheduler: welcome taken, it accepts clients now
  kLearningRate = 25,  // scheduler -> server: round(); meta = lr (LearningRateMeta): every
                       // tensor's lr from that round on; sent before that round's kRound
  kCheckpoint = 26,      // scheduler -> server: round() = the version to write, once every
                         // round before it is applied; meta = the checkpoint's directory
  kCheckpointDone = 27,  // server -> scheduler: round() = that version; meta = CheckpointDone
  kServerGone = 28,      // scheduler -> every node: gone_server() was lost; losses() = servers
                         // lost so far, this one included (they are told in that order)
  kServerBack = 29,      // scheduler -> workers, servers: a new server took gone_server()'s
                         // rank; backs() = rank takeovers so far, this one included;
                         // meta (workers) = ServerBackMeta: where it listens, its proof
  // worker <-> server
  kInit = 30,      // tensor(), slice(), replica(); meta = InitMeta; payload = initial values
  kInitAck = 31,   // slice_version()
  kPush = 32,      // tensor(), slice(), clock(), base(); payload = gradient
  kPushAck = 33,   // tensor(), slice(), clock(); meta: the receipt (Tag) when this push
                   // completed the tensor on this server, else empty
  kPull = 34,      // tensor(), slice(), min_version()
  kPullReply = 35, // tensor(), slice(), slice_version(); payload = parameters
  // recreating a lost rank's copies (docs/design.md, "Recreating lost copies")
  kCopyOut = 40,  // scheduler -> live server: round() = the version to copy, gone_server() =
                  // the rank's server to copy for, backs() = the takeover's number; -> the new
                  // server: the same, and senders() = how many servers send it copies
  kCopy = 41,     // server -> scheduler -> the new server: round(), backs() as in its
                  // kCopyOut; payload = a checkpoint
                  // file's bytes (ps/checkpoint.h) with the copies the rank holds of some of
                  // the sender's slices; flags & kFlagLast: the sender's last; status != 0:
                  // the sender cannot (meta = why)
  kCopied = 42,   // the new server -> scheduler: round(): every copy is in, at that version
  // the staleness policy damp (StalenessPolicy)
  kDamp = 43,     // scheduler -> server: round(): the damped policy applies from that round
                  // on; sent before that round's kRound
};

std::string_view MsgTypeName(MsgType type);
// A tensor shape as Python prints one: "(3, 4)", "(5,)", "()".
std::string ShapeText(std::span<const uint64_t> shape);

// The 64-byte frame header. The fields every frame has are named; the four words whose
// meaning depends on the type are read and written through the accessors below, named for
// what each message carries (the enum above says which message carries which).
struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kProtocolVersion;  // of the protocol
  uint16_t type = 0;
  uint32_t sender = 0;   // node id (informational; receivers trust the authenticated link)
  uint8_t dtype = 0;
  uint8_t flags = 0;
  uint16_t status = 0;   // StatusCode in kError
  uint32_t id32[2] = {0, 0};  // per type: use the accessors
  uint64_t word[2] = {0, 0};  // per type: use the accessors
  uint64_t request = 0;  // echoed in the reply
  uint32_t meta_len = 0;
  uint32_t reserved = 0;
  uint64_t payload_len = 0;

  MsgType msg_type() const { return static_cast<MsgType>(type); }

  // kInit, kInitAck, kPush, kPushAck, kPull, kPullReply; echoed in kError.
  TensorId tensor() const { return id32[0]; }
  void set_tensor(TensorId t) { id32[0] = t; }
  uint32_t slice() const { return id32[1]; }
  void set_slice(uint32_t s) { id32[1] = s; }
  // kBegin, kCommit, kPush, kPushAck, kGate: the worker's gradient counter.
  Clock clock() const { return word[0]; }
  void set_clock(Clock c) { word[0] = c; }
  // kBegin, kCommit, kPush: the model version the gradient is computed on.
  Version base() const { return word[1]; }
  void set_base(Version v) { word[1] = v; }
  // kCommitAck, kRound, kApplied, kSetLearningRateAck, kLearningRate.
  Round round() const { return word[0]; }
  void set_round(Round r) { word[0] = r; }
  // kCommitAck, kGate, kPull: the lowest version the (next) pulls may return.
  Version min_version() const { return word[1]; }
  void set_min_version(Version v) { word[1] = v; }
  // kInitAck, kPullReply: the slice's version.
  Version slice_version() const { return word[0]; }
  void set_slice_version(Version v) { word[0] = v; }
  // kShutdown to an observer: the version training ended at.
  Version final_version() const { return word[0]; }
  void set_final_version(Version v) { word[0] = v; }
  // kError: the type of the request refused.
  MsgType refused() const { return static_cast<MsgType>(word[0]); }
  void set_refused(MsgType t) { word[0] = static_cast<uint64_t>(t); }
  // kWorkerGone: the worker, and the first clock of it that is void.
  WorkerId gone_worker() const { return id32[0]; }
  void set_gone_worker(WorkerId w) { id32[0] = w; }
  Clock next_clock() const { return word[0]; }
  void set_next_clock(Clock c) { word[0] = c; }
  // kInit: which copy of the slice this server is to hold (0: the primary).
  uint32_t replica() const { return static_cast<uint32_t>(word[0]); }
  void set_replica(uint32_t r) { word[0] = r; }
  // kServerGone: the server lost. kServerGone, kCommit: how many servers were lost so far (a
  // commit's receipts cover the servers still live after that many losses).
  NodeId gone_server() const { return id32[0]; }
  void set_gone_server(NodeId s) { id32[0] = s; }
  uint32_t losses() const { return id32[1]; }
  void set_losses(uint32_t n) { id32[1] = n; }
  // kServerBack, kServerBackAck: how many times a new server took a lost rank's place so far.
  uint32_t backs() const { return id32[1]; }
  void set_backs(uint32_t n) { id32[1] = n; }
  // kCopyOut to the server taking a rank over: how many servers send it copies.
  uint32_t senders() const { return static_cast<uint32_t>(word[1]); }
  void set_senders(uint32_t n) { word[1] = n; }
};
static_assert(sizeof(FrameHeader) == 64);
static_assert(std::is_trivially_copyable_v<FrameHeader> && std::is_standard_layout_v<FrameHeader>);
static_assert(offsetof(FrameHeader, id32) == 16);
static_assert(offsetof(FrameHeader, word) == 24);
static_assert(offsetof(FrameHeader, payload_len) == 56);

constexpr uint64_t kNoGate = ~0ull;
constexpr uint8_t kFlagEmpty = 1;
// kCommitAck: the job's gradient budget (Config::max_gradients) is spent; stop training.
constexpr uint8_t kFlagStop = 2;
// kInit to a server that takes a lost rank's place: no payload; the slice's values come with
// the copies the other servers send it.
constexpr uint8_t kFlagLayout = 4;
// kCopy: the sender's last.
constexpr uint8_t kFlagLast = 8;

inline FrameHeader MakeHeader(MsgType type, NodeId sender) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.sender = sender;
  return h;
}

// Checks what can be checked before reading further: magic, version, length bounds.
// kProtocol for a bad magic (random bytes), kUnimplemented for another protocol version.
Status ValidateHeader(const FrameHeader& header);
// What a peer that has not authenticated yet may send (kMaxHelloMetaBytes): checked by the
// transports from the header alone, so nothing more is read from a stranger.
Status CheckUnauthenticatedFrame(const FrameHeader& header);

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

// Tensors named by a commit or a round, as ascending runs of ids.
struct TensorRange {
  TensorId first = 0;
  uint32_t count = 0;
  bool operator==(const TensorRange&) const = default;
};
// A few runs are kept inline: the usual commit (every tensor, one run) allocates nothing on
// its way through the worker, the scheduler and the servers.
class TensorSet {
 public:
  static constexpr size_t kInline = 4;
  TensorSet() = default;
  TensorSet(std::initializer_list<TensorRange> runs) {
    for (const TensorRange& r : runs) push_back(r);
  }
  void clear() {
    n_ = 0;
    heap_.clear();
  }
  void push_back(const TensorRange& r) {
    if (n_ < kInline) {
      inline_[n_++] = r;
      return;
    }
    if (heap_.empty()) heap_.assign(inline_.begin(), inline_.end());
    heap_.push_back(r);
    ++n_;
  }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  const TensorRange* begin() const { return n_ > kInline ? heap_.data() : inline_.data(); }
  const TensorRange* end() const { return begin() + n_; }
  TensorRange& back() { return (n_ > kInline ? heap_.data() : inline_.data())[n_ - 1]; }
  bool operator==(const TensorSet& o) const {
    return std::equal(begin(), end(), o.begin(), o.end());
  }

 private:
  std::array<TensorRange, kInline> inline_{};
  size_t n_ = 0;
  std::vector<TensorRange> heap_;  // all runs, once there are more than kInline
};
bool Contains(const TensorSet& set, TensorId tensor);
uint64_t TensorCount(const TensorSet& set);

// One member of a round as the servers see it: which tensors its gradient covers (a commit
// may cover some tensors only, Worker::Advance; empty for an empty commit).
struct RoundEntry {
  RoundMember member;
  TensorSet tensors;
};
// kRound metadata: the members, in summation (worker-id) order.
void EncodeRound(std::span<const RoundEntry> entries, std::vector<std::byte>& out);
Status DecodeRound(std::span<const std::byte> meta, std::vector<RoundEntry>& out);

// kCommit metadata: what the worker claims it pushed (each tensor with the placement of its
// slices: how many, and the server rank of slice 0), and the XOR of the servers' receipts
// for it. The scheduler recomputes the receipts from the claims, so a false claim fails.
struct CommittedTensor {
  TensorId tensor = 0;
  uint32_t slices = 0;
  uint32_t first_rank = 0;
  bool operator==(const CommittedTensor&) const = default;
};
struct CommitProof {
  std::array<uint8_t, 16> receipts{};
  std::vector<CommittedTensor> tensors;  // ascending ids, each once
  // The gradient's size, the root mean square of its elements, where the job's staleness
  // policy damps (GrowthWatch); negative where not measured. Any float is accepted: a
  // gradient that is not finite has a size that is not (the scheduler treats it as growth).
  float size = kSizeNotMeasured;
  static constexpr float kSizeNotMeasured = -1.0f;
};
void EncodeCommit(const CommitProof& proof, std::vector<std::byte>& out);
Status DecodeCommit(std::span<const std::byte> meta, CommitProof& out);
TensorSet TensorsOf(const CommitProof& proof);

// kInit metadata: identifies the tensor so that workers registering different tensors under
// one id are caught, and carries the optimizer the worker asks for this tensor (none: the
// job's). Decoding checks every field, the optimizer's hyperparameters included.
struct InitMeta {
  std::string name;
  uint64_t tensor_elements = 0;
  uint64_t slice_offset = 0;
  std::optional<OptimizerConfig> optimizer;
  std::vector<uint64_t> shape;  // empty: not given; else its product is tensor_elements
};
void EncodeInit(const InitMeta& meta, std::vector<std::byte>& out);
Status DecodeInit(std::span<const std::byte> meta, InitMeta& out);

// kCheckpointDone metadata: where the server's file went, or (status != 0) why it failed.
struct CheckpointDone {
  std::string file;  // relative to the checkpoint's directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
void EncodeCheckpointDone(const CheckpointDone& done, std::vector<std::byte>& out);
Status DecodeCheckpointDone(std::span<const std::byte> meta, CheckpointDone& out);

// kApplied metadata: per member of the round, in its order, whether this server measured its
// agreement with the round's fresh gradients and that agreement (ps/gradient_agreement.h).
// Decoding refuses a measured value that is not finite; a member not measured carries +0.0.
struct Agreement {
  std::vector<double> dots;
  std::vector<uint8_t> measured;
};
void EncodeAgreement(const Agreement& a, std::vector<std::byte>& out);
Status DecodeAgreement(std::span<const std::byte> meta, Agreement& out);

// kSetLearningRate and kLearningRate metadata: the learning rate, a float32. Decoding
// refuses any other length, and a rate that is not finite or is negative.
void EncodeLearningRate(float lr, std::vector<std::byte>& out);
Result<float> DecodeLearningRate(std::span<const std::byte> meta);

inline std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
inline std::string_view AsText(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

}  // namespace dsync::ps
