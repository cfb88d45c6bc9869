#include "ps/scheduler_journal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

namespace dsync::ps {
namespace {

uint32_t Crc(std::span<const char> bytes) {
  return static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

uint32_t LoadU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;  // little-endian hosts only, as the wire format (protocol.h)
}

void StoreU32(std::vector<char>& out, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, sizeof b);
  out.insert(out.end(), b, b + 4);
}

// fsync of the directory that holds `path`: the file's creation is durable too.
Status SyncParent(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::absolute(path).parent_path();
  const int dfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Error(StatusCode::kUnavailable, "cannot open {}: {}", parent.string(), std::strerror(errno));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0) return Error(StatusCode::kUnavailable, "cannot sync {}: {}", parent.string(), std::strerror(err));
  return Status::Ok();
}

}  // namespace

bool IsJournal(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[kJournalMagicBytes] = {};
  in.read(magic, sizeof magic);
  return in.gcount() == static_cast<std::streamsize>(sizeof magic) &&
         std::memcmp(magic, kJournalMagic, sizeof magic) == 0;
}

Result<JournalContents> ReadJournal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Error(StatusCode::kNotFound, "cannot read the journal {}", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < kJournalMagicBytes ||
      std::memcmp(bytes.data(), kJournalMagic, kJournalMagicBytes) != 0) {
    return Error(StatusCode::kInvalidArgument, "{} is not a dsyncps scheduler journal", path);
  }
  JournalContents out;
  size_t at = kJournalMagicBytes;
  while (at < bytes.size()) {
    const size_t left = bytes.size() - at;
    if (left < 8) break;  // a torn header
    const uint32_t len = LoadU32(bytes.data() + at);
    const uint32_t crc = LoadU32(bytes.data() + at + 4);
    // A record is never empty ("{}" at least): zeros to the end are a tail the disk never
    // wrote (a power loss), zeros followed by data are damage.
    if (len == 0) {
      if (std::all_of(bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.end(),
                      [](char c) { return c == 0; })) {
        break;
      }
      return Error(StatusCode::kDataLoss, "the journal {} is damaged at byte {}: an empty record "
                   "and more data after it", path, at);
    }
    if (len > kMaxJournalRecord) {
      return Error(StatusCode::kDataLoss, "the journal {} is damaged at byte {}: a record of {} bytes",
                   path, at, len);
    }
    if (left - 8 < len) break;  // a torn payload
    const std::span<const char> payload(bytes.data() + at + 8, len);
    if (Crc(payload) != crc) {
      if (at + 8 + len == bytes.size()) break;  // the last record, torn by the crash
      return Error(StatusCode::kDataLoss,
                   "the journal {} is damaged at byte {}: a record fails its CRC-32 and more "
                   "follow (not a torn end); it cannot be resumed from",
                   path, at);
    }
    nlohmann::json record = nlohmann::json::parse(payload.begin(), payload.end(), nullptr, false);
    if (record.is_discarded() || !record.is_object()) {
      return Error(StatusCode::kDataLoss, "the journal {} is damaged at byte {}: a record is not "
                   "a JSON object", path, at);
    }
    out.records.push_back(std::move(record));
    at += 8 + len;
  }
  out.good_bytes = at;
  out.torn_bytes = bytes.size() - at;
  return out;
}

JournalFile::JournalFile(JournalFile&& other) noexcept { *this = std::move(other); }

JournalFile& JournalFile::operator=(JournalFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

JournalFile::~JournalFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<JournalFile> JournalFile::OpenToAppend(const std::string& path, int flags,
                                              std::string_view what) {
  // 0600: the journal holds the job key, which credentials and receipts derive from.
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | flags, 0600);
  if (fd < 0) {
    return Error(StatusCode::kInvalidArgument, "{} {}: cannot write it: {}", what, path,
                 std::strerror(errno));
  }
  JournalFile f;
  f.fd_ = fd;
  f.path_ = path;
  // One scheduler writes a journal: a second one (a restart while the old process still
  // runs, hung or cut off) would interleave its records with the first's.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    return Error(StatusCode::kAlreadyExists,
                 "{} {}: another scheduler has this journal open; stop it first (a scheduler "
                 "that still runs is not lost)",
                 what, path);
  }
  return f;
}

Result<JournalFile> JournalFile::Create(const std::string& path) {
  DSYNC_ASSIGN_OR_RETURN(JournalFile f, OpenToAppend(path, O_CREAT, "--journal"));
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    return Error(StatusCode::kInvalidArgument, "--journal {}: not a regular file", path);
  }
  if (st.st_size != 0) {
    return Error(StatusCode::kAlreadyExists,
                 "--journal {}: the file exists (another job's journal?): resume that job with "
                 "--resume {}, or remove the file to start a new one",
                 path, path);
  }
  DSYNC_RETURN_IF_ERROR(f.WriteDurably(std::span<const char>(kJournalMagic, kJournalMagicBytes)));
  DSYNC_RETURN_IF_ERROR(SyncParent(path));
  return f;
}

Result<JournalFile> JournalFile::Continue(const std::string& path, const JournalContents& read) {
  DSYNC_ASSIGN_OR_RETURN(JournalFile f, OpenToAppend(path, 0, "--resume"));
  if (read.torn_bytes > 0 &&
      (::ftruncate(f.fd_, static_cast<off_t>(read.good_bytes)) != 0 || ::fdatasync(f.fd_) != 0)) {
    return Error(StatusCode::kUnavailable, "--resume {}: cannot cut off its torn end: {}", path,
                 std::strerror(errno));
  }
  return f;
}

void JournalFile::Add(const nlohmann::json& record) {
  // Messages may carry a peer's bytes: replaced where they are not UTF-8, never thrown on.
  const std::string text = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  StoreU32(buffer_, static_cast<uint32_t>(text.size()));
  StoreU32(buffer_, Crc(text));
  buffer_.insert(buffer_.end(), text.begin(), text.end());
}

void JournalFile::Take(std::vector<char>& out) {
  out.clear();
  out.swap(buffer_);
}

Status JournalFile::WriteDurably(std::span<const char> bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return Error(StatusCode::kUnavailable, "cannot write the journal {}: {}", path_,
                   std::strerror(n < 0 ? errno : EIO));
    }
    done += static_cast<size_t>(n);
  }
  if (!bytes.empty() && ::fdatasync(fd_) != 0) {
    return Error(StatusCode::kUnavailable, "cannot sync the journal {}: {}", path_, std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace dsync::ps
