#include "ps/handshake.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "ps/slicing.h"

namespace dsync::ps {
namespace {

using nlohmann::json;

Result<json> ParseJson(std::span<const std::byte> meta, std::string_view what) {
  json j = json::parse(AsText(meta), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Error(StatusCode::kProtocol, "{} is not a JSON object", what);
  }
  return j;
}

// Reads a field of the expected type without throwing on a malformed peer message. A
// number the field cannot hold (negative, too large, fractional, beyond a float) is refused,
// never wrapped, truncated or turned into infinity.
template <typename T>
Status Field(const json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end()) return Error(StatusCode::kProtocol, "handshake field '{}' is missing", key);
  const json& v = *it;
  const Status wrong = Error(StatusCode::kProtocol, "handshake field '{}' has the wrong type", key);
  const Status range =
      Error(StatusCode::kProtocol, "handshake field '{}' is out of range: {}", key, v.dump());
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return wrong;
    *out = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    using Limits = std::numeric_limits<T>;
    if (v.is_number_unsigned()) {
      const uint64_t x = v.get<uint64_t>();
      if (x > static_cast<uint64_t>(Limits::max())) return range;
      *out = static_cast<T>(x);
    } else if (v.is_number_integer()) {
      const int64_t x = v.get<int64_t>();
      if (x < static_cast<int64_t>(Limits::min()) ||
          (x > 0 && static_cast<uint64_t>(x) > static_cast<uint64_t>(Limits::max()))) {
        return range;
      }
      *out = static_cast<T>(x);
    } else {
      return v.is_number() ? range : wrong;  // a fraction is no count
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return wrong;
    const double x = v.get<double>();
    if (!std::isfinite(x) || std::fabs(x) > static_cast<double>(std::numeric_limits<T>::max())) {
      return range;
    }
    *out = static_cast<T>(x);
  } else {
    try {
      *out = v.template get<T>();
    } catch (const json::exception&) {
      return wrong;
    }
  }
  return Status::Ok();
}

// A hex-encoded tag field.
Status TagField(const json& j, const char* key, Tag* out) {
  std::string hex;
  DSYNC_RETURN_IF_ERROR(Field(j, key, &hex));
  auto tag = TagFromHex(hex);
  if (!tag) return Error(StatusCode::kProtocol, "handshake field '{}' is not a credential", key);
  *out = *tag;
  return Status::Ok();
}

}  // namespace

std::string EncodeHello(const Hello& h) {
  json j = {{"role", RoleName(h.role)}, {"token", h.token}, {"node", h.node},
            {"host", h.host},           {"port", h.port},    {"observer", h.observer}};
  if (h.credential) j["credential"] = ToHex(*h.credential);
  if (h.rejoin) {
    j["rejoin"] = true;
    j["rounds_received"] = h.rounds_received;
    j["rounds_applied"] = h.rounds_applied;
    j["nonce"] = ToHex(h.nonce);
  }
  return j.dump();
}

Result<Hello> DecodeHello(std::span<const std::byte> meta) {
  DSYNC_ASSIGN_OR_RETURN(json j, ParseJson(meta, "hello"));
  Hello h;
  std::string role;
  DSYNC_RETURN_IF_ERROR(Field(j, "role", &role));
  DSYNC_ASSIGN_OR_RETURN(h.role, ParseRole(role));
  DSYNC_RETURN_IF_ERROR(Field(j, "token", &h.token));
  DSYNC_RETURN_IF_ERROR(Field(j, "node", &h.node));
  DSYNC_RETURN_IF_ERROR(Field(j, "host", &h.host));
  DSYNC_RETURN_IF_ERROR(Field(j, "port", &h.port));
  if (j.contains("observer")) DSYNC_RETURN_IF_ERROR(Field(j, "observer", &h.observer));
  if (j.contains("credential")) {
    Tag t;
    DSYNC_RETURN_IF_ERROR(TagField(j, "credential", &t));
    h.credential = t;
  }
  if (j.contains("rejoin")) {
    DSYNC_RETURN_IF_ERROR(Field(j, "rejoin", &h.rejoin));
    DSYNC_RETURN_IF_ERROR(Field(j, "rounds_received", &h.rounds_received));
    DSYNC_RETURN_IF_ERROR(Field(j, "rounds_applied", &h.rounds_applied));
    DSYNC_RETURN_IF_ERROR(TagField(j, "nonce", &h.nonce));
    if (h.rounds_applied > h.rounds_received) {
      return Error(StatusCode::kProtocol, "hello: {} round(s) applied of {} received",
                   h.rounds_applied, h.rounds_received);
    }
  }
  return h;
}

