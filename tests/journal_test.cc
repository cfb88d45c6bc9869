// The scheduler's journal file (ps/scheduler_journal.h): records read back as written; the
// record a crash cut short is cut off, while damage with good records after it is refused,
// naming the offset; a journal is never overwritten by a new job.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "cluster_harness.h"
#include "dsync/scheduler.h"
#include "ps/keys.h"
#include "ps/rejoin.h"
#include "ps/scheduler_journal.h"

namespace dsync::ps {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class JournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dsync-journal-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "journal").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A journal of `n` records {"k":"round","r":i}.
  void Write(int n) {
    auto f = JournalFile::Create(path_);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    for (int i = 0; i < n; ++i) f->Add({{"k", "round"}, {"r", i}});
    std::vector<char> bytes;
    f->Take(bytes);
    ASSERT_TRUE(f->WriteDurably(bytes).ok());
  }

  fs::path dir_;
  std::string path_;
};

TEST_F(JournalTest, RecordsReadBackInOrderAndTheFileIsTheOwnersAlone) {
  Write(5);
  EXPECT_TRUE(IsJournal(path_));
  auto read = ReadJournal(path_);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->records.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(read->records[i]["r"].get<int>(), i);
  EXPECT_EQ(read->torn_bytes, 0u);
  EXPECT_EQ(read->good_bytes, fs::file_size(path_));
  // It holds the job key: nobody else reads it.
  EXPECT_EQ(fs::status(path_).permissions() & (fs::perms::group_all | fs::perms::others_all),
            fs::perms::none);
}

// A journal of a newer build is refused, saying so, rather than misread: its records may mean
// what this build's do not (since format 2 an `auto` record names only the delayed workers,
// where format 1 named every worker).
TEST_F(JournalTest, ASchedulerRefusesTheJournalOfANewerBuildAndReadsAnOlderOne) {
  for (int format : {kJournalFormat + 1, kOldestJournalFormat - 1, kOldestJournalFormat}) {
    fs::remove(path_);
    {
      auto f = JournalFile::Create(path_);
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      f->Add({{"k", "job"}, {"format", format}, {"key", "not hex"}});
      std::vector<char> bytes;
      f->Take(bytes);
      ASSERT_TRUE(f->WriteDurably(bytes).ok());
    }
    Config cfg = testing::TestConfig("bsp", 1, 1);
    cfg.role = Role::kScheduler;
    cfg.resume = path_;
    auto scheduler = Scheduler::Start(cfg);
    ASSERT_FALSE(scheduler.ok()) << "format " << format;
    const std::string msg = scheduler.status().message();
    EXPECT_EQ(scheduler.status().code(), StatusCode::kDataLoss) << msg;
    EXPECT_NE(msg.find("record 0"), std::string::npos) << msg;
    if (format > kJournalFormat) {
      EXPECT_NE(msg.find("a newer build wrote it"), std::string::npos) << msg;
    } else if (format < kOldestJournalFormat) {
      EXPECT_NE(msg.find("is not one this build reads"), std::string::npos) << msg;
    } else {
      // Read past the format: what stops it is the key this test left malformed.
      EXPECT_NE(msg.find("the job key is malformed"), std::string::npos) << msg;
    }
  }
}

TEST_F(JournalTest, ANewJobNeverOverwritesAJournal) {
  Write(1);
  auto again = JournalFile::Create(path_);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("--resume " + path_), std::string::npos)
      << again.status().ToString();
  EXPECT_EQ(ReadJournal(path_)->records.size(), 1u);
}

