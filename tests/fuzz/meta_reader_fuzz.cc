// ps::MetaReader, under every binary metadata decoder: a script of reads (taken from the end
// of the input) runs over the rest of the input. Each read that succeeds returns the next
// bytes and nothing else; one that fails had too few bytes left; writing the values read
// with MetaWriter gives back exactly the bytes consumed; done() means all were.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "ps/protocol.h"

using namespace dsync::ps;

namespace {

enum class Op : uint8_t { kU8, kU16, kU32, kU64, kString, kMaxValue = kString };

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  std::vector<Op> script(in.ConsumeIntegralInRange<size_t>(0, 32));
  for (Op& op : script) op = in.ConsumeEnum<Op>();
  const std::vector<uint8_t> bytes = in.ConsumeRemainingBytes<uint8_t>();

  MetaReader reader(FuzzBytes(bytes.data(), bytes.size()));
  std::vector<std::byte> rewritten;
  MetaWriter writer(rewritten);
  size_t pos = 0;  // bytes consumed so far
  auto fixed = [&]<typename T>(T) {
    T v{};
    if (!reader.Get(&v)) {
      FUZZ_CHECK(bytes.size() - pos < sizeof v);
      return false;
    }
    FUZZ_CHECK(bytes.size() - pos >= sizeof v);
    FUZZ_CHECK(std::memcmp(&v, bytes.data() + pos, sizeof v) == 0);
    writer.Put(v);
    pos += sizeof v;
    return true;
  };
  bool all_read = true;
  for (Op op : script) {
    bool ok = false;
    switch (op) {
      case Op::kU8: ok = fixed(uint8_t{}); break;
      case Op::kU16: ok = fixed(uint16_t{}); break;
      case Op::kU32: ok = fixed(uint32_t{}); break;
      case Op::kU64: ok = fixed(uint64_t{}); break;
      case Op::kString: {
        std::string s;
        ok = reader.GetString(&s);
        const size_t left = bytes.size() - pos;
        uint32_t n = 0;
        if (left >= sizeof n) std::memcpy(&n, bytes.data() + pos, sizeof n);
        if (ok) {
          FUZZ_CHECK(left >= sizeof n && left - sizeof n >= n && s.size() == n);
          writer.PutString(s);
          pos += sizeof n + n;
        } else {
          FUZZ_CHECK(left < sizeof n || left - sizeof n < n);
        }
        break;
      }
    }
    // Decoders give up at the first failed read; where the reader stands then is unspecified.
    if (!ok) {
      all_read = false;
      break;
    }
  }
  FUZZ_CHECK(rewritten.size() == pos);
  FUZZ_CHECK(std::equal(rewritten.begin(), rewritten.end(), FuzzBytes(bytes.data(), pos).begin()));
  if (all_read) FUZZ_CHECK(reader.done() == (pos == bytes.size()));
  return 0;
}