Result<Hello> AcceptHello(std::span<const std::byte> meta, const std::string& token) {
  DSYNC_ASSIGN_OR_RETURN(Hello hello, DecodeHello(meta));
  if (!TokenMatches(token, hello.token)) {
    return Error(StatusCode::kPermissionDenied,
                 "wrong cluster token; set DSYNC_TOKEN (or --token) to the job's token");
  }
  return hello;
}

namespace {

json AddressJson(const ServerAddress& s) {
  return {{"id", s.id}, {"host", s.host}, {"port", s.port}, {"proof", ToHex(s.proof)}};
}

Status ReadAddress(const json& s, ServerAddress* a) {
  DSYNC_RETURN_IF_ERROR(Field(s, "id", &a->id));
  DSYNC_RETURN_IF_ERROR(Field(s, "host", &a->host));
  DSYNC_RETURN_IF_ERROR(Field(s, "port", &a->port));
  return TagField(s, "proof", &a->proof);
}

}  // namespace

std::string EncodeServerAddress(const ServerAddress& address) {
  return AddressJson(address).dump();
}

Result<ServerAddress> DecodeServerAddress(std::span<const std::byte> meta) {
  DSYNC_ASSIGN_OR_RETURN(json j, ParseJson(meta, "server address"));
  ServerAddress a;
  DSYNC_RETURN_IF_ERROR(ReadAddress(j, &a));
  return a;
}

std::string EncodeLiveRanks(const std::vector<bool>& live) {
  json j = json::array();
  for (bool b : live) j.push_back(b);
  return json{{"live", j}}.dump();
}

Status DecodeLiveRanks(std::span<const std::byte> meta, uint32_t num_servers,
                       std::vector<bool>& live) {
  DSYNC_ASSIGN_OR_RETURN(json o, ParseJson(meta, "live servers"));
  json j;
  DSYNC_RETURN_IF_ERROR(Field(o, "live", &j));
  if (!j.is_array() || j.size() != num_servers) {
    return Error(StatusCode::kProtocol, "live servers: not a list of {} flags", num_servers);
  }
  live.clear();
  for (const json& b : j) {
    if (!b.is_boolean()) return Error(StatusCode::kProtocol, "live servers: not a flag: {}", b.dump());
    live.push_back(b.get<bool>());
  }
  return Status::Ok();
}

std::string EncodeWelcome(const Welcome& w) {
  json servers = json::array();
  for (const ServerAddress& s : w.servers) servers.push_back(AddressJson(s));
  const OptimizerConfig& o = w.optimizer;
  json j = {{"id", w.id},
            {"sync", w.sync.ToString()},
            {"optimizer",
             {{"kind", OptimizerName(o.kind)}, {"lr", o.lr}, {"momentum", o.momentum},
              {"dampening", o.dampening}, {"nesterov", o.nesterov}, {"beta1", o.beta1},
              {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}}},
            {"staleness", w.staleness.ToString()},
            {"slice_bytes", w.slice_bytes},
            {"heartbeat_interval_ms", w.heartbeat_interval_ms},
            {"servers", servers},
            {"join_round", w.join_round},
            {"start_clock", w.start_clock},
            {"gate", w.gate},
            {"observer", w.observer},
            {"credential", ToHex(w.credential)},
            {"num_servers", w.num_servers}};
  if (w.job_key) j["job_key"] = ToHex(*w.job_key);
  if (w.learning_rate) {
    j["lr_from_round"] = w.learning_rate->first;
    j["lr"] = w.learning_rate->second;
  }
  if (w.checkpoints) j["checkpoints"] = true;
  if (w.reconnect_grace_ms != 0) j["reconnect_grace_ms"] = w.reconnect_grace_ms;
  if (w.scheduler_proof) j["scheduler_proof"] = ToHex(*w.scheduler_proof);
  if (w.replicas != 1) j["replicas"] = w.replicas;
  if (!w.servers_lost.empty()) j["servers_lost"] = w.servers_lost;
  if (!w.servers_back.empty()) j["servers_back"] = w.servers_back;
  if (!w.servers_filling.empty()) j["servers_filling"] = w.servers_filling;
  if (w.takeover_from) j["takeover_from"] = *w.takeover_from;
  if (w.damp_from) j["damp_from"] = *w.damp_from;
  if (w.restore) {
    j["restore"] = {{"file", w.restore->file}, {"crc32", w.restore->crc32},
                    {"version", w.restore->version}};
    if (!w.restore->copies.empty()) {
      json copies = json::array();
      for (const auto& c : w.restore->copies) copies.push_back({{"file", c.file}, {"crc32", c.crc32}});
      j["restore"]["copies"] = copies;
    }
  }
  return j.dump();
}

