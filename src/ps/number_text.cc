#include "ps/number_text.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

namespace dsync::ps {
namespace {

std::string Prefix(std::string_view what) {
  return what.empty() ? std::string() : std::string(what) + ": ";
}

}  // namespace

Result<uint64_t> ParseUnsigned(std::string_view what, std::string_view text, uint64_t max) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > max) {
    return Error(StatusCode::kInvalidArgument, "{}'{}' is not a whole number up to {}",
                 Prefix(what), text, max);
  }
  return v;
}

Result<float> ParseFloat(std::string_view what, std::string_view text) {
  std::string s(text);
  char* end = nullptr;
  errno = 0;
  const float v = std::strtof(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    return Error(StatusCode::kInvalidArgument, "{}'{}' is not a number", Prefix(what), text);
  }
  // strtof saturates to infinity (or flushes towards 0) and says so only in errno; glibc
  // leaves errno alone for a subnormal it could represent exactly (0x1p-149), whose shortest
  // text ("1e-45") would then be refused on the way back: refused alike.
  if (errno == ERANGE || (v != 0.0f && std::fabs(v) < std::numeric_limits<float>::min())) {
    return Error(StatusCode::kInvalidArgument,
                 "{}'{}' does not fit a 32-bit float (magnitudes 1.2e-38 .. 3.4e38, or 0)",
                 Prefix(what), text);
  }
  return v;
}

Result<uint64_t> ParseBytes(std::string_view what, std::string_view text) {
  uint64_t mult = 1;
  std::string_view digits = text;
  auto strip = [&](std::string_view suffix, uint64_t m) {
    if (digits.size() > suffix.size() && digits.ends_with(suffix)) {
      digits.remove_suffix(suffix.size());
      mult = m;
      return true;
    }
    return false;
  };
  strip("KiB", 1ull << 10) || strip("MiB", 1ull << 20) || strip("GiB", 1ull << 30) ||
      strip("k", 1ull << 10) || strip("K", 1ull << 10) || strip("M", 1ull << 20) ||
      strip("G", 1ull << 30);
  DSYNC_ASSIGN_OR_RETURN(uint64_t v, ParseUnsigned(what, digits, UINT64_MAX / mult));
  return v * mult;
}

}  // namespace dsync::ps
