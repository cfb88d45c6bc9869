// Fashion-MNIST from Debian's package dataset-fashion-mnist: gzip-compressed IDX files
// (http://yann.lecun.com/exdb/mnist/ describes the format), read with zlib.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsync/status.h"

namespace dsync::train {

inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  uint32_t count = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
  std::vector<uint8_t> pixels;  // count x rows x cols, row-major
  std::vector<uint8_t> labels;  // count, 0..9

  uint32_t features() const { return rows * cols; }
  const uint8_t* image(uint32_t i) const { return pixels.data() + size_t{i} * features(); }
};

// The raw contents of one .gz file, gunzipped; clear errors for missing, corrupt or
// truncated files.
Result<std::vector<uint8_t>> ReadGzip(const std::string& path);

// Parses an IDX file (big-endian header: magic 0x0000TTDD, then DD dimension sizes) of
// unsigned bytes with the expected number of dimensions.
Result<std::vector<uint32_t>> ParseIdxHeader(const std::vector<uint8_t>& data, uint32_t dims,
                                             const std::string& path);

// split: "train" (60000 images) or "t10k" (10000).
Result<Dataset> LoadFashionMnist(const std::string& dir, const std::string& split);

}  // namespace dsync::train
