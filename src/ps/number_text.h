// Numbers as they are written in environment variables and flags, each refused with what
// was wrong: whole numbers with a maximum, 32-bit floats (no silent infinity), and sizes
// such as 4M or 512KiB.
#pragma once

#include <cstdint>
#include <string_view>

#include "dsync/status.h"

namespace dsync::ps {

// Errors read "{what}: '{text}' is not ..." (no "{what}: " when `what` is empty).
Result<uint64_t> ParseUnsigned(std::string_view what, std::string_view text, uint64_t max);
Result<float> ParseFloat(std::string_view what, std::string_view text);
Result<uint64_t> ParseBytes(std::string_view what, std::string_view text);

}  // namespace dsync::ps
