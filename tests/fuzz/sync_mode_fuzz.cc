// SyncMode::Parse (--sync, DSYNC_SYNC, and the welcome every node receives): a parsed mode
// is one the design allows, prints as text that parses back to it, and that text is the
// canonical one; every mode built from valid parameters survives the same round trip.
#include <fuzzer/FuzzedDataProvider.h>

#include <string>

#include "dsync/config.h"
#include "fuzz_check.h"

using namespace dsync;

namespace {

void CheckRoundTrip(const SyncMode& m) {
  const std::string text = m.ToString();
  const Result<SyncMode> again = SyncMode::Parse(text);
  FUZZ_CHECK(again.ok() && *again == m);
  FUZZ_CHECK(again->ToString() == text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const Result<SyncMode> m = SyncMode::Parse(text);
  if (m.ok()) {
    switch (m->kind) {
      case SyncKind::kRound:
        if (m->adaptive) FUZZ_CHECK(m->bound >= 1 && m->quorum == SyncMode::kAll);
        if (m->bound == 0) FUZZ_CHECK(m->quorum == SyncMode::kAll && !m->adaptive);
        FUZZ_CHECK(m->bound != SyncMode::kUnbounded);
        break;
      case SyncKind::kSsp:
        FUZZ_CHECK(m->bound != SyncMode::kUnbounded && m->quorum == SyncMode::kAll);
        break;
      case SyncKind::kAsp:
        FUZZ_CHECK(*m == SyncMode::Asp());
        break;
    }
    CheckRoundTrip(*m);
  } else {
    FUZZ_CHECK(m.status().code() == StatusCode::kInvalidArgument);
  }

  // Modes made by the factories, within the parameters Parse accepts.
  FuzzedDataProvider in(data, size);
  const uint32_t d = in.ConsumeIntegralInRange<uint32_t>(0, SyncMode::kUnbounded - 1);
  const uint32_t q = in.ConsumeIntegralInRange<uint32_t>(0, SyncMode::kUnbounded - 1);
  CheckRoundTrip(SyncMode::Dsync(d, q));
  CheckRoundTrip(SyncMode::Ssp(d));
  CheckRoundTrip(SyncMode::Auto(in.ConsumeIntegralInRange<uint32_t>(1, 1024)));
  return 0;
}
