// The DSYNC_RDMA_* variables: the RDMA tunables (rdma_transport.h) a user may set, each read
// and checked here and nowhere else.
#include <cstdlib>

#include "ps/number_text.h"
#include "ps/protocol.h"
#include "rdma/rdma_conn.h"
#include "rdma/rdma_transport.h"

namespace dsync::rdma {
namespace {

struct Variable {
  const char* name;
  uint64_t min, max;
  uint64_t multiple_of;  // 1: any value in range
  void (*store)(RdmaTunables& t, uint64_t value);
};

// clang-format off
constexpr Variable kVariables[] = {
  {"DSYNC_RDMA_SLOTS", RdmaTunables::kMinSlots, RdmaTunables::kMaxSlots, 1,
   [](RdmaTunables& t, uint64_t v) { t.slots = static_cast<uint32_t>(v); }},
  {"DSYNC_RDMA_SLOT_BYTES", RdmaTunables::kMinSlotBytes, RdmaTunables::kMaxSlotBytes, 8,
   [](RdmaTunables& t, uint64_t v) { t.slot_bytes = static_cast<uint32_t>(v); }},
  {"DSYNC_RDMA_MAX_RENDEZVOUS", 1, RdmaTunables::kMaxRendezvous, 1,
   [](RdmaTunables& t, uint64_t v) { t.max_rendezvous = static_cast<uint32_t>(v); }},
  {"DSYNC_RDMA_SPIN_US", 0, RdmaTunables::kMaxSpinUs, 1,
   [](RdmaTunables& t, uint64_t v) { t.spin = std::chrono::microseconds(v); }},
  {"DSYNC_RDMA_RETRY_COUNT", 0, RdmaTunables::kMaxRetryCount, 1,
   [](RdmaTunables& t, uint64_t v) { t.retry_count = static_cast<uint8_t>(v); }},
};
// clang-format on

}  // namespace

std::vector<std::string_view> RdmaTunableVariables() {
  std::vector<std::string_view> names;
  for (const Variable& v : kVariables) names.emplace_back(v.name);
  return names;
}

Status ReadRdmaTunables(RdmaTunables& tunables) {
  return ReadRdmaTunables(tunables, [](const char* name) { return std::getenv(name); });
}

Status Validate(const RdmaTunables& t) {
  using T = RdmaTunables;
  if (t.slots < T::kMinSlots || t.slots > T::kMaxSlots || t.slot_bytes < T::kMinSlotBytes ||
      t.slot_bytes > T::kMaxSlotBytes || t.slot_bytes % 8 != 0 || t.max_rendezvous == 0 ||
      t.max_rendezvous > T::kMaxRendezvous) {
    return Error(StatusCode::kInvalidArgument,
                 "bad RDMA slot settings: {} slots of {} bytes, {} rendezvous (DSYNC_RDMA_SLOTS "
                 "{} to {}, DSYNC_RDMA_SLOT_BYTES {} to {} in multiples of 8, "
                 "DSYNC_RDMA_MAX_RENDEZVOUS 1 to {})",
                 t.slots, t.slot_bytes, t.max_rendezvous, T::kMinSlots, T::kMaxSlots,
                 T::kMinSlotBytes, T::kMaxSlotBytes, T::kMaxRendezvous);
  }
  // A frame goes eagerly when its header and metadata fit half the ring (EagerChannel::Send),
  // and control frames carry up to kMaxMetaBytes of it.
  const uint64_t need = 2 * (sizeof(SlotHeader) + sizeof(ps::FrameHeader) + ps::kMaxMetaBytes);
  if (uint64_t{t.slots} * t.slot_bytes < need) {
    return Error(StatusCode::kInvalidArgument,
                 "DSYNC_RDMA_SLOTS x DSYNC_RDMA_SLOT_BYTES is {} x {} = {} bytes, below the {} "
                 "the largest control frame needs (twice its header and metadata)",
                 t.slots, t.slot_bytes, uint64_t{t.slots} * t.slot_bytes, need);
  }
  if (uint64_t{t.slots} * t.slot_bytes > T::kMaxRingBytes) {
    return Error(StatusCode::kInvalidArgument,
                 "DSYNC_RDMA_SLOTS x DSYNC_RDMA_SLOT_BYTES is {} x {} = {} bytes, above the {} a "
                 "connection may pin (twice: ring and staging)",
                 t.slots, t.slot_bytes, uint64_t{t.slots} * t.slot_bytes, T::kMaxRingBytes);
  }
  if (t.resolve_addr_min > t.resolve_addr_max || t.idle_wait.count() <= 0) {
    return Error(StatusCode::kInvalidArgument,
                 "RDMA timeouts: address resolution {} to {} ms, idle wait {} ms",
                 t.resolve_addr_min.count(), t.resolve_addr_max.count(), t.idle_wait.count());
  }
  if (t.retry_count > T::kMaxRetryCount || t.rnr_retry_count > T::kMaxRetryCount) {
    return Error(StatusCode::kInvalidArgument, "RDMA retry counts {} and {}: at most {}",
                 t.retry_count, t.rnr_retry_count, T::kMaxRetryCount);
  }
  return Status::Ok();
}

Status ReadRdmaTunables(RdmaTunables& tunables,
                        const std::function<const char*(const char*)>& lookup) {
  RdmaTunables read = tunables;  // assigned only once each variable and the whole set pass
  for (const Variable& v : kVariables) {
    const char* text = lookup(v.name);
    if (!text) continue;
    const Result<uint64_t> value = ps::ParseUnsigned(v.name, text, v.max);
    if (!value.ok() || *value < v.min) {
      return Error(StatusCode::kInvalidArgument, "{}: '{}' is not a whole number from {} to {}",
                   v.name, text, v.min, v.max);
    }
    if (*value % v.multiple_of != 0) {
      return Error(StatusCode::kInvalidArgument, "{}: '{}' is not a multiple of {}", v.name,
                   text, v.multiple_of);
    }
    v.store(read, *value);
  }
  DSYNC_RETURN_IF_ERROR(Validate(read));
  tunables = read;
  return Status::Ok();
}

}  // namespace dsync::rdma
