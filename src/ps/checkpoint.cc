#include "ps/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace dsync::ps {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kMagic[8] = {'D', 'S', 'C', 'K', 'P', 'T', '0', '1'};
constexpr const char* kManifest = "MANIFEST.json";
constexpr const char* kPrefix = "ckpt-";

uint32_t Crc(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes uInt lengths
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(crc32(crc, p, chunk));
    p += chunk;
    n -= chunk;
  }
  return crc;
}

Status Errno(const std::string& what, const std::string& path) {
  return Error(StatusCode::kUnavailable, "{} '{}': {}", what, path, std::strerror(errno));
}

// Makes a rename (or a new file) in `dir` durable.
Status SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("opening the directory", dir);
  const int rc = fsync(fd);
  close(fd);
  if (rc != 0) return Errno("syncing the directory", dir);
  return Status::Ok();
}

// Writes `parts` to `path` through a temporary file, fsync and rename: never torn.
Status WriteAtomically(const std::string& path, const std::vector<std::span<const std::byte>>& parts) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("creating", tmp);
  for (std::span<const std::byte> part : parts) {
    size_t done = 0;
    while (done < part.size()) {
      const ssize_t n = write(fd, part.data() + done, part.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        Status st = Errno("writing", tmp);
        close(fd);
        unlink(tmp.c_str());
        return st;
      }
      done += static_cast<size_t>(n);
    }
  }
  if (fsync(fd) != 0) {
    Status st = Errno("syncing", tmp);
    close(fd);
    unlink(tmp.c_str());
    return st;
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    Status st = Errno("renaming into place", tmp);
    unlink(tmp.c_str());
    return st;
  }
  return SyncDirectory(fs::path(path).parent_path().string());
}

Result<std::vector<std::byte>> ReadWhole(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("opening", path);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    Status s = Errno("reading the size of", path);
    close(fd);
    return s;
  }
  std::vector<std::byte> data(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  if (done != data.size()) return Error(StatusCode::kDataLoss, "'{}' could not be read whole", path);
  return data;
}

std::span<const std::byte> FloatBytes(const std::vector<float>& v) {
  return {reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float)};
}

// A version in a directory name, or nothing for a name that is not a checkpoint's.
std::optional<Version> VersionOf(const std::string& name) {
  if (name.rfind(kPrefix, 0) != 0 || name.size() == std::strlen(kPrefix)) return std::nullopt;
  Version v = 0;
  for (char c : name.substr(std::strlen(kPrefix))) {
    if (c < '0' || c > '9' || v > (~0ull - 9) / 10) return std::nullopt;
    v = v * 10 + static_cast<Version>(c - '0');
  }
  return v;
}

// Checkpoint directories under `dir`, newest first.
std::vector<std::pair<Version, fs::path>> Listed(const std::string& dir) {
  std::vector<std::pair<Version, fs::path>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_directory(ec)) continue;
    if (auto v = VersionOf(e.path().filename().string())) out.emplace_back(*v, e.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

Result<CheckpointManifest> ReadManifest(const std::string& checkpoint_dir) {
  const std::string path = (fs::path(checkpoint_dir) / kManifest).string();
  DSYNC_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadWhole(path));
  json j = json::parse(AsText(bytes), nullptr, /*allow_exceptions=*/false);
  const Status bad = Error(StatusCode::kDataLoss, "'{}' is not a checkpoint manifest", path);
  if (!j.is_object()) return bad;
  CheckpointManifest m;
  try {
    if (j.at("format").get<int>() != 1) {
      return Error(StatusCode::kUnimplemented, "'{}' has format {}, this dsyncps reads format 1",
                   path, j.at("format").dump());
    }
    m.version = j.at("version").get<Version>();
    m.num_servers = j.at("num_servers").get<uint32_t>();
    m.slice_bytes = j.at("slice_bytes").get<uint64_t>();
    m.sync = j.at("sync").get<std::string>();
    m.gradients_committed = j.at("gradients_committed").get<uint64_t>();
    if (!j.at("learning_rate").is_null()) {
      m.learning_rate = std::make_pair(j.at("learning_rate").at("from_round").get<Round>(),
                                       j.at("learning_rate").at("value").get<float>());
    }
    for (const json& f : j.at("files")) {
      CheckpointFile cf;
      cf.rank = f.at("rank").get<uint32_t>();
      cf.name = f.at("file").get<std::string>();
      cf.bytes = f.at("bytes").get<uint64_t>();
      cf.crc32 = f.at("crc32").get<uint32_t>();
      // A name is a plain file name inside the checkpoint's directory, nothing else.
      if (cf.name.empty() || cf.name.find('/') != std::string::npos || cf.name[0] == '.') return bad;
      m.files.push_back(std::move(cf));
    }
  } catch (const json::exception&) {  // nlohmann reports a wrong type by throwing
    return bad;
  }
  if (m.num_servers == 0 || m.files.size() != m.num_servers) return bad;
  std::sort(m.files.begin(), m.files.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  for (uint32_t r = 0; r < m.num_servers; ++r) {
    if (m.files[r].rank != r) return bad;
  }
  return m;
}

// Whether every file the manifest names has its recorded size and CRC-32.
Status CheckFiles(const std::string& checkpoint_dir, const CheckpointManifest& m) {
  for (const CheckpointFile& f : m.files) {
    const std::string path = (fs::path(checkpoint_dir) / f.name).string();
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    if (ec) return Error(StatusCode::kDataLoss, "'{}' is missing: {}", path, ec.message());
    if (size != f.bytes) {
      return Error(StatusCode::kDataLoss, "'{}' has {} bytes, the manifest says {} (torn)", path,
                   size, f.bytes);
    }
    DSYNC_RETURN_IF_ERROR(ReadServerCheckpoint(path, f.crc32).status());
  }
  return Status::Ok();
}

}  // namespace

