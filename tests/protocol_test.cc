// The wire format and handshake: bounds checked before anything is read, codecs that refuse
// truncated input, tokens compared in full.
#include <gtest/gtest.h>

#include "ps/handshake.h"
#include "ps/protocol.h"
#include "ps/slicing.h"

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
  bad.version = 7;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kUnimplemented);
  EXPECT_NE(ValidateHeader(bad).message().find("protocol version 7"), std::string::npos);
  bad = h;
  bad.meta_len = kMaxMetaBytes + 1;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kProtocol);
  bad = h;
  bad.payload_len = kMaxPayloadBytes + 1;
  EXPECT_EQ(ValidateHeader(bad).code(), StatusCode::kProtocol);
}

TEST(MembersCodec, RoundTripsAndRejectsTruncation) {
  std::vector<RoundMember> in = {{1000, 3, 1}, {1001, 4, 2}, {1007, 0, 0}};
  std::vector<std::byte> buf;
  EncodeMembers(in, buf);
  std::vector<RoundMember> out;
  ASSERT_TRUE(DecodeMembers(buf, out).ok());
  EXPECT_EQ(out, in);
  for (size_t cut = 0; cut < buf.size(); ++cut) {
    EXPECT_FALSE(DecodeMembers(std::span(buf).first(cut), out).ok()) << cut;
  }
  buf.push_back(std::byte{0});
  EXPECT_FALSE(DecodeMembers(buf, out).ok());
  // A count claiming more members than the bytes could hold is refused before reserving.
  std::vector<std::byte> huge(4, std::byte{0xff});
  EXPECT_FALSE(DecodeMembers(huge, out).ok());
}

TEST(InitCodec, RoundTripsAndRejectsGarbage) {
  InitMeta in{"layer1.weight", 123456, 4096};
  std::vector<std::byte> buf;
  EncodeInit(in, buf);
  InitMeta out;
  ASSERT_TRUE(DecodeInit(buf, out).ok());
  EXPECT_EQ(out.name, in.name);
  EXPECT_EQ(out.tensor_elements, in.tensor_elements);
  EXPECT_EQ(out.slice_offset, in.slice_offset);
  buf.resize(buf.size() - 1);
  EXPECT_FALSE(DecodeInit(buf, out).ok());
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
  w.slice_bytes = 1 << 20;
  w.servers = {{1, "a", 10}, {2, "b", 11}};
  w.join_round = 7;
  w.gate = 6;
  auto wb = DecodeWelcome(AsBytes(EncodeWelcome(w)));
  ASSERT_TRUE(wb.ok()) << wb.status().ToString();
  EXPECT_EQ(wb->id, 1003u);
  EXPECT_EQ(wb->sync, w.sync);
  EXPECT_EQ(wb->optimizer, w.optimizer);
  ASSERT_EQ(wb->servers.size(), 2u);
  EXPECT_EQ(wb->servers[1].host, "b");
  EXPECT_EQ(wb->join_round, 7u);
  EXPECT_EQ(wb->gate, 6u);
}

TEST(Handshake, MalformedHellosAreRefusedNotThrown) {
  for (const char* text : {"", "[]", "{", "{\"role\":\"worker\"}", "{\"role\":3,\"token\":\"\","
                           "\"node\":0,\"host\":\"\",\"port\":0}", "{\"role\":\"king\",\"token\":"
                           "\"\",\"node\":0,\"host\":\"\",\"port\":0}"}) {
    EXPECT_FALSE(DecodeHello(AsBytes(text)).ok()) << text;
  }
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

}  // namespace
}  // namespace dsync::ps
