// The engine: concurrent saves, both memory modes, commit ordering ("newest wins"), retention
// and recycling, back-pressure, and failures that never damage earlier checkpoints.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <mutex>
#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "commit.h"
#include "engine.h"
#include "env_fault.h"
#include "env_record.h"
#include "file_io.h"
#include "options.h"
#include "platform.h"
#include "recovery.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::SaveReq;
using alpsck_test::Exists;
using alpsck_test::RandomBytes;
using alpsck_test::TempDir;

namespace {

std::unique_ptr<Engine> Open(const std::string& dir, Env* env = nullptr, uint32_t max_in_flight = 2,
                             uint32_t keep_last = 3, uint64_t chunk = 64 << 10, bool one_history = false) {
  EngineOptions o;
  o.run_dir = dir;
  o.chunk_bytes = chunk;
  o.max_in_flight = max_in_flight;
  o.keep_last = keep_last;
  o.threads = 3;
  o.env = env;
  o.one_history = one_history;
  std::unique_ptr<Engine> e;
  Status s = Engine::Open(o, &e);
  if (!s.ok()) std::fprintf(stderr, "Engine::Open: %s\n", s.message().c_str());
  return e;
}

// One snapshot save of extent "a", waited for: its final status (and result).
Status SaveOne(Engine* e, uint64_t step, const std::vector<char>& a, SaveResult* r = nullptr) {
  std::shared_ptr<SaveHandle> h;
  Status s = e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h);
  if (!s.ok()) return s;
  h->Wait(-1);
  if (r) *r = h->result();
  return h->status();
}

// The slots Open's engine (max_in_flight 2, 3 writers, 64 KiB chunks) sizes its pool to for a
// save of `bytes` in one extent.
uint64_t PoolSlots(uint64_t bytes) { return 2 * (bytes / (64 << 10)); }

// Polls done() every millisecond until it holds or `seconds` pass; returns done() at the end.
template <typename Done>
bool WaitFor(int seconds, Done done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return done();
}

// Every fdatasync sleeps delay_us first (and succeeds): saves stay in flight that long.
void SlowFDataSync(FaultEnv* env, uint64_t delay_us) {
  FaultRule slow;
  slow.op = FaultRule::Op::kFDataSync;
  slow.error = 0;
  slow.delay_us = delay_us;
  slow.count = UINT64_MAX;
  env->AddRule(slow);
}

// The first write to a file whose path holds `gated` waits until Release() (at most 60 s): a save
// held back by order, not by a delay a loaded machine could outrun.
class GatedEnv : public FaultEnv {
 public:
  explicit GatedEnv(std::string gated) : gated_(std::move(gated)) {}
  ssize_t PWrite(int fd, const void* buf, size_t n, uint64_t off) override {
    const bool gated = PathOf(fd).find(gated_) != std::string::npos;
    {
      std::unique_lock<std::mutex> l(mu_);
      if (gated && !held_one_) {
        held_one_ = true;
        cv_.wait_for(l, std::chrono::seconds(60), [&] { return released_; });
      }
    }
    return FaultEnv::PWrite(fd, buf, n, off);
  }
  void Release() {
    std::lock_guard<std::mutex> l(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  const std::string gated_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_one_ = false, released_ = false;
};

std::string Latest(const std::string& dir) {
  std::string s;
  ReadSmallFile(Env::Default(), JoinPath(dir, kLatestName), 100, &s);
  return s;
}

// Reads extent `name` of the checkpoint at step and compares it with want.
bool Matches(const std::string& dir, uint64_t step, const std::string& name, const std::vector<char>& want) {
  std::unique_ptr<ShardReader> r;
  if (!ShardReader::Open(Env::Default(), JoinPath(JoinPath(dir, StepDirName(step)), ShardFileName(0)), true, &r).ok())
    return false;
  const auto& ex = r->index().layout.extents;
  std::vector<char> got(want.size());
  std::vector<char*> dsts(ex.size(), nullptr);
  for (size_t k = 0; k < ex.size(); ++k)
    if (ex[k].name == name && ex[k].size == want.size()) dsts[k] = got.data();
  Status s = r->Read(dsts, 2);
  return s.ok() && got == want;
}

}  // namespace

TEST(save_copy_and_zero_copy_round_trip) {
  TempDir d;
  auto e = Open(d.path());
  REQUIRE(e);
  auto a = RandomBytes(300001, 1), b = RandomBytes(17, 2);
  std::vector<char> empty;
  for (bool copy : {true, false}) {
    uint64_t step = copy ? 10 : 20;
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(step, {{"a", a.data(), a.size()}, {"b", b.data(), b.size()}, {"e", empty.data(), 0}}, "{}",
                    copy ? SaveMode::kSnapshot : SaveMode::kZeroCopy), &h).ok());
    REQUIRE(h->Wait(-1));
    CHECK(h->status().ok());
    CHECK_EQ(h->result().path, JoinPath(d.path(), StepDirName(step)));
    CHECK(Matches(d.path(), step, "a", a));
    CHECK(Matches(d.path(), step, "b", b));
  }
  CHECK_EQ(Latest(d.path()), std::string("20\n"));
  CHECK_EQ(e->published_step(), int64_t{20});
}

TEST(copy_mode_snapshot_is_isolated_from_later_mutation) {
  TempDir d;
  auto e = Open(d.path());
  REQUIRE(e);
  auto a = RandomBytes(1 << 20, 3);
  const auto orig = a;
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  std::memset(a.data(), 0, a.size());  // the training step mutates right after save returns
  REQUIRE(h->Wait(-1));
  CHECK(h->status().ok());
  CHECK(Matches(d.path(), 1, "a", orig));
}

TEST(a_run_dir_the_engine_creates_is_made_durable_in_its_parent_before_a_save_inside_is) {
  // Else a power loss after the first commit could take the run dir's name, and every checkpoint with it.
  // The fsync is not Open's: the committer does it while the first save is written (dir_sync.h).
  TempDir d;
  const std::string run = JoinPath(d.path(), "run");
  RecordingEnv rec;
  auto e = Open(run, &rec);
  REQUIRE(e);
  const std::vector<char> a = RandomBytes(100 << 10, 5);
  REQUIRE(SaveOne(e.get(), 1, a).ok());
  const std::vector<RecordedOp> ops = rec.Ops();
  size_t mk = ops.size(), synced = ops.size(), committed = ops.size();
  int parent_fd = -1;
  for (size_t i = 0; i < ops.size(); ++i) {
    const RecordedOp& op = ops[i];
    if (op.kind == RecordedOp::Kind::kMkdir && op.path == run) mk = i;
    if (op.kind == RecordedOp::Kind::kOpen && op.path == d.path()) parent_fd = op.fd;
    if (op.kind == RecordedOp::Kind::kFSync && parent_fd >= 0 && op.fd == parent_fd && synced == ops.size()) synced = i;
    if (op.kind == RecordedOp::Kind::kRename && op.path2 == JoinPath(run, StepDirName(1))) committed = i;
  }
  REQUIRE(mk < ops.size() && committed < ops.size());
  CHECK(mk < synced && synced < committed);
  // Opened again on the existing directory: nothing created, nothing more to sync there.
  e.reset();
  RecordingEnv again;
  REQUIRE(Open(run, &again));
  for (const RecordedOp& op : again.Ops()) CHECK(!(op.kind == RecordedOp::Kind::kOpen && op.path == d.path()));
}

TEST(a_run_dirs_name_that_cannot_be_made_durable_fails_the_save_and_the_next_one_tries_again) {
  TempDir d;
  const std::string run = JoinPath(d.path(), "run");
  FaultEnv env;
  FaultRule dir;  // the first fsync an engine on a new run dir makes is of its parent (nothing else is synced yet)
  dir.op = FaultRule::Op::kFSync;
  dir.count = 2;  // in the background, and again when the save's shard is sealed
  env.AddRule(dir);
  auto e = Open(run, &env);
  REQUIRE(e);
  const std::vector<char> a = RandomBytes(100 << 10, 6);
  const Status s = SaveOne(e.get(), 1, a);
  CHECK(!s.ok());
  CHECK(s.message().find("fsync directory " + d.path()) != std::string::npos);
  CHECK_EQ(env.FaultsInjected(), uint64_t{2});
  CHECK(!Matches(run, 1, "a", a));
  REQUIRE(SaveOne(e.get(), 1, a).ok());  // the fsync is tried again, and succeeds
  CHECK(Matches(run, 1, "a", a));
}