Result<Welcome> DecodeWelcome(std::span<const std::byte> meta) {
  DSYNC_ASSIGN_OR_RETURN(json j, ParseJson(meta, "welcome"));
  Welcome w;
  std::string sync;
  DSYNC_RETURN_IF_ERROR(Field(j, "id", &w.id));
  DSYNC_RETURN_IF_ERROR(Field(j, "sync", &sync));
  DSYNC_ASSIGN_OR_RETURN(w.sync, SyncMode::Parse(sync));
  json opt;
  DSYNC_RETURN_IF_ERROR(Field(j, "optimizer", &opt));
  std::string kind;
  DSYNC_RETURN_IF_ERROR(Field(opt, "kind", &kind));
  DSYNC_ASSIGN_OR_RETURN(w.optimizer.kind, ParseOptimizer(kind));
  DSYNC_RETURN_IF_ERROR(Field(opt, "lr", &w.optimizer.lr));
  DSYNC_RETURN_IF_ERROR(Field(opt, "momentum", &w.optimizer.momentum));
  DSYNC_RETURN_IF_ERROR(Field(opt, "dampening", &w.optimizer.dampening));
  DSYNC_RETURN_IF_ERROR(Field(opt, "nesterov", &w.optimizer.nesterov));
  DSYNC_RETURN_IF_ERROR(Field(opt, "beta1", &w.optimizer.beta1));
  DSYNC_RETURN_IF_ERROR(Field(opt, "beta2", &w.optimizer.beta2));
  DSYNC_RETURN_IF_ERROR(Field(opt, "eps", &w.optimizer.eps));
  DSYNC_RETURN_IF_ERROR(Field(opt, "weight_decay", &w.optimizer.weight_decay));
  if (Status st = ValidateOptimizer(w.optimizer); !st.ok()) {
    return Error(StatusCode::kProtocol, "welcome: {}", st.message());
  }
  if (j.contains("staleness")) {
    std::string staleness;
    DSYNC_RETURN_IF_ERROR(Field(j, "staleness", &staleness));
    auto policy = StalenessPolicy::Parse(staleness);
    if (!policy.ok()) return Error(StatusCode::kProtocol, "welcome: {}", policy.status().message());
    w.staleness = *policy;
  }
  DSYNC_RETURN_IF_ERROR(Field(j, "slice_bytes", &w.slice_bytes));
  DSYNC_RETURN_IF_ERROR(Field(j, "heartbeat_interval_ms", &w.heartbeat_interval_ms));
  json servers;
  DSYNC_RETURN_IF_ERROR(Field(j, "servers", &servers));
  if (!servers.is_array()) return Error(StatusCode::kProtocol, "welcome: servers is not a list");
  for (const json& s : servers) {
    ServerAddress a;
    DSYNC_RETURN_IF_ERROR(ReadAddress(s, &a));
    w.servers.push_back(std::move(a));
  }
  DSYNC_RETURN_IF_ERROR(Field(j, "join_round", &w.join_round));
  DSYNC_RETURN_IF_ERROR(Field(j, "start_clock", &w.start_clock));
  DSYNC_RETURN_IF_ERROR(Field(j, "gate", &w.gate));
  if (j.contains("observer")) DSYNC_RETURN_IF_ERROR(Field(j, "observer", &w.observer));
  DSYNC_RETURN_IF_ERROR(TagField(j, "credential", &w.credential));
  DSYNC_RETURN_IF_ERROR(Field(j, "num_servers", &w.num_servers));
  if (j.contains("job_key")) {
    std::string hex;
    DSYNC_RETURN_IF_ERROR(Field(j, "job_key", &hex));
    w.job_key = JobKeyFromHex(hex);
    if (!w.job_key) return Error(StatusCode::kProtocol, "handshake field 'job_key' is not a key");
  }
  if (j.contains("lr_from_round") || j.contains("lr")) {
    Round from = 0;
    float lr = 0.0f;
    DSYNC_RETURN_IF_ERROR(Field(j, "lr_from_round", &from));
    DSYNC_RETURN_IF_ERROR(Field(j, "lr", &lr));
    if (lr < 0.0f) return Error(StatusCode::kProtocol, "handshake field 'lr' is negative: {}", lr);
    w.learning_rate = std::make_pair(from, lr);
  }
  if (j.contains("checkpoints")) DSYNC_RETURN_IF_ERROR(Field(j, "checkpoints", &w.checkpoints));
  if (j.contains("reconnect_grace_ms")) {
    DSYNC_RETURN_IF_ERROR(Field(j, "reconnect_grace_ms", &w.reconnect_grace_ms));
  }
  if (j.contains("scheduler_proof")) {
    Tag t;
    DSYNC_RETURN_IF_ERROR(TagField(j, "scheduler_proof", &t));
    w.scheduler_proof = t;
  }
  if (j.contains("replicas")) DSYNC_RETURN_IF_ERROR(Field(j, "replicas", &w.replicas));
  if (j.contains("servers_lost")) DSYNC_RETURN_IF_ERROR(Field(j, "servers_lost", &w.servers_lost));
  if (j.contains("servers_back")) DSYNC_RETURN_IF_ERROR(Field(j, "servers_back", &w.servers_back));
  if (j.contains("servers_filling")) {
    DSYNC_RETURN_IF_ERROR(Field(j, "servers_filling", &w.servers_filling));
  }
  if (j.contains("damp_from")) {
    Round from = 0;
    DSYNC_RETURN_IF_ERROR(Field(j, "damp_from", &from));
    w.damp_from = from;
  }
  if (j.contains("takeover_from")) {
    Round from = 0;
    DSYNC_RETURN_IF_ERROR(Field(j, "takeover_from", &from));
    w.takeover_from = from;
  }
  const uint32_t servers_n = w.job_key ? w.num_servers : static_cast<uint32_t>(w.servers.size());
  const std::vector<bool> lost = LostNow(w.servers_lost, w.servers_back, servers_n);
  const auto lost_now = static_cast<size_t>(std::count(lost.begin(), lost.end(), true));
  if (w.replicas == 0 || (servers_n > 0 && w.replicas > servers_n) ||
      lost_now >= std::max<size_t>(servers_n, 1)) {
    return Error(StatusCode::kProtocol, "welcome: {} replica(s) and {} lost server(s) of {}",
                 w.replicas, lost_now, servers_n);
  }
  for (const std::vector<NodeId>* list : {&w.servers_lost, &w.servers_back, &w.servers_filling}) {
    for (NodeId s : *list) {
      if (s < kFirstServerId || s - kFirstServerId >= servers_n) {
        return Error(StatusCode::kProtocol, "welcome: server {} is not a server of the job", s);
      }
    }
  }
  if (j.contains("restore")) {
    json r;
    Welcome::Restore restore;
    DSYNC_RETURN_IF_ERROR(Field(j, "restore", &r));
    DSYNC_RETURN_IF_ERROR(Field(r, "file", &restore.file));
    DSYNC_RETURN_IF_ERROR(Field(r, "crc32", &restore.crc32));
    DSYNC_RETURN_IF_ERROR(Field(r, "version", &restore.version));
    if (r.contains("copies")) {
      json copies;
      DSYNC_RETURN_IF_ERROR(Field(r, "copies", &copies));
      if (!copies.is_array()) return Error(StatusCode::kProtocol, "welcome: restore copies is not a list");
      for (const json& c : copies) {
        Welcome::Restore::Source src;
        DSYNC_RETURN_IF_ERROR(Field(c, "file", &src.file));
        DSYNC_RETURN_IF_ERROR(Field(c, "crc32", &src.crc32));
        restore.copies.push_back(std::move(src));
      }
    }
    w.restore = std::move(restore);
  }
  return w;
}

