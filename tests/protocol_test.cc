// The wire format and handshake: bounds checked before anything is read, codecs that refuse
// truncated input, tokens compared in full.
#include <gtest/gtest.h>

#include <cstring>
#include <bit>
#include <limits>

#include "ps/commit_proof.h"
#include "ps/handshake.h"
#include "ps/keys.h"
#include "ps/protocol.h"
#include "ps/round_rule.h"
#include "ps/slicing.h"
#include "ps/staging_ledger.h"

namespace dsync::ps {
namespace {

TEST(FrameHeader, ValidatesMagicVersionAndLengths) {
  FrameHeader h = MakeHeader(MsgType::kPush, 1000);
  EXPECT_TRUE(ValidateHeader(h).ok());
  FrameHeader bad = h;
  bad.magic = 0x12345678;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kProtocol);
  EXPECT_NE(ValidateHeader(bad).message().find("not a dsyncps frame"), std::string::npos);
  bad = h;
  bad.version = 99;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kUnimplemented);
  EXPECT_NE(ValidateHeader(bad).message().find("protocol version 99"), std::string::npos);
  bad = h;
  bad.meta_len = kMaxMetaBytes + 1;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kProtocol);
  bad = h;
  bad.payload_len = kMaxPayloadBytes + 1;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kProtocol);
}

TEST(FrameHeader, EachMessageReadsItsOwnNamedFields) {
  FrameHeader push = MakeHeader(MsgType::kPush, 1000);
  push.set_tensor(7);
  push.set_slice(3);
  push.set_clock(41);
  push.set_base(39);
  EXPECT_EQ(push.tensor(), 7u);
  EXPECT_EQ(push.slice(), 3u);
  EXPECT_EQ(push.clock(), 41u);
  EXPECT_EQ(push.base(), 39u);
  FrameHeader err = MakeHeader(MsgType::kError, 1);
  err.set_refused(MsgType::kCommit);
  EXPECT_EQ(err.refused(), MsgType::kCommit);
  FrameHeader gone = MakeHeader(MsgType::kWorkerGone, 0);
  gone.set_gone_worker(1003);
  gone.set_next_clock(58);
  EXPECT_EQ(gone.gone_worker(), 1003u);
  EXPECT_EQ(gone.next_clock(), 58u);
  FrameHeader ack = MakeHeader(MsgType::kCommitAck, 0);
  ack.set_round(12);
  ack.set_min_version(kNoGate);
  EXPECT_EQ(ack.round(), 12u);
  EXPECT_EQ(ack.min_version(), kNoGate);
  FrameHeader init = MakeHeader(MsgType::kInit, 1000);
  init.set_tensor(2);
  init.set_slice(5);
  init.set_replica(1);
  EXPECT_EQ(init.replica(), 1u);
  EXPECT_EQ(init.slice(), 5u);
  FrameHeader lost = MakeHeader(MsgType::kServerGone, 0);
  lost.set_gone_server(3);
  lost.set_losses(2);
  EXPECT_EQ(lost.gone_server(), 3u);
  EXPECT_EQ(lost.losses(), 2u);
  FrameHeader commit = MakeHeader(MsgType::kCommit, 1000);
  commit.set_clock(9);
  commit.set_base(8);
  commit.set_losses(1);
  EXPECT_EQ(commit.clock(), 9u);
  EXPECT_EQ(commit.base(), 8u);
  EXPECT_EQ(commit.losses(), 1u);
  FrameHeader back = MakeHeader(MsgType::kServerBackAck, 1000);
  back.set_backs(2);
  back.set_next_clock(17);
  EXPECT_EQ(back.backs(), 2u);
  EXPECT_EQ(back.next_clock(), 17u);
  EXPECT_EQ(MsgTypeName(MsgType::kCopyOut), "copy-out");
  EXPECT_EQ(MsgTypeName(MsgType::kDamp), "damp");
  EXPECT_EQ(kProtocolVersion, 7u) << "the wire changed: damping (kDamp, a commit's size)";
}

TEST(FrameHeader, StrangersMaySendOneSmallHelloOnly) {
  FrameHeader hello = MakeHeader(MsgType::kHello, 0);
  hello.meta_len = kMaxHelloMetaBytes;
  EXPECT_TRUE(CheckUnauthenticatedFrame(hello).ok());
  FrameHeader big = hello;
  big.meta_len = kMaxHelloMetaBytes + 1;
  EXPECT_EQ(CheckUnauthenticatedFrame(big).code(), StatusCode::kPermissionDenied);
  FrameHeader payload = hello;
  payload.payload_len = 2ull << 30;
  EXPECT_EQ(CheckUnauthenticatedFrame(payload).code(), StatusCode::kPermissionDenied);
  FrameHeader push = MakeHeader(MsgType::kPush, 0);
  const Status st = CheckUnauthenticatedFrame(push);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(st.message().find("the first frame must be a hello"), std::string::npos);
}

