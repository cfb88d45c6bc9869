#include "fashion_mnist.h"

#include <zlib.h>

#include <filesystem>

namespace dsync::train {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

Status Missing(const std::string& path) {
  return Error(StatusCode::kNotFound,
               "Fashion-MNIST file {} is missing: install Debian's package dataset-fashion-mnist "
               "(apt-get install dataset-fashion-mnist) or point --data-dir at a folder holding "
               "the four *-ubyte.gz files",
               path);
}

}  // namespace

Result<std::vector<uint8_t>> ReadGzip(const std::string& path) {
  if (!std::filesystem::exists(path)) return Missing(path);
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return Error(StatusCode::kUnavailable, "cannot open {}", path);
  gzbuffer(f, 1 << 17);
  std::vector<uint8_t> out;
  uint8_t chunk[1 << 16];
  for (;;) {
    const int n = gzread(f, chunk, sizeof(chunk));
    if (n < 0) {
      int err = 0;
      const std::string what = gzerror(f, &err);
      gzclose(f);
      return Error(StatusCode::kInvalidArgument,
                   "{} is not a valid gzip file ({}); reinstall dataset-fashion-mnist", path,
                   what);
    }
    if (n == 0) break;
    out.insert(out.end(), chunk, chunk + n);
  }
  // A gzip stream cut short reads as a clean end of file; zlib says so only here.
  int err = 0;
  const char* msg = gzerror(f, &err);
  const std::string text = msg ? msg : "";
  gzclose(f);
  if (err != Z_OK && err != Z_STREAM_END) {
    return Error(StatusCode::kInvalidArgument, "{} is damaged ({}); reinstall "
                 "dataset-fashion-mnist", path, text);
  }
  return out;
}

Result<std::vector<uint32_t>> ParseIdxHeader(const std::vector<uint8_t>& data, uint32_t dims,
                                             const std::string& path) {
  if (data.size() < 4 + 4 * size_t{dims}) {
    return Error(StatusCode::kInvalidArgument, "{} is too short for an IDX header", path);
  }
  if (data[0] != 0 || data[1] != 0 || data[2] != kUnsignedByte || data[3] != dims) {
    return Error(StatusCode::kInvalidArgument,
                 "{} is not an IDX file of {}-dimensional unsigned bytes (magic {:02x}{:02x}"
                 "{:02x}{:02x})",
                 path, dims, data[0], data[1], data[2], data[3]);
  }
  std::vector<uint32_t> sizes(dims);
  uint64_t total = 1;
  for (uint32_t d = 0; d < dims; ++d) {
    sizes[d] = BigEndian32(data.data() + 4 + 4 * d);
    total *= sizes[d];
  }
  const uint64_t expected = 4 + 4 * uint64_t{dims} + total;
  if (data.size() != expected) {
    return Error(StatusCode::kInvalidArgument,
                 "{} holds {} bytes but its header promises {}: the file is truncated or "
                 "damaged; reinstall dataset-fashion-mnist",
                 path, data.size(), expected);
  }
  return sizes;
}

Result<Dataset> LoadFashionMnist(const std::string& dir, const std::string& split) {
  if (split != "train" && split != "t10k") {
    return Error(StatusCode::kInvalidArgument, "split '{}' is not train or t10k", split);
  }
  const std::string images_path = dir + "/" + split + "-images-idx3-ubyte.gz";
  const std::string labels_path = dir + "/" + split + "-labels-idx1-ubyte.gz";
  DSYNC_ASSIGN_OR_RETURN(std::vector<uint8_t> images, ReadGzip(images_path));
  DSYNC_ASSIGN_OR_RETURN(std::vector<uint8_t> labels, ReadGzip(labels_path));
  DSYNC_ASSIGN_OR_RETURN(auto image_dims, ParseIdxHeader(images, 3, images_path));
  DSYNC_ASSIGN_OR_RETURN(auto label_dims, ParseIdxHeader(labels, 1, labels_path));
  if (image_dims[0] != label_dims[0]) {
    return Error(StatusCode::kInvalidArgument, "{} has {} images but {} has {} labels",
                 images_path, image_dims[0], labels_path, label_dims[0]);
  }
  Dataset ds;
  ds.count = image_dims[0];
  ds.rows = image_dims[1];
  ds.cols = image_dims[2];
  ds.pixels.assign(images.begin() + 16, images.end());
  ds.labels.assign(labels.begin() + 8, labels.end());
  for (uint32_t i = 0; i < ds.count; ++i) {
    if (ds.labels[i] > 9) {
      return Error(StatusCode::kInvalidArgument, "{}: label {} of image {} is not a class 0..9",
                   labels_path, ds.labels[i], i);
    }
  }
  return ds;
}

}  // namespace dsync::train