TEST_F(JournalTest, TheRecordACrashCutShortIsCutOffAndTheJournalGoesOn) {
  Write(3);
  const auto whole = fs::file_size(path_);
  for (uint64_t cut : {1u, 5u, 9u}) {  // in the length, the CRC, the payload
    fs::resize_file(path_, whole - cut);
    auto read = ReadJournal(path_);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(read->records.size(), 2u) << "cut " << cut;
    EXPECT_GT(read->torn_bytes, 0u);
    // Continued: the torn end is gone and new records follow the good ones.
    auto f = JournalFile::Continue(path_, *read);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    f->Add({{"k", "round"}, {"r", 2}});
    std::vector<char> bytes;
    f->Take(bytes);
    ASSERT_TRUE(f->WriteDurably(bytes).ok());
    auto again = ReadJournal(path_);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->records.size(), 3u);
    EXPECT_EQ(again->records[2]["r"].get<int>(), 2);
    EXPECT_EQ(again->torn_bytes, 0u);
  }
}

TEST_F(JournalTest, ZerosAtTheEndAreATornTailZerosBeforeDataAreDamage) {
  Write(2);
  const auto whole = fs::file_size(path_);
  {
    std::ofstream f(path_, std::ios::app | std::ios::binary);
    const std::string zeros(300, '\0');  // what a power loss may leave: blocks never written
    f << zeros;
  }
  auto read = ReadJournal(path_);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->records.size(), 2u);
  EXPECT_EQ(read->good_bytes, whole);
  EXPECT_EQ(read->torn_bytes, 300u);
  {
    std::ofstream f(path_, std::ios::app | std::ios::binary);
    f << "x";  // data after the zeros: not a tail a crash leaves
  }
  read = ReadJournal(path_);
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("an empty record and more data after it"),
            std::string::npos)
      << read.status().ToString();
}

TEST_F(JournalTest, DamageBeforeTheEndIsRefusedNamingWhere) {
  Write(3);
  std::fstream f(path_, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(kJournalMagicBytes + 8 + 2);  // inside the first record's payload
  f.put('#');
  f.close();
  auto read = ReadJournal(path_);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(read.status().message().find("damaged at byte 8"), std::string::npos)
      << read.status().ToString();
}

TEST_F(JournalTest, OneSchedulerAtATimeWritesAJournal) {
  Write(1);
  auto read = ReadJournal(path_);
  ASSERT_TRUE(read.ok());
  auto first = JournalFile::Continue(path_, *read);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = JournalFile::Continue(path_, *read);  // a restart while the first still runs
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("another scheduler has this journal open"),
            std::string::npos)
      << second.status().ToString();
  first = Status(StatusCode::kAborted, "closed");  // the first one ends: its lock goes with it
  EXPECT_TRUE(JournalFile::Continue(path_, *read).ok());
}

// A welcome to a rejoin is the scheduler's only if it proves so over the attempt's nonce, with
// the job key (servers) or the worker's credential: not another job's, not a replayed one.
TEST(Rejoin, AWelcomeIsTheSchedulersOnlyWithItsProofOverThisAttemptsNonce) {
  const JobKey key = RandomJobKey(), other = RandomJobKey();
  RejoinState state;
  state.nonce = RandomNonce();
  Welcome w;
  EXPECT_FALSE(state.Proven(w, key, 1)) << "no proof";
  w.scheduler_proof = SchedulerProof(key, 1, state.nonce);
  EXPECT_TRUE(state.Proven(w, key, 1));
  EXPECT_FALSE(state.Proven(w, other, 1)) << "another job's key";
  EXPECT_FALSE(state.Proven(w, key, 2)) << "another node's";
  const Tag credential = ClientCredential(key, 1000, false);
  w.scheduler_proof = SchedulerProof(credential, 1000, state.nonce);
  EXPECT_TRUE(state.Proven(w, credential, 1000));
  state.nonce = RandomNonce();  // the next attempt: the old answer proves nothing
  EXPECT_FALSE(state.Proven(w, credential, 1000));
}

TEST_F(JournalTest, OtherFilesAreNoJournals) {
  std::ofstream(path_) << "{\"k\":\"job\"}\n";
  EXPECT_FALSE(IsJournal(path_));
  EXPECT_FALSE(IsJournal(dir_.string()));
  auto read = ReadJournal(path_);
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("not a dsyncps scheduler journal"), std::string::npos);
}

}  // namespace
}  // namespace dsync::ps
