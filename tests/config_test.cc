// Configuration: sync modes, optimizers, sizes, the environment bootstrap and validation.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <iterator>
#include <set>
#include <tuple>

#include <cmath>
#include <limits>

#include "ps/settings.h"
#include "dsync/config.h"
#include "ps/hostlist.h"

namespace dsync {
namespace {

TEST(SyncModeParse, AcceptsEveryModeOfTheDesign) {
  EXPECT_EQ(SyncMode::Parse("bsp").value(), SyncMode::Bsp());
  EXPECT_EQ(SyncMode::Parse("asp").value(), SyncMode::Asp());
  EXPECT_EQ(SyncMode::Parse("ssp:3").value(), SyncMode::Ssp(3));
  const SyncMode d = SyncMode::Parse("dsync:2").value();
  EXPECT_EQ(d.kind, SyncKind::kRound);
  EXPECT_EQ(d.bound, 2u);
  EXPECT_EQ(d.quorum, SyncMode::kAll);
  const SyncMode dq = SyncMode::Parse("dsync:2,3").value();
  EXPECT_EQ(dq.bound, 2u);
  EXPECT_EQ(dq.quorum, 3u);
  // D = 0 forces the quorum to all: dsync:0 is bsp.
  EXPECT_EQ(SyncMode::Parse("dsync:0,1").value(), SyncMode::Bsp());
  EXPECT_EQ(SyncMode::Parse("dsync:0").value().ToString(), "bsp");
}

TEST(SyncModeParse, RoundTripsThroughText) {
  for (const char* text : {"bsp", "asp", "ssp:0", "ssp:7", "dsync:1", "dsync:4,2", "dsync:auto",
                           "dsync:auto:8"}) {
    EXPECT_EQ(SyncMode::Parse(text).value().ToString(), text);
  }
}

TEST(SyncModeParse, RejectsMalformedModesWithTheAcceptedForms) {
  for (const char* text : {"", "bsp:1", "dsync", "dsync:", "dsync:x", "dsync:2,0", "dsync:2,",
                           "ssp:", "ssp:-1", "dsync:99999999999", "async", "dsync:auto:0",
                           "dsync:auto:", "dsync:auto,2", "dsync:autox"}) {
    auto r = SyncMode::Parse(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(
                  "expected bsp, dsync:K, dsync:K,Q, dsync:auto[:KMAX], ssp:K or asp"),
              std::string::npos)
        << r.status().message();
  }
}

TEST(StalenessPolicy, ParsesRoundTripsAndWeighs) {
  for (const char* text : {"none", "inverse", "exp:0.5", "exp:1", "exp:0.1"}) {
    EXPECT_EQ(StalenessPolicy::Parse(text).value().ToString(), text);
  }
  const StalenessPolicy none = StalenessPolicy::Parse("none").value();
  const StalenessPolicy inverse = StalenessPolicy::Parse("inverse").value();
  const StalenessPolicy exp = StalenessPolicy::Parse("exp:0.5").value();
  for (const StalenessPolicy& p : {none, inverse, exp}) EXPECT_EQ(p.Weight(0), 1.0f);
  EXPECT_EQ(none.Weight(7), 1.0f);
  EXPECT_EQ(inverse.Weight(1), 0.5f);
  EXPECT_EQ(inverse.Weight(3), 0.25f);
  EXPECT_EQ(inverse.Weight(2), static_cast<float>(1.0 / 3.0));
  EXPECT_EQ(exp.Weight(1), 0.5f);
  EXPECT_EQ(exp.Weight(4), 0.0625f);
  EXPECT_EQ(StalenessPolicy::Parse("exp:0.9").value().Weight(2), static_cast<float>(
                std::pow(static_cast<double>(0.9f), 2.0)));
  // Far beyond any bound: tiny or zero, never negative or NaN.
  EXPECT_GE(exp.Weight(UINT64_MAX), 0.0f);
  EXPECT_GT(inverse.Weight(UINT64_MAX), 0.0f);
  EXPECT_EQ(StalenessPolicy::Parse("exp:1").value().Weight(1000), 1.0f);
}

TEST(StalenessPolicy, DelayCompensationParsesAloneOrAfterAWeightAndKeepsWhatTheModeNeeds) {
  for (const char* text : {"dc:0.5", "dc:2,8", "inverse+dc:0.04", "exp:0.5+dc:1,3", "dca:2",
                           "inverse+dca:0.5,3"}) {
    EXPECT_EQ(StalenessPolicy::Parse(text).value().ToString(), text);
  }
  EXPECT_FALSE(StalenessPolicy::Parse("dc:1").value().adaptive);
  EXPECT_TRUE(StalenessPolicy::Parse("dca:1").value().adaptive);
  EXPECT_TRUE(StalenessPolicy::Parse("exp:0.5+dca:1,2").value().adaptive);
  const StalenessPolicy dc = StalenessPolicy::Parse("dc:0.5").value();
  EXPECT_EQ(dc.kind, StalenessKind::kNone);
  EXPECT_EQ(dc.compensation, 0.5f);
  EXPECT_EQ(dc.Weight(3), 1.0f);  // compensation alone weighs nothing
  const StalenessPolicy both = StalenessPolicy::Parse("inverse+dc:2,8").value();
  EXPECT_EQ(both.kind, StalenessKind::kInverse);
  EXPECT_EQ(both.Weight(1), 0.5f);
  EXPECT_EQ(both.compensation, 2.0f);
  EXPECT_EQ(both.depth, 8u);
  // What the servers keep: a round mode's bound (capped by D), none in bsp, D or the default
  // where nothing bounds the staleness in rounds.
  EXPECT_EQ(dc.CompensationDepth(SyncMode::Bsp()), 0u);
  EXPECT_EQ(dc.CompensationDepth(SyncMode::Dsync(3, 2)), 3u);
  EXPECT_EQ(dc.CompensationDepth(SyncMode::Auto()), SyncMode::kDefaultAutoMax);
  EXPECT_EQ(both.CompensationDepth(SyncMode::Dsync(20)), 8u);
  EXPECT_EQ(both.CompensationDepth(SyncMode::Dsync(2)), 2u);
  EXPECT_EQ(dc.CompensationDepth(SyncMode::Dsync(1000)), StalenessPolicy::kMaxCompensationDepth);
  EXPECT_EQ(dc.CompensationDepth(SyncMode::Asp()), StalenessPolicy::kDefaultCompensationDepth);
  EXPECT_EQ(both.CompensationDepth(SyncMode::Ssp(2)), 8u);
  EXPECT_EQ(StalenessPolicy::Parse("inverse").value().CompensationDepth(SyncMode::Asp()), 0u);
  for (const char* text : {"dc", "dc:", "dc:0", "dc:-1", "dc:inf", "dc:nan", "dc:1,0", "dc:1,65",
                           "dc:1,x", "dc:0.5+inverse", "none+dc:1", "inverse+exp:0.5",
                           "inverse+dc:0", "dc:1+dc:1", "dca", "dca:0", "dcb:1", "dca:1,"}) {
    auto r = StalenessPolicy::Parse(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(StalenessPolicy::Parse("dc:0x1p-149").ok());  // a subnormal factor
  EXPECT_FALSE(StalenessPolicy::Parse("exp:0x1p-149").ok());
  // A factor large enough to print with an exponent reads back: "1e+18" would split at '+'.
  for (const char* text : {"dc:1000000000000000000", "dca:3e20,2", "inverse+dc:1e18+momentum"}) {
    const StalenessPolicy p = StalenessPolicy::Parse(text).value();
    const auto again = StalenessPolicy::Parse(p.ToString());
    ASSERT_TRUE(again.ok()) << p.ToString() << ": " << again.status().ToString();
    EXPECT_EQ(*again, p) << text;
  }
  EXPECT_NE(StalenessPolicy::Parse("dc:1,65").status().message().find("must be 1 to 64"),
            std::string::npos);
  EXPECT_NE(StalenessPolicy::Parse("dc:0").status().message().find("above 0"), std::string::npos);
}

TEST(StalenessPolicy, DampAppliesNoneUntilDampedAndItsPolicyFromThen) {
  // "damp" alone is damp:inverse+momentum; "damp:P" any policy but none.
  const StalenessPolicy plain = StalenessPolicy::Parse("damp").value();
  EXPECT_TRUE(plain.damp);
  EXPECT_EQ(plain.ToString(), "damp:inverse+momentum");
  EXPECT_EQ(StalenessPolicy::Parse(plain.ToString()).value(), plain);
  for (const char* text : {"damp:inverse", "damp:exp:0.5", "damp:dca:0.002,3",
                           "damp:inverse+dc:0.01+momentum", "damp:momentum"}) {
    const auto p = StalenessPolicy::Parse(text);
    ASSERT_TRUE(p.ok()) << text << ": " << p.status().ToString();
    EXPECT_EQ(p->ToString(), text);
    // Undamped: none, exactly (every weight 1, no compensation, the momentum asked for).
    EXPECT_EQ(p->Active(false), StalenessPolicy{}) << text;
    // Damped: the policy after "damp:", which is no damp policy itself.
    EXPECT_EQ(p->Active(true), StalenessPolicy::Parse(std::string_view(text).substr(5)).value());
    EXPECT_FALSE(p->Active(true).damp);
  }
  const StalenessPolicy inverse = StalenessPolicy::Parse("damp:inverse").value();
  EXPECT_EQ(inverse.Active(false).Weight(3), 1.0f);
  EXPECT_EQ(inverse.Active(true).Weight(3), 0.25f);
  // The versions a compensation needs are kept from the start: they are there once damped.
  EXPECT_EQ(StalenessPolicy::Parse("damp:dc:1,3").value().CompensationDepth(SyncMode::Dsync(5)),
            3u);
  // A policy that is not damp is its own active policy, damped or not.
  const StalenessPolicy dc = StalenessPolicy::Parse("inverse+dc:1").value();
  EXPECT_EQ(dc.Active(false), dc);
  EXPECT_EQ(dc.Active(true), dc);
  for (const char* text : {"damp:", "damp:none", "damp:damp", "damp:damp:inverse", "dampx",
                           "damp:inverse+", "inverse+damp", "damp+momentum", "Damp"}) {
    auto r = StalenessPolicy::Parse(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  }
}

TEST(StalenessPolicy, MomentumTemperingParsesLastOrAloneAndKeepsTheGainOfTheAskedMomentum) {
  for (const char* text : {"momentum", "inverse+momentum", "exp:0.5+momentum", "dc:0.5+momentum",
                           "inverse+dca:32+momentum", "exp:0.5+dc:1,3+momentum"}) {
    auto p = StalenessPolicy::Parse(text);
    ASSERT_TRUE(p.ok()) << text << ": " << p.status().ToString();
    EXPECT_TRUE(p->temper_momentum) << text;
    EXPECT_EQ(p->ToString(), text);
  }
  const StalenessPolicy alone = StalenessPolicy::Parse("momentum").value();
  EXPECT_EQ(alone.kind, StalenessKind::kNone);
  EXPECT_EQ(alone.compensation, 0.0f);
  EXPECT_EQ(alone.Weight(3), 1.0f);  // tempering weighs nothing
  const StalenessPolicy both = StalenessPolicy::Parse("inverse+dca:32+momentum").value();
  EXPECT_EQ(both.kind, StalenessKind::kInverse);
  EXPECT_TRUE(both.adaptive);
  EXPECT_EQ(both.compensation, 32.0f);
  EXPECT_FALSE(StalenessPolicy::Parse("inverse+dca:32").value().temper_momentum);

  // Fresh rounds, and every policy without it, step with the momentum asked, bit for bit.
  for (float m : {0.0f, 0.5f, 0.9f, 0.99f}) {
    EXPECT_EQ(alone.RoundMomentum(m, 0.0), m);
    EXPECT_EQ(StalenessPolicy{}.RoundMomentum(m, 2.0), m);
    EXPECT_EQ(StalenessPolicy::Parse("inverse").value().RoundMomentum(m, 2.0), m);
  }
  // 1 - (1 - m)(1 + s): the explicit and the implied momentum keep the gain 1 / (1 - m).
  EXPECT_FLOAT_EQ(alone.RoundMomentum(0.9f, 1.0), 0.8f);
  EXPECT_FLOAT_EQ(alone.RoundMomentum(0.9f, 2.0), 0.7f);
  EXPECT_FLOAT_EQ(alone.RoundMomentum(0.9f, 0.5), 0.85f);
  EXPECT_FLOAT_EQ(alone.RoundMomentum(0.99f, 3.0), 0.96f);
  for (double s : {0.25, 1.0, 3.0}) {
    const double m = alone.RoundMomentum(0.9f, s);
    const double implied = s / (1.0 + s);
    EXPECT_NEAR((1.0 - m) * (1.0 - implied), 1.0 - 0.9, 1e-6) << s;
  }
  // Staler than the momentum can give back: none left, never negative.
  EXPECT_EQ(alone.RoundMomentum(0.9f, 9.5), 0.0f);
  EXPECT_EQ(alone.RoundMomentum(0.5f, 1e30), 0.0f);
  EXPECT_EQ(alone.RoundMomentum(0.0f, 1.0), 0.0f);
  // A mean that is not a number leaves the momentum as asked rather than poisoning it, and
  // so does a momentum that never decays (1 or more): tempering never raises it.
  EXPECT_EQ(alone.RoundMomentum(0.9f, std::nan("")), 0.9f);
  EXPECT_EQ(alone.RoundMomentum(1.0f, 2.0), 1.0f);
  EXPECT_EQ(alone.RoundMomentum(1.5f, 1.0), 1.5f);
  for (float m = 0.0f; m < 1.0f; m += 0.0625f) {
    for (double st : {0.001, 0.5, 1.0, 4.0, 64.0}) {
      const float t = alone.RoundMomentum(m, st);
      EXPECT_GE(t, 0.0f) << m << " " << st;
      EXPECT_LE(t, m) << m << " " << st;
    }
  }

  for (const char* text : {"none+momentum", "momentum+inverse", "momentum+momentum",
                           "inverse+momentum+dc:1", "+momentum", "inverse+", "momentum:2",
                           "dc:1+momentum+momentum"}) {
    auto r = StalenessPolicy::Parse(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("+momentum"), std::string::npos) << r.status().message();
  }
}

TEST(StalenessPolicy, RefusesWhatIsNotAPolicyWithTheAcceptedForms) {
  for (const char* text : {"", "exp", "exp:", "exp:0", "exp:-0.5", "exp:1.5", "exp:nan",
                           "exp:x", "inverse:2", "linear"}) {
    auto r = StalenessPolicy::Parse(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find("exp:C"), std::string::npos) << r.status().message();
  }
  auto env = Config::FromEnvironment({{"DSYNC_STALENESS_POLICY", "exp:2"}});
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("DSYNC_STALENESS_POLICY"), std::string::npos)
      << env.status().message();
  EXPECT_EQ(Config::FromEnvironment({{"DSYNC_STALENESS_POLICY", "inverse"}}).value().staleness,
            StalenessPolicy::Parse("inverse").value());
}

TEST(SyncModeParse, AutoCarriesItsMaximumBound) {
  const SyncMode a = SyncMode::Parse("dsync:auto").value();
  EXPECT_TRUE(a.adaptive);
  EXPECT_EQ(a.kind, SyncKind::kRound);
  EXPECT_EQ(a.bound, SyncMode::kDefaultAutoMax);
  const SyncMode b = SyncMode::Parse("dsync:auto:8").value();
  EXPECT_TRUE(b.adaptive);
  EXPECT_EQ(b.bound, 8u);
  EXPECT_NE(a, SyncMode::Dsync(SyncMode::kDefaultAutoMax));
}

TEST(ConfigEnvironment, ReadsDsyncVariables) {
  auto c = Config::FromEnvironment({{"DSYNC_ROLE", "server"},
                                    {"DSYNC_SCHEDULER_URI", "10.0.0.5"},
                                    {"DSYNC_SCHEDULER_PORT", "7000"},
                                    {"DSYNC_NUM_SERVERS", "3"},
                                    {"DSYNC_NUM_WORKERS", "8"},
                                    {"DSYNC_SYNC", "dsync:2,6"},
                                    {"DSYNC_OPTIMIZER", "adam"},
                                    {"DSYNC_LR", "0.001"},
                                    {"DSYNC_SLICE_BYTES", "1M"},
                                    {"DSYNC_TOKEN", "s3cret"},
                                    {"DSYNC_INTERFACE", "0.0.0.0"},
                                    {"DSYNC_ADVERTISE", "10.0.0.9"},
                                    {"DSYNC_HEARTBEAT_TIMEOUT_MS", "9000"}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->role, Role::kServer);
  EXPECT_EQ(c->scheduler_host, "10.0.0.5");
  EXPECT_EQ(c->scheduler_port, 7000);
  EXPECT_EQ(c->num_servers, 3u);
  EXPECT_EQ(c->num_workers, 8u);
  EXPECT_EQ(c->sync, SyncMode::Dsync(2, 6));
  EXPECT_EQ(c->optimizer.kind, OptimizerKind::kAdam);
  EXPECT_FLOAT_EQ(c->optimizer.lr, 0.001f);
  EXPECT_EQ(c->slice_bytes, 1u << 20);
  EXPECT_EQ(c->token, "s3cret");
  EXPECT_EQ(c->bind_host, "0.0.0.0");
  EXPECT_EQ(c->advertise_host, "10.0.0.9");
  EXPECT_EQ(c->heartbeat_timeout_ms, 9000u);
  EXPECT_TRUE(c->Validate().ok());
}

TEST(ConfigEnvironment, ToEnvironmentGivesAnotherProcessTheSameJob) {
  Config c;
  c.scheduler_host = "10.1.2.3";
  c.scheduler_port = 12345;
  c.bind_host = "eth7";
  c.rendezvous = "/shared/job.addr";
  c.token = "s3cret";
  c.num_servers = 3;
  c.num_workers = 7;
  c.sync = SyncMode::Dsync(2, 5);
  c.optimizer = {.kind = OptimizerKind::kMomentum, .lr = 0.1f / 3.0f, .momentum = 0.5f,
                 .dampening = 0.0f, .nesterov = true, .beta1 = 0.8f, .beta2 = 0.95f,
                 .eps = 1e-7f, .weight_decay = 1e-4f};
  c.slice_bytes = 123456;
  c.staleness = StalenessPolicy::Parse("exp:0.3").value();
  c.max_gradients = 999;
  c.finish_bsp_percent = 25;
  c.heartbeat_interval_ms = 250;
  c.heartbeat_timeout_ms = 1500;
  c.connect_timeout_ms = 4000;
  c.handshake_timeout_ms = 700;
  c.max_pending_connections = 9;
  c.max_pending_per_source = 3;
  c.store = StoreKind::kAuto;
  c.gpudirect = GpuDirectMode::kOff;
  c.gid_index = 3;
  c.rdma_device = "rxe0";
  c.pin_heap = false;
  // A node's own settings stay behind.
  c.role = Role::kServer;
  c.port = 4444;
  c.advertise_host = "1.2.3.4";
  c.link_delay_us = 5000;
  const auto env = c.ToEnvironment();
  EXPECT_FALSE(env.contains("DSYNC_ROLE"));
  EXPECT_FALSE(env.contains("DSYNC_PORT"));
  EXPECT_FALSE(env.contains("DSYNC_ADVERTISE"));
  EXPECT_FALSE(env.contains("DSYNC_LINK_DELAY_MS"));
  const Config back = Config::FromEnvironment(env).value();
  EXPECT_EQ(back.scheduler_host, c.scheduler_host);
  EXPECT_EQ(back.scheduler_port, c.scheduler_port);
  EXPECT_EQ(back.bind_host, c.bind_host);
  EXPECT_EQ(back.rendezvous, c.rendezvous);
  EXPECT_EQ(back.token, c.token);
  EXPECT_EQ(back.num_servers, 3u);
  EXPECT_EQ(back.num_workers, 7u);
  EXPECT_EQ(back.sync, c.sync);
  EXPECT_EQ(back.optimizer, c.optimizer);  // floats bit for bit
  EXPECT_EQ(back.slice_bytes, c.slice_bytes);
  EXPECT_EQ(back.staleness, c.staleness);
  EXPECT_EQ(back.max_gradients, 999u);
  EXPECT_EQ(back.finish_bsp_percent, 25u);
  EXPECT_EQ(back.heartbeat_interval_ms, 250u);
  EXPECT_EQ(back.heartbeat_timeout_ms, 1500u);
  EXPECT_EQ(back.connect_timeout_ms, 4000u);
  EXPECT_EQ(back.handshake_timeout_ms, 700u);
  EXPECT_EQ(back.max_pending_connections, 9u);
  EXPECT_EQ(back.max_pending_per_source, 3u);
  EXPECT_EQ(back.store, StoreKind::kAuto);
  EXPECT_EQ(back.gpudirect, GpuDirectMode::kOff);
  EXPECT_EQ(back.gid_index, 3);
  EXPECT_EQ(back.rdma_device, "rxe0");
  EXPECT_FALSE(back.pin_heap);
  EXPECT_EQ(back.role, Role::kWorker);
  EXPECT_EQ(back.port, 0);
  EXPECT_EQ(back.link_delay_us, 0u);
}

// A DSYNC_* name no node reads is said, never ignored in silence.
TEST(Settings, AVariableNoNodeReadsIsNamedWithTheSettingItWasMeantToBe) {
  const std::map<std::string, std::string> env = {
      {"DSYNC_AUTO_FINISH", "10"},          // renamed
      {"DSYNC_STALENES_POLICY", "inverse"},  // one letter left out
      {"DSYNC_LR", "0.1"},                   // a setting
      {"DSYNC_ROLE", "worker"},              // read besides the settings
      {"DSYNC_WORKER_RANK", "3"},            // handed to workers by launchers
      {"DSYNC_RXE_VM", "1"},                 // the project's scripts
      {"DSYNC_FUZZ_SECONDS", "60"},
      {"DMLC_NUM_WORKER", "2"},              // not ours to judge
      {"HOME", "/root"},
      {"DSYNC_COMPLETELY_DIFFERENT_THING", "1"},
      {"DSYNC_HOST", "a"},    // two edits from DSYNC_PORT: too far for a name this short
      {"DSYNC_BETA", "0.9"},  // as near to BETA1 as to BETA2: both named
      {"DSYNC_LRR", "0.1"},
      {"DSYNC_BAD\nNAME", "1"}};  // shown without its control character
  const std::vector<std::string> w = Config::UnknownVariables(env);
  ASSERT_EQ(w.size(), 7u) << fmt::format("{}", fmt::join(w, " | "));
  // In name order (the map's).
  EXPECT_EQ(w[0], "DSYNC_AUTO_FINISH is not a setting and is ignored: it is DSYNC_FINISH_BSP now");
  EXPECT_EQ(w[1], "DSYNC_BAD?NAME is not a setting and is ignored (README.md's table of "
                  "variables, or dsyncps ROLE --help, lists them)");
  EXPECT_EQ(w[2], "DSYNC_BETA is not a setting and is ignored: did you mean DSYNC_BETA1 or "
                  "DSYNC_BETA2?");
  EXPECT_EQ(w[3], "DSYNC_COMPLETELY_DIFFERENT_THING is not a setting and is ignored (README.md's "
                  "table of variables, or dsyncps ROLE --help, lists them)");
  EXPECT_EQ(w[4], "DSYNC_HOST is not a setting and is ignored (README.md's table of variables, "
                  "or dsyncps ROLE --help, lists them)");
  EXPECT_EQ(w[5], "DSYNC_LRR is not a setting and is ignored: did you mean DSYNC_LR?");
  EXPECT_EQ(w[6], "DSYNC_STALENES_POLICY is not a setting and is ignored: did you mean "
                  "DSYNC_STALENESS_POLICY?");
  // A process a launcher started: the launcher said it already.
  std::map<std::string, std::string> child = env;
  child["DSYNC_ENV_CHECKED"] = "1";
  EXPECT_TRUE(Config::UnknownVariables(child).empty());
  // Every setting, and its ps-lite fallbacks, is known.
  std::map<std::string, std::string> all;
  for (const ps::Setting& s : ps::Settings()) {
    all[std::string(s.env)] = "x";
    for (std::string_view f : s.fallbacks) {
      if (!f.empty()) all[std::string(f)] = "x";
    }
  }
  EXPECT_TRUE(Config::UnknownVariables(all).empty());
}

// The table every variable and flag comes from: each entry is whole and unique, its default
// reads back to itself, and the README's table of variables documents it.
TEST(Settings, EveryEntryIsWholeUniqueReadsBackAndIsDocumented) {
  std::ifstream readme(DSYNC_SOURCE_DIR "/README.md");
  const std::string doc((std::istreambuf_iterator<char>(readme)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(doc.empty());
  std::set<std::string_view> envs, flags;
  const Config defaults;
  for (const ps::Setting& s : ps::Settings()) {
    SCOPED_TRACE(std::string(s.env));
    EXPECT_TRUE(s.env.starts_with("DSYNC_"));
    EXPECT_TRUE(envs.insert(s.env).second) << "defined twice";
    EXPECT_TRUE(s.flags.starts_with("--"));
    EXPECT_TRUE(flags.insert(s.flags).second);
    EXPECT_FALSE(s.help.empty());
    ASSERT_NE(s.set, nullptr);
    ASSERT_NE(s.get, nullptr);
    EXPECT_NE(doc.find("`" + std::string(s.env) + "`"), std::string::npos) << "not in README.md";
    const std::string text = s.get(defaults);
    if (!text.empty()) {
      Config back;
      ASSERT_TRUE(s.set(back, text).ok()) << text;
      EXPECT_EQ(s.get(back), text);
    }
    EXPECT_EQ(ps::FindSetting(s.env), &s);
  }
  EXPECT_EQ(ps::FindSetting("DSYNC_NOT_A_SETTING"), nullptr);
  // An error names where the text came from.
  auto bad = Config::FromEnvironment({{"DMLC_NUM_SERVER", "two"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("DMLC_NUM_SERVER: 'two' is not a whole number"),
            std::string::npos)
      << bad.status().message();
}

TEST(ConfigEnvironment, FallsBackToPsLiteNamesButPrefersDsyncOnes) {
  auto c = Config::FromEnvironment({{"DMLC_ROLE", "worker"},
                                    {"DMLC_PS_ROOT_URI", "host-a"},
                                    {"DMLC_PS_ROOT_PORT", "8000"},
                                    {"DMLC_NUM_SERVER", "2"},
                                    {"DMLC_NUM_WORKER", "5"},
                                    {"DSYNC_NUM_WORKERS", "6"}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->role, Role::kWorker);
  EXPECT_EQ(c->scheduler_host, "host-a");
  EXPECT_EQ(c->scheduler_port, 8000);
  EXPECT_EQ(c->num_servers, 2u);
  EXPECT_EQ(c->num_workers, 6u);
  // ps-lite's and BytePS's DMLC_INTERFACE (a NIC name) before the older DMLC_NODE_HOST.
  auto nic = Config::FromEnvironment({{"DMLC_INTERFACE", "eth0"}, {"DMLC_NODE_HOST", "10.0.0.3"}});
  ASSERT_TRUE(nic.ok());
  EXPECT_EQ(nic->bind_host, "eth0");
  auto host = Config::FromEnvironment({{"DMLC_NODE_HOST", "10.0.0.3"}});
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->bind_host, "10.0.0.3");
}

TEST(ConfigEnvironment, TaskRanksPickRolesAgainWhenTheServerCountChanges) {
  auto c = Config::FromEnvironment(
      {{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "6"}, {"SLURM_STEP_ID", "0"}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->role, Role::kWorker);  // one server by default: rank 2 is a worker
  EXPECT_EQ(c->num_workers, 4u);
  c->num_servers = 2;  // as --num-servers 2 does
  ASSERT_TRUE(c->ApplyTaskRank().ok());
  EXPECT_EQ(c->role, Role::kServer);
  EXPECT_EQ(c->num_workers, 3u);
  c->num_servers = 5;
  auto st = c->ApplyTaskRank();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("6 tasks cannot hold a scheduler, 5 server(s) and a worker"),
            std::string::npos)
      << st.ToString();
}

TEST(HostList, ExpandsSlurmsCompressedForm) {
  using dsync::ps::ExpandHostList;
  using V = std::vector<std::string>;
  EXPECT_EQ(*ExpandHostList("node01"), V{"node01"});
  EXPECT_EQ(*ExpandHostList("node[01-04,07]"), (V{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(*ExpandHostList("a[8-10],gpu3"), (V{"a8", "a9", "a10", "gpu3"}));
  EXPECT_EQ(*ExpandHostList("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(*ExpandHostList("r[1-2]-n[1-2].x"), (V{"r1-n1.x", "r1-n2.x", "r2-n1.x", "r2-n2.x"}));
}

TEST(HostList, SaysWhereAListCannotBeParsed) {
  using dsync::ps::ExpandHostList;
  for (const char* bad : {"", "node[01-", "node[4-2]", "node[a]", "n[1-2],", "n1,,n2", "n[1;2]",
                          "n o", "n[]"}) {
    auto r = ExpandHostList(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("cannot parse the host list"), std::string::npos)
        << r.status().ToString();
  }
  for (const char* many : {"n[1-999999999]", "n[0-18446744073709551]", "a[1-60000],b[1-60000]"}) {
    auto huge = ExpandHostList(many);
    ASSERT_FALSE(huge.ok()) << many;
    EXPECT_NE(huge.status().message().find("names more than 65536 hosts"), std::string::npos)
        << huge.status().ToString();
  }
  auto huge = ExpandHostList("n[1-999999999]");
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("names more than 65536 hosts"), std::string::npos)
      << huge.status().ToString();
}

TEST(ConfigEnvironment, UnderSlurmTheSchedulerIsTheStepsFirstHost) {
  auto c = Config::FromEnvironment({{"SLURM_JOB_NODELIST", "node[03-05],gpu1"},
                                    {"SLURM_STEP_NODELIST", "node[04-05]"},
                                    {"SLURM_JOB_ID", "4242"},
                                    {"SLURM_STEP_ID", "1"},
                                    {"SLURM_PROCID", "3"},
                                    {"SLURM_NTASKS", "4"}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->scheduler_host, "node04");
  EXPECT_EQ(c->scheduler_port, dsync::SlurmSchedulerPort(4242, 1));
  EXPECT_GE(c->scheduler_port, 10000);
  EXPECT_LT(c->scheduler_port, 30000);
  EXPECT_NE(dsync::SlurmSchedulerPort(4242, 1), dsync::SlurmSchedulerPort(4242, 2));
  EXPECT_EQ(c->bind_host, "0.0.0.0");  // two hosts: loopback would keep them apart
  EXPECT_EQ(c->role, Role::kWorker);
  // What is given wins.
  auto given = Config::FromEnvironment({{"SLURM_JOB_NODELIST", "node[03-05]"},
                                        {"SLURM_JOB_ID", "4242"},
                                        {"SLURM_PROCID", "1"},
                                        {"DSYNC_SCHEDULER_URI", "head"},
                                        {"DSYNC_SCHEDULER_PORT", "7000"},
                                        {"DSYNC_INTERFACE", "ib0"}});
  ASSERT_TRUE(given.ok()) << given.status().ToString();
  EXPECT_EQ(given->scheduler_host, "head");
  EXPECT_EQ(given->scheduler_port, 7000);
  EXPECT_EQ(given->bind_host, "ib0");
  // One host: loopback stays.
  auto one = Config::FromEnvironment({{"SLURM_JOB_NODELIST", "node07"}, {"SLURM_PROCID", "0"}});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->scheduler_host, "127.0.0.1");
  EXPECT_EQ(one->bind_host, "127.0.0.1");
  auto bad = Config::FromEnvironment({{"SLURM_JOB_NODELIST", "node[1-"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("finding the scheduler from Slurm's node list"),
            std::string::npos)
      << bad.status().ToString();
}

TEST(ConfigEnvironment, NamesTheVariableThatIsWrong) {
  auto port = Config::FromEnvironment({{"DSYNC_SCHEDULER_PORT", "70000"}});
  ASSERT_FALSE(port.ok());
  EXPECT_NE(port.status().message().find("DSYNC_SCHEDULER_PORT"), std::string::npos);
  auto servers = Config::FromEnvironment({{"DSYNC_NUM_SERVERS", "two"}});
  ASSERT_FALSE(servers.ok());
  EXPECT_NE(servers.status().message().find("DSYNC_NUM_SERVERS"), std::string::npos);
  auto role = Config::FromEnvironment({{"DSYNC_ROLE", "master"}});
  ASSERT_FALSE(role.ok());
  EXPECT_NE(role.status().message().find("scheduler, server, worker"), std::string::npos);
  auto lr = Config::FromEnvironment({{"DSYNC_LR", "fast"}});
  ASSERT_FALSE(lr.ok());
  EXPECT_NE(lr.status().message().find("DSYNC_LR"), std::string::npos);
  auto opt = Config::FromEnvironment({{"DSYNC_OPTIMIZER", "lamb"}});
  ASSERT_FALSE(opt.ok());
  EXPECT_NE(opt.status().message().find("sgd, momentum, adam, adamw, sum"), std::string::npos);
  auto heap = Config::FromEnvironment({{"DSYNC_PIN_HEAP", "yes"}});
  ASSERT_FALSE(heap.ok());
  EXPECT_NE(heap.status().message().find("DSYNC_PIN_HEAP: 'yes' is not 0 or 1"), std::string::npos)
      << heap.status().message();
  EXPECT_TRUE(Config{}.pin_heap);
  EXPECT_FALSE(Config::FromEnvironment({{"DSYNC_PIN_HEAP", "0"}}).value().pin_heap);
}

TEST(ConfigEnvironment, TheFinishAsBspDefaultsByModeAndIsAPercentage) {
  // Unset, dsync:auto finishes its budget's last 10 % as bsp and a fixed mode delays to the end.
  Config c = Config{};
  c.sync = SyncMode::Auto();
  EXPECT_EQ(c.FinishBspPercent(), kAutoFinishPercent);
  c.sync = SyncMode::Dsync(2, 3);
  EXPECT_EQ(c.FinishBspPercent(), 0u);
  auto set = Config::FromEnvironment({{"DSYNC_SYNC", "dsync:2,3"}, {"DSYNC_FINISH_BSP", "15"}});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->FinishBspPercent(), 15u);
  auto off = Config::FromEnvironment({{"DSYNC_SYNC", "dsync:auto"}, {"DSYNC_FINISH_BSP", "0"}});
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_EQ(off->FinishBspPercent(), 0u);
  auto bad = Config::FromEnvironment({{"DSYNC_FINISH_BSP", "101"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("DSYNC_FINISH_BSP"), std::string::npos)
      << bad.status().message();
}

TEST(ConfigEnvironment, RefusesNumbersAFloatCannotHold) {
  // 0x1p-149 is a subnormal strtof reads exactly (no ERANGE); its shortest text, 1e-45, would
  // then not read back.
  for (const char* text : {"1e999", "-1e999", "1e-999", "0x1p-149", "1e-40"}) {
    auto c = Config::FromEnvironment({{"DSYNC_LR", text}});
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.status().message().find("DSYNC_LR"), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("does not fit a 32-bit float"), std::string::npos)
        << c.status().message();
  }
  auto c = Config::FromEnvironment({{"DSYNC_WEIGHT_DECAY", "1e39"}});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("DSYNC_WEIGHT_DECAY"), std::string::npos);
}

TEST(ConfigEnvironment, RefusesAnEmptyRole) {
  for (const char* name : {"DSYNC_ROLE", "DMLC_ROLE"}) {
    auto c = Config::FromEnvironment({{name, ""}});
    ASSERT_FALSE(c.ok()) << name;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(std::string(name) + " is set but empty"),
              std::string::npos)
        << c.status().message();
    EXPECT_NE(c.status().message().find("scheduler, server or worker"), std::string::npos);
  }
  // One empty name does not matter when the other gives the role.
  auto c = Config::FromEnvironment({{"DSYNC_ROLE", "server"}, {"DMLC_ROLE", ""}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->role, Role::kServer);
}

TEST(ConfigEnvironment, SlurmAndMpiRanksPickTheRole) {
  auto role_of = [](const char* rank_var, const char* rank) {
    auto c = Config::FromEnvironment({{rank_var, rank}, {"SLURM_NTASKS", "7"}, {"SLURM_STEP_ID", "3"},
                                      {"OMPI_COMM_WORLD_SIZE", "7"}, {"DSYNC_NUM_SERVERS", "2"}});
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->num_workers, 4u);
    return c->role;
  };
  EXPECT_EQ(role_of("SLURM_PROCID", "0"), Role::kScheduler);
  EXPECT_EQ(role_of("SLURM_PROCID", "2"), Role::kServer);
  EXPECT_EQ(role_of("SLURM_PROCID", "3"), Role::kWorker);
  EXPECT_EQ(role_of("OMPI_COMM_WORLD_RANK", "1"), Role::kServer);
  EXPECT_EQ(role_of("OMPI_COMM_WORLD_RANK", "6"), Role::kWorker);
  // An explicit role wins.
  auto c = Config::FromEnvironment({{"SLURM_PROCID", "0"}, {"DSYNC_ROLE", "worker"}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->role, Role::kWorker);
  auto too_few = Config::FromEnvironment({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                                          {"SLURM_STEP_ID", "0"}, {"DSYNC_NUM_SERVERS", "1"}});
  ASSERT_FALSE(too_few.ok());
  EXPECT_NE(too_few.status().message().find("at least 3 tasks"), std::string::npos);
  // Not a task of a parallel launch: a batch script (SLURM_PROCID=0, no step), a step of one
  // task, an MPI world of one.
  for (const std::map<std::string, std::string>& one :
       {std::map<std::string, std::string>{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}},
        std::map<std::string, std::string>{
            {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_STEP_ID", "2"}},
        std::map<std::string, std::string>{{"OMPI_COMM_WORLD_RANK", "0"},
                                           {"OMPI_COMM_WORLD_SIZE", "1"}}}) {
    auto single = Config::FromEnvironment(one);
    ASSERT_TRUE(single.ok()) << single.status().ToString();
    EXPECT_FALSE(single->task_rank.has_value());
    EXPECT_EQ(single->role, Role::kWorker);  // the default: a subcommand or DSYNC_ROLE says
  }
}

// A configuration that passes validation: the defaults and a token.
Config WithToken() {
  Config c;
  c.token = "t";
  return c;
}

TEST(ConfigValidate, RefusesWhatCannotRun) {
  Config c = WithToken();
  c.num_servers = 0;
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
  c = WithToken();
  c.heartbeat_timeout_ms = c.heartbeat_interval_ms;
  EXPECT_NE(c.Validate().message().find("heartbeat timeout"), std::string::npos);
  c = WithToken();
  c.finish_bsp_percent = 150;  // set in code, past the parser's check
  EXPECT_NE(c.Validate().message().find("--finish-bsp (DSYNC_FINISH_BSP) 150"), std::string::npos)
      << c.Validate().ToString();
  // Names that are none of the choices are refused where they are read.
  for (const auto& [var, text, choices] :
       {std::tuple{"DSYNC_TRANSPORT", "infiniband", "not one of tcp, rdma, auto"},
        std::tuple{"DSYNC_STORE", "gpu", "not one of cpu, cuda, auto"},
        std::tuple{"DSYNC_GPUDIRECT", "yes", "not one of auto, on, off"}}) {
    auto bad = Config::FromEnvironment({{var, text}});
    ASSERT_FALSE(bad.ok()) << var;
    EXPECT_NE(bad.status().message().find(std::string(var) + ": "), std::string::npos)
        << bad.status().message();
    EXPECT_NE(bad.status().message().find(choices), std::string::npos) << bad.status().message();
  }
  c = WithToken();
  c.transport = TransportKind::kRdma;
#if DSYNC_HAVE_RDMA
  EXPECT_TRUE(c.Validate().ok());  // whether a device is there is the transport factory's question
#else
  EXPECT_EQ(c.Validate().code(), StatusCode::kUnimplemented);
  EXPECT_NE(c.Validate().message().find("--transport tcp"), std::string::npos);
#endif
  c = WithToken();
  c.store = StoreKind::kCuda;
  EXPECT_TRUE(c.Validate().ok());  // whether a GPU is there is the store factory's question
  c = WithToken();
  c.slice_bytes = 2;
  EXPECT_FALSE(c.Validate().ok());
  c = WithToken();
  c.handshake_timeout_ms = 0;
  EXPECT_FALSE(c.Validate().ok());
}

TEST(ConfigValidate, NoTokenIsRefusedUnlessInsecureIsSaid) {
  Config c;
  const Status st = c.Validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("no cluster token: set DSYNC_TOKEN"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("--insecure (DSYNC_INSECURE=1)"), std::string::npos);
  c.insecure = true;
  EXPECT_TRUE(c.Validate().ok());
  auto env = Config::FromEnvironment({{"DSYNC_INSECURE", "1"}});
  ASSERT_TRUE(env.ok());
  EXPECT_TRUE(env->insecure);
  EXPECT_TRUE(env->Validate().ok());
  EXPECT_FALSE(Config::FromEnvironment({{"DSYNC_INSECURE", "yes"}}).ok());
  auto limits = Config::FromEnvironment({{"DSYNC_TOKEN", "t"},
                                          {"DSYNC_HANDSHAKE_TIMEOUT_MS", "1500"},
                                          {"DSYNC_MAX_PENDING_CONNECTIONS", "8"},
                                          {"DSYNC_MAX_PENDING_PER_SOURCE", "2"}});
  ASSERT_TRUE(limits.ok());
  EXPECT_EQ(limits->handshake_timeout_ms, 1500u);
  EXPECT_EQ(limits->max_pending_connections, 8u);
  EXPECT_EQ(limits->max_pending_per_source, 2u);
}

TEST(ConfigValidate, RefusesOptimizerHyperparametersOutOfRange) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    float OptimizerConfig::*field;
    float value;
    const char* expect;  // the flag, the variable and the range, all in the message
  };
  const Case cases[] = {
      {&OptimizerConfig::lr, inf, "--lr, DSYNC_LR"},
      {&OptimizerConfig::lr, nan, "a finite number >= 0"},
      {&OptimizerConfig::lr, -0.1f, "--lr"},
      {&OptimizerConfig::momentum, nan, "--momentum, DSYNC_MOMENTUM"},
      {&OptimizerConfig::momentum, -inf, "a finite number >= 0"},
      {&OptimizerConfig::beta1, 1.0f, "--beta1, DSYNC_BETA1"},
      {&OptimizerConfig::beta1, -0.5f, "in [0, 1)"},
      {&OptimizerConfig::beta2, nan, "--beta2, DSYNC_BETA2"},
      {&OptimizerConfig::eps, -1.0f, "--eps, DSYNC_EPS"},
      {&OptimizerConfig::eps, 0.0f, "a finite number > 0"},
      {&OptimizerConfig::eps, inf, "--eps"},
      {&OptimizerConfig::weight_decay, nan, "--weight-decay, DSYNC_WEIGHT_DECAY"},
      {&OptimizerConfig::weight_decay, -1.0f, "a finite number >= 0"},
      {&OptimizerConfig::dampening, 1.5f, "--dampening, DSYNC_DAMPENING"},
      {&OptimizerConfig::dampening, nan, "in [0, 1]"},
  };
  for (const Case& k : cases) {
    Config c = WithToken();
    c.optimizer.*k.field = k.value;
    const Status s = c.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << k.expect << " " << k.value;
    EXPECT_NE(s.message().find(k.expect), std::string::npos) << s.message();
  }
  Config edges = WithToken();
  edges.optimizer.lr = 0.0f;
  edges.optimizer.momentum = 0.0f;
  edges.optimizer.beta1 = 0.0f;
  edges.optimizer.beta2 = 0.9999f;
  edges.optimizer.weight_decay = 0.0f;
  EXPECT_TRUE(edges.Validate().ok()) << edges.Validate().ToString();
  // Nesterov as torch.optim.SGD takes it: the momentum optimizer, momentum > 0, no dampening.
  struct Nesterov {
    OptimizerKind kind;
    float momentum, dampening;
    const char* expect;  // empty: accepted
  };
  const Nesterov nesterov[] = {
      {OptimizerKind::kMomentum, 0.9f, 0.0f, ""},
      {OptimizerKind::kMomentum, 0.0f, 0.0f, "requires a momentum > 0 and zero dampening"},
      {OptimizerKind::kMomentum, 0.9f, 0.1f, "requires a momentum > 0 and zero dampening"},
      {OptimizerKind::kSgd, 0.9f, 0.0f, "the momentum optimizer only, not sgd"},
      {OptimizerKind::kAdamW, 0.9f, 0.0f, "the momentum optimizer only, not adamw"},
  };
  for (const Nesterov& n : nesterov) {
    Config c = WithToken();
    c.optimizer.kind = n.kind;
    c.optimizer.nesterov = true;
    c.optimizer.momentum = n.momentum;
    c.optimizer.dampening = n.dampening;
    const Status s = c.Validate();
    if (*n.expect == '\0') {
      EXPECT_TRUE(s.ok()) << s.ToString();
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(n.expect), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("DSYNC_NESTEROV"), std::string::npos) << s.message();
  }
  auto switched = Config::FromEnvironment(
      {{"DSYNC_OPTIMIZER", "momentum"}, {"DSYNC_NESTEROV", "1"}, {"DSYNC_DAMPENING", "0"}});
  ASSERT_TRUE(switched.ok()) << switched.status().ToString();
  EXPECT_TRUE(switched->optimizer.nesterov);
  EXPECT_EQ(Config::FromEnvironment({{"DSYNC_NESTEROV", "yes"}}).status().code(),
            StatusCode::kInvalidArgument);
  auto adamw = Config::FromEnvironment({{"DSYNC_OPTIMIZER", "adamw"}});
  ASSERT_TRUE(adamw.ok());
  EXPECT_EQ(adamw->optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(adamw->optimizer.weight_decay, 0.0f) << "one default for every optimizer";
  // The environment's text reaches the same check.
  auto from_env = Config::FromEnvironment({{"DSYNC_MOMENTUM", "nan"}});
  ASSERT_TRUE(from_env.ok());
  EXPECT_NE(from_env->Validate().message().find("DSYNC_MOMENTUM"), std::string::npos);
}

}  // namespace
}  // namespace dsync
