#include "npz_writer.h"

#include <fmt/format.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>

#include "ps/protocol.h"

namespace dsync::app {
namespace {

class Out {
 public:
  explicit Out(std::FILE* f) : f_(f) {}
  void Bytes(const void* p, size_t n) {
    ok_ = ok_ && std::fwrite(p, 1, n, f_) == n;
    at_ += n;
  }
  template <typename T>
  void Le(T v) {  // little-endian on every host we build for (ps/protocol.h asserts it)
    Bytes(&v, sizeof(v));
  }
  uint64_t at() const { return at_; }
  bool ok() const { return ok_; }

 private:
  std::FILE* f_;
  uint64_t at_ = 0;
  bool ok_ = true;
};

// The .npy header: magic, version 1.0, the dict, padded with spaces to a multiple of 64.
std::string NpyHeader(const std::vector<uint64_t>& shape) {
  std::string dict = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}",
                                 ps::ShapeText(shape));
  constexpr size_t kFixed = 6 + 2 + 2;  // magic, version, header length
  const size_t total = (kFixed + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - kFixed - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string h("\x93NUMPY\x01\x00", 8);
  const auto len = static_cast<uint16_t>(dict.size());
  h.append(reinterpret_cast<const char*>(&len), 2);
  return h + dict;
}

// General purpose flag bit 11 (APPNOTE 4.4.4): names are UTF-8, as tensor names may be.
constexpr uint16_t kUtf8Names = 1u << 11;

struct Entry {
  std::string name;
  uint32_t crc = 0;
  uint64_t size = 0;
  uint64_t offset = 0;
};

}  // namespace

Status WriteNpz(const std::string& path, std::span<const NpzArray> arrays) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return Error(StatusCode::kUnavailable, "cannot create '{}'", tmp);
  Out out(f);
  std::vector<Entry> entries;
  constexpr uint64_t kZip32 = 0xffffffffull;
  for (const NpzArray& a : arrays) {
    const std::string header = NpyHeader(a.shape);
    Entry e;
    e.name = a.name + ".npy";
    e.size = header.size() + a.values.size_bytes();
    e.offset = out.at();
    if (e.size >= kZip32 || e.offset >= kZip32 || e.name.size() > 0xffff) {
      std::fclose(f);
      std::remove(tmp.c_str());
      return Error(StatusCode::kUnimplemented,
                   "'{}' would need zip64 (an array or the archive past 4 GiB): not supported",
                   path);
    }
    uLong crc = crc32(0, nullptr, 0);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(header.data()), static_cast<uInt>(header.size()));
    for (size_t done = 0; done < a.values.size_bytes();) {
      const size_t n = std::min<size_t>(a.values.size_bytes() - done, 1u << 30);
      crc = crc32(crc, reinterpret_cast<const Bytef*>(a.values.data()) + done, static_cast<uInt>(n));
      done += n;
    }
    e.crc = static_cast<uint32_t>(crc);
    // Local file header (APPNOTE 4.3.7): stored, no data descriptor.
    out.Le<uint32_t>(0x04034b50);
    out.Le<uint16_t>(20);
    out.Le<uint16_t>(kUtf8Names);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0x21);  // 1980-01-01
    out.Le<uint32_t>(e.crc);
    out.Le<uint32_t>(static_cast<uint32_t>(e.size));
    out.Le<uint32_t>(static_cast<uint32_t>(e.size));
    out.Le<uint16_t>(static_cast<uint16_t>(e.name.size()));
    out.Le<uint16_t>(0);
    out.Bytes(e.name.data(), e.name.size());
    out.Bytes(header.data(), header.size());
    out.Bytes(a.values.data(), a.values.size_bytes());
    entries.push_back(std::move(e));
  }
  const uint64_t directory = out.at();
  for (const Entry& e : entries) {  // central directory (APPNOTE 4.3.12)
    out.Le<uint32_t>(0x02014b50);
    out.Le<uint16_t>(20);
    out.Le<uint16_t>(20);
    out.Le<uint16_t>(kUtf8Names);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0x21);
    out.Le<uint32_t>(e.crc);
    out.Le<uint32_t>(static_cast<uint32_t>(e.size));
    out.Le<uint32_t>(static_cast<uint32_t>(e.size));
    out.Le<uint16_t>(static_cast<uint16_t>(e.name.size()));
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0);
    out.Le<uint16_t>(0);
    out.Le<uint32_t>(0);
    out.Le<uint32_t>(static_cast<uint32_t>(e.offset));
    out.Bytes(e.name.data(), e.name.size());
  }
  const uint64_t directory_size = out.at() - directory;
  if (entries.size() > 0xffff || out.at() >= kZip32) {
    std::fclose(f);
    std::remove(tmp.c_str());
    return Error(StatusCode::kUnimplemented, "'{}' would need zip64: not supported", path);
  }
  out.Le<uint32_t>(0x06054b50);  // end of central directory (APPNOTE 4.3.16)
  out.Le<uint16_t>(0);
  out.Le<uint16_t>(0);
  out.Le<uint16_t>(static_cast<uint16_t>(entries.size()));
  out.Le<uint16_t>(static_cast<uint16_t>(entries.size()));
  out.Le<uint32_t>(static_cast<uint32_t>(directory_size));
  out.Le<uint32_t>(static_cast<uint32_t>(directory));
  out.Le<uint16_t>(0);
  const bool written = out.ok() && std::fflush(f) == 0;
  std::fclose(f);
  if (!written || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Error(StatusCode::kUnavailable, "could not write '{}'", path);
  }
  return Status::Ok();
}

}  // namespace dsync::app
