#include "ps/checkpoint.h"
#include "ps/slicing.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace dsync::ps {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Format 02 adds each slice's copy number (replicated slices), 03 the versions each slice
// keeps for delay compensation; 01 and 02 files still load (no versions kept).
constexpr char kMagic[8] = {'D', 'S', 'C', 'K', 'P', 'T', '0', '3'};
constexpr char kMagicTwo[8] = {'D', 'S', 'C', 'K', 'P', 'T', '0', '2'};
constexpr char kMagicOne[8] = {'D', 'S', 'C', 'K', 'P', 'T', '0', '1'};
// The format a file's magic names (1, 2, 3), or 0 when it is none of ours.
int FormatOf(const void* p) {
  if (std::memcmp(p, kMagic, sizeof(kMagic)) == 0) return 3;
  if (std::memcmp(p, kMagicTwo, sizeof(kMagicTwo)) == 0) return 2;
  if (std::memcmp(p, kMagicOne, sizeof(kMagicOne)) == 0) return 1;
  return 0;
}
bool IsMagic(const void* p) { return FormatOf(p) != 0; }
constexpr const char* kManifest = "MANIFEST.json";
constexpr const char* kPrefix = "ckpt-";
constexpr const char* kRefusedPrefix = "refused-";
constexpr const char* kPartialPrefix = "partial-";
// A manifest is a few hundred bytes per server; anything this large is not one.
constexpr uint64_t kMaxManifestBytes = 1u << 20;
// Bytes before a server file's slices: magic, rank, servers, version, slice bytes, count.
constexpr size_t kHeaderBytes = sizeof(kMagic) + 3 * sizeof(uint32_t) + 2 * sizeof(uint64_t);

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

// Opens a regular file for reading (never blocks on a FIFO or device) and says its size.
Result<int> OpenRegular(const std::string& path, uint64_t* size) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Error(StatusCode::kDataLoss, "'{}' is missing", path);
    return Errno("opening", path);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    Status s = Errno("reading the size of", path);
    close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return Error(StatusCode::kDataLoss, "'{}' is not a regular file", path);
  }
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

