// NumPy's .npz: a zip archive of .npy arrays (numpy.lib.format, version 1.0), stored without
// compression. Written by hand because no Debian library writes .npy (libzip could write the
// archive, but the entries' layout is NumPy's either way, and a stored zip is 60 lines).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsync/status.h"

namespace dsync::app {

struct NpzArray {
  std::string name;  // numpy.load(...)[name]
  std::vector<uint64_t> shape;
  std::span<const float> values;  // float32, C order
};

// Writes the arrays to `path` (through a temporary file, renamed into place). Archives and
// entries past 4 GiB (zip64) are refused, saying so.
Status WriteNpz(const std::string& path, std::span<const NpzArray> arrays);

}  // namespace dsync::app
