// Retention (retention.h): the rule on its own, and the engine's use of it per save.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "options.h"
#include "recovery.h"
#include "retention.h"
#include "run_dir_actions.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::SaveReq;
using alpsck_test::RandomBytes;
using alpsck_test::TempDir;

namespace {

RetainedStep At(uint64_t step, double created = 0, Metrics metrics = {}, bool pinned = false) {
  RetainedStep r;
  r.step = step;
  r.created = created;
  r.metrics = std::move(metrics);
  r.pinned = pinned;
  return r;
}

std::vector<uint64_t> Kept(const RetentionPolicy& p, const std::vector<RetainedStep>& steps) {
  const std::vector<std::string> rules = DecideRetention(p, steps);
  std::vector<uint64_t> kept;
  for (size_t i = 0; i < steps.size(); ++i)
    if (!rules[i].empty()) kept.push_back(steps[i].step);
  return kept;
}

RetentionPolicy Policy(uint32_t keep_last, const std::string& best = "") {
  RetentionPolicy p;
  const Status s = ParseKeepBest(best, &p);
  if (!s.ok()) std::fprintf(stderr, "ParseKeepBest(%s): %s\n", best.c_str(), s.message().c_str());
  p.keep_last = keep_last;
  return p;
}

std::unique_ptr<Engine> Open(const std::string& dir, uint32_t keep_last, uint64_t every_steps,
                             const std::string& best = "") {
  EngineOptions o;
  o.run_dir = dir;
  o.keep_last = keep_last;
  o.keep_every_steps = every_steps;
  o.keep_best = best;
  o.threads = 2;
  std::unique_ptr<Engine> e;
  Status s = Engine::Open(o, &e);
  if (!s.ok()) std::fprintf(stderr, "Engine::Open: %s\n", s.message().c_str());
  return e;
}

Status Save(Engine* e, uint64_t step, const Metrics& metrics, bool pin = false) {
  const std::vector<char> a = RandomBytes(4096, static_cast<uint32_t>(step));
  std::shared_ptr<SaveHandle> h;
  Status s = e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot, CommitMode::kAuto,
                     Status::Ok(), SaveNotes{metrics, "", pin}), &h);
  if (!s.ok()) return s;
  h->Wait(-1);
  return h->status();
}

std::vector<uint64_t> OnDisk(const std::string& dir) {
  std::vector<CheckpointInfo> infos;
  std::vector<uint64_t> steps;
  if (!ScanRunDir(Env::Default(), dir, false, 1, &infos).ok()) return steps;
  for (const auto& i : infos)
    if (i.state == CheckpointState::kCommitted) steps.push_back(i.step);
  return steps;
}

}  // namespace

TEST(keep_best_ranks_nan_and_infinities_worst_in_either_mode) {
  const double nan = std::nan(""), inf = HUGE_VAL;
  // min, k = 2 over [1.0, 0.5, 2.0, NaN] (Orbax's BestN sorts the raw floats: NaN could come first).
  std::vector<RetainedStep> s = {At(1, 0, {{"v", 1.0}}), At(2, 0, {{"v", 0.5}}), At(3, 0, {{"v", 2.0}}),
                                 At(4, 0, {{"v", nan}})};
  RetentionPolicy p = Policy(1, "v:min:2");
  // keep_last 1 keeps 4 (NaN), the newest healthy is 3, the best two are 2 and 1.
  CHECK(Kept(p, s) == (std::vector<uint64_t>{1, 2, 3, 4}));
  s.push_back(At(5, 0, {{"v", 3.0}}));  // newest, healthy: 3 loses "newest healthy"
  CHECK(Kept(p, s) == (std::vector<uint64_t>{1, 2, 5}));
  // max, k = 1 over [0.5, +inf, 0.7]: +inf is no best (Lightning ranks it first in max mode).
  RetentionPolicy q = Policy(1, "v:max:1");
  std::vector<RetainedStep> t = {At(1, 0, {{"v", 0.5}}), At(2, 0, {{"v", inf}}), At(3, 0, {{"v", 0.7}}),
                                 At(4, 0, {{"w", 9.0}})};
  const std::vector<std::string> rules = DecideRetention(q, t);
  CHECK(rules[0].empty());
  CHECK(rules[1].empty());  // +inf: unhealthy, not best, not newest
  CHECK(rules[2] == "keep_best v max 1 (#1)");
  CHECK(rules[3] == "newest healthy, keep_last 1");  // no value of v: kept only by the other rules
  // -inf in min mode is no best either.
  CHECK(Kept(Policy(1, "v:min:1"), {At(1, 0, {{"v", -inf}}), At(2, 0, {{"v", 5.0}}), At(3, 0, {{"x", 1.0}})}) ==
        (std::vector<uint64_t>{2, 3}));
}

TEST(keep_every_seconds_keeps_the_oldest_then_each_interval_after_the_last_kept) {
  RetentionPolicy p = Policy(1);
  p.keep_every_seconds = 60;
  std::vector<RetainedStep> s = {At(1, 0), At(2, 10), At(3, 50), At(4, 65), At(5, 130)};
  CHECK(Kept(p, s) == (std::vector<uint64_t>{1, 4, 5}));
  // Over the survivors again (a later process): the same decisions.
  CHECK(Kept(p, {At(1, 0), At(4, 65), At(5, 130)}) == (std::vector<uint64_t>{1, 4, 5}));
}

