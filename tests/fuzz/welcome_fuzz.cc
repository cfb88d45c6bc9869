// ps::DecodeWelcome: the job configuration a joining node takes from the scheduler's reply.
// A decoded welcome says what its JSON says (no wrapped or truncated numbers, no optimizer
// setting that overflowed to infinity) and encodes and decodes back to itself.
#include <nlohmann/json.hpp>

#include <cmath>

#include "fuzz_check.h"
#include "ps/handshake.h"

using namespace dsync;
using namespace dsync::ps;

namespace {

using nlohmann::json;

// Whether `v` is the number `value`: a decoder must refuse a number its field cannot hold
// (negative, too large, fractional) rather than wrap or truncate it.
bool NumberIs(const json& v, uint64_t value) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() == value;
  if (v.is_number_integer()) return v.get<int64_t>() >= 0 && v.get<uint64_t>() == value;
  return v.is_number_float() && v.get<double>() == static_cast<double>(value);
}

bool Same(const Welcome& a, const Welcome& b) {
  if (a.servers.size() != b.servers.size()) return false;
  for (size_t i = 0; i < a.servers.size(); ++i) {
    const ServerAddress &x = a.servers[i], &y = b.servers[i];
    if (x.id != y.id || x.host != y.host || x.port != y.port || x.proof != y.proof) return false;
  }
  return a.id == b.id && a.sync == b.sync && a.optimizer == b.optimizer &&
         a.slice_bytes == b.slice_bytes && a.heartbeat_interval_ms == b.heartbeat_interval_ms &&
         a.join_round == b.join_round && a.start_clock == b.start_clock && a.gate == b.gate &&
         a.observer == b.observer && a.credential == b.credential && a.job_key == b.job_key &&
         a.num_servers == b.num_servers && a.learning_rate == b.learning_rate;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto meta = FuzzBytes(data, size);
  const Result<Welcome> w = DecodeWelcome(meta);
  if (!w.ok()) {
    FUZZ_CHECK(w.status().code() == StatusCode::kProtocol ||
               w.status().code() == StatusCode::kInvalidArgument);  // unknown mode, optimizer
    return 0;
  }
  const json j = json::parse(AsText(meta));
  FUZZ_CHECK(NumberIs(j.at("id"), w->id));
  FUZZ_CHECK(NumberIs(j.at("slice_bytes"), w->slice_bytes));
  FUZZ_CHECK(NumberIs(j.at("heartbeat_interval_ms"), w->heartbeat_interval_ms));
  FUZZ_CHECK(NumberIs(j.at("join_round"), w->join_round));
  FUZZ_CHECK(NumberIs(j.at("start_clock"), w->start_clock));
  FUZZ_CHECK(NumberIs(j.at("gate"), w->gate));
  FUZZ_CHECK(NumberIs(j.at("num_servers"), w->num_servers));
  FUZZ_CHECK(j.at("servers").size() == w->servers.size());
  for (size_t i = 0; i < w->servers.size(); ++i) {
    FUZZ_CHECK(NumberIs(j.at("servers")[i].at("id"), w->servers[i].id));
    FUZZ_CHECK(NumberIs(j.at("servers")[i].at("port"), w->servers[i].port));
  }
  const OptimizerConfig& o = w->optimizer;
  for (float x : {o.lr, o.momentum, o.dampening, o.beta1, o.beta2, o.eps, o.weight_decay}) {
    FUZZ_CHECK(std::isfinite(x));
  }
  if (w->learning_rate) {
    FUZZ_CHECK(NumberIs(j.at("lr_from_round"), w->learning_rate->first));
    FUZZ_CHECK(std::isfinite(w->learning_rate->second) && w->learning_rate->second >= 0.0f);
  }

  const Result<Welcome> again = DecodeWelcome(AsBytes(EncodeWelcome(*w)));
  FUZZ_CHECK(again.ok() && Same(*again, *w));
  return 0;
}
