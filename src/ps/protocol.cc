#include "ps/protocol.h"

#include <bit>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dsync/worker.h"  // TensorOptions::kMaxTensorDims

namespace dsync::ps {

std::string_view MsgTypeName(MsgType type) {
  switch (type) {
    case MsgType::kHello: return "hello";
    case MsgType::kHelloAck: return "hello-ack";
    case MsgType::kError: return "error";
    case MsgType::kHeartbeat: return "heartbeat";
    case MsgType::kPending: return "pending";
    case MsgType::kBegin: return "begin";
    case MsgType::kCommit: return "commit";
    case MsgType::kCommitAck: return "commit-ack";
    case MsgType::kGate: return "gate";
    case MsgType::kLeave: return "leave";
    case MsgType::kLeaveAck: return "leave-ack";
    case MsgType::kSetLearningRate: return "set-learning-rate";
    case MsgType::kSetLearningRateAck: return "set-learning-rate-ack";
    case MsgType::kServerBackAck: return "server-back-ack";
    case MsgType::kServerServes: return "server-serves";
    case MsgType::kRound: return "round";
    case MsgType::kWorkerGone: return "worker-gone";
    case MsgType::kApplied: return "applied";
    case MsgType::kShutdown: return "shutdown";
    case MsgType::kReady: return "ready";
    case MsgType::kLearningRate: return "learning-rate";
    case MsgType::kCheckpoint: return "checkpoint";
    case MsgType::kCheckpointDone: return "checkpoint-done";
    case MsgType::kServerGone: return "server-gone";
    case MsgType::kServerBack: return "server-back";
    case MsgType::kInit: return "init";
    case MsgType::kInitAck: return "init-ack";
    case MsgType::kPush: return "push";
    case MsgType::kPushAck: return "push-ack";
    case MsgType::kPull: return "pull";
    case MsgType::kPullReply: return "pull-reply";
    case MsgType::kCopyOut: return "copy-out";
    case MsgType::kCopy: return "copy";
    case MsgType::kCopied: return "copied";
    case MsgType::kDamp: return "damp";
  }
  return "unknown";
}

Status ValidateHeader(const FrameHeader& h) {
  if (h.magic != kFrameMagic) {
    return Error(StatusCode::kProtocol,
                 "not a dsyncps frame (magic {:#010x}); is something else talking to this port?",
                 h.magic);
  }
  if (h.version != kProtocolVersion) {
    return Error(StatusCode::kUnimplemented,
                 "protocol version {} is not supported (this node speaks {}); run the same "
                 "dsyncps release on every node",
                 h.version, kProtocolVersion);
  }
  if (h.meta_len > kMaxMetaBytes) {
    return Error(StatusCode::kProtocol, "{} frame metadata of {} bytes exceeds the {} byte limit",
                 MsgTypeName(h.msg_type()), h.meta_len, kMaxMetaBytes);
  }
  if (h.payload_len > kMaxPayloadBytes) {
    return Error(StatusCode::kProtocol, "{} frame payload of {} bytes exceeds the {} byte limit",
                 MsgTypeName(h.msg_type()), h.payload_len, kMaxPayloadBytes);
  }
  return Status::Ok();
}

void MetaWriter::PutString(std::string_view s) {
  Put(static_cast<uint32_t>(s.size()));
  Append(s.data(), s.size());
}

bool MetaReader::GetString(std::string* s) {
  uint32_t n = 0;
  const size_t start = pos_;
  if (!Get(&n) || in_.size() - pos_ < n) {
    pos_ = start;  // a failed read consumes nothing
    return false;
  }
  s->assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
  pos_ += n;
  return true;
}

Status CheckUnauthenticatedFrame(const FrameHeader& h) {
  if (h.msg_type() != MsgType::kHello || h.meta_len > kMaxHelloMetaBytes || h.payload_len != 0) {
    return Error(StatusCode::kPermissionDenied,
                 "the first frame must be a hello of at most {} bytes without payload (got {} "
                 "with {} bytes of metadata and {} of payload)",
                 kMaxHelloMetaBytes, MsgTypeName(h.msg_type()), h.meta_len, h.payload_len);
  }
  return Status::Ok();
}

bool Contains(const TensorSet& set, TensorId tensor) {
  for (const TensorRange& r : set) {
    if (tensor >= r.first && tensor - r.first < r.count) return true;
  }
  return false;
}

uint64_t TensorCount(const TensorSet& set) {
  uint64_t n = 0;
  for (const TensorRange& r : set) n += r.count;
  return n;
}

namespace {

constexpr size_t kRangeBytes = 2 * sizeof(uint32_t);
constexpr size_t kRoundEntryMinBytes = sizeof(WorkerId) + 2 * sizeof(uint64_t) + sizeof(uint32_t);
constexpr size_t kCommittedTensorBytes = 3 * sizeof(uint32_t);

void PutTensors(MetaWriter& w, const TensorSet& set) {
  w.Put(static_cast<uint32_t>(set.size()));
  for (const TensorRange& r : set) {
    w.Put(r.first);
    w.Put(r.count);
  }
}

// Ascending, non-empty, non-overlapping runs: what the encoder writes, so a server never has
// to make sense of anything else.
bool GetTensors(MetaReader& r, size_t meta_size, TensorSet* set) {
  uint32_t n = 0;
  if (!r.Get(&n) || n > meta_size / kRangeBytes) return false;
  set->clear();
  uint64_t next = 0;
  for (uint32_t i = 0; i < n; ++i) {
    TensorRange t;
    if (!r.Get(&t.first) || !r.Get(&t.count) || t.count == 0 || t.first < next ||
        uint64_t{t.first} + t.count > (uint64_t{1} << 32)) {
      return false;
    }
    next = uint64_t{t.first} + t.count;
    set->push_back(t);
  }
  return true;
}

}  // namespace

void EncodeRound(std::span<const RoundEntry> entries, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(static_cast<uint32_t>(entries.size()));
  for (const RoundEntry& e : entries) {
    w.Put(e.member.worker);
    w.Put(e.member.clock);
    w.Put(e.member.base);
    PutTensors(w, e.tensors);
  }
}

Status DecodeRound(std::span<const std::byte> meta, std::vector<RoundEntry>& out) {
  MetaReader r(meta);
  uint32_t n = 0;
  out.clear();
  if (!r.Get(&n) || n > meta.size() / kRoundEntryMinBytes) {
    return Error(StatusCode::kProtocol, "round member list is truncated");
  }
  for (uint32_t i = 0; i < n; ++i) {
    RoundEntry e;
    if (!r.Get(&e.member.worker) || !r.Get(&e.member.clock) || !r.Get(&e.member.base)) {
      return Error(StatusCode::kProtocol, "round member list is truncated");
    }
    if (!GetTensors(r, meta.size(), &e.tensors)) {
      return Error(StatusCode::kProtocol, "round member {}: its tensor list is malformed",
                   e.member.worker);
    }
    if (!out.empty() && out.back().member.worker >= e.member.worker) {
      return Error(StatusCode::kProtocol,
                   "round members are not in ascending worker order ({} after {})",
                   e.member.worker, out.back().member.worker);
    }
    out.push_back(std::move(e));
  }
  if (!r.done()) return Error(StatusCode::kProtocol, "round member list has trailing bytes");
  return Status::Ok();
}

void EncodeCommit(const CommitProof& proof, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(proof.receipts);
  w.Put(proof.size);
  w.Put(static_cast<uint32_t>(proof.tensors.size()));
  for (const CommittedTensor& t : proof.tensors) {
    w.Put(t.tensor);
    w.Put(t.slices);
    w.Put(t.first_rank);
  }
}

Status DecodeCommit(std::span<const std::byte> meta, CommitProof& out) {
  MetaReader r(meta);
  uint32_t n = 0;
  out.tensors.clear();
  if (!r.Get(&out.receipts) || !r.Get(&out.size) || !r.Get(&n) ||
      n > meta.size() / kCommittedTensorBytes) {
    return Error(StatusCode::kProtocol, "commit metadata is truncated");
  }
  for (uint32_t i = 0; i < n; ++i) {
    CommittedTensor t;
    if (!r.Get(&t.tensor) || !r.Get(&t.slices) || !r.Get(&t.first_rank)) {
      return Error(StatusCode::kProtocol, "commit metadata is truncated");
    }
    // Each tensor once: a tensor named twice would cancel its own receipts in the XOR.
    if (t.slices == 0 || (!out.tensors.empty() && t.tensor <= out.tensors.back().tensor)) {
      return Error(StatusCode::kProtocol,
                   "commit metadata names tensor {} out of order, twice or with no slices",
                   t.tensor);
    }
    out.tensors.push_back(t);
  }
  if (!r.done()) return Error(StatusCode::kProtocol, "commit metadata has trailing bytes");
  return Status::Ok();
}

TensorSet TensorsOf(const CommitProof& proof) {
  TensorSet set;
  for (const CommittedTensor& t : proof.tensors) {
    if (!set.empty() && set.back().first + set.back().count == t.tensor) {
      ++set.back().count;
    } else {
      set.push_back({t.tensor, 1});
    }
  }
  return set;
}

std::string ShapeText(std::span<const uint64_t> shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

void EncodeInit(const InitMeta& meta, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(meta.tensor_elements);
  w.Put(meta.slice_offset);
  w.PutString(meta.name);
  w.Put(static_cast<uint8_t>(meta.shape.size()));
  for (uint64_t d : meta.shape) w.Put(d);
  w.Put(static_cast<uint8_t>(meta.optimizer ? 1 : 0));
  if (!meta.optimizer) return;
  const OptimizerConfig& o = *meta.optimizer;
  w.Put(static_cast<uint8_t>(o.kind));
  w.Put(static_cast<uint8_t>(o.nesterov ? 1 : 0));
  for (float x : {o.lr, o.momentum, o.dampening, o.beta1, o.beta2, o.eps, o.weight_decay}) {
    w.Put(x);
  }
}

Status DecodeInit(std::span<const std::byte> meta, InitMeta& out) {
  MetaReader r(meta);
  const Status malformed = Error(StatusCode::kProtocol, "init metadata is malformed");
  uint8_t has_optimizer = 0;
  uint8_t dims = 0;
  if (!r.Get(&out.tensor_elements) || !r.Get(&out.slice_offset) || !r.GetString(&out.name) ||
      !r.Get(&dims) || dims > TensorOptions::kMaxTensorDims) {
    return malformed;
  }
  out.shape.assign(dims, 0);
  uint64_t product = 1;
  for (uint64_t& d : out.shape) {
    // The product must be the element count, computed without overflow.
    if (!r.Get(&d) || (d != 0 && product > out.tensor_elements / d)) return malformed;
    product *= d;
  }
  if ((dims > 0 && product != out.tensor_elements) || !r.Get(&has_optimizer) ||
      has_optimizer > 1) {
    return malformed;
  }
  out.optimizer.reset();
  if (has_optimizer == 0) return r.done() ? Status::Ok() : malformed;
  uint8_t kind = 0, nesterov = 0;
  OptimizerConfig o;
  if (!r.Get(&kind) || !r.Get(&nesterov) || !r.Get(&o.lr) || !r.Get(&o.momentum) ||
      !r.Get(&o.dampening) || !r.Get(&o.beta1) || !r.Get(&o.beta2) || !r.Get(&o.eps) ||
      !r.Get(&o.weight_decay) || !r.done() || nesterov > 1 ||
      kind > static_cast<uint8_t>(OptimizerKind::kAdamW)) {
    return malformed;
  }
  o.kind = static_cast<OptimizerKind>(kind);
  o.nesterov = nesterov == 1;
  if (Status st = ValidateOptimizer(o); !st.ok()) {
    return Error(StatusCode::kProtocol, "init metadata of tensor '{}': {}", out.name,
                 st.message());
  }
  out.optimizer = o;
  return Status::Ok();
}

void EncodeCheckpointDone(const CheckpointDone& done, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(done.bytes);
  w.Put(done.crc32);
  w.PutString(done.file);
}

Status DecodeCheckpointDone(std::span<const std::byte> meta, CheckpointDone& out) {
  MetaReader r(meta);
  if (!r.Get(&out.bytes) || !r.Get(&out.crc32) || !r.GetString(&out.file) || !r.done()) {
    return Error(StatusCode::kProtocol, "checkpoint-done metadata is malformed");
  }
  return Status::Ok();
}

void EncodeAgreement(const Agreement& a, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(static_cast<uint32_t>(a.dots.size()));
  for (size_t m = 0; m < a.dots.size(); ++m) {
    const bool measured = m < a.measured.size() && a.measured[m];
    w.Put(static_cast<uint8_t>(measured ? 1 : 0));
    w.Put(measured ? a.dots[m] : 0.0);
  }
}

Status DecodeAgreement(std::span<const std::byte> meta, Agreement& out) {
  MetaReader r(meta);
  uint32_t n = 0;
  // 9 bytes per member: a count past what the metadata holds is refused before any allocation.
  if (!r.Get(&n) || meta.size() != 4 + uint64_t{n} * 9) {
    return Error(StatusCode::kProtocol, "agreement metadata of {} bytes is malformed",
                 meta.size());
  }
  out.dots.resize(n);
  out.measured.resize(n);
  for (uint32_t m = 0; m < n; ++m) {
    uint8_t measured = 0;
    double dot = 0;
    // One form per report: a member not measured carries +0.0.
    if (!r.Get(&measured) || !r.Get(&dot) || measured > 1 ||
        (!measured && std::bit_cast<uint64_t>(dot) != 0)) {
      return Error(StatusCode::kProtocol, "agreement metadata of {} bytes is malformed",
                   meta.size());
    }
    if (measured && !std::isfinite(dot)) {
      return Error(StatusCode::kProtocol, "agreement of member {} is {}, not a finite number",
                   m, dot);
    }
    out.measured[m] = measured;
    out.dots[m] = dot;
  }
  if (!r.done()) {
    return Error(StatusCode::kProtocol, "agreement metadata of {} bytes is malformed",
                 meta.size());
  }
  return Status::Ok();
}

void EncodeLearningRate(float lr, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(lr);
}

Result<float> DecodeLearningRate(std::span<const std::byte> meta) {
  MetaReader r(meta);
  float lr = 0.0f;
  if (!r.Get(&lr) || !r.done()) {
    return Error(StatusCode::kProtocol, "learning-rate metadata is {} bytes, not 4", meta.size());
  }
  if (!std::isfinite(lr) || lr < 0.0f) {
    return Error(StatusCode::kInvalidArgument,
                 "learning rate {} must be a finite number >= 0", lr);
  }
  return lr;
}

}  // namespace dsync::ps
