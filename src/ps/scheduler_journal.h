// The scheduler's journal (docs/design.md, "A restartable scheduler"): every input of the
// round rule and every decision the scheduler sends, in the order it took them, so that a
// scheduler started again with --resume JOURNAL replays it into the same state and the job
// goes on. A decision leaves the scheduler only once the records it follows from are on disk
// (written and fdatasync'd), so a restarted scheduler never contradicts what a node was told:
// a round never gets two different member lists.
//
// The file: the 8 bytes "DSJRNL01", then records, each a little-endian u32 payload length,
// the u32 CRC-32 of the payload, and the payload, a JSON object (records are small and rare
// next to gradients; JSON keeps them readable with jq and easy to extend). A crash in the middle of a write leaves a torn last record: it is cut off when
// the journal is opened again. A bad record followed by good ones is damage, not a crash:
// refused, naming the offset.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dsync/status.h"

namespace dsync::ps {

inline constexpr char kJournalMagic[] = "DSJRNL01";
inline constexpr size_t kJournalMagicBytes = 8;
// The job record's "format". 2: an `auto` record names the delayed workers only (every other
// worker's allowance is 0); 1 named every worker, zeros included, and still replays alike.
// A build refuses a format newer than its own, which it would misread.
inline constexpr int kJournalFormat = 2;
inline constexpr int kOldestJournalFormat = 1;
// No record comes near this (the largest is a round: a few words per member and tensor).
inline constexpr uint32_t kMaxJournalRecord = 64u << 20;

struct JournalContents {
  std::vector<nlohmann::json> records;
  uint64_t good_bytes = 0;  // the magic and every whole record
  uint64_t torn_bytes = 0;  // after them: the record a crash cut short
};

// Whether `path` is a journal (a regular file that starts with the magic).
bool IsJournal(const std::string& path);

// Reads every record; a torn last record is reported in torn_bytes, not as an error.
Result<JournalContents> ReadJournal(const std::string& path);

class JournalFile {
 public:
  JournalFile() = default;
  JournalFile(JournalFile&& other) noexcept;
  JournalFile& operator=(JournalFile&& other) noexcept;
  JournalFile(const JournalFile&) = delete;
  JournalFile& operator=(const JournalFile&) = delete;
  ~JournalFile();

  // A new journal; an existing non-empty file is refused (it is another job's journal).
  static Result<JournalFile> Create(const std::string& path);
  // The journal of `path` read back to continue it: a torn tail is cut off first.
  static Result<JournalFile> Continue(const std::string& path, const JournalContents& read);

  bool open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

  // Buffers a record (under the caller's lock); Take hands the buffered bytes to the writer.
  void Add(const nlohmann::json& record);
  bool pending() const { return !buffer_.empty(); }
  // Swaps the buffered bytes into `out` (cleared first; its capacity is reused).
  void Take(std::vector<char>& out);
  // Appends `bytes` and makes them durable (write + fdatasync). Outside the caller's lock.
  Status WriteDurably(std::span<const char> bytes);

 private:
  static Result<JournalFile> OpenToAppend(const std::string& path, int flags,
                                          std::string_view what);

  int fd_ = -1;
  std::string path_;
  std::vector<char> buffer_;
};

}  // namespace dsync::ps
