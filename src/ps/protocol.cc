#include "ps/protocol.h"

namespace dsync::ps {

std::string_view MsgTypeName(MsgType type) {
  switch (type) {
    case MsgType::kHello: return "hello";
    case MsgType::kHelloAck: return "hello-ack";
    case MsgType::kError: return "error";
    case MsgType::kHeartbeat: return "heartbeat";
    case MsgType::kBegin: return "begin";
    case MsgType::kCommit: return "commit";
    case MsgType::kCommitAck: return "commit-ack";
    case MsgType::kGate: return "gate";
    case MsgType::kLeave: return "leave";
    case MsgType::kLeaveAck: return "leave-ack";
    case MsgType::kRound: return "round";
    case MsgType::kWorkerGone: return "worker-gone";
    case MsgType::kApplied: return "applied";
    case MsgType::kShutdown: return "shutdown";
    case MsgType::kInit: return "init";
    case MsgType::kInitAck: return "init-ack";
    case MsgType::kPush: return "push";
    case MsgType::kPushAck: return "push-ack";
    case MsgType::kPull: return "pull";
    case MsgType::kPullReply: return "pull-reply";
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
  if (!Get(&n) || in_.size() - pos_ < n) return false;
  s->assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
  pos_ += n;
  return true;
}

void EncodeMembers(std::span<const RoundMember> members, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(static_cast<uint32_t>(members.size()));
  for (const RoundMember& m : members) {
    w.Put(m.worker);
    w.Put(m.clock);
    w.Put(m.base);
  }
}

Status DecodeMembers(std::span<const std::byte> meta, std::vector<RoundMember>& out) {
  MetaReader r(meta);
  uint32_t n = 0;
  out.clear();
  if (!r.Get(&n) || n > meta.size() / 20) {
    return Error(StatusCode::kProtocol, "round member list is truncated");
  }
  for (uint32_t i = 0; i < n; ++i) {
    RoundMember m;
    if (!r.Get(&m.worker) || !r.Get(&m.clock) || !r.Get(&m.base)) {
      return Error(StatusCode::kProtocol, "round member list is truncated");
    }
    out.push_back(m);
  }
  if (!r.done()) return Error(StatusCode::kProtocol, "round member list has trailing bytes");
  return Status::Ok();
}

void EncodeInit(const InitMeta& meta, std::vector<std::byte>& out) {
  MetaWriter w(out);
  w.Put(meta.tensor_elements);
  w.Put(meta.slice_offset);
  w.PutString(meta.name);
}

Status DecodeInit(std::span<const std::byte> meta, InitMeta& out) {
  MetaReader r(meta);
  if (!r.Get(&out.tensor_elements) || !r.Get(&out.slice_offset) || !r.GetString(&out.name) ||
      !r.done()) {
    return Error(StatusCode::kProtocol, "init metadata is malformed");
  }
  return Status::Ok();
}

}  // namespace dsync::ps
