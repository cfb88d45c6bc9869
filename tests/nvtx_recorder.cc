#include "nvtx_recorder.h"

#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

// A tool needs NVTX's types, not its implementation (nvToolsExt.h: NVTX_NO_IMPL "when
// writing NVTX tools"). Our InitializeInjectionNvtx2_fnptr below replaces the weak one the
// implementation in libdsync defines (nvtxInit.h, "static injection"); NVTX calls it on its
// first use in the process.
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

namespace dsync::testing {
namespace {

struct State {
  std::mutex mu;
  NvtxSnapshot snap;
  std::deque<std::string> strings;  // stable addresses: the handles point here
  std::unordered_map<std::thread::id, int64_t> depth;
  std::set<nvtxRangeId_t> open;
  nvtxRangeId_t next_id = 1;
};

State& S() {
  static State s;
  return s;
}

int kDomainTag;  // the address is the one domain handle we hand out

NvtxRecord RecordOf(const nvtxEventAttributes_t* a) {
  NvtxRecord r;
  if (!a) return r;
  r.category = a->category;
  if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED) {
    r.name = *reinterpret_cast<const std::string*>(a->message.registered);
  } else if (a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii) {
    r.name = a->message.ascii;
  }
  if (a->payloadType == NVTX_PAYLOAD_TYPE_UNSIGNED_INT64) {
    r.has_payload = true;
    r.payload = a->payload.ullValue;
  }
  return r;
}

nvtxDomainHandle_t DomainCreateA(const char* name) {
  std::lock_guard lock(S().mu);
  S().snap.domains.emplace_back(name ? name : "");
  return reinterpret_cast<nvtxDomainHandle_t>(&kDomainTag);
}

void DomainNameCategoryA(nvtxDomainHandle_t, uint32_t category, const char* name) {
  std::lock_guard lock(S().mu);
  S().snap.categories[category] = name ? name : "";
}

nvtxStringHandle_t DomainRegisterStringA(nvtxDomainHandle_t, const char* text) {
  std::lock_guard lock(S().mu);
  S().strings.emplace_back(text ? text : "");
  S().snap.registered.push_back(S().strings.back());
  return reinterpret_cast<nvtxStringHandle_t>(&S().strings.back());
}

int DomainRangePushEx(nvtxDomainHandle_t, const nvtxEventAttributes_t* a) {
  std::lock_guard lock(S().mu);
  S().snap.pushed.push_back(RecordOf(a));
  return static_cast<int>(++S().depth[std::this_thread::get_id()]);
}

int DomainRangePop(nvtxDomainHandle_t) {
  std::lock_guard lock(S().mu);
  int64_t& d = S().depth[std::this_thread::get_id()];
  if (d == 0) {
    ++S().snap.unbalanced_pops;
    return -1;
  }
  return static_cast<int>(--d);
}

nvtxRangeId_t DomainRangeStartEx(nvtxDomainHandle_t, const nvtxEventAttributes_t* a) {
  std::lock_guard lock(S().mu);
  S().snap.started.push_back(RecordOf(a));
  const nvtxRangeId_t id = S().next_id++;
  S().open.insert(id);
  return id;
}

void DomainRangeEnd(nvtxDomainHandle_t, nvtxRangeId_t id) {
  std::lock_guard lock(S().mu);
  if (S().open.erase(id) == 0) ++S().snap.unknown_ends;
}

template <typename F>
void Set(NvtxFunctionTable table, unsigned size, NvtxCallbackIdCore2 id, F fn) {
  if (static_cast<unsigned>(id) < size) *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn);
}

int InitializeInjection(NvtxGetExportTableFunc_t get_table) {
  const auto* callbacks =
      static_cast<const NvtxExportTableCallbacks*>(get_table(NVTX_ETID_CALLBACKS));
  if (!callbacks) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned size = 0;
  if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) || !table) {
    return 0;
  }
  Set(table, size, NVTX_CBID_CORE2_DomainCreateA, &DomainCreateA);
  Set(table, size, NVTX_CBID_CORE2_DomainNameCategoryA, &DomainNameCategoryA);
  Set(table, size, NVTX_CBID_CORE2_DomainRegisterStringA, &DomainRegisterStringA);
  Set(table, size, NVTX_CBID_CORE2_DomainRangePushEx, &DomainRangePushEx);
  Set(table, size, NVTX_CBID_CORE2_DomainRangePop, &DomainRangePop);
  Set(table, size, NVTX_CBID_CORE2_DomainRangeStartEx, &DomainRangeStartEx);
  Set(table, size, NVTX_CBID_CORE2_DomainRangeEnd, &DomainRangeEnd);
  std::lock_guard lock(S().mu);
  S().snap.injected = true;
  return 1;
}

}  // namespace

NvtxSnapshot NvtxRecorded() {
  std::lock_guard lock(S().mu);
  NvtxSnapshot s = S().snap;
  for (const auto& [thread, d] : S().depth) s.open_pushes += d;
  s.open_starts = static_cast<int64_t>(S().open.size());
  return s;
}

}  // namespace dsync::testing

extern "C" {
NvtxInitializeInjectionNvtxFunc_t InitializeInjectionNvtx2_fnptr =
    &dsync::testing::InitializeInjection;
}