std::string CheckpointPath(const std::string& dir, Version version) {
  return (fs::path(dir) / fmt::format("{}{:012}", kPrefix, version)).string();
}

Result<CheckpointFile> WriteServerCheckpoint(const std::string& checkpoint_dir,
                                             const ServerCheckpoint& c) {
  std::error_code ec;
  fs::create_directories(checkpoint_dir, ec);
  if (ec) {
    return Error(StatusCode::kUnavailable, "cannot create the checkpoint directory '{}': {}",
                 checkpoint_dir, ec.message());
  }
  // The fixed fields and each slice's header go into one buffer; the floats are written
  // from the snapshots where they are (no second copy of the model).
  std::vector<std::byte> head;
  std::vector<std::vector<std::byte>> slice_heads(c.slices.size());
  {
    MetaWriter w(head);
    for (char ch : kMagic) w.Put(ch);
    w.Put(c.rank);
    w.Put(c.num_servers);
    w.Put(c.version);
    w.Put(c.slice_bytes);
    w.Put(static_cast<uint32_t>(c.slices.size()));
  }
  std::vector<std::byte> meta;
  for (size_t i = 0; i < c.slices.size(); ++i) {
    const CheckpointSlice& s = c.slices[i];
    EncodeInit(s.meta, meta);
    MetaWriter w(slice_heads[i]);
    w.Put(s.tensor);
    w.Put(s.slice);
    w.Put(static_cast<uint64_t>(s.snapshot.params.size()));
    w.Put(s.snapshot.steps);
    w.Put(static_cast<uint32_t>(s.snapshot.state.size()));
    w.Put(static_cast<uint32_t>(meta.size()));
    slice_heads[i].insert(slice_heads[i].end(), meta.begin(), meta.end());
  }
  std::vector<std::span<const std::byte>> parts;
  parts.emplace_back(head);
  for (size_t i = 0; i < c.slices.size(); ++i) {
    parts.emplace_back(slice_heads[i]);
    parts.push_back(FloatBytes(c.slices[i].snapshot.params));
    for (const std::vector<float>& st : c.slices[i].snapshot.state) parts.push_back(FloatBytes(st));
  }
  uint32_t crc = Crc(0, nullptr, 0);
  uint64_t bytes = 0;
  for (std::span<const std::byte> p : parts) {
    crc = Crc(crc, p.data(), p.size());
    bytes += p.size();
  }
  std::array<std::byte, sizeof(uint32_t)> tail;
  std::memcpy(tail.data(), &crc, sizeof(crc));
  parts.emplace_back(tail);
  CheckpointFile f;
  f.rank = c.rank;
  f.name = fmt::format("server-{}.ckpt", c.rank);
  f.bytes = bytes + tail.size();
  f.crc32 = crc;
  DSYNC_RETURN_IF_ERROR(WriteAtomically((fs::path(checkpoint_dir) / f.name).string(), parts));
  return f;
}

