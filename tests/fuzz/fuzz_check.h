// Helpers shared by the libFuzzer targets in this folder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

// A property that must hold for every input. A violation aborts, so libFuzzer reports it
// like a crash and saves the input that caused it.
#define FUZZ_CHECK(cond)                                                                     \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: property violated: %s\n", __FILE__, __LINE__, #cond);    \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

inline std::span<const std::byte> FuzzBytes(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}