TEST(rules_are_ored_and_named) {
  RetentionPolicy p = Policy(2, "loss:min:1");
  p.keep_every_steps = 10;
  std::vector<RetainedStep> s;
  for (uint64_t i = 1; i <= 30; ++i) s.push_back(At(i, 0, {{"loss", i == 7 ? 0.1 : 1.0}}, i == 3));
  const std::vector<std::string> rules = DecideRetention(p, s);
  CHECK(rules[2] == "pinned");
  CHECK(rules[6] == "keep_best loss min 1 (#1)");
  CHECK(rules[9] == "keep_every_steps 10");
  CHECK(rules[28] == "keep_last 2");
  CHECK(rules[29] == "newest healthy, keep_last 2, keep_every_steps 10");
  CHECK(rules[10].empty() && rules[0].empty());
  // keep_last 0 keeps all, and makes the other rules moot: refused by name.
  RetentionPolicy all = Policy(0);
  CHECK(Kept(all, s).size() == s.size());
  all.keep_every_steps = 10;
  Status st = CheckRetention(all);
  CHECK(st.code() == Code::kInvalidArgument && st.message().find("keep_every_steps") != std::string::npos);
  for (const char* bad : {"loss", "loss:min", "loss:avg:2", "loss:min:0", "loss:min:x", ":min:2", "a b:min:1"}) {
    RetentionPolicy b;
    CHECK(ParseKeepBest(bad, &b).code() == Code::kInvalidArgument);
  }
  RetentionPolicy c;
  REQUIRE(ParseKeepBest("val:acc:max:3", &c).ok());  // split at the last two colons
  CHECK(c.best_metric == "val:acc" && c.best_max && c.keep_best == 3);
}

TEST(engine_retention_keeps_milestones_and_the_newest_healthy_step) {
  // The acceptance: steps 1-50, keep_last 2, keep_every_steps 10, loss 1/step, NaN at 50.
  TempDir d;
  auto e = Open(d.path(), 2, 10);
  REQUIRE(e);
  for (uint64_t s = 1; s <= 50; ++s)
    REQUIRE(Save(e.get(), s, {{"loss", s == 50 ? std::nan("") : 1.0 / static_cast<double>(s)}}).ok());
  e->Close();
  CHECK(OnDisk(d.path()) == (std::vector<uint64_t>{10, 20, 30, 40, 49, 50}));
}

TEST(engine_retention_never_expires_a_pinned_step_pinned_at_save_or_since) {
  TempDir d;
  auto e = Open(d.path(), 1, 0);
  REQUIRE(e);
  REQUIRE(Save(e.get(), 1, {}, /*pin=*/true).ok());
  REQUIRE(Save(e.get(), 2, {}).ok());
  REQUIRE(PinStep(Env::Default(), d.path(), 2).ok());  // another process pins it after the commit
  CHECK(PinStep(Env::Default(), d.path(), 77).code() == Code::kNotFound);
  for (uint64_t s = 3; s <= 6; ++s) REQUIRE(Save(e.get(), s, {}).ok());
  CHECK(OnDisk(d.path()) == (std::vector<uint64_t>{1, 2, 6}));
  REQUIRE(UnpinStep(Env::Default(), d.path(), 1).ok());
  REQUIRE(Save(e.get(), 7, {}).ok());
  e->Close();
  // The engine still counts step 1 pinned (it pinned it itself, and is not told of an unpin), so it
  // stays until a retention from a listing (or prune) sees it unpinned.
  RetentionPolicy p = Policy(1);
  CHECK(RetainNewest(Env::Default(), d.path(), p).empty());
  CHECK(OnDisk(d.path()) == (std::vector<uint64_t>{2, 7}));
}

TEST(engine_keep_best_holds_across_a_reopen) {
  TempDir d;
  {
    auto e = Open(d.path(), 1, 0, "val:min:2");
    REQUIRE(e);
    const double vals[] = {5, 1, 4, 2, std::nan(""), 3};
    for (uint64_t s = 1; s <= 6; ++s) REQUIRE(Save(e.get(), s, {{"val", vals[s - 1]}}).ok());
    e->Close();
  }
  CHECK(OnDisk(d.path()) == (std::vector<uint64_t>{2, 4, 6}));
  // A new process reads the kept ones' metrics back from their manifests: 2 and 4 stay the best.
  auto e = Open(d.path(), 1, 0, "val:min:2");
  REQUIRE(e);
  REQUIRE(Save(e.get(), 7, {{"val", 9.0}}).ok());
  REQUIRE(Save(e.get(), 8, {{"val", 1.5}}).ok());
  e->Close();
  CHECK(OnDisk(d.path()) == (std::vector<uint64_t>{2, 8}));
}

TEST(engine_refuses_moot_or_malformed_retention_by_name) {
  TempDir d;
  EngineOptions o;
  o.run_dir = d.path();
  o.keep_last = 0;
  o.keep_best = "loss:min:2";
  std::unique_ptr<Engine> e;
  Status s = Engine::Open(o, &e);
  CHECK(s.code() == Code::kInvalidArgument && s.message().find("keep_best") != std::string::npos);
  o.keep_last = 1;
  o.keep_best = "loss:median:2";
  s = Engine::Open(o, &e);
  CHECK(s.code() == Code::kInvalidArgument && s.message().find("median") != std::string::npos);
}

ALPSCK_TEST_MAIN()