Result<ServerCheckpoint> ReadServerCheckpoint(const std::string& path,
                                              std::optional<uint32_t> expected_crc) {
  DSYNC_ASSIGN_OR_RETURN(std::vector<std::byte> data, ReadWhole(path));
  const auto corrupt = [&](std::string_view what) {
    return Error(StatusCode::kDataLoss, "checkpoint file '{}' is corrupt: {}", path, what);
  };
  if (data.size() < sizeof(kMagic) + sizeof(uint32_t) ||
      std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    return corrupt("it does not start as a dsyncps checkpoint does");
  }
  uint32_t stored = 0;
  std::memcpy(&stored, data.data() + data.size() - sizeof(stored), sizeof(stored));
  const size_t body = data.size() - sizeof(stored);
  if (Crc(Crc(0, nullptr, 0), data.data(), body) != stored) return corrupt("its CRC-32 does not match");
  if (expected_crc && *expected_crc != stored) {
    return corrupt(fmt::format("its CRC-32 {:08x} is not the manifest's {:08x}", stored, *expected_crc));
  }
  MetaReader r(std::span<const std::byte>(data.data(), body));
  ServerCheckpoint c;
  uint32_t count = 0;
  for (size_t i = 0; i < sizeof(kMagic); ++i) {
    char ch;
    (void)r.Get(&ch);
  }
  if (!r.Get(&c.rank) || !r.Get(&c.num_servers) || !r.Get(&c.version) || !r.Get(&c.slice_bytes) ||
      !r.Get(&count)) {
    return corrupt("its header is cut short");
  }
  size_t at = sizeof(kMagic) + 3 * sizeof(uint32_t) + 2 * sizeof(uint64_t);
  for (uint32_t i = 0; i < count; ++i) {
    CheckpointSlice s;
    uint64_t elements = 0;
    uint32_t arrays = 0, meta_len = 0;
    MetaReader h(std::span<const std::byte>(data.data() + at, body - at));
    if (!h.Get(&s.tensor) || !h.Get(&s.slice) || !h.Get(&elements) || !h.Get(&s.snapshot.steps) ||
        !h.Get(&arrays) || !h.Get(&meta_len)) {
      return corrupt(fmt::format("slice {} of {} is cut short", i, count));
    }
    at += 2 * sizeof(uint32_t) + 2 * sizeof(uint64_t) + 2 * sizeof(uint32_t);
    // Lengths are checked against what is left before anything is allocated.
    const uint64_t left = body - at;
    if (arrays > kMaxStateArrays || meta_len > kMaxMetaBytes || meta_len > left ||
        elements == 0 || elements > (left - meta_len) / sizeof(float) / (1 + arrays)) {
      return corrupt(fmt::format("slice {} of {} announces more than the file holds", i, count));
    }
    DSYNC_RETURN_IF_ERROR(DecodeInit(std::span<const std::byte>(data.data() + at, meta_len), s.meta)
                              .WithContext(fmt::format("checkpoint file '{}', slice {}", path, i)));
    at += meta_len;
    const auto take = [&](std::vector<float>& v) {
      v.resize(elements);
      std::memcpy(v.data(), data.data() + at, elements * sizeof(float));
      at += elements * sizeof(float);
    };
    take(s.snapshot.params);
    s.snapshot.state.resize(arrays);
    for (std::vector<float>& st : s.snapshot.state) take(st);
    c.slices.push_back(std::move(s));
  }
  if (at != body) return corrupt("it holds more than its slices");
  return c;
}

Status WriteManifest(const std::string& checkpoint_dir, const CheckpointManifest& m) {
  json files = json::array();
  for (const CheckpointFile& f : m.files) {
    files.push_back({{"rank", f.rank}, {"file", f.name}, {"bytes", f.bytes}, {"crc32", f.crc32}});
  }
  json j = {{"format", 1},
            {"version", m.version},
            {"num_servers", m.num_servers},
            {"slice_bytes", m.slice_bytes},
            {"sync", m.sync},
            {"gradients_committed", m.gradients_committed},
            {"learning_rate", nullptr},
            {"files", files}};
  if (m.learning_rate) {
    j["learning_rate"] = {{"from_round", m.learning_rate->first}, {"value", m.learning_rate->second}};
  }
  const std::string text = j.dump(1) + "\n";
  return WriteAtomically((fs::path(checkpoint_dir) / kManifest).string(), {AsBytes(text)});
}

Result<FoundCheckpoint> FindNewestCheckpoint(const std::string& dir,
                                             std::vector<std::string>* skipped) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Error(StatusCode::kNotFound, "'{}' is not a directory of checkpoints", dir);
  }
  std::vector<std::string> why;
  for (const auto& [version, path] : Listed(dir)) {
    Result<CheckpointManifest> m = ReadManifest(path.string());
    Status st = m.ok() ? CheckFiles(path.string(), *m) : m.status();
    if (st.ok() && m->version != version) {
      st = Error(StatusCode::kDataLoss, "'{}' names version {}, its directory {}",
                 (path / kManifest).string(), m->version, version);
    }
    if (st.ok()) {
      if (skipped) skipped->insert(skipped->end(), why.begin(), why.end());
      return FoundCheckpoint{path.string(), std::move(m).value()};
    }
    if (st.code() == StatusCode::kUnavailable && !fs::exists(path / kManifest, ec)) {
      st = Error(StatusCode::kDataLoss, "'{}' has no manifest (incomplete: the job stopped while "
                                        "writing it)", path.string());
    }
    why.push_back(st.message());
  }
  if (skipped) skipped->insert(skipped->end(), why.begin(), why.end());
  if (why.empty()) return Error(StatusCode::kNotFound, "'{}' holds no checkpoint", dir);
  return Error(StatusCode::kNotFound, "'{}' holds no complete, sound checkpoint: {}", dir,
               fmt::join(why, "; "));
}

void PruneCheckpoints(const std::string& dir, size_t keep) {
  size_t complete = 0;
  std::error_code ec;
  for (const auto& [version, path] : Listed(dir)) {
    const bool has_manifest = fs::exists(path / kManifest, ec);
    // Incomplete ones newer than the newest complete one may be being written right now.
    const bool remove = has_manifest ? ++complete > keep : complete > 0;
    if (!remove) continue;
    fs::remove_all(path, ec);
    if (ec) spdlog::warn("checkpoints: could not delete '{}': {}", path.string(), ec.message());
  }
}

}  // namespace dsync::ps