// Reads up to n bytes at the file's position; fewer only at its end.
size_t ReadSome(int fd, void* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = read(fd, static_cast<char*>(out) + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

Result<std::vector<std::byte>> ReadWhole(const std::string& path, uint64_t max_bytes) {
  uint64_t size = 0;
  DSYNC_ASSIGN_OR_RETURN(const int fd, OpenRegular(path, &size));
  if (size > max_bytes) {
    close(fd);
    return Error(StatusCode::kDataLoss, "'{}' has {} bytes, more than it can hold ({})", path,
                 size, max_bytes);
  }
  std::vector<std::byte> data;
  try {  // the one allocation the size of a model's shard
    data.resize(static_cast<size_t>(size));
  } catch (const std::bad_alloc&) {
    close(fd);
    return Error(StatusCode::kResourceExhausted, "no memory to read '{}' ({} bytes)", path, size);
  }
  const size_t done = ReadSome(fd, data.data(), data.size());
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

// Checkpoint directories under `dir`, newest first (none where it cannot be read).
std::vector<std::pair<Version, fs::path>> Listed(const std::string& dir) {
  std::vector<std::pair<Version, fs::path>> out;
  std::error_code ec;
  // The non-throwing forms throughout: a file system error is no reason to abort a node.
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (!it->is_directory(type_ec)) continue;
    if (auto v = VersionOf(it->path().filename().string())) out.emplace_back(*v, it->path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

Result<CheckpointManifest> ReadManifest(const std::string& checkpoint_dir) {
  const std::string path = (fs::path(checkpoint_dir) / kManifest).string();
  std::error_code ec;
  if (!fs::exists(path, ec) && !ec) {
    return Error(StatusCode::kDataLoss, "'{}' has no manifest (incomplete: the job stopped while "
                                        "writing it)", checkpoint_dir);
  }
  DSYNC_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadWhole(path, kMaxManifestBytes));
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
    m.replicas = j.value("replicas", uint32_t{1});
    if (j.contains("lost_ranks")) m.lost_ranks = j.at("lost_ranks").get<std::vector<uint32_t>>();
    if (j.contains("partial")) m.partial = j.at("partial").get<bool>();
    m.sync = j.at("sync").get<std::string>();
    m.gradients_committed = j.at("gradients_committed").get<uint64_t>();
    m.clock = j.at("clock").get<Clock>();
    if (!j.at("learning_rate").is_null()) {
      const Round from = j.at("learning_rate").at("from_round").get<Round>();
      const double lr = j.at("learning_rate").at("value").get<double>();
      if (!(lr >= 0 && lr <= 3.4e38) || from > m.version) return bad;  // a float's range
      m.learning_rate = std::make_pair(from, static_cast<float>(lr));
    }
    if (j.contains("damp_from")) {
      m.damp_from = j.at("damp_from").get<Round>();
      if (*m.damp_from > m.version) return bad;
    }
    for (const json& f : j.at("files")) {
      CheckpointFile cf;
      cf.rank = f.at("rank").get<uint32_t>();
      cf.name = f.at("file").get<std::string>();
      cf.bytes = f.at("bytes").get<uint64_t>();
      cf.crc32 = f.at("crc32").get<uint32_t>();
      // Exactly the name its rank's server writes: nothing outside the directory.
      if (cf.name != ServerFileName(cf.rank)) return bad;
      m.files.push_back(std::move(cf));
    }
  } catch (const json::exception&) {  // nlohmann reports a wrong type by throwing
    return bad;
  }
  if (m.num_servers == 0 || m.files.size() + m.lost_ranks.size() != m.num_servers ||
      m.replicas == 0 || m.replicas > m.num_servers) {
    return bad;
  }
  // Every rank once: a file, or lost (its slices' copies, if any, in the other files).
  std::vector<bool> seen(m.num_servers, false);
  for (uint32_t r : m.lost_ranks) {
    if (r >= m.num_servers || seen[r]) return bad;
    seen[r] = true;
  }
  for (const CheckpointFile& f : m.files) {
    if (f.rank >= m.num_servers || seen[f.rank]) return bad;
    seen[f.rank] = true;
  }
  // Partial exactly when some slice may have no copy left in it.
  if (m.partial != MissesSomeSlice(m)) return bad;
  std::sort(m.files.begin(), m.files.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  return m;
}

// Whether a server's file is the one the manifest recorded: a regular file of its size, with
// the manifest's rank, servers, version and slice size in its header, and its CRC-32,
// computed as the file streams past (the scheduler never holds a shard in memory).
Status CheckFile(const std::string& path, const CheckpointFile& f, const CheckpointManifest& m) {
  uint64_t size = 0;
  DSYNC_ASSIGN_OR_RETURN(const int fd, OpenRegular(path, &size));
  const auto done = [&](Status st) {
    close(fd);
    return st;
  };
  if (size != f.bytes) {
    return done(Error(StatusCode::kDataLoss, "'{}' has {} bytes, the manifest says {} (torn)",
                      path, size, f.bytes));
  }
  if (size < kHeaderBytes + sizeof(uint32_t)) {
    return done(Error(StatusCode::kDataLoss, "'{}' is too short for a checkpoint file", path));
  }
  std::vector<std::byte> buf(1u << 20);
  uint32_t crc = Crc(0, nullptr, 0);
  uint64_t left = size - sizeof(uint32_t);
  bool first = true;
  while (left > 0) {
    const size_t n = ReadSome(fd, buf.data(), static_cast<size_t>(std::min<uint64_t>(left, buf.size())));
    if (n == 0) return done(Errno("reading", path));
    if (first) {
      first = false;
      ServerCheckpoint h;
      MetaReader r(std::span<const std::byte>(buf.data(), n));
      char magic[sizeof(kMagic)];
      bool ok = n >= kHeaderBytes;
      for (char& c : magic) ok = ok && r.Get(&c);
      ok = ok && IsMagic(magic) && r.Get(&h.rank) &&
           r.Get(&h.num_servers) && r.Get(&h.version) && r.Get(&h.slice_bytes);
      if (!ok || h.rank != f.rank || h.num_servers != m.num_servers || h.version != m.version ||
          h.slice_bytes != m.slice_bytes) {
        return done(Error(StatusCode::kDataLoss,
                          "'{}' is not rank {}'s file of this checkpoint (version {}, {} servers, "
                          "slices of {} bytes)",
                          path, f.rank, m.version, m.num_servers, m.slice_bytes));
      }
    }
    crc = Crc(crc, buf.data(), n);
    left -= n;
  }
  uint32_t stored = 0;
  if (ReadSome(fd, &stored, sizeof(stored)) != sizeof(stored)) return done(Errno("reading", path));
  if (stored != crc || stored != f.crc32) {
    return done(Error(StatusCode::kDataLoss,
                      "checkpoint file '{}' is corrupt: its CRC-32 does not match", path));
  }
  return done(Status::Ok());
}

}  // namespace

bool MissesSomeSlice(const CheckpointManifest& m) {
  if (m.lost_ranks.empty()) return false;
  std::vector<bool> lost(m.num_servers, false);
  for (uint32_t r : m.lost_ranks) lost[r] = true;
  return !EverySliceHasACopy(lost, m.replicas);
}

std::string CheckpointPath(const std::string& dir, Version version) {
  return (fs::path(dir) / fmt::format("{}{:012}", kPrefix, version)).string();
}

std::string ServerFileName(uint32_t rank) { return fmt::format("server-{}.ckpt", rank); }

namespace {

// A server file's bytes, in order: the fixed fields and each slice's header are encoded into
// `heads`; the floats stay where the snapshots hold them (no second copy of the model). The
// CRC-32 is the caller's to append.
std::vector<std::span<const std::byte>> FileParts(const ServerCheckpoint& c,
                                                  std::vector<std::vector<std::byte>>& heads) {
  heads.assign(c.slices.size() + 1, {});
  {
    MetaWriter w(heads[0]);
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
    MetaWriter w(heads[i + 1]);
    w.Put(s.tensor);
    w.Put(s.slice);
    w.Put(s.replica);
    w.Put(static_cast<uint64_t>(s.snapshot.params.size()));
    w.Put(s.snapshot.steps);
    w.Put(static_cast<uint32_t>(s.snapshot.state.size()));
    w.Put(static_cast<uint32_t>(s.snapshot.kept.size()));
    for (const KeptVersion& k : s.snapshot.kept) w.Put(k.round);
    w.Put(static_cast<uint32_t>(s.snapshot.mean_square.empty() ? 0 : 1));
    w.Put(static_cast<uint32_t>(meta.size()));
    heads[i + 1].insert(heads[i + 1].end(), meta.begin(), meta.end());
  }
  std::vector<std::span<const std::byte>> parts;
  parts.emplace_back(heads[0]);
  for (size_t i = 0; i < c.slices.size(); ++i) {
    parts.emplace_back(heads[i + 1]);
    parts.push_back(FloatBytes(c.slices[i].snapshot.params));
    for (const std::vector<float>& st : c.slices[i].snapshot.state) parts.push_back(FloatBytes(st));
    for (const KeptVersion& k : c.slices[i].snapshot.kept) parts.push_back(FloatBytes(k.params));
    if (!c.slices[i].snapshot.mean_square.empty()) {
      parts.push_back(FloatBytes(c.slices[i].snapshot.mean_square));
    }
  }
  return parts;
}

uint32_t PartsCrc(const std::vector<std::span<const std::byte>>& parts, uint64_t* bytes) {
  uint32_t crc = Crc(0, nullptr, 0);
  *bytes = 0;
  for (std::span<const std::byte> p : parts) {
    crc = Crc(crc, p.data(), p.size());
    *bytes += p.size();
  }
  return crc;
}

}  // namespace

Result<CheckpointFile> WriteServerCheckpoint(const std::string& checkpoint_dir,
                                             const ServerCheckpoint& c) {
  std::error_code ec;
  if (fs::create_directories(checkpoint_dir, ec)) {
    // The new directory's entry must be durable before older checkpoints are pruned.
    DSYNC_RETURN_IF_ERROR(SyncDirectory(fs::path(checkpoint_dir).parent_path().string()));
  }
  if (ec) {
    return Error(StatusCode::kUnavailable, "cannot create the checkpoint directory '{}': {}",
                 checkpoint_dir, ec.message());
  }
  std::vector<std::vector<std::byte>> heads;
  std::vector<std::span<const std::byte>> parts = FileParts(c, heads);
  uint64_t bytes = 0;
  const uint32_t crc = PartsCrc(parts, &bytes);
  std::array<std::byte, sizeof(uint32_t)> tail;
  std::memcpy(tail.data(), &crc, sizeof(crc));
  parts.emplace_back(tail);
  CheckpointFile f;
  f.rank = c.rank;
  f.name = ServerFileName(c.rank);
  f.bytes = bytes + tail.size();
  f.crc32 = crc;
  DSYNC_RETURN_IF_ERROR(WriteAtomically((fs::path(checkpoint_dir) / f.name).string(), parts));
  return f;
}

std::vector<std::byte> SerializeServerCheckpoint(const ServerCheckpoint& c) {
  std::vector<std::vector<std::byte>> heads;
  const std::vector<std::span<const std::byte>> parts = FileParts(c, heads);
  uint64_t bytes = 0;
  const uint32_t crc = PartsCrc(parts, &bytes);
  std::vector<std::byte> out;
  out.reserve(bytes + sizeof(crc));
  for (std::span<const std::byte> p : parts) out.insert(out.end(), p.begin(), p.end());
  const auto* c8 = reinterpret_cast<const std::byte*>(&crc);
  out.insert(out.end(), c8, c8 + sizeof(crc));
  return out;
}

Result<ServerCheckpoint> ReadServerCheckpoint(const std::string& path,
                                              std::optional<uint32_t> expected_crc) {
  DSYNC_ASSIGN_OR_RETURN(std::vector<std::byte> data, ReadWhole(path, ~0ull));
  return ParseServerCheckpoint(data, fmt::format("checkpoint file '{}'", path), expected_crc);
}

Result<ServerCheckpoint> ParseServerCheckpoint(std::span<const std::byte> data,
                                               std::string_view what,
                                               std::optional<uint32_t> expected_crc) {
  const auto corrupt = [&](std::string_view why) {
    return Error(StatusCode::kDataLoss, "{} is corrupt: {}", what, why);
  };
  if (data.size() < sizeof(kMagic) + sizeof(uint32_t) || !IsMagic(data.data())) {
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
  const int format = FormatOf(data.data());
  const bool copies = format >= 2, kept_versions = format >= 3;
  size_t at = kHeaderBytes;
  for (uint32_t i = 0; i < count; ++i) {
    CheckpointSlice s;
    uint64_t elements = 0;
    uint32_t arrays = 0, kept = 0, mean_square = 0, meta_len = 0;
    MetaReader h(std::span<const std::byte>(data.data() + at, body - at));
    bool whole = h.Get(&s.tensor) && h.Get(&s.slice) && (!copies || h.Get(&s.replica)) &&
                 h.Get(&elements) && h.Get(&s.snapshot.steps) && h.Get(&arrays) &&
                 (!kept_versions || h.Get(&kept));
    if (whole && kept > kMaxKeptVersions) {
      return corrupt(fmt::format("slice {} of {} keeps {} versions; at most {} are kept", i, count,
                                 kept, kMaxKeptVersions));
    }
    s.snapshot.kept.resize(whole ? kept : 0);
    for (KeptVersion& k : s.snapshot.kept) whole = whole && h.Get(&k.round);
    if (!whole || (kept_versions && !h.Get(&mean_square)) || !h.Get(&meta_len)) {
      return corrupt(fmt::format("slice {} of {} is cut short", i, count));
    }
    at += (copies ? 3 : 2) * sizeof(uint32_t) + 2 * sizeof(uint64_t) + 2 * sizeof(uint32_t) +
          (kept_versions ? 2 * sizeof(uint32_t) + kept * sizeof(uint64_t) : 0);
    // Lengths are checked against what is left before anything is allocated.
    const uint64_t left = body - at;
    if (arrays > kMaxStateArrays || mean_square > 1 || meta_len > kMaxMetaBytes ||
        meta_len > left || elements == 0 ||
        elements > (left - meta_len) / sizeof(float) / (1 + arrays + kept + mean_square)) {
      return corrupt(fmt::format("slice {} of {} announces more than the file holds", i, count));
    }
    DSYNC_RETURN_IF_ERROR(DecodeInit(std::span<const std::byte>(data.data() + at, meta_len), s.meta)
                              .WithContext(fmt::format("{}, slice {}", what, i)));
    at += meta_len;
    const auto take = [&](std::vector<float>& v) {
      v.resize(elements);
      std::memcpy(v.data(), data.data() + at, elements * sizeof(float));
      at += elements * sizeof(float);
    };
    take(s.snapshot.params);
    s.snapshot.state.resize(arrays);
    for (std::vector<float>& st : s.snapshot.state) take(st);
    for (KeptVersion& k : s.snapshot.kept) take(k.params);
    if (mean_square) take(s.snapshot.mean_square);
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
            {"replicas", m.replicas},
            {"slice_bytes", m.slice_bytes},
            {"sync", m.sync},
            {"gradients_committed", m.gradients_committed},
            {"clock", m.clock},
            {"learning_rate", nullptr},
            {"files", files}};
  if (!m.lost_ranks.empty()) j["lost_ranks"] = m.lost_ranks;
  if (m.partial) j["partial"] = true;
  if (m.learning_rate) {
    j["learning_rate"] = {{"from_round", m.learning_rate->first}, {"value", m.learning_rate->second}};
  }
  if (m.damp_from) j["damp_from"] = *m.damp_from;
  const std::string text = j.dump(1) + "\n";
  return WriteAtomically((fs::path(checkpoint_dir) / kManifest).string(), {AsBytes(text)});
}

Result<CheckpointManifest> ReadCheckpoint(const std::string& checkpoint_dir) {
  DSYNC_ASSIGN_OR_RETURN(CheckpointManifest m, ReadManifest(checkpoint_dir));
  for (const CheckpointFile& f : m.files) {
    DSYNC_RETURN_IF_ERROR(CheckFile((fs::path(checkpoint_dir) / f.name).string(), f, m));
  }
  return m;
}

Result<FoundCheckpoint> FindNewestCheckpoint(const std::string& dir,
                                             std::vector<SkippedCheckpoint>* skipped) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Error(StatusCode::kNotFound, "'{}' is not a directory of checkpoints", dir);
  }
  std::vector<SkippedCheckpoint> refused;
  const auto report = [&] {
    if (skipped) skipped->insert(skipped->end(), refused.begin(), refused.end());
  };
  for (const auto& [version, path] : Listed(dir)) {
    Result<CheckpointManifest> m = ReadCheckpoint(path.string());
    Status st = m.status();
    if (st.ok() && m->version != version) {
      st = Error(StatusCode::kDataLoss, "'{}' names version {}, its directory {}",
                 (path / kManifest).string(), m->version, version);
    }
    if (st.ok() && m->partial) {  // sound, but not the whole model: an older one is resumed
      refused.push_back({path.string(),
                         fmt::format("'{}' is partial (written when server rank(s) {} were lost, "
                                     "without their slices): `dsyncps checkpoint export` reads "
                                     "it, a job cannot resume from it",
                                     path.string(), fmt::join(m->lost_ranks, ", ")),
                         /*damaged=*/false});
      continue;
    }
    if (st.ok()) {
      report();
      return FoundCheckpoint{path.string(), std::move(m).value()};
    }
    if (st.code() != StatusCode::kDataLoss) {
      report();
      return st.WithContext(fmt::format("reading the checkpoint {}", path.string()));
    }
    refused.push_back({path.string(), st.message()});
  }
  report();
  if (refused.empty()) return Error(StatusCode::kNotFound, "'{}' holds no checkpoint", dir);
  std::vector<std::string> why;
  for (const SkippedCheckpoint& r : refused) why.push_back(r.why);
  return Error(StatusCode::kNotFound, "'{}' holds no complete, sound checkpoint: {}", dir,
               fmt::join(why, "; "));
}

Status CheckUtf8(const std::string& path) {
  try {  // nlohmann's UTF-8 check is the one the welcome's encoding applies
    (void)json(path).dump();
  } catch (const json::exception&) {
    return Error(StatusCode::kInvalidArgument, "the path '{}' is not valid UTF-8", path);
  }
  return Status::Ok();
}

namespace {

// Renames DIR/ckpt-... to DIR/<prefix>ckpt-...: no longer listed (Listed), so neither resumed
// from, nor pruned, nor overwritten by a later checkpoint of the same version.
Result<std::string> MoveAside(const std::string& checkpoint_dir, std::string_view prefix,
                              std::string_view what) {
  const fs::path from(checkpoint_dir);
  const fs::path to = from.parent_path() / (std::string(prefix) + from.filename().string());
  std::error_code ec;
  fs::remove_all(to, ec);
  fs::rename(from, to, ec);
  if (ec) {
    return Error(StatusCode::kUnavailable, "cannot move the {} checkpoint '{}' aside: {}", what,
                 checkpoint_dir, ec.message());
  }
  DSYNC_RETURN_IF_ERROR(SyncDirectory(from.parent_path().string()));
  return to.string();
}

}  // namespace

Status SetAside(const std::string& checkpoint_dir) {
  return MoveAside(checkpoint_dir, kRefusedPrefix, "refused").status();
}

Result<std::string> KeepPartial(const std::string& checkpoint_dir) {
  return MoveAside(checkpoint_dir, kPartialPrefix, "partial");
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