TEST(RoundCodec, RoundTripsAndRejectsTruncationAndDisorder) {
  std::vector<RoundEntry> in = {{{1000, 3, 1}, {{0, 6}}},
                                {{1001, 4, 2}, {{0, 2}, {4, 1}}},
                                {{1007, 0, 0}, {}}};
  std::vector<std::byte> buf;
  EncodeRound(in, buf);
  std::vector<RoundEntry> out;
  ASSERT_TRUE(DecodeRound(buf, out).ok());
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i].member, in[i].member);
    EXPECT_EQ(out[i].tensors, in[i].tensors);
  }
  EXPECT_TRUE(Contains(out[1].tensors, 4));
  EXPECT_FALSE(Contains(out[1].tensors, 3));
  EXPECT_EQ(TensorCount(out[0].tensors), 6u);
  for (size_t cut = 0; cut < buf.size(); ++cut) {
    EXPECT_FALSE(DecodeRound(std::span(buf).first(cut), out).ok()) << cut;
  }
  buf.push_back(std::byte{0});
  EXPECT_FALSE(DecodeRound(buf, out).ok());
  // A count claiming more members than the bytes could hold is refused before reserving.
  std::vector<std::byte> huge(4, std::byte{0xff});
  EXPECT_FALSE(DecodeRound(huge, out).ok());
  // Members out of worker order, overlapping tensor runs, empty runs: refused.
  for (const auto& bad : std::vector<std::vector<RoundEntry>>{
           {{{1001, 0, 0}, {}}, {{1000, 0, 0}, {}}},
           {{{1000, 0, 0}, {{0, 3}, {2, 1}}}},
           {{{1000, 0, 0}, {{5, 0}}}}}) {
    EncodeRound(bad, buf);
    EXPECT_FALSE(DecodeRound(buf, out).ok());
  }
}

TEST(CommitCodec, RoundTripsAndRefusesATensorNamedTwice) {
  CommitProof in;
  in.receipts[0] = 0xab;
  in.tensors = {{0, 3, 1}, {1, 1, 0}, {5, 2, 1}};
  std::vector<std::byte> buf;
  EncodeCommit(in, buf);
  CommitProof out;
  ASSERT_TRUE(DecodeCommit(buf, out).ok());
  EXPECT_EQ(out.receipts, in.receipts);
  EXPECT_EQ(out.tensors, in.tensors);
  EXPECT_EQ(out.size, CommitProof::kSizeNotMeasured);
  EXPECT_EQ(TensorsOf(out), (TensorSet{{0, 2}, {5, 1}}));
  // The gradient's size travels as it is, bit for bit, a NaN's included (the scheduler's
  // growth watch decides what a size that is not finite means).
  for (const float size : {0.25f, 0.0f, std::numeric_limits<float>::infinity(),
                           std::bit_cast<float>(0x7fc00123u)}) {
    in.size = size;
    EncodeCommit(in, buf);
    ASSERT_TRUE(DecodeCommit(buf, out).ok());
    EXPECT_EQ(std::bit_cast<uint32_t>(out.size), std::bit_cast<uint32_t>(size));
  }
  for (size_t cut = 0; cut < buf.size(); ++cut) {
    EXPECT_FALSE(DecodeCommit(std::span(buf).first(cut), out).ok()) << cut;
  }
  // Twice (its receipts would cancel out in the XOR), out of order, or with no slices.
  for (const auto& bad : std::vector<std::vector<CommittedTensor>>{
           {{1, 1, 0}, {1, 1, 0}}, {{2, 1, 0}, {1, 1, 0}}, {{0, 0, 0}}}) {
    in.tensors = bad;
    EncodeCommit(in, buf);
    EXPECT_FALSE(DecodeCommit(buf, out).ok());
  }
}

TEST(InitCodec, RoundTripsAndRejectsGarbage) {
  InitMeta in{"layer1.weight", 123456, 4096, std::nullopt, {}};
  std::vector<std::byte> buf;
  EncodeInit(in, buf);
  InitMeta out;
  ASSERT_TRUE(DecodeInit(buf, out).ok());
  EXPECT_EQ(out.name, in.name);
  EXPECT_EQ(out.tensor_elements, in.tensor_elements);
  EXPECT_EQ(out.slice_offset, in.slice_offset);
  EXPECT_FALSE(out.optimizer.has_value());
  buf.resize(buf.size() - 1);
  EXPECT_FALSE(DecodeInit(buf, out).ok());
}

