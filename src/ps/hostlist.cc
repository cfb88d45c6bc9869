#include "ps/hostlist.h"

#include <fmt/format.h>

#include <cctype>
#include <cstdint>

namespace dsync::ps {
namespace {

struct Range {
  uint64_t lo = 0, hi = 0;
  size_t width = 0;  // digits of the lower bound as written: the padding of every number
};

Status Bad(std::string_view list, size_t at, std::string_view what) {
  return Error(StatusCode::kInvalidArgument,
               "cannot parse the host list '{}' at character {}: {} (expected names like "
               "node[01-04,07],gpu3)",
               list, at + 1, what);
}

// Reads digits at `pos`; false when there are none or they overflow.
bool Number(std::string_view s, size_t& pos, uint64_t* value, size_t* width) {
  const size_t start = pos;
  uint64_t v = 0;
  while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) {
    if (v > (UINT64_MAX - 9) / 10) return false;
    v = v * 10 + static_cast<uint64_t>(s[pos] - '0');
    ++pos;
  }
  *value = v;
  *width = pos - start;
  return pos > start;
}

// One bracket group's ranges, `pos` just past '['; leaves `pos` just past ']'.
Status ParseGroup(std::string_view list, size_t& pos, std::vector<Range>* ranges) {
  for (;;) {
    Range r;
    if (!Number(list, pos, &r.lo, &r.width)) return Bad(list, pos, "a number");
    r.hi = r.lo;
    if (pos < list.size() && list[pos] == '-') {
      ++pos;
      size_t hi_width = 0;
      if (!Number(list, pos, &r.hi, &hi_width)) return Bad(list, pos, "the end of a range");
      if (r.hi < r.lo) return Bad(list, pos - 1, "a range that does not go down");
    }
    ranges->push_back(r);
    if (pos >= list.size()) return Bad(list, pos, "']'");
    if (list[pos] == ']') {
      ++pos;
      return Status::Ok();
    }
    if (list[pos] != ',') return Bad(list, pos, "',' or ']'");
    ++pos;
  }
}

bool NameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}

}  // namespace

Result<std::vector<std::string>> ExpandHostList(std::string_view list) {
  std::vector<std::string> hosts;
  size_t pos = 0;
  if (list.empty()) return Bad(list, 0, "a host name");
  while (pos <= list.size()) {
    // One item: literal text and bracket groups up to a ',' outside brackets.
    std::vector<std::string> partial = {""};
    size_t item_start = pos;
    while (pos < list.size() && list[pos] != ',') {
      if (list[pos] == '[') {
        ++pos;
        std::vector<Range> ranges;
        DSYNC_RETURN_IF_ERROR(ParseGroup(list, pos, &ranges));
        uint64_t count = 0;  // each term is checked before it is added: no wrap-around
        bool too_many = false;
        for (const Range& r : ranges) {
          too_many = too_many || r.hi - r.lo >= kMaxHostListHosts;
          if (!too_many) count += r.hi - r.lo + 1;
          too_many = too_many || count > kMaxHostListHosts;
        }
        if (too_many || partial.size() * count + hosts.size() > kMaxHostListHosts) {
          return Error(StatusCode::kInvalidArgument,
                       "the host list '{}' names more than {} hosts", list, kMaxHostListHosts);
        }
        std::vector<std::string> next;
        next.reserve(partial.size() * count);
        for (const std::string& p : partial) {
          for (const Range& r : ranges) {
            for (uint64_t n = r.lo;; ++n) {
              next.push_back(fmt::format("{}{:0{}}", p, n, r.width));
              if (n == r.hi) break;
            }
          }
        }
        partial = std::move(next);
      } else if (NameChar(list[pos])) {
        for (std::string& p : partial) p += list[pos];
        ++pos;
      } else {
        return Bad(list, pos, fmt::format("a host name character, not '{}'", list[pos]));
      }
    }
    if (pos == item_start) return Bad(list, pos, "a host name");
    for (std::string& p : partial) hosts.push_back(std::move(p));
    if (pos == list.size()) break;
    ++pos;  // the ','
    if (pos == list.size()) return Bad(list, pos, "a host name after ','");
  }
  return hosts;
}

}  // namespace dsync::ps
