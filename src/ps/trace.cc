#include "ps/trace.h"

#include <array>

#if DSYNC_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace dsync::trace {
namespace {

struct Info {
  const char* name;
  uint32_t category;  // 1 worker, 2 server, 3 store
  uint32_t argb;
};

// Colors by layer, shades by activity: waits are grey-ish so the busy ranges stand out.
constexpr std::array<Info, static_cast<size_t>(Range::kCount)> kInfo = {{
    {"worker: push", 1, 0xFF1F77B4},
    {"worker: pull", 1, 0xFF6BAED6},
    {"worker: wait for bound", 1, 0xFF9E9E9E},
    {"worker: wait for pull", 1, 0xFFBDBDBD},
    {"worker: wait for push", 1, 0xFFBDBDBD},
    {"server: push", 2, 0xFF2CA02C},
    {"server: pull", 2, 0xFF98DF8A},
    {"server: round", 2, 0xFF006D2C},
    {"store: aggregate", 3, 0xFFFF7F0E},
    {"store: apply", 3, 0xFFD62728},
    {"store: read", 3, 0xFFFFBB78},
}};

const Info& InfoOf(Range r) { return kInfo[static_cast<size_t>(r)]; }

#if DSYNC_HAVE_NVTX
// Registered once: registered strings let a tool map a range to its name by handle instead
// of copying the text on every call (NVTX docs, "Registered Strings").
struct Domain {
  nvtxDomainHandle_t handle = nullptr;
  std::array<nvtxStringHandle_t, static_cast<size_t>(Range::kCount)> names{};
  Domain() {
    handle = nvtxDomainCreateA("dsyncps");
    nvtxDomainNameCategoryA(handle, 1, "worker");
    nvtxDomainNameCategoryA(handle, 2, "server");
    nvtxDomainNameCategoryA(handle, 3, "store");
    for (size_t i = 0; i < names.size(); ++i) {
      names[i] = nvtxDomainRegisterStringA(handle, kInfo[i].name);
    }
  }
};

const Domain& TheDomain() {
  static const Domain domain;
  return domain;
}

nvtxEventAttributes_t Attributes(Range r, uint64_t payload) {
  const Domain& d = TheDomain();
  const Info& info = InfoOf(r);
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.category = info.category;
  a.colorType = NVTX_COLOR_ARGB;
  a.color = info.argb;
  if (payload != 0) {
    a.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
    a.payload.ullValue = payload;
  }
  a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
  a.message.registered = d.names[static_cast<size_t>(r)];
  return a;
}
#endif

}  // namespace

std::string_view Name(Range r) { return InfoOf(r).name; }

#if DSYNC_HAVE_NVTX
bool Enabled() { return true; }

void Push(Range r, uint64_t payload) {
  const nvtxEventAttributes_t a = Attributes(r, payload);
  nvtxDomainRangePushEx(TheDomain().handle, &a);
}

void Pop() { nvtxDomainRangePop(TheDomain().handle); }

uint64_t Start(Range r) {
  const nvtxEventAttributes_t a = Attributes(r, 0);
  return nvtxDomainRangeStartEx(TheDomain().handle, &a);
}

void End(uint64_t id) {
  if (id != 0) nvtxDomainRangeEnd(TheDomain().handle, id);
}
#else
bool Enabled() { return false; }
void Push(Range, uint64_t) {}
void Pop() {}
uint64_t Start(Range) { return 0; }
void End(uint64_t) {}
#endif

}  // namespace dsync::trace