// A tensor's shape travels with it; one whose product is not the element count, with more
// dimensions than allowed, or whose product overflows is a protocol error.
TEST(InitCodec, CarriesTheShapeAndRefusesOneThatDoesNotHoldTheTensor) {
  InitMeta in{"conv.weight", 2 * 3 * 5, 0, std::nullopt, {2, 3, 5}};
  std::vector<std::byte> buf;
  EncodeInit(in, buf);
  InitMeta out;
  ASSERT_TRUE(DecodeInit(buf, out).ok());
  EXPECT_EQ(out.shape, (std::vector<uint64_t>{2, 3, 5}));
  EXPECT_EQ(ShapeText(out.shape), "(2, 3, 5)");
  EXPECT_EQ(ShapeText(std::vector<uint64_t>{7}), "(7,)");
  for (const std::vector<uint64_t>& bad :
       {std::vector<uint64_t>{2, 3, 4}, std::vector<uint64_t>{uint64_t{1} << 40, uint64_t{1} << 40, 0},
        std::vector<uint64_t>(17, 1)}) {
    InitMeta b = in;
    b.shape = bad;
    EncodeInit(b, buf);
    EXPECT_EQ(DecodeInit(buf, out).code(), StatusCode::kProtocol) << ShapeText(bad);
  }
}

// A tensor's own optimizer travels whole, and every field is checked on the way in: a kind
// beyond the known ones, a flag that is not 0 or 1, a hyperparameter out of range or not
// finite, or bytes left over, are protocol errors.
TEST(InitCodec, CarriesATensorsOptimizerAndChecksEveryField) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kMomentum;
  o.lr = 0.125f;
  o.momentum = 0.75f;
  o.nesterov = true;
  o.weight_decay = 1e-3f;
  InitMeta in{"w", 10, 0, o, {}};
  std::vector<std::byte> good;
  EncodeInit(in, good);
  InitMeta out;
  ASSERT_TRUE(DecodeInit(good, out).ok());
  ASSERT_TRUE(out.optimizer.has_value());
  EXPECT_EQ(*out.optimizer, o);
  // Layout after the name: has-optimizer, kind, nesterov, then 7 floats.
  const size_t at = good.size() - 2 - 7 * sizeof(float);
  const auto refused = [&](std::vector<std::byte> bytes, const char* mention) {
    InitMeta x;
    const Status st = DecodeInit(bytes, x);
    EXPECT_EQ(st.code(), StatusCode::kProtocol) << mention;
    EXPECT_NE(st.message().find(mention), std::string::npos) << st.message();
  };
  auto bytes = good;
  bytes[at - 1] = std::byte{2};
  refused(bytes, "malformed");  // has-optimizer neither 0 nor 1
  bytes = good;
  bytes[at] = std::byte{5};
  refused(bytes, "malformed");  // no such kind
  bytes = good;
  bytes[at + 1] = std::byte{7};
  refused(bytes, "malformed");  // nesterov neither 0 nor 1
  bytes = good;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bytes.data() + at + 2, &nan, sizeof nan);  // lr
  refused(bytes, "learning rate");
  bytes = good;
  const float negative = -1.0f;
  std::memcpy(bytes.data() + at + 2 + 6 * sizeof(float), &negative, sizeof negative);
  refused(bytes, "weight decay");
  bytes = good;
  bytes[at + 1] = std::byte{1};
  const float dampened = 0.5f;  // nesterov with dampening: torch refuses it too
  std::memcpy(bytes.data() + at + 2 + 2 * sizeof(float), &dampened, sizeof dampened);
  refused(bytes, "nesterov");
  bytes = good;
  bytes.push_back(std::byte{0});
  refused(bytes, "malformed");
  bytes = good;
  bytes.pop_back();
  refused(bytes, "malformed");
}

