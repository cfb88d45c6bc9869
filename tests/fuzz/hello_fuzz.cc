// ps::DecodeHello and ps::AcceptHello, the first frame any peer sends (before it has shown
// the token). A decoded hello says what its JSON says, encodes and decodes back to itself,
// and AcceptHello accepts it exactly when its token is the cluster's.
#include <nlohmann/json.hpp>

#include <string>

#include "fuzz_check.h"
#include "ps/handshake.h"

using namespace dsync;
using namespace dsync::ps;

namespace {

bool Same(const Hello& a, const Hello& b) {
  return a.role == b.role && a.token == b.token && a.node == b.node && a.host == b.host &&
         a.port == b.port && a.observer == b.observer && a.credential == b.credential;
}

// Whether `j[key]` is the number `value`: a decoder must refuse a number its field cannot
// hold (negative, too large, fractional) rather than wrap or truncate it.
bool NumberIs(const nlohmann::json& j, const char* key, uint64_t value) {
  const auto& v = j.at(key);
  if (v.is_number_unsigned()) return v.get<uint64_t>() == value;
  if (v.is_number_integer()) return v.get<int64_t>() >= 0 && v.get<uint64_t>() == value;
  return v.is_number_float() && v.get<double>() == static_cast<double>(value);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto meta = FuzzBytes(data, size);
  const Result<Hello> hello = DecodeHello(meta);
  if (hello.ok()) {
    const auto j = nlohmann::json::parse(AsText(meta));
    FUZZ_CHECK(NumberIs(j, "node", hello->node));
    FUZZ_CHECK(NumberIs(j, "port", hello->port));
    const Result<Hello> again = DecodeHello(AsBytes(EncodeHello(*hello)));
    FUZZ_CHECK(again.ok() && Same(*again, *hello));
  } else {
    FUZZ_CHECK(hello.status().code() == StatusCode::kProtocol ||
               hello.status().code() == StatusCode::kInvalidArgument);  // an unknown role
  }

  for (const std::string token : {"", "cluster-token"}) {
    const Result<Hello> accepted = AcceptHello(meta, token);
    FUZZ_CHECK(accepted.ok() == (hello.ok() && hello->token == token));
    if (hello.ok() && !accepted.ok()) {
      FUZZ_CHECK(accepted.status().code() == StatusCode::kPermissionDenied);
    }
    if (hello.ok()) FUZZ_CHECK(TokenMatches(token, hello->token) == (token == hello->token));
  }
  return 0;
}