bool TokenMatches(const std::string& expected, const std::string& presented) {
  unsigned diff = expected.size() == presented.size() ? 0u : 1u;
  for (size_t i = 0; i < expected.size(); ++i) {
    const char p = i < presented.size() ? presented[i] : '\0';
    diff |= static_cast<unsigned>(static_cast<unsigned char>(expected[i]) ^
                                  static_cast<unsigned char>(p));
  }
  return diff == 0;
}

Status SendError(Transport& transport, PeerId peer, NodeId self, const Status& error,
                 const FrameHeader& about, bool close_after, SendDone then) {
  FrameHeader h = MakeHeader(MsgType::kError, self);
  h.status = static_cast<uint16_t>(error.code());
  h.request = about.request;
  h.set_tensor(about.tensor());
  h.set_slice(about.slice());
  h.set_refused(about.msg_type());
  const std::string& text = error.message();
  const size_t n = std::min<size_t>(text.size(), kMaxMetaBytes);
  if (close_after) {
    then = [t = &transport, peer](const Status&) { t->Close(peer); };
  }
  Status st = transport.Send(peer, h, AsBytes(std::string_view(text).substr(0, n)), nullptr, 0,
                             std::move(then));
  if (!st.ok() && close_after) transport.Close(peer);
  return st;
}

Status SendControl(Transport& transport, PeerId peer, const FrameHeader& header) {
  return transport.Send(peer, header, {}, nullptr, 0);
}

Status ErrorFromFrame(const FrameHeader& header, std::span<const std::byte> meta) {
  auto code = static_cast<StatusCode>(header.status);
  if (code == StatusCode::kOk) code = StatusCode::kInternal;
  return Status(code, std::string(AsText(meta)));
}

}  // namespace dsync::ps