TEST(LearningRateCodec, RoundTripsAndRefusesWhatIsNotARate) {
  std::vector<std::byte> buf;
  EncodeLearningRate(0.0625f, buf);
  auto lr = DecodeLearningRate(buf);
  ASSERT_TRUE(lr.ok());
  EXPECT_EQ(*lr, 0.0625f);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), -1e-3f}) {
    EncodeLearningRate(bad, buf);
    EXPECT_EQ(DecodeLearningRate(buf).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  buf.push_back(std::byte{0});
  EXPECT_EQ(DecodeLearningRate(buf).status().code(), StatusCode::kProtocol);
  EXPECT_EQ(DecodeLearningRate({}).status().code(), StatusCode::kProtocol);
}

TEST(AgreementCodec, RoundTripsAndRefusesWhatIsMalformed) {
  Agreement a;
  a.dots = {0.25, 0.0, -3.5e-7};
  a.measured = {1, 0, 1};
  std::vector<std::byte> buf;
  EncodeAgreement(a, buf);
  EXPECT_EQ(buf.size(), 4u + 3 * 9);
  Agreement back;
  ASSERT_TRUE(DecodeAgreement(buf, back).ok());
  EXPECT_EQ(back.dots, a.dots);
  EXPECT_EQ(back.measured, a.measured);
  // A member not measured goes out as +0.0 whatever the caller left there.
  a.dots[1] = 42.0;
  EncodeAgreement(a, buf);
  ASSERT_TRUE(DecodeAgreement(buf, back).ok());
  EXPECT_EQ(back.dots[1], 0.0);
  EXPECT_TRUE(DecodeAgreement(std::vector<std::byte>(4, std::byte{0}), back).ok());
  EXPECT_TRUE(back.dots.empty());

  auto refused = [](std::vector<std::byte> bytes, const std::string& what) {
    Agreement out;
    const Status st = DecodeAgreement(bytes, out);
    EXPECT_EQ(st.code(), StatusCode::kProtocol) << what;
    EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
  };
  EncodeAgreement(a, buf);
  std::vector<std::byte> bytes = buf;
  bytes.push_back(std::byte{0});
  refused(bytes, "agreement metadata of 32 bytes is malformed");
  bytes = buf;
  bytes.pop_back();
  refused(bytes, "malformed");
  refused({}, "agreement metadata of 0 bytes is malformed");
  bytes = buf;
  bytes[0] = std::byte{0xff};  // a count far past what the bytes hold
  bytes[1] = bytes[2] = bytes[3] = std::byte{0xff};
  refused(bytes, "malformed");
  bytes = buf;
  bytes[4] = std::byte{2};  // a flag that is neither 0 nor 1
  refused(bytes, "malformed");
  bytes = buf;
  bytes[4 + 9 + 8] = std::byte{0x80};  // member 1, not measured, carries -0.0
  refused(bytes, "malformed");
  for (double bad : {std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    a.dots[2] = bad;
    EncodeAgreement(a, buf);
    refused(buf, "agreement of member 2 is");
  }
}

TEST(Handshake, HelloAndWelcomeRoundTrip) {
  Hello h;
  h.role = Role::kServer;
  h.token = "tok";
  h.host = "10.1.2.3";
  h.port = 4567;
  const std::string text = EncodeHello(h);
  auto back = DecodeHello(AsBytes(text));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->role, Role::kServer);
  EXPECT_EQ(back->token, "tok");
  EXPECT_EQ(back->port, 4567);

  Welcome w;
  w.id = 1003;
  w.sync = SyncMode::Dsync(2, 3);
  w.optimizer.kind = OptimizerKind::kAdam;
  w.optimizer.lr = 0.125f;
  w.staleness = StalenessPolicy::Parse("exp:0.7").value();
  w.slice_bytes = 1 << 20;
  w.servers = {{1, "a", 10, {}}, {2, "b", 11, {}}};
  w.servers[1].proof[3] = 9;
  w.credential[0] = 0x5a;
  w.job_key = JobKey{};
  w.job_key->at(15) = 7;
  w.num_servers = 2;
  w.join_round = 7;
  w.gate = 6;
  auto wb = DecodeWelcome(AsBytes(EncodeWelcome(w)));
  ASSERT_TRUE(wb.ok()) << wb.status().ToString();
  EXPECT_EQ(wb->id, 1003u);
  EXPECT_EQ(wb->sync, w.sync);
  EXPECT_EQ(wb->optimizer, w.optimizer);
  EXPECT_EQ(wb->staleness, w.staleness);
  ASSERT_EQ(wb->servers.size(), 2u);
  EXPECT_EQ(wb->servers[1].host, "b");
  EXPECT_EQ(wb->servers[1].proof, w.servers[1].proof);
  EXPECT_EQ(wb->join_round, 7u);
  EXPECT_EQ(wb->gate, 6u);
  EXPECT_EQ(wb->credential, w.credential);
  EXPECT_EQ(wb->job_key, w.job_key);
  EXPECT_EQ(wb->num_servers, 2u);
  EXPECT_FALSE(wb->damp_from.has_value());
  // A damped job's welcome names the round it is damped from.
  w.staleness = StalenessPolicy::Parse("damp").value();
  w.damp_from = 41;
  wb = DecodeWelcome(AsBytes(EncodeWelcome(w)));
  ASSERT_TRUE(wb.ok()) << wb.status().ToString();
  EXPECT_EQ(wb->staleness, w.staleness);
  EXPECT_EQ(wb->damp_from, std::optional<Round>(41));

  Hello worker;
  worker.node = 1003;
  worker.credential = w.credential;
  auto wh = DecodeHello(AsBytes(EncodeHello(worker)));
  ASSERT_TRUE(wh.ok());
  EXPECT_EQ(wh->credential, w.credential);
  // A credential that is not 32 hex digits is malformed, not merely wrong.
  EXPECT_FALSE(DecodeHello(AsBytes(R"({"role":"worker","token":"","node":1000,"host":"",)"
                                   R"("port":0,"credential":"xyz"})"))
                   .ok());
}

TEST(Handshake, MalformedHellosAreRefusedNotThrown) {
  for (const char* text : {"", "[]", "{", "{\"role\":\"worker\"}", "{\"role\":3,\"token\":\"\","
                           "\"node\":0,\"host\":\"\",\"port\":0}", "{\"role\":\"king\",\"token\":"
                           "\"\",\"node\":0,\"host\":\"\",\"port\":0}"}) {
    EXPECT_FALSE(DecodeHello(AsBytes(text)).ok()) << text;
  }
}

TEST(Handshake, NumbersAFieldCannotHoldAreRefusedNotWrapped) {
  const std::string base = R"({"role":"worker","token":"t","host":"","observer":false,)";
  for (const char* fields : {R"("node":-1,"port":0})", R"("node":1000,"port":70000})",
                             R"("node":1000,"port":4000.5})", R"("node":1000,"port":1e30})",
                             R"("node":4294967296,"port":0})"}) {
    const auto hello = DecodeHello(AsBytes(base + fields));
    ASSERT_FALSE(hello.ok()) << fields;
    EXPECT_EQ(hello.status().code(), StatusCode::kProtocol);
    EXPECT_NE(hello.status().message().find("out of range"), std::string::npos)
        << hello.status().message();
  }
  EXPECT_TRUE(DecodeHello(AsBytes(base + R"("node":4294967295,"port":65535})")).ok());
  Welcome w;
  w.credential[0] = 1;
  std::string text = EncodeWelcome(w);
  const auto lr = text.find("\"lr\":");
  ASSERT_NE(lr, std::string::npos);
  text.insert(lr + 5, "1e39,\"x\":");  // a learning rate beyond any float
  EXPECT_FALSE(DecodeWelcome(AsBytes(text)).ok()) << text;
}

TEST(Handshake, AWelcomeWithABadStalenessPolicyIsRefusedAndNoneIsTheDefault) {
  Welcome w;
  std::string text = EncodeWelcome(w);
  const auto at = text.find("\"staleness\":\"none\"");
  ASSERT_NE(at, std::string::npos) << text;
  std::string bad = text;
  bad.replace(at, 18, "\"staleness\":\"exp:2\"");
  const auto refused = DecodeWelcome(AsBytes(bad));
  ASSERT_FALSE(refused.ok()) << bad;
  EXPECT_EQ(refused.status().code(), StatusCode::kProtocol);
  EXPECT_NE(refused.status().message().find("exp:C must be in (0, 1]"), std::string::npos)
      << refused.status().message();
  std::string absent = text;
  absent.erase(at, 19);  // the field and its comma: a welcome from before the policy existed
  const auto old = DecodeWelcome(AsBytes(absent));
  ASSERT_TRUE(old.ok()) << absent << ": " << old.status().ToString();
  EXPECT_EQ(old->staleness.kind, StalenessKind::kNone);
}

TEST(Handshake, TokensMatchOnlyWhenEqual) {
  EXPECT_TRUE(TokenMatches("", ""));
  EXPECT_TRUE(TokenMatches("abc", "abc"));
  EXPECT_FALSE(TokenMatches("abc", "abd"));
  EXPECT_FALSE(TokenMatches("abc", "ab"));
  EXPECT_FALSE(TokenMatches("abc", "abcd"));
  EXPECT_FALSE(TokenMatches("", "x"));
}

TEST(Slicing, CutsTensorsAndBalancesSlicesOverServers) {
  SlicePlanner planner(4096, 4, 3);  // 1024 floats a slice
  auto big = planner.Plan(0, 10 * 1024 + 5);
  ASSERT_TRUE(big.ok());
  ASSERT_EQ(big->slices.size(), 11u);
  EXPECT_EQ(big->slices.back().elements, 5u);
  uint64_t covered = 0;
  std::vector<int> per_server(3);
  for (const SliceRef& s : big->slices) {
    EXPECT_EQ(s.offset, covered);
    covered += s.elements;
    ++per_server[s.server];
  }
  EXPECT_EQ(covered, 10u * 1024 + 5);
  EXPECT_EQ(per_server, (std::vector<int>{4, 4, 3}));
  // Small tensors continue where the big one left off, so they balance too.
  std::vector<int> small(3);
  for (TensorId t = 1; t <= 6; ++t) ++small[planner.Plan(t, 10)->slices[0].server];
  EXPECT_EQ(small, (std::vector<int>{2, 2, 2}));
  EXPECT_FALSE(planner.Plan(9, 0).ok());
}

TEST(Slicing, AnUnplannedTensorLeavesThePlacementAsIfItWasNeverPlanned) {
  SlicePlanner planner(8, 4, 2);  // 2 floats a slice
  SlicePlanner reference(8, 4, 2);
  ASSERT_TRUE(planner.Plan(0, 3).ok());
  ASSERT_TRUE(reference.Plan(0, 3).ok());
  auto refused = planner.Plan(1, 3);  // slices on servers 0, 1
  ASSERT_TRUE(refused.ok());
  planner.Unplan(*refused);
  auto again = planner.Plan(1, 5);
  auto expected = reference.Plan(1, 5);
  ASSERT_TRUE(again.ok() && expected.ok());
  ASSERT_EQ(again->slices.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(again->slices[i].server, expected->slices[i].server);
  EXPECT_EQ(again->slices[0].server, 0u);
}

TEST(Credentials, AreBoundToTheJobKeyTheIdAndTheKind) {
  const JobKey key = RandomJobKey();
  const JobKey other = RandomJobKey();
  EXPECT_NE(key, other);
  const Tag c = ClientCredential(key, 1000, false);
  EXPECT_TRUE(TagsEqual(c, ClientCredential(key, 1000, false)));
  EXPECT_FALSE(TagsEqual(c, ClientCredential(key, 1001, false)));
  EXPECT_FALSE(TagsEqual(c, ClientCredential(key, 1000, true)));
  EXPECT_FALSE(TagsEqual(c, ClientCredential(other, 1000, false)));
  EXPECT_FALSE(TagsEqual(ServerProof(key, 1, 1000), ServerProof(key, 2, 1000)));
  EXPECT_FALSE(TagsEqual(ServerProof(key, 1, 1000), ServerProof(key, 1, 1001)));
  EXPECT_EQ(TagFromHex(ToHex(c)), c);
  EXPECT_EQ(RandomToken().size(), 32u);
  EXPECT_NE(RandomToken(), RandomToken());
}

// A worker's commit with the receipts the servers would give for what it pushed.
CommitProof Honest(const JobKey& key, const Holders& servers, WorkerId w, Clock c,
                   std::vector<CommittedTensor> tensors) {
  CommitProof p;
  p.tensors = std::move(tensors);
  p.receipts = ExpectedReceipts(key, servers, w, c, p.tensors);
  return p;
}

TEST(CommitProof, OnlyWhatEveryHoldingServerStagedIsPlaced) {
  const JobKey key = RandomJobKey();
  // Tensor 0: 5 slices over 3 servers from rank 1 (ranks 1, 2, 0, 1, 2); tensor 1: one
  // slice on rank 0.
  const std::vector<CommittedTensor> both = {{0, 5, 1}, {1, 1, 0}};
  EXPECT_TRUE(VerifyCommit(key, 3, 1000, 7, false, Honest(key, 3, 1000, 7, both)).ok());
  // Receipts of another clock, worker or job do not prove this one.
  EXPECT_EQ(VerifyCommit(key, 3, 1000, 8, false, Honest(key, 3, 1000, 7, both)).code(),
            StatusCode::kPermissionDenied);
  EXPECT_FALSE(VerifyCommit(key, 3, 1001, 7, false, Honest(key, 3, 1000, 7, both)).ok());
  EXPECT_FALSE(VerifyCommit(RandomJobKey(), 3, 1000, 7, false, Honest(key, 3, 1000, 7, both)).ok());
  // A commit with no push at all, claiming a gradient.
  CommitProof nothing;
  nothing.tensors = both;
  const Status none = VerifyCommit(key, 3, 1000, 7, false, nothing);
  EXPECT_EQ(none.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(none.message().find("not proved by the servers' receipts"), std::string::npos);
  // Tensor 0 staged on ranks 1 and 2 only (rank 0 missing): one receipt short.
  CommitProof partial = Honest(key, 3, 1000, 7, both);
  XorInto(partial.receipts, Receipt(key, {kFirstServerId + 0, 1000, 7, 0, 5, 1}));
  EXPECT_FALSE(VerifyCommit(key, 3, 1000, 7, false, partial).ok());
  // Claiming fewer slices or another placement than the servers attested.
  CommitProof fewer = Honest(key, 3, 1000, 7, both);
  fewer.tensors[0].slices = 2;
  EXPECT_FALSE(VerifyCommit(key, 3, 1000, 7, false, fewer).ok());
  CommitProof moved = Honest(key, 3, 1000, 7, both);
  moved.tensors[0].first_rank = 2;
  EXPECT_FALSE(VerifyCommit(key, 3, 1000, 7, false, moved).ok());
  CommitProof nowhere = Honest(key, 3, 1000, 7, {{0, 5, 3}});
  EXPECT_EQ(VerifyCommit(key, 3, 1000, 7, false, nowhere).code(), StatusCode::kInvalidArgument);
  // Empty commits carry nothing; a gradient commit names something.
  EXPECT_TRUE(VerifyCommit(key, 3, 1000, 7, true, CommitProof{}).ok());
  EXPECT_FALSE(VerifyCommit(key, 3, 1000, 7, true, Honest(key, 3, 1000, 7, both)).ok());
  EXPECT_EQ(VerifyCommit(key, 3, 1000, 7, false, CommitProof{}).code(),
            StatusCode::kInvalidArgument);
}

TEST(StagingLedger, ReceiptsComeWhenEverySliceHereIsStaged) {
  const JobKey key = RandomJobKey();
  StagingLedger ledger;
  ledger.Configure(key, kFirstServerId + 1, 3, 4);  // rank 1 of 3, window 4
  // Tensor 0: 5 slices from rank 1 -> slices 0 and 3 live on rank 1.
  ASSERT_TRUE(ledger.Place(0, 5, 0).ok());
  ASSERT_TRUE(ledger.Place(0, 5, 3).ok());
  const Status wrong = ledger.Place(0, 5, 1);  // slice 1 is rank 2's
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("does not belong on server rank 1"), std::string::npos);
  std::optional<Tag> receipt;
  ASSERT_TRUE(ledger.Staged(1000, 0, 0, &receipt).ok());
  EXPECT_FALSE(receipt.has_value()) << "slice 3 is not staged yet";
  ASSERT_TRUE(ledger.Staged(1000, 0, 0, &receipt).ok());
  ASSERT_TRUE(receipt.has_value());
  EXPECT_TRUE(TagsEqual(*receipt, Receipt(key, {kFirstServerId + 1, 1000, 0, 0, 5, 1})));
}

// With copies, every server holding a copy of a slice of a tensor stages it and answers with
// its receipt; a commit leaves out exactly the servers lost before it.
TEST(CommitProof, WithCopiesEveryHolderProvesAndLostServersAreLeftOut) {
  const JobKey key = RandomJobKey();
  // Tensor 0: 2 slices over 4 servers from rank 3, 2 copies: slice 0 on ranks 3, 0; slice 1
  // on ranks 0, 1. Holders: ranks 3, 0, 1 (not 2).
  const std::vector<CommittedTensor> t = {{0, 2, 3}};
  const Holders copies(4, 2);
  CommitProof p;
  p.tensors = t;
  for (uint32_t rank : {3u, 0u, 1u}) {
    XorInto(p.receipts, Receipt(key, {kFirstServerId + rank, 1000, 7, 0, 2, 3}));
  }
  EXPECT_TRUE(TagsEqual(p.receipts, ExpectedReceipts(key, copies, 1000, 7, t)));
  EXPECT_TRUE(VerifyCommit(key, copies, 1000, 7, false, p).ok());
  EXPECT_FALSE(VerifyCommit(key, Holders(4, 1), 1000, 7, false, p).ok())
      << "one copy: rank 0's and 1's receipts only";
  // Rank 0 lost: the worker takes its receipt out; the commit is proved with rank 0 left out
  // and refused where rank 0 still counts.
  CommitProof without = p;
  XorInto(without.receipts, Receipt(key, {kFirstServerId + 0, 1000, 7, 0, 2, 3}));
  const std::vector<bool> lost = {true, false, false, false};
  EXPECT_TRUE(VerifyCommit(key, Holders(4, 2, &lost), 1000, 7, false, without).ok());
  EXPECT_FALSE(VerifyCommit(key, copies, 1000, 7, false, without).ok());
  EXPECT_FALSE(VerifyCommit(key, Holders(4, 2, &lost), 1000, 7, false, p).ok());
  // Three copies of one slice on three servers: all three prove it, one does not.
  EXPECT_TRUE(VerifyCommit(key, Holders(3, 3), 1001, 2, false,
                           Honest(key, Holders(3, 3), 1001, 2, {{0, 1, 0}})).ok());
  EXPECT_FALSE(VerifyCommit(key, Holders(3, 3), 1001, 2, false,
                            Honest(key, 3, 1001, 2, {{0, 1, 0}})).ok());
}

TEST(StagingLedger, EachServerCountsTheCopiesItHoldsBeforeItsReceipt) {
  const JobKey key = RandomJobKey();
  StagingLedger ledger;
  ledger.Configure(key, kFirstServerId + 0, 4, 4, 2);  // rank 0 of 4, 2 copies
  // Tensor 0 as above: copy 1 of slice 0 and copy 0 of slice 1 live on rank 0.
  ASSERT_TRUE(ledger.Place(0, 2, 0, 1).ok());
  ASSERT_TRUE(ledger.Place(0, 2, 1, 0).ok());
  // Copy 0 of slice 0 would put slice 0's primary here: another placement.
  EXPECT_EQ(ledger.Place(0, 2, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.Place(0, 2, 1, 2).code(), StatusCode::kInvalidArgument) << "no third copy";
  std::optional<Tag> receipt;
  ASSERT_TRUE(ledger.Staged(1000, 7, 0, &receipt).ok());
  EXPECT_FALSE(receipt.has_value());
  ASSERT_TRUE(ledger.Staged(1000, 7, 0, &receipt).ok());
  ASSERT_TRUE(receipt.has_value());
  EXPECT_TRUE(TagsEqual(*receipt, Receipt(key, {kFirstServerId + 0, 1000, 7, 0, 2, 3})));
}

TEST(Slicing, TheJobGoesOnWhileEverySliceHasACopy) {
  EXPECT_EQ(ReplicaRank(3, 1, 4), 0u);
  EXPECT_TRUE(EverySliceHasACopy({false, false, false}, 1));
  EXPECT_FALSE(EverySliceHasACopy({false, true, false}, 1));
  EXPECT_TRUE(EverySliceHasACopy({true, false, true, false}, 2)) << "ranks 0 and 2: apart";
  EXPECT_FALSE(EverySliceHasACopy({true, false, false, true}, 2)) << "ranks 3 and 0: adjacent";
  EXPECT_FALSE(EverySliceHasACopy({false, true, true}, 2));
  EXPECT_TRUE(EverySliceHasACopy({true, true, false}, 3));
  EXPECT_FALSE(EverySliceHasACopy({true, true, true}, 3));
}

TEST(StagingLedger, AWorkerHoldsAtMostItsWindowOfClocks) {
  StagingLedger ledger;
  ledger.Configure(RandomJobKey(), kFirstServerId, 1, 3);
  ASSERT_TRUE(ledger.Place(0, 2, 0).ok());
  std::optional<Tag> receipt;
  for (Clock c = 0; c < 3; ++c) ASSERT_TRUE(ledger.Staged(1000, c, 0, &receipt).ok()) << c;
  // A fourth clock is refused; more slices of a clock already staged are not.
  const Status over = ledger.Admit(1000, 3);
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("3 clocks staged"), std::string::npos) << over.message();
  EXPECT_TRUE(ledger.Admit(1000, 2).ok());
  EXPECT_TRUE(ledger.Admit(1001, 0).ok()) << "another worker has a quota of its own";
  // Applied: room again, and the applied clock cannot be pushed a second time.
  ledger.Applied(1000, 0);
  EXPECT_TRUE(ledger.Admit(1000, 3).ok());
  EXPECT_EQ(ledger.Admit(1000, 0).code(), StatusCode::kFailedPrecondition);
  // Gone from clock 2 on: those are reclaimed.
  ledger.Gone(1000, 2);
  EXPECT_TRUE(ledger.Admit(1000, 4).ok());
  EXPECT_TRUE(ledger.Admit(1000, 5).ok());
}

TEST(StagingWindow, IsWhatTheGatesLetAnHonestWorkerHaveInFlight) {
  EXPECT_EQ(StagingWindow(SyncMode::Bsp()), 2u);
  EXPECT_EQ(StagingWindow(SyncMode::Dsync(4, 3)), 6u);
  EXPECT_EQ(StagingWindow(SyncMode::Auto(4)), 6u);
  EXPECT_EQ(StagingWindow(SyncMode::Dsync(UINT32_MAX - 1)), UINT32_MAX);
  EXPECT_EQ(StagingWindow(SyncMode::Asp()), kAspBacklog + 2);
}

}  // namespace
}  // namespace dsync::ps