TEST(empty_state_commits) {
  TempDir d;
  auto e = Open(d.path());
  REQUIRE(e);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(5, {}, "{\"only\":\"meta\"}", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->status().ok());
  std::vector<CheckpointInfo> infos;
  REQUIRE(ScanRunDir(Env::Default(), d.path(), true, 2, &infos).ok());
  REQUIRE(infos.size() == 1);
  CHECK(infos[0].state == CheckpointState::kCommitted);
}

TEST(out_of_order_completion_never_publishes_an_older_step) {
  TempDir d;
  GatedEnv env("step-000000100");  // one chunk write of step 100 waits, so step 200 commits first
  auto e = Open(d.path(), &env, 2, 0);
  REQUIRE(e);
  auto a = RandomBytes(256 << 10, 4), b = RandomBytes(1000, 5);
  std::shared_ptr<SaveHandle> h100, h200;
  REQUIRE(e->Save(SaveReq(100, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h100).ok());
  REQUIRE(e->Save(SaveReq(200, {{"b", b.data(), b.size()}}, "", SaveMode::kSnapshot), &h200).ok());
  REQUIRE(h200->Wait(-1));
  CHECK(!h100->Done());  // really out of order
  env.Release();
  CHECK_EQ(Latest(d.path()), std::string("200\n"));
  REQUIRE(h100->Wait(-1));
  CHECK(h100->status().ok());
  CHECK_EQ(Latest(d.path()), std::string("200\n"));  // the late, older commit did not win
  CHECK(Exists(JoinPath(d.path(), StepDirName(100))));
  CHECK(Matches(d.path(), 100, "a", a));
}

TEST(max_in_flight_applies_back_pressure) {
  TempDir d;
  FaultEnv env;
  SlowFDataSync(&env, 100000);
  auto e = Open(d.path(), &env, 2, 0);
  REQUIRE(e);
  auto a = RandomBytes(4096, 6);
  std::vector<std::shared_ptr<SaveHandle>> hs(5);
  for (uint64_t s = 0; s < 5; ++s) {
    REQUIRE(e->Save(SaveReq(s + 1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &hs[s]).ok());
    CHECK(e->in_flight() <= 2);
  }
  e->WaitAll();
  for (auto& h : hs) CHECK(h->Done() && h->status().ok());
  CHECK_EQ(e->in_flight(), 0u);
}

TEST(retention_keeps_newest_and_recycles) {
  TempDir d;
  auto e = Open(d.path(), nullptr, 2, 2);
  REQUIRE(e);
  auto a = RandomBytes(200000, 7);
  for (uint64_t s = 1; s <= 6; ++s) {
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(s * 10, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    REQUIRE(h->Wait(-1));
    CHECK(h->status().ok());
    CHECK(h->result().warning.empty());
  }
  std::vector<CheckpointInfo> infos;
  REQUIRE(ScanRunDir(Env::Default(), d.path(), true, 2, &infos).ok());
  REQUIRE(infos.size() == 2);
  CHECK_EQ(infos[0].step, uint64_t{50});
  CHECK_EQ(infos[1].step, uint64_t{60});
  CHECK(infos[1].state == CheckpointState::kCommitted);
  std::vector<std::string> names;
  Env::Default()->ListDir(d.path(), &names);
  size_t free_dirs = 0;
  for (auto& n : names) free_dirs += n.rfind("free-", 0) == 0;
  CHECK(free_dirs >= 1 && free_dirs <= 2);
}

TEST(already_committed_step_is_skipped) {
  TempDir d;
  auto e = Open(d.path());
  REQUIRE(e);
  auto a = RandomBytes(1000, 8), b = RandomBytes(1000, 9);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(7, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  REQUIRE(e->Save(SaveReq(7, {{"a", b.data(), b.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->result().skipped);
  CHECK(Matches(d.path(), 7, "a", a));
}

TEST(reopen_sees_committed_and_reuses_abandoned_tmp) {
  TempDir d;
  auto a = RandomBytes(5000, 10);
  {
    auto e = Open(d.path());
    REQUIRE(e);
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(3, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    REQUIRE(h->Wait(-1));
  }
  REQUIRE(Env::Default()->Mkdir(JoinPath(d.path(), "step-000000009.tmp")) == 0);  // a crash left it
  auto e = Open(d.path());
  REQUIRE(e);
  CHECK_EQ(e->published_step(), int64_t{3});
  CHECK(!Exists(JoinPath(d.path(), "step-000000009.tmp")));
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(3, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->result().skipped);
}

// Names in dir starting with prefix.
std::vector<std::string> NamesWith(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> names, out;
  Env::Default()->ListDir(dir, &names);
  for (auto& n : names)
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  std::sort(out.begin(), out.end());
  return out;
}

// Saves steps with data RandomBytes(1000 + step, seed + step) through a fresh engine.
void SaveSteps(const std::string& dir, std::initializer_list<uint64_t> steps, uint32_t seed) {
  auto e = Open(dir, nullptr, 2, 0);
  REQUIRE(e);
  for (uint64_t step : steps) {
    auto a = RandomBytes(1000 + step, seed + static_cast<uint32_t>(step));
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    REQUIRE(h->Wait(-1));
    REQUIRE(h->status().ok());
  }
}

TEST(a_resumed_run_retires_the_abandoned_newer_checkpoints_and_saves_their_steps_anew) {
  // The run restored step 2 (say step 3 and 4 were corrupt, or an older step was restored on
  // purpose): 3 and 4 belong to an abandoned future. Without Supersede, save(3) was a silent
  // no-op and restore kept finding the abandoned step 4.
  TempDir d;
  SaveSteps(d.path(), {1, 2, 3, 4}, 100);
  REQUIRE(Env::Default()->Unlink(JoinPath(JoinPath(d.path(), StepDirName(4)), kManifestName)) == 0);  // half-gone
  auto e = Open(d.path(), nullptr, 2, 3);
  REQUIRE(e);
  CHECK_EQ(e->published_step(), int64_t{4});  // from LATEST
  e->ContinueFrom(2);
  std::vector<std::pair<uint64_t, std::string>> retired;
  REQUIRE(e->Supersede(3, &retired).ok());
  REQUIRE(retired.size() == 2u);
  CHECK_EQ(retired[0].first, uint64_t{4});  // newest first
  CHECK_EQ(retired[1].first, uint64_t{3});
  const auto sup = NamesWith(d.path(), kSupersededPrefix);
  REQUIRE(sup.size() == 2u);
  CHECK(sup[0].rfind(std::string(kSupersededPrefix) + StepDirName(3) + "-", 0) == 0);
  CHECK(Exists(JoinPath(retired[1].second, ShardFileName(0))));  // moved, not deleted
  CHECK(!Exists(JoinPath(d.path(), StepDirName(3))) && !Exists(JoinPath(d.path(), StepDirName(4))));
  CHECK_EQ(e->published_step(), int64_t{2});
  CHECK_EQ(Latest(d.path()), std::string("2\n"));  // the hint no longer names a retired step
  auto fresh = RandomBytes(5000, 7);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(3, {{"a", fresh.data(), fresh.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  REQUIRE(h->status().ok());
  CHECK(!h->result().skipped);
  CHECK(Matches(d.path(), 3, "a", fresh));
  CHECK_EQ(Latest(d.path()), std::string("3\n"));
  // Retention counts this history only: 1, 2, 3 kept (keep_last 3), nothing of the old one.
  std::vector<CheckpointInfo> infos;
  REQUIRE(ScanRunDir(Env::Default(), d.path(), false, 1, &infos).ok());
  std::vector<uint64_t> steps;
  for (auto& i : infos) steps.push_back(i.step);
  CHECK(steps == (std::vector<uint64_t>{1, 2, 3}));
  // Idempotent, and the restored step stays: saving it again is still a no-op.
  REQUIRE(e->Supersede(2, &retired).ok());
  CHECK(retired.empty());
  REQUIRE(e->Save(SaveReq(2, {{"a", fresh.data(), fresh.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->result().skipped);
  CHECK(Matches(d.path(), 2, "a", RandomBytes(1002, 102)));
}

TEST(a_run_that_restored_nothing_retires_what_its_first_save_would_land_beside) {
  TempDir d;
  SaveSteps(d.path(), {5, 10, 15}, 200);
  auto e = Open(d.path(), nullptr, 2, 0);
  REQUIRE(e);
  std::vector<std::pair<uint64_t, std::string>> retired;
  REQUIRE(e->Supersede(10, &retired).ok());  // no ContinueFrom: steps >= 10 go, 5 stays
  REQUIRE(retired.size() == 2u);
  CHECK(Exists(JoinPath(d.path(), StepDirName(5))));
  CHECK_EQ(e->published_step(), int64_t{5});
  // ContinueFrom(-1): every checkpoint found belongs to an abandoned history.
  auto e2 = Open(d.path() + "/sub", nullptr, 2, 0);
  REQUIRE(e2);
  e.reset();
  SaveSteps(d.path() + "/sub", {1, 2}, 300);
  e2.reset();
  e2 = Open(d.path() + "/sub", nullptr, 2, 0);
  REQUIRE(e2);
  e2->ContinueFrom(-1);
  REQUIRE(e2->Supersede(7, &retired).ok());
  CHECK_EQ(retired.size(), size_t{2});
  CHECK_EQ(e2->published_step(), int64_t{-1});
  CHECK(!Exists(JoinPath(d.path() + "/sub", kLatestName)));
}

TEST(a_found_step_is_still_skipped_without_supersede_and_a_refused_retirement_fails_loudly) {
  TempDir d;
  SaveSteps(d.path(), {1, 2}, 400);
  FaultEnv env;
  FaultRule deny;
  deny.op = FaultRule::Op::kRename;
  deny.path_contains = StepDirName(2);
  deny.error = EACCES;
  deny.count = 1;
  env.AddRule(deny);
  auto e = Open(d.path(), &env, 2, 0);
  REQUIRE(e);
  auto a = RandomBytes(300, 9);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->result().skipped);  // the engine alone never replaces a checkpoint it did not write
  e->ContinueFrom(1);
  std::vector<std::pair<uint64_t, std::string>> retired;
  Status s = e->Supersede(2, &retired);
  CHECK(!s.ok());
  CHECK(s.message().find("abandoned history") != std::string::npos);
  CHECK(Matches(d.path(), 2, "a", RandomBytes(1002, 402)));  // nothing lost
  REQUIRE(e->Supersede(2, &retired).ok());  // the fault was once: now it goes
  CHECK_EQ(retired.size(), size_t{1});
}

TEST(a_rollback_in_the_same_process_saves_the_steps_again_and_retires_its_own_newer_ones) {
  // Found by a review: only directories found at Open were retired, so after save 1-6 and a
  // restore of step 3 in the same process, saves of 4-6 were skipped and restore kept the old 6.
  TempDir d;
  auto e = Open(d.path(), nullptr, 2, 0, 64 << 10, /*one_history=*/true);
  REQUIRE(e);
  std::shared_ptr<SaveHandle> h;
  auto save = [&](uint64_t step, uint32_t seed) {
    auto a = RandomBytes(1000 + step, seed + static_cast<uint32_t>(step));
    REQUIRE(e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    REQUIRE(h->Wait(-1));
    REQUIRE(h->status().ok());
    CHECK(!h->result().skipped);
  };
  for (uint64_t s = 1; s <= 6; ++s) save(s, 100);
  CHECK(e->TakeRetired().empty());
  e->ContinueFrom(3);
  save(4, 200);  // Save retires 4-6 itself (one_history)
  auto retired = e->TakeRetired();
  REQUIRE(retired.size() == 3u);
  CHECK(retired[0].first == 6 && retired[2].first == 4);
  CHECK(e->TakeRetired().empty());  // handed out once
  CHECK(Matches(d.path(), 4, "a", RandomBytes(1004, 204)));
  CHECK(Matches(d.path(), 3, "a", RandomBytes(1003, 103)));  // the restored step stays
  CHECK(!Exists(JoinPath(d.path(), StepDirName(5))) && !Exists(JoinPath(d.path(), StepDirName(6))));
  e->ContinueFrom(2);  // a second rollback retires the restored 3 and the new 4 too
  save(3, 300);
  CHECK_EQ(e->TakeRetired().size(), size_t{2});
  CHECK(Matches(d.path(), 3, "a", RandomBytes(1003, 303)));
  CHECK_EQ(e->published_step(), int64_t{3});
  CHECK_EQ(Latest(d.path()), std::string("3\n"));
  CHECK_EQ(NamesWith(d.path(), kSupersededPrefix).size(), size_t{5});
}

TEST(a_superseded_name_left_by_an_earlier_job_is_not_reused) {
  // Found by a review: the name was <pid>-<seq> with seq from 0 in every engine, so an earlier
  // job with the same pid (common in containers) left it taken and every save of the step failed.
  TempDir d;
  SaveSteps(d.path(), {1, 2}, 500);
  for (int seq = 0; seq < 2; ++seq) {
    const std::string taken = JoinPath(d.path(), std::string(kSupersededPrefix) + StepDirName(2) + "-" +
                                                     std::to_string(::getpid()) + "-" + std::to_string(seq));
    REQUIRE(Env::Default()->Mkdir(taken) == 0);
    REQUIRE(WriteFileSynced(Env::Default(), JoinPath(taken, "x"), "x").ok());  // non-empty: ENOTEMPTY
  }
  auto e = Open(d.path(), nullptr, 2, 0, 64 << 10, /*one_history=*/true);
  REQUIRE(e);
  e->ContinueFrom(1);
  auto a = RandomBytes(777, 3);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1) && h->status().ok());
  CHECK(Matches(d.path(), 2, "a", a));
  CHECK_EQ(NamesWith(d.path(), kSupersededPrefix).size(), size_t{3});
}

TEST(the_default_staging_pool_follows_the_largest_save_and_external_fills_stay_in_its_first_mapping) {
  // A first save before the optimizer has state is a third of the later ones: the pool sized for
  // it made every later save wait for the writers (a longer stall). It now grows; an external
  // fill (the GPU path: slots named by their offset from staging_base, that mapping registered
  // with CUDA) still only ever gets slots of the first mapping.
  TempDir d;
  auto e = Open(d.path(), nullptr, 2, 0);  // 64 KiB chunks, 3 writers
  REQUIRE(e);
  const uint64_t chunk = e->chunk_bytes();
  auto small = RandomBytes(chunk, 1), big = RandomBytes(10 * chunk, 2);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(1, {{"a", small.data(), small.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1) && h->status().ok());
  CHECK_EQ(e->staging_slots(), uint64_t{2 * 1});
  const uint64_t first_bytes = e->staging_bytes();
  char* const base = e->staging_base();
  REQUIRE(e->Save(SaveReq(2, {{"a", big.data(), big.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1) && h->status().ok());
  CHECK_EQ(e->staging_slots(), uint64_t{2 * 10});
  CHECK_EQ(e->staging_bytes(), first_bytes);  // the first mapping is unchanged
  CHECK(e->staging_base() == base);
  CHECK(Matches(d.path(), 2, "a", big));
  for (int i = 0; i < 3; ++i)  // the old and the new slots serve saves alike
    REQUIRE(e->Save(SaveReq(3 + i, {{"a", big.data(), big.size()}}, "", SaveMode::kSnapshotOverlap), &h).ok());
  e->WaitAll();
  CHECK(Matches(d.path(), 5, "a", big));
  std::shared_ptr<ExternalFill> f;
  REQUIRE(e->Save(SaveReq(9, {{"a", nullptr, big.size()}}, "{}", SaveMode::kExternal, CommitMode::kAuto), &h, &f).ok());
  for (uint64_t i = 0; i < f->num_chunks(); ++i) {
    char* slot = f->Acquire(i, true);  // 10 chunks through the 2 first-mapping slots: pipelined
    REQUIRE(slot);
    CHECK(slot >= base && slot + chunk <= base + first_bytes);
    std::memcpy(slot, big.data() + i * chunk, f->layout().chunk_len(i));
    REQUIRE(f->Submit(i, slot).ok());
  }
  f->Finish();
  REQUIRE(h->Wait(60) && h->status().ok());
  CHECK(Matches(d.path(), 9, "a", big));
  CHECK_EQ(e->staging_slots(), uint64_t{2 * 10});  // external fills never grow it
}

TEST(disk_full_fails_loudly_and_keeps_earlier_checkpoints) {
  TempDir d;
  FaultEnv env;
  auto e = Open(d.path(), &env, 2, 3);
  REQUIRE(e);
  auto a = RandomBytes(300000, 11);
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  REQUIRE(h->status().ok());
  FaultRule full;
  full.op = FaultRule::Op::kPWrite;
  full.error = ENOSPC;
  full.skip = 2;
  full.count = UINT64_MAX;
  env.AddRule(full);
  REQUIRE(e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->status().code() == Code::kNoSpace);
  CHECK(h->status().message().find("step-000000002") != std::string::npos);
  CHECK(!Exists(JoinPath(d.path(), "step-000000002")));
  CHECK(!Exists(JoinPath(d.path(), "step-000000002.tmp")));
  CHECK_EQ(Latest(d.path()), std::string("1\n"));
  CHECK(Matches(d.path(), 1, "a", a));
  env.ClearRules();  // space comes back: saving works again
  REQUIRE(e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
  REQUIRE(h->Wait(-1));
  CHECK(h->status().ok());
  CHECK(Matches(d.path(), 2, "a", a));
}

// A step whose directory cannot even be made (ENOSPC at mkdir) fails with that error: it used to
// read "step N is committed, durability unconfirmed", since no attempt directory and no abort on
// disk looks like a commit retention already expired.
TEST(a_step_whose_directory_cannot_be_made_fails_and_is_not_called_committed) {
  TempDir d;
  FaultEnv env;
  auto e = Open(d.path(), &env, 2, 3);
  REQUIRE(e);
  FaultRule mk;
  mk.op = FaultRule::Op::kMkdir;
  mk.error = ENOSPC;
  mk.count = 1;
  env.AddRule(mk);
  auto a = RandomBytes(1000, 3);
  std::shared_ptr<SaveHandle> h;
  Status s = e->Save(SaveReq(1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h);
  CHECK(s.code() == Code::kNoSpace);
  CHECK(s.message().find("committed") == std::string::npos);
  CHECK(s.message().find("step-000000001.tmp") != std::string::npos);
  CHECK(!Exists(JoinPath(d.path(), "step-000000001")));
  CHECK(SaveOne(e.get(), 1, a).ok());  // the disk has room again: the step saves
  CHECK(Matches(d.path(), 1, "a", a));
}

TEST(a_failed_save_can_be_retried_the_moment_its_handle_completes) {
  // The step stops being "in flight" before its handle completes, so a caller that saw the
  // failure may save the same step again at once (it used to race: "already being saved").
  TempDir d;
  FaultEnv env;
  auto e = Open(d.path(), &env, 2, 2);
  REQUIRE(e);
  auto a = RandomBytes(100000, 5);
  FaultRule full;
  full.op = FaultRule::Op::kPWrite;
  full.error = ENOSPC;
  full.count = UINT64_MAX;
  for (uint64_t step = 1; step <= 60; ++step) {
    env.AddRule(full);
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    REQUIRE(h->Wait(-1));
    CHECK(h->status().code() == Code::kNoSpace);
    env.ClearRules();
    Status s = e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h);
    if (!s.ok()) {
      std::fprintf(stderr, "retry of step %llu: %s\n", static_cast<unsigned long long>(step), s.message().c_str());
      CHECK(s.ok());
      break;
    }
    REQUIRE(h->Wait(-1));
    CHECK(h->status().ok());
  }
  CHECK(Matches(d.path(), 60, "a", a));
}

TEST(fsync_and_rename_failures_never_publish) {
  struct Case {
    FaultRule::Op op;
    const char* path;
  };
  for (Case c : {Case{FaultRule::Op::kFDataSync, "rank-"}, Case{FaultRule::Op::kFSync, "MANIFEST"},
                 Case{FaultRule::Op::kRename, "step-000000002.tmp"}, Case{FaultRule::Op::kFAllocate, ""}}) {
    TempDir d;
    FaultEnv env;
    auto e = Open(d.path(), &env, 2, 3);
    REQUIRE(e);
    auto a = RandomBytes(100000, 12);
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    REQUIRE(h->Wait(-1));
    FaultRule r;
    r.op = c.op;
    r.path_contains = c.path;
    r.error = c.op == FaultRule::Op::kFAllocate ? ENOSPC : EIO;
    env.AddRule(r);
    Status s = e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h);
    if (s.ok()) {
      REQUIRE(h->Wait(-1));
      s = h->status();
    }
    CHECK(!s.ok());
    CHECK(!Exists(JoinPath(d.path(), "step-000000002")));
    CHECK_EQ(Latest(d.path()), std::string("1\n"));
    std::vector<CheckpointInfo> infos;
    REQUIRE(ScanRunDir(Env::Default(), d.path(), true, 2, &infos).ok());
    REQUIRE(!infos.empty());
    CHECK(infos.back().step == 1 && infos.back().state == CheckpointState::kCommitted);
  }
}

TEST(a_failed_fsync_after_the_commit_rename_fails_the_save_and_says_the_step_is_committed) {
  // The one outcome the commit cannot take back: the rename happened, the fsync of RUN_DIR that
  // makes it durable failed. The save is not reported durable, and its error says what is on disk.
  TempDir d;
  FaultEnv env;
  auto e = Open(d.path(), &env, 2, 3);
  REQUIRE(e);
  auto a = RandomBytes(100000, 12);
  FaultRule r;  // the commit's fsyncs: the manifest, step-N.tmp/, then RUN_DIR (the third)
  r.op = FaultRule::Op::kFSync;
  r.skip = 2;
  env.AddRule(r);
  const Status s = SaveOne(e.get(), 1, a);
  CHECK(s.code() == Code::kIoError);
  CHECK(s.message().find("step 1 is committed, durability unconfirmed") != std::string::npos);
  CHECK(Exists(JoinPath(JoinPath(d.path(), StepDirName(1)), kManifestName)));
}

TEST(options_take_their_defaults_from_the_table_and_out_of_range_values_are_refused_by_name) {
  EngineOptions o;
  CHECK_EQ(o.threads, static_cast<uint32_t>(EngineOptionSpec("threads").default_value));
  CHECK_EQ(o.keep_last, static_cast<uint32_t>(EngineOptionSpec("keep_last").default_value));
  CHECK(CheckEngineOptions(o).ok());
  TempDir d;
  struct Case {
    std::function<void(EngineOptions*)> set;
    const char* says;
  };
  const Case cases[] = {
      {[](EngineOptions* x) { x->threads = 0; }, "threads is 0: it must be between 1 and 1024"},
      {[](EngineOptions* x) { x->threads = 5000; }, "threads is 5000"},
      {[](EngineOptions* x) { x->max_in_flight = 0; }, "max_in_flight is 0"},
      {[](EngineOptions* x) { x->chunk_bytes = 2ull << 30; }, "chunk_bytes is 2147483648"},
      {[](EngineOptions* x) { x->commit_timeout_s = 0; }, "commit_timeout_s is 0"},
      {[](EngineOptions* x) { x->commit_timeout_s = 1e12; }, "commit_timeout_s is 1000000000000"},
      {[](EngineOptions* x) { x->commit_timeout_s = std::nan(""); }, "commit_timeout_s is not a number"},
      {[](EngineOptions* x) { x->pin_cpus = {0, -1}; }, "pin_cpus holds -1"},
      {[](EngineOptions* x) { x->copy_threads = 100000; }, "copy_threads is 100000: it must be between 0 and 1024 (0: auto"},
  };
  for (const Case& c : cases) {
    EngineOptions x;
    x.run_dir = d.path();
    c.set(&x);
    std::unique_ptr<Engine> e;
    const Status s = Engine::Open(x, &e);
    CHECK(s.code() == Code::kInvalidArgument);
    if (s.message().find(c.says) == std::string::npos) std::fprintf(stderr, "got: %s\n", s.message().c_str());
    CHECK(s.message().find(c.says) != std::string::npos);
    CHECK(!e);
  }
}

TEST(numa_node_places_the_staging_pool_and_an_unknown_node_is_refused_before_anything_is_created) {
  const std::vector<int> nodes = CpuNumaNodes();
  REQUIRE(!nodes.empty());
  TempDir d;
  {
    EngineOptions o;
    o.run_dir = d.sub("unknown");
    o.numa_node = 1023;
    std::unique_ptr<Engine> e;
    const Status s = Engine::Open(o, &e);
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK(s.message().find("numa_node 1023 is not a NUMA node with CPUs on this machine (those: " +
                           std::to_string(nodes.front())) != std::string::npos);
    CHECK(!e);
    CHECK(!Exists(d.sub("unknown")));  // refused before the run directory was made
  }
  PrefaultedMemory probe;
  REQUIRE(probe.Map(PageSize()));
  if (PreferNumaNode(probe.data(), probe.size(), nodes.back()) == -ENOSYS) {  // qemu-user: no mbind
    EngineOptions o;
    o.run_dir = d.sub("nombind");
    o.numa_node = nodes.back();
    std::unique_ptr<Engine> e;
    const Status s = Engine::Open(o, &e);
    CHECK(!s.ok() && !e);
    CHECK(s.message().find("numa_node " + std::to_string(nodes.back()) + ": place memory on that node (mbind)") !=
          std::string::npos);
    CHECK(!Exists(d.sub("nombind")));
    return;
  }
  for (const int node : {-1, nodes.back()}) {
    EngineOptions o;
    o.run_dir = d.sub("run" + std::to_string(node + 1));
    o.chunk_bytes = 64 << 10;
    o.numa_node = node;
    std::unique_ptr<Engine> e;
    REQUIRE(Engine::Open(o, &e).ok());
    const std::vector<char> a = RandomBytes(300 << 10, 7);
    REQUIRE(SaveOne(e.get(), 1, a).ok());
    REQUIRE(e->staging_base() != nullptr);
    int mode = -1, got = -2;
    REQUIRE(NumaPolicyOf(e->staging_base(), &mode, &got) == 0);
    CHECK_EQ(mode, node < 0 ? 0 : 1);
    if (node >= 0) CHECK_EQ(got, node);
  }
}

namespace {

// Every file below dir, with its content: what a test compares before and after.
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  std::vector<std::string> names;
  if (Env::Default()->ListDir(dir, &names) != 0) return out;
  for (const auto& n : names) {
    const std::string p = JoinPath(dir, n);
    if (Env::Default()->IsOwnDir(p) == 1) {
      for (const auto& [k, v] : Snapshot(p)) out[n + "/" + k] = v;
    } else {
      std::string text;
      ReadSmallFile(Env::Default(), p, 1 << 24, &text);
      out[n] = text;
    }
  }
  return out;
}

}  // namespace

TEST(symlinks_in_the_run_dir_are_never_written_or_deleted_through) {
  // Sentinels outside the run directory, and a symlink at each name the engine uses in turn:
  // nothing outside changes, and the engine says what it refused.
  TempDir d;
  const std::string run = d.sub("run"), outside = d.sub("outside");
  REQUIRE(::mkdir(run.c_str(), 0755) == 0 && ::mkdir(outside.c_str(), 0755) == 0);
  REQUIRE(alpsck_test::WriteText(JoinPath(outside, "sentinel"), "keep me"));
  REQUIRE(alpsck_test::WriteText(JoinPath(outside, ShardFileName(0)), "not a shard"));
  REQUIRE(alpsck_test::WriteText(JoinPath(outside, "file"), "a file"));
  const auto before = Snapshot(outside);
  auto a = RandomBytes(100000, 3);
  // A free directory that is a link out (claimable by name), at Open: neither removed through nor claimed.
  REQUIRE(::symlink(outside.c_str(), JoinPath(run, "free-9-1-0").c_str()) == 0);
  auto e = Open(run, nullptr, 1, 1);
  REQUIRE(e);
  REQUIRE(SaveOne(e.get(), 1, a).ok());
  // The next save's attempt directory is a link out: refused, by name.
  REQUIRE(::symlink(outside.c_str(), JoinPath(run, TmpDirName(2)).c_str()) == 0);
  Status s = SaveOne(e.get(), 2, a);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find(TmpDirName(2) + " is a symbolic link") != std::string::npos);
  REQUIRE(::unlink(JoinPath(run, TmpDirName(2)).c_str()) == 0);
  // LATEST is replaced by a link to a file outside: never written through. The engine holding
  // LATEST open goes on writing the file it opened (a hint, unlinked now); a new engine refuses
  // the link, the save is durable, a warning says LATEST was not updated.
  const std::string latest = JoinPath(run, kLatestName);
  REQUIRE(::unlink(latest.c_str()) == 0);
  REQUIRE(::symlink(JoinPath(outside, "file").c_str(), latest.c_str()) == 0);
  SaveResult r;
  REQUIRE(SaveOne(e.get(), 3, a, &r).ok());
  CHECK(Snapshot(outside) == before);
  e = Open(run, nullptr, 1, 1);
  REQUIRE(e);
  REQUIRE(SaveOne(e.get(), 4, a, &r).ok());
  CHECK(r.warning.find("LATEST not updated") != std::string::npos);
  CHECK(r.warning.find("symbolic link") != std::string::npos);
  REQUIRE(::unlink(latest.c_str()) == 0);
  // A committed checkpoint that is a link to a copy elsewhere: read, never expired by retention
  // (keep_last 1), its files untouched.
  const std::string copy = d.sub("copy");
  REQUIRE(::rename(JoinPath(run, StepDirName(4)).c_str(), copy.c_str()) == 0);
  REQUIRE(::symlink(copy.c_str(), JoinPath(run, StepDirName(4)).c_str()) == 0);
  const auto copy_before = Snapshot(copy);
  for (uint64_t step : {5, 6}) REQUIRE(SaveOne(e.get(), step, a).ok());
  e.reset();
  CHECK(Snapshot(copy) == copy_before);
  CHECK(Env::Default()->IsOwnDir(JoinPath(run, StepDirName(4))) == 0);  // still the link
  std::vector<CheckpointInfo> infos;
  REQUIRE(ScanRunDir(Env::Default(), run, true, 2, &infos).ok());
  bool linked_ok = false;
  for (const auto& i : infos) linked_ok |= i.step == 4 && i.state == CheckpointState::kCommitted;
  CHECK(linked_ok);
  // A reopened engine tidies: the link out at free-9-1-0 is left as it is.
  e = Open(run, nullptr, 1, 1);
  REQUIRE(e);
  REQUIRE(SaveOne(e.get(), 7, a).ok());
  e.reset();
  CHECK(Snapshot(outside) == before);
  CHECK(Env::Default()->IsOwnDir(JoinPath(run, "free-9-1-0")) == 0);
  // A shard name in the attempt directory that links out: the write is refused, never done through it.
  const std::string tmp = JoinPath(run, TmpDirName(8));
  REQUIRE(::mkdir(tmp.c_str(), 0755) == 0);
  REQUIRE(::symlink(JoinPath(outside, ShardFileName(0)).c_str(), JoinPath(tmp, ShardFileName(0)).c_str()) == 0);
  EngineOptions o;  // keep_last 0: no claim, the existing directory is joined as it is
  o.run_dir = run;
  o.keep_last = 0;
  std::unique_ptr<Engine> e2;
  REQUIRE(Engine::Open(o, &e2).ok());  // (rank 0 tidies step-8.tmp at Open: make it again)
  REQUIRE(::mkdir(tmp.c_str(), 0755) == 0);
  REQUIRE(::symlink(JoinPath(outside, ShardFileName(0)).c_str(), JoinPath(tmp, ShardFileName(0)).c_str()) == 0);
  s = SaveOne(e2.get(), 8, a);
  CHECK(s.code() == Code::kInvalidArgument && s.message().find("is a symbolic link") != std::string::npos);
  e2.reset();
  CHECK(Snapshot(outside) == before);
}

TEST(bad_run_dirs_are_clear_errors) {
  TempDir d;
  REQUIRE(alpsck_test::WriteText(d.sub("file"), "x"));
  std::unique_ptr<Engine> e;
  EngineOptions o;
  o.run_dir = d.sub("file");
  Status s = Engine::Open(o, &e);
  CHECK(!s.ok() && s.message().find("not a directory") != std::string::npos);
  o.run_dir = d.sub("missing/parent/run");
  s = Engine::Open(o, &e);
  CHECK(!s.ok() && s.message().find("missing/parent/run") != std::string::npos);
  o.run_dir = d.sub("file/sub");
  s = Engine::Open(o, &e);
  CHECK(!s.ok());
  FaultEnv ro;
  FaultRule deny;
  deny.op = FaultRule::Op::kOpen;
  deny.error = EROFS;
  ro.AddRule(deny);
  o.run_dir = d.path();
  o.env = &ro;
  s = Engine::Open(o, &e);
  CHECK(!s.ok() && s.message().find("not writable") != std::string::npos);
}

TEST(many_concurrent_saves_from_two_threads_under_load) {
  TempDir d;
  auto e = Open(d.path(), nullptr, 3, 4, 4096 * 4);
  REQUIRE(e);
  auto a = RandomBytes(100000, 13), b = RandomBytes(70000, 14);
  std::vector<std::shared_ptr<SaveHandle>> ha(20), hb(20);
  std::thread t1([&] {
    for (uint64_t i = 0; i < 20; ++i) {
      Status s = e->Save(SaveReq(2 * i + 1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &ha[i]);
      if (!s.ok()) std::fprintf(stderr, "save: %s\n", s.message().c_str());
    }
  });
  std::thread t2([&] {
    for (uint64_t i = 0; i < 20; ++i) e->Save(SaveReq(2 * i + 2, {{"b", b.data(), b.size()}}, "", SaveMode::kZeroCopy), &hb[i]);
  });
  t1.join();
  t2.join();
  e->WaitAll();
  for (auto& h : ha) {
    CHECK(h && h->Done() && h->status().ok());
    if (h && !h->status().ok()) std::fprintf(stderr, "%s\n", h->status().message().c_str());
  }
  for (auto& h : hb) {
    CHECK(h && h->Done() && h->status().ok());
    if (h && !h->status().ok()) std::fprintf(stderr, "%s\n", h->status().message().c_str());
  }
  CHECK_EQ(e->published_step(), int64_t{40});
  CHECK(Matches(d.path(), 40, "b", b));
  CHECK(Matches(d.path(), 39, "a", a));
}

TEST(tiny_staging_pool_streams_in_every_mode_without_deadlock) {
  // One- and two-slot pools, two copy threads, two saving threads, many chunks: the copiers
  // must hand held chunks to the writers before they block or leave.
  for (uint64_t slots : {uint64_t{1}, uint64_t{2}}) {
    for (SaveMode mode : {SaveMode::kSnapshot, SaveMode::kSnapshotOverlap}) {
      TempDir d;
      EngineOptions o;
      o.run_dir = d.path();
      o.chunk_bytes = 64 << 10;
      o.staging_bytes = slots * (64 << 10);
      o.copy_threads = 2;
      o.threads = 2;
      o.max_in_flight = 2;
      o.keep_last = 0;
      std::unique_ptr<Engine> e;
      REQUIRE(Engine::Open(o, &e).ok());
      auto a = RandomBytes(1 << 20, 15), b = RandomBytes(700000, 16);
      std::vector<std::shared_ptr<SaveHandle>> ha(4), hb(4);
      std::thread t1([&] {
        for (uint64_t i = 0; i < 4; ++i) e->Save(SaveReq(2 * i + 1, {{"a", a.data(), a.size()}}, "", mode), &ha[i]);
      });
      std::thread t2([&] {
        for (uint64_t i = 0; i < 4; ++i) e->Save(SaveReq(2 * i + 2, {{"b", b.data(), b.size()}}, "", mode), &hb[i]);
      });
      t1.join();
      t2.join();
      for (auto& h : ha) CHECK(h && h->Wait(60) && h->status().ok());
      for (auto& h : hb) CHECK(h && h->Wait(60) && h->status().ok());
      CHECK(Matches(d.path(), 7, "a", a));
      CHECK(Matches(d.path(), 8, "b", b));
    }
  }
}

namespace {
// Copies chunk i's extent bytes from srcs into slot, as an external filler (a GPU copy) would.
void FillChunk(const ExternalFill& f, const std::vector<const std::vector<char>*>& srcs, uint64_t i, char* slot) {
  const ShardLayout& l = f.layout();
  const uint64_t b = l.chunk_begin(i), e = b + l.chunk_len(i);
  for (size_t k = 0; k < l.extents.size(); ++k) {
    const ExtentLayout& x = l.extents[k];
    uint64_t s = std::max(b, x.offset), t = std::min(e, x.offset + x.size);
    if (t > s) std::memcpy(slot + (s - b), srcs[k]->data() + (s - x.offset), t - s);
  }
}
}  // namespace

TEST(external_fill_commits_chunks_submitted_in_any_order_from_another_thread) {
  // A two-slot pool: the filler must submit before it can acquire more (pipelining), and it
  // submits in reverse pairs. Stale bytes in reused slots must not reach the padding.
  TempDir d;
  EngineOptions o;
  o.run_dir = d.path();
  o.chunk_bytes = 64 << 10;
  o.staging_bytes = 2 * (64 << 10);
  o.threads = 2;
  std::unique_ptr<Engine> e;
  REQUIRE(Engine::Open(o, &e).ok());
  auto a = RandomBytes(700001, 21), b = RandomBytes(33, 22), c = RandomBytes(200000, 23);
  std::shared_ptr<SaveHandle> h;
  std::shared_ptr<ExternalFill> f;
  REQUIRE(e->Save(SaveReq(5, {{"a", nullptr, a.size()}, {"b", nullptr, b.size()}, {"c", nullptr, c.size()}}, "{}",
                  SaveMode::kExternal, CommitMode::kAuto), &h, &f).ok());
  REQUIRE(f);
  CHECK(!h->Done());
  std::memset(e->staging_base(), 0x5a, e->staging_bytes());  // stale bytes everywhere
  std::thread filler([&] {
    const std::vector<const std::vector<char>*> srcs = {&a, &b, &c};
    for (uint64_t i = 0; i < f->num_chunks(); i += 2) {
      const uint64_t n = std::min<uint64_t>(2, f->num_chunks() - i);
      char* slots[2] = {nullptr, nullptr};
      for (uint64_t k = 0; k < n; ++k) {
        slots[k] = f->Acquire(i + k, true);
        REQUIRE(slots[k]);
        FillChunk(*f, srcs, i + k, slots[k]);
      }
      for (uint64_t k = n; k-- > 0;) CHECK(f->Submit(i + k, slots[k]).ok());
    }
    f->Finish();
  });
  filler.join();
  REQUIRE(h->Wait(60));
  CHECK(h->status().ok());
  CHECK(Matches(d.path(), 5, "a", a));
  CHECK(Matches(d.path(), 5, "b", b));
  CHECK(Matches(d.path(), 5, "c", c));
  // The whole file verifies, padding included (its CRCs were taken over zeroed gaps).
  std::vector<CheckpointInfo> infos;
  REQUIRE(ScanRunDir(Env::Default(), d.path(), true, 2, &infos).ok());
  REQUIRE(infos.size() == 1);
  CHECK(infos[0].state == CheckpointState::kCommitted);
  // The gap after "a" (packed at 64-byte offsets) holds zeros, not the slot's stale bytes.
  const std::string shard = JoinPath(JoinPath(d.path(), StepDirName(5)), ShardFileName(0));
  FILE* fp = std::fopen(shard.c_str(), "rb");
  REQUIRE(fp);
  char gap[31];
  std::fseek(fp, 700001, SEEK_SET);
  CHECK_EQ(std::fread(gap, 1, sizeof(gap), fp), sizeof(gap));
  std::fclose(fp);
  CHECK(std::all_of(gap, gap + sizeof(gap), [](char ch) { return ch == 0; }));
}

TEST(external_fill_misuse_fails_the_save_and_keeps_the_previous_checkpoint) {
  TempDir d;
  EngineOptions o;
  o.run_dir = d.path();
  o.chunk_bytes = 64 << 10;
  o.staging_bytes = 3 * (64 << 10);  // 3 slots: a leaked slot would starve the last save
  o.threads = 2;
  std::unique_ptr<Engine> e;
  REQUIRE(Engine::Open(o, &e).ok());
  auto a = RandomBytes(300000, 31);
  std::shared_ptr<SaveHandle> good;
  REQUIRE(e->Save(SaveReq(1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &good).ok());
  REQUIRE(good->Wait(60) && good->status().ok());

  // No filler: refused up front.
  std::shared_ptr<SaveHandle> h;
  CHECK(e->Save(SaveReq(2, {{"a", nullptr, a.size()}}, "", SaveMode::kExternal), &h).code() == Code::kInvalidArgument);

  // Double submit, foreign memory, out of range; then finished with chunks missing.
  std::shared_ptr<ExternalFill> f;
  REQUIRE(e->Save(SaveReq(2, {{"a", nullptr, a.size()}}, "", SaveMode::kExternal, CommitMode::kAuto), &h, &f).ok());
  char* s0 = f->Acquire(0, true);
  REQUIRE(s0);
  CHECK(f->Submit(0, s0).ok());
  char* s1 = f->Acquire(1, false);
  REQUIRE(s1);
  CHECK(f->Submit(0, s1).code() == Code::kInvalidArgument);
  CHECK(f->Submit(99, s1).code() == Code::kInvalidArgument);
  char local[8];
  CHECK(f->Submit(1, local).code() == Code::kInvalidArgument);
  f->Release(s1);
  f->Finish();
  f->Finish();  // idempotent
  CHECK(f->Acquire(1, true) == nullptr);
  REQUIRE(h->Wait(60));
  CHECK(!h->status().ok());
  CHECK(h->status().message().find("never filled") != std::string::npos);
  CHECK_EQ(e->published_step(), int64_t{1});

  // A filler's own failure is the save's error; dropping an unfinished filler fails the save.
  REQUIRE(e->Save(SaveReq(3, {{"a", nullptr, a.size()}}, "", SaveMode::kExternal, CommitMode::kAuto), &h, &f).ok());
  f->Fail("device copy failed: boom");
  CHECK(f->Acquire(0, true) == nullptr);
  f->Finish();
  REQUIRE(h->Wait(60));
  CHECK(h->status().message().find("boom") != std::string::npos);
  REQUIRE(e->Save(SaveReq(4, {{"a", nullptr, a.size()}}, "", SaveMode::kExternal, CommitMode::kAuto), &h, &f).ok());
  REQUIRE(f->Acquire(0, false) && f->Acquire(1, false) && f->Acquire(2, false));  // the whole pool
  f.reset();
  REQUIRE(h->Wait(60));
  CHECK(h->status().message().find("abandoned") != std::string::npos);
  CHECK(Matches(d.path(), 1, "a", a));
  CHECK_EQ(e->published_step(), int64_t{1});
  // Every slot came back: a full external save succeeds without blocking on Acquire.
  REQUIRE(e->Save(SaveReq(6, {{"a", nullptr, a.size()}}, "", SaveMode::kExternal, CommitMode::kAuto), &h, &f).ok());
  const std::vector<const std::vector<char>*> srcs = {&a};
  for (uint64_t i = 0; i < f->num_chunks(); ++i) {
    char* slot = f->Acquire(i, false);
    REQUIRE(slot || i >= 3);             // nothing in flight: the whole pool is free
    if (!slot) slot = f->Acquire(i, true);  // later chunks wait for the writers
    REQUIRE(slot);
    FillChunk(*f, srcs, i, slot);
    CHECK(f->Submit(i, slot).ok());
  }
  f->Finish();
  REQUIRE(h->Wait(60) && h->status().ok());
  CHECK(Matches(d.path(), 6, "a", a));
  e->Close();  // nothing left in flight
}

TEST(close_fails_a_save_blocked_on_its_in_flight_slot) {
  // max_in_flight 1 and a slow fdatasync: the second Save waits for a slot. Close() during that
  // wait must fail it ("engine is closed"), not let it in after WaitAll saw nothing in flight
  // (its chunks would then reach stopped writers, and its handle would never complete).
  TempDir d;
  FaultEnv env;
  auto e = Open(d.path(), &env, 1, 0);
  REQUIRE(e);
  FaultRule slow;  // the first save's shard is made durable 2 s late: far longer than the 50 ms below
  slow.op = FaultRule::Op::kFDataSync;
  slow.path_contains = "step-000000001";
  slow.error = 0;
  slow.delay_us = 2000000;
  env.AddRule(slow);
  auto a = RandomBytes(4096, 21);
  std::shared_ptr<SaveHandle> first;
  REQUIRE(e->Save(SaveReq(1, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &first).ok());
  Status second_status;
  std::shared_ptr<SaveHandle> second;
  std::thread t([&] { second_status = e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &second); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the second Save now waits for the slot
  e->Close();
  t.join();
  CHECK_EQ(env.FaultsInjected(), uint64_t{1});  // the first save was in flight for those 2 s
  CHECK(first->Done() && first->status().ok());
  CHECK(second_status.code() == Code::kAborted);
  CHECK(!second || (second->Wait(5) && !second->status().ok()));
  CHECK(!Exists(JoinPath(d.path(), "step-000000002")));
  CHECK(Matches(d.path(), 1, "a", a));
}

// A forked child (a DataLoader worker) inherits the engine object but not its threads or its
// staging memory: there Save and Supersede refuse by name and touch nothing, WaitAll and Close
// return at once, and the parent's engine saves on as before.
TEST(a_forked_child_cannot_save_through_its_parents_engine) {
  TempDir d;
  auto e = Open(d.path(), nullptr, 2, 3, 64 << 10, true);
  REQUIRE(e);
  auto a = RandomBytes(200 << 10, 31);
  REQUIRE(SaveOne(e.get(), 1, a).ok());
  CHECK(!e->Forked());
  std::shared_ptr<SaveHandle> in_flight;  // the parent's, still being written while the child runs
  REQUIRE(e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &in_flight).ok());
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int failures = 0;
    auto expect = [&](bool ok, const char* what) {
      if (!ok) std::fprintf(stderr, "forked child: %s\n", what), ++failures;
    };
    expect(e->Forked(), "Forked() is false in the child");
    std::shared_ptr<SaveHandle> h;
    const Status s = e->Save(SaveReq(3, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h);
    expect(s.code() == Code::kInvalidArgument, "Save was not refused as invalid");
    expect(s.message().find("is a fork of it") != std::string::npos, "Save's error does not say fork");
    expect(!h, "a refused Save handed out a handle");
    std::vector<std::pair<uint64_t, std::string>> retired;
    expect(e->Supersede(3, &retired).code() == Code::kInvalidArgument, "Supersede was not refused");
    e->Prepare({1 << 20});
    e->WaitAll();  // would wait forever on the parent's save 2
    e->Close();
    e.release();  // never destroyed in a child (engine.h)
    _exit(failures);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(in_flight->Wait(30) && in_flight->status().ok());
  REQUIRE(SaveOne(e.get(), 4, a).ok());
  CHECK(!Exists(JoinPath(d.path(), "step-000000003")));
  CHECK(Matches(d.path(), 4, "a", a));
}

// Prepare sizes and faults the staging pool on a background thread: a save that starts while it
// is still faulting copies into the slots already faulted and waits for the rest (the pool is
// never allocated twice), saves after it find the pool as sized, and Close during a Prepare
// returns without faulting the rest.
TEST(prepare_faults_the_pool_in_the_background_and_a_save_meanwhile_uses_it) {
  TempDir d;
  auto e = Open(d.path());  // max_in_flight 2, 3 writers, 64 KiB chunks
  REQUIRE(e);
  const std::vector<char> a = RandomBytes(8 << 20, 7);
  e->Prepare({a.size()});
  CHECK(SaveOne(e.get(), 1, a).ok());  // at once: the pool is likely still being faulted
  const uint64_t want = PoolSlots(a.size());
  CHECK_EQ(e->staging_slots(), want);
  CHECK(SaveOne(e.get(), 2, a).ok());
  CHECK_EQ(e->staging_slots(), want);
  CHECK(Matches(d.path(), 1, "a", a) && Matches(d.path(), 2, "a", a));
  e->Prepare({a.size() * 4});  // grows (a new mapping) ...
  e->Prepare({a.size()});      // ... and shrinks back once the grown slots are free
  CHECK(SaveOne(e.get(), 3, a).ok());
  CHECK(Matches(d.path(), 3, "a", a));
  TempDir d2;
  auto big = Open(d2.path());
  REQUIRE(big);
  big->Prepare({uint64_t{256} << 20});  // 512 MiB of slots to fault: Close must not wait for them all
  const auto t0 = std::chrono::steady_clock::now();
  big->Close();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
}

// A Prepare while an earlier one still faults the pool in returns at once (the training calls it:
// restore() prepares, and a second restore or prepare() right after it waited for the whole
// pool, seconds for gigabytes); the thread that is faulting takes the newest sizes up when done.
TEST(prepare_returns_while_an_earlier_one_still_faults_and_the_newest_sizes_win) {
  TempDir d;
  auto e = Open(d.path());  // max_in_flight 2, 3 writers, 64 KiB chunks
  REQUIRE(e);
  const uint64_t big = uint64_t{256} << 20;     // 2 x 4096 + 3 slots of 64 KiB: 512 MiB to fault
  const uint64_t small = uint64_t{8} << 20;
  e->Prepare({small});                          // made first, ...
  e->Prepare({big});                            // ... this one waits for its turn, ...
  e->Prepare({big});                            // ... and this returns before the pool is faulted in
  const uint64_t want = PoolSlots(big);
  CHECK(e->staging_free_slots() < want);
  WaitFor(120, [&] { return e->staging_slots() >= want; });
  CHECK_EQ(e->staging_slots(), want);  // the newest sizes were taken up by the running preparer
  const std::vector<char> a = RandomBytes(1 << 20, 9);
  CHECK(SaveOne(e.get(), 1, a).ok());
  CHECK(Matches(d.path(), 1, "a", a));
  e->Prepare({big});  // Close while it may still run: joins it, no thread left behind
  e->Close();
}

// Writers start as chunks come, up to the option: an engine opened for one small save (one per
// checkpoint path, as Lightning's CheckpointIO opens them) no longer starts and joins all of them.
TEST(writer_threads_start_as_chunks_are_queued_up_to_the_option) {
  TempDir d;
  EngineOptions o;
  o.run_dir = d.path();
  o.chunk_bytes = 64 << 10;
  o.threads = 8;
  std::unique_ptr<Engine> e;
  REQUIRE(Engine::Open(o, &e).ok());
  CHECK_EQ(e->threads(), uint32_t{8});
  CHECK_EQ(e->writers_started(), uint32_t{1});
  const std::vector<char> one = RandomBytes(1000, 3);
  CHECK(SaveOne(e.get(), 1, one).ok());
  // Its chunk goes to the writer the engine started (even if it had not run yet: ASan's CI run started a second
  // for it), and so does the seal, which that writer queues as it comes back from the chunk.
  CHECK_EQ(e->writers_started(), uint32_t{1});
  CHECK(Matches(d.path(), 1, "a", one));
  const std::vector<char> many = RandomBytes(40 << 16, 4);  // 40 chunks
  for (uint64_t step = 2; step < 6; ++step) CHECK(SaveOne(e.get(), step, many).ok());
  CHECK(e->writers_started() >= 1 && e->writers_started() <= 8);
  CHECK(Matches(d.path(), 5, "a", many));
  e->Close();
}

// Resident memory of this process (bytes), from /proc/self/statm.
uint64_t ResidentBytes() {
  unsigned long long size = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * PageSize() : 0;
}

// A Prepare that grows the pool faults the new slots outside the lock a save sizes its staging
// under: a save that fits the pool as it is starts at once. (It waited for the whole growth, a
// stall of seconds for gigabytes, whenever prepare() came again with a larger state.)
TEST(a_save_that_fits_the_pool_does_not_wait_for_a_prepare_growing_it) {
  // Up to three tries: a stall of this thread of some 100 ms while the preparer faults (a loaded
  // machine) lets the growth finish first; a Save that waits for the growth fails every try.
  bool before_the_growth = false;
  for (int attempt = 0; attempt < 3 && !before_the_growth; ++attempt) {
    TempDir d;
    auto e = Open(d.path());  // max_in_flight 2, 3 writers, 64 KiB chunks
    REQUIRE(e);
    const std::vector<char> a = RandomBytes(1 << 20, 11);
    e->Prepare({a.size()});
    const uint64_t small = PoolSlots(a.size());
    WaitFor(60, [&] { return e->staging_free_slots() >= small; });
    REQUIRE(e->staging_free_slots() == small);
    // A save first, so that every writer has started: the timed one below then starts no thread (under
    // qemu, on a loaded machine, starting them took long enough for the growth to finish first).
    REQUIRE(SaveOne(e.get(), 1, a).ok());
    const uint64_t rss0 = ResidentBytes();
    REQUIRE(rss0 > 0);
    const uint64_t big = uint64_t{256} << 20;  // 2 x 4096 + 3 slots: 512 MiB more to fault
    e->Prepare({big});
    REQUIRE(WaitFor(60, [&] { return ResidentBytes() >= rss0 + (32 << 20); }));  // the growth is faulting now
    std::shared_ptr<SaveHandle> h;
    REQUIRE(e->Save(SaveReq(2, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot), &h).ok());
    before_the_growth = e->staging_slots() == small;  // Save returned while the growth still faulted
    if (!before_the_growth) std::fprintf(stderr, "try %d: the growth finished before Save returned\n", attempt + 1);
    h->Wait(-1);
    CHECK(h->status().ok());
    const uint64_t want = PoolSlots(big);
    WaitFor(120, [&] { return e->staging_slots() >= want; });
    CHECK_EQ(e->staging_slots(), want);
    CHECK(Matches(d.path(), 2, "a", a));
    e->Close();
  }
  CHECK(before_the_growth);
}

// WaitPrepared returns once the preparer has faulted every slot asked for (what the Python layer
// waits for before pinning the pool for a GPU), at once when nothing is being prepared, and when
// Close stops a preparer it waits for.
TEST(wait_prepared_returns_once_the_pool_is_faulted_and_when_close_stops_the_preparer) {
  TempDir d;
  auto e = Open(d.path());  // max_in_flight 2, 3 writers, 64 KiB chunks
  REQUIRE(e);
  e->WaitPrepared();  // nothing prepared: at once
  const uint64_t big = uint64_t{64} << 20;  // 2 x 1024 + 3 slots: 128 MiB to fault
  e->Prepare({big});
  e->WaitPrepared();
  CHECK_EQ(e->staging_slots(), PoolSlots(big));
  CHECK_EQ(e->staging_free_slots(), PoolSlots(big));  // each slot is free once faulted: all of them
  e->Close();
  e->WaitPrepared();  // closed: at once

  TempDir d2;
  auto e2 = Open(d2.path());
  REQUIRE(e2);
  e2->Prepare({uint64_t{256} << 20});  // 512 MiB of slots: Close comes long before they are faulted
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    e2->WaitPrepared();
    returned = true;
  });
  e2->Close();
  CHECK(WaitFor(60, [&] { return returned.load(); }));
  waiter.join();
}

ALPSCK_TEST_MAIN()

TEST(metrics_are_recorded_in_the_manifest_non_finite_ones_too) {
  TempDir d;
  auto e = Open(d.path());
  REQUIRE(e);
  auto a = RandomBytes(1000, 3);
  const Metrics metrics = {{"loss", 1.5}, {"val/loss", std::nan("")}, {"grad_norm", HUGE_VAL}, {"lr", -HUGE_VAL}};
  std::shared_ptr<SaveHandle> h;
  REQUIRE(e->Save(SaveReq(7, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot, CommitMode::kAuto,
                  Status::Ok(), SaveNotes{metrics, "", false}), &h).ok());
  REQUIRE(h->Wait(-1));
  REQUIRE(h->status().ok());
  // Names a manifest cannot hold are refused before anything is queued.
  for (const Metrics& bad : {Metrics{{"", 1.0}}, Metrics{{"a b", 1.0}}, Metrics{{"x", 1.0}, {"x", 2.0}},
                             Metrics(kMaxMetrics + 1, {"m", 0.0})}) {
    std::shared_ptr<SaveHandle> h2;
    Status s = e->Save(SaveReq(8, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot, CommitMode::kAuto,
                       Status::Ok(), SaveNotes{bad, "", false}), &h2);
    CHECK(s.code() == Code::kInvalidArgument);
  }
  e->Close();
  std::vector<CheckpointInfo> infos;
  REQUIRE(ScanRunDir(Env::Default(), d.path(), false, 1, &infos).ok());
  REQUIRE(infos.size() == 1 && infos[0].state == CheckpointState::kCommitted);
  const Metrics& got = infos[0].metrics;
  REQUIRE(got.size() == 4);
  CHECK(got[0].first == "loss" && got[0].second == 1.5);
  CHECK(got[1].first == "val/loss" && std::isnan(got[1].second));
  CHECK(got[2].first == "grad_norm" && std::isinf(got[2].second) && got[2].second > 0);
  CHECK(got[3].first == "lr" && std::isinf(got[3].second) && got[3].second < 0);
}

// One snapshot save of extent "a" recording `metrics`, waited for: its final status.
static Status SaveWithMetrics(Engine* e, uint64_t step, const std::vector<char>& a, const Metrics& metrics) {
  std::shared_ptr<SaveHandle> h;
  Status s = e->Save(SaveReq(step, {{"a", a.data(), a.size()}}, "", SaveMode::kSnapshot, CommitMode::kAuto,
                     Status::Ok(), SaveNotes{metrics, "", false}), &h);
  if (!s.ok()) return s;
  h->Wait(-1);
  return h->status();
}

static std::vector<uint64_t> CommittedSteps(const std::string& dir) {
  std::vector<CheckpointInfo> infos;
  std::vector<uint64_t> steps;
  if (!ScanRunDir(Env::Default(), dir, false, 1, &infos).ok()) return steps;
  for (const auto& i : infos)
    if (i.state == CheckpointState::kCommitted) steps.push_back(i.step);
  return steps;
}

TEST(retention_never_expires_the_newest_healthy_step) {
  // keep_last 2, losses fine up to step 30, then NaN at 40 and 50: the newest two (40, 50) stay, and
  // so does 30, the newest a restore would use (recovery.h, rule 5b); 10 and 20 expire. A healthy 60
  // then makes 50, 60 the newest two and 60 the newest healthy: 30 and 40 expire.
  TempDir d;
  auto e = Open(d.path(), nullptr, 1, 2);
  REQUIRE(e);
  auto a = RandomBytes(5000, 8);
  for (uint64_t s = 1; s <= 5; ++s)
    REQUIRE(SaveWithMetrics(e.get(), s * 10, a, {{"loss", s <= 3 ? 1.0 / static_cast<double>(s) : std::nan("")}}).ok());
  CHECK(CommittedSteps(d.path()) == (std::vector<uint64_t>{30, 40, 50}));
  REQUIRE(SaveWithMetrics(e.get(), 60, a, {{"loss", 0.1}}).ok());
  e->Close();
  CHECK(CommittedSteps(d.path()) == (std::vector<uint64_t>{50, 60}));
}
