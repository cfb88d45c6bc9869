// Which receipts a commit carries once lost ranks are taken over by new servers, and when a
// new server's copies may be taken (ps/takeover.h).
#include <gtest/gtest.h>

#include <map>

#include "ps/takeover.h"

namespace dsync::ps {
namespace {

constexpr NodeId kServer(uint32_t rank) { return kFirstServerId + rank; }

std::vector<bool> LeftOut(const ServerEvents& e, uint32_t losses, WorkerId w, Clock clock) {
  std::vector<bool> out;
  e.LeftOut(losses, w, clock, out);
  return out;
}

TEST(ServerEvents, ACommitLeavesOutTheLossesItKnewUnlessItsClockWentToTheNewServer) {
  ServerEvents e(3);
  EXPECT_EQ(LeftOut(e, 0, 7, 0), (std::vector<bool>{false, false, false}));
  e.Lost(kServer(1));
  EXPECT_EQ(LeftOut(e, 0, 7, 3), (std::vector<bool>{false, false, false}))
      << "a commit that did not know of the loss still had every receipt";
  EXPECT_EQ(LeftOut(e, 1, 7, 3), (std::vector<bool>{false, true, false}));
  e.TakenOver(kServer(1), {7, 8});
  // Until worker 7 says from which clock it pushes to the new server, none of its clocks do.
  EXPECT_EQ(e.PushesFrom(0, 7), kNoClock);
  EXPECT_EQ(LeftOut(e, 1, 7, 100), (std::vector<bool>{false, true, false}));
  e.Pushes(0, 7, 5);
  EXPECT_EQ(LeftOut(e, 1, 7, 4), (std::vector<bool>{false, true, false}));
  EXPECT_EQ(LeftOut(e, 1, 7, 5), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(LeftOut(e, 1, 8, 5), (std::vector<bool>{false, true, false})) << "8 has not said";
  // A worker that joined after the takeover pushes to it from its first clock.
  EXPECT_EQ(e.PushesFrom(0, 9), 0u);
  EXPECT_EQ(LeftOut(e, 1, 9, 0), (std::vector<bool>{false, false, false}));
  // The new server is lost again: a commit that knows counts it out, one that does not, in.
  e.Lost(kServer(1));
  EXPECT_EQ(LeftOut(e, 1, 7, 6), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(LeftOut(e, 2, 7, 6), (std::vector<bool>{false, true, false}));
  // A second takeover of the rank that worker 8 answers, though it never answered the first.
  e.TakenOver(kServer(1), {7, 8});
  e.Pushes(1, 8, 40);
  EXPECT_EQ(LeftOut(e, 2, 8, 40), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(LeftOut(e, 2, 8, 39), (std::vector<bool>{false, true, false}));
  EXPECT_EQ(e.losses(), (std::vector<NodeId>{kServer(1), kServer(1)}));
  EXPECT_EQ(e.takeovers(), (std::vector<NodeId>{kServer(1), kServer(1)}));
  // A worker answers once: a second answer moves nothing.
  e.Pushes(1, 8, 30);
  EXPECT_EQ(e.PushesFrom(1, 8), 40u);
}

TEST(Takeover, CopiesWaitUntilEveryClockThatMissedTheNewServerIsInARoundSent) {
  Takeover t(kServer(2), 0, 10, {1, 2, 3});
  std::map<WorkerId, Clock> placed = {{1, 4}, {2, 4}, {3, 4}};
  const auto ready = [&] { return t.Ready([&](WorkerId w) { return placed[w]; }); };
  EXPECT_FALSE(ready()) << "nobody said from which clock it pushes to the new server";
  t.Pushes(1, 5);
  t.Pushes(2, 4);
  EXPECT_FALSE(ready()) << "worker 3 has not said";
  t.Gone(3, 6);  // its clocks up to 5 were committed: they are placed still
  EXPECT_FALSE(ready()) << "worker 1's clock 4 and worker 3's clocks 4 and 5 are in no round yet";
  placed[1] = 5;
  placed[3] = 6;
  EXPECT_TRUE(ready());
  // A worker that leaves without answering: only what it committed must be placed.
  Takeover u(kServer(2), 1, 10, {1});
  u.Gone(1, 3);
  EXPECT_FALSE(u.Ready([](WorkerId) { return Clock{2}; }));
  EXPECT_TRUE(u.Ready([](WorkerId) { return Clock{3}; }));
  // With no worker at all, at once.
  EXPECT_TRUE(Takeover(kServer(0), 2, 0, {}).Ready([](WorkerId) { return Clock{0}; }));
}

}  // namespace
}  // namespace dsync::ps
