// Power loss at every moment of several concurrent saves: every state the disk could be left in
// recovers to a valid checkpoint no older than the last one reported durable.
//
// The real Engine saves through a RecordingEnv (several checkpoints in flight, keep_last small
// so expired directories are recycled, then a restart that cleans up and saves again; and the
// same with two ranks, each its own Engine, rank 0 committing and expiring). For every
// crash point (after each logged call) PowerLossModel (power_loss.h) generates the states a
// power loss could leave: unsynced data dropped, applied or torn per 4 KiB block, directory
// changes (create, rename, unlink) after the directory's last fsync lost. Each distinct state is
// written into a fresh directory and recovered with ScanRunDir, which must find:
//   - no corrupt checkpoint, and nothing that the quick check calls committed failing to read
//     back with every chunk CRC verified;
//   - every committed checkpoint holding exactly the bytes saved for its step (nothing under
//     .tmp, nothing stale);
//   - a committed step at least as new as the newest save reported durable before the crash;
//   - LATEST, if readable, no newer than the newest committed step;
// and for a sample of states, a restarted (one-rank) engine that saves again and commits.
//
// The first tests check the checker: protocols with a missing fsync are caught.
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "commit.h"
#include "coordinate.h"
#include "engine.h"
#include "env_fault.h"
#include "env_record.h"
#include "file_io.h"
#include "kv_store_memory.h"
#include "platform.h"
#include "power_loss.h"
#include "recovery.h"
#include "run_dir_actions.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::SaveReq;
using alpsck_test::PowerLossModel;
using alpsck_test::RandomBytes;
using alpsck_test::TempDir;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || !defined(NDEBUG)
constexpr bool kSlowBuild = true;
#else
constexpr bool kSlowBuild = false;
#endif

using Policy = PowerLossModel::Policy;
using Fate = PowerLossModel::Fate;

// ---------------------------------------------------------------- what each step saves

uint64_t g_chunk = 0;  // the engine's chunk size (its alignment): set by the first Open

const std::vector<char>& StepData(uint64_t step) {
  // Sizes differ per step, so a recycled file must really be truncated and rewritten.
  static std::map<std::pair<uint64_t, uint64_t>, std::vector<char>> cache;  // (chunk, step) -> bytes
  auto& v = cache[{g_chunk, step}];
  if (v.empty()) v = RandomBytes(static_cast<size_t>(2 * g_chunk + 1000 + 777 * (step % 13)), static_cast<uint32_t>(step));
  return v;
}
std::vector<char> StepSmall(uint64_t step) { return RandomBytes(100, static_cast<uint32_t>(step + 100000)); }
// What rank r saves at a step (rank 0: StepData(step), StepSmall(step)).
// History 1: what a run resumed from an older step saves (other bytes for the same steps).
uint64_t RankKey(uint64_t step, uint32_t rank, uint32_t history = 0) {
  return step + 1000000ull * rank + 500000ull * history;
}
std::string StepMeta(uint64_t step, uint32_t history = 0) {
  return "{\"step\":" + std::to_string(step) + (history ? ",\"history\":" + std::to_string(history) : "") + "}";
}
// The step a resumed session continued from (-1: no resumed session): once any checkpoint of
// history 1 is valid, none of history 0 newer than it may be (it would shadow the new history).
int64_t g_resumed_from = -1;
constexpr uint64_t kRestartSteps = 100000;  // CheckRestart's saves: outside both histories

EngineOptions Options(const std::string& dir, Env* env) {
  EngineOptions o;
  o.run_dir = dir;
  o.env = env;
  o.threads = 3;
  o.max_in_flight = 2;
  o.keep_last = 2;
  o.chunk_bytes = 1;  // rounded up to the alignment: the smallest chunk, so every save has several
  o.copy_threads = 1;
  return o;
}

// ---------------------------------------------------------------- the checker

void RemoveTree(const std::string& p) {
  nftw(p.c_str(), [](const char* f, const struct stat*, int, struct FTW*) { return ::remove(f); }, 16,
       FTW_DEPTH | FTW_PHYS);
}

// Checks the bytes of every shard of a committed checkpoint against what its rank saved for
// its step.
std::string CheckContent(const CheckpointInfo& c, uint32_t* history) {
  if (c.shards.empty()) return "no shards";
  for (uint32_t rank = 0; rank < c.shards.size(); ++rank) {
    if (c.shards[rank] != ShardFileName(rank)) return "shard " + c.shards[rank] + " out of place";
    std::unique_ptr<ShardReader> r;
    Status s = ShardReader::Open(Env::Default(), JoinPath(c.path, ShardFileName(rank)), false, &r);
    if (!s.ok()) return "reopen: " + s.message();
    if (r->index().meta == StepMeta(c.step, 1)) *history = 1;
    else if (r->index().meta == StepMeta(c.step)) *history = 0;
    else return "meta is " + r->index().meta;
    const auto& ex = r->index().layout.extents;
    const std::vector<char>& want_a = StepData(RankKey(c.step, rank, *history));
    const std::vector<char> want_m = StepSmall(RankKey(c.step, rank, *history));
    std::vector<char> a(want_a.size()), m(want_m.size());
    std::vector<char*> dsts(ex.size(), nullptr);
    for (size_t i = 0; i < ex.size(); ++i) {
      if (ex[i].name == "a" && ex[i].size == a.size()) dsts[i] = a.data();
      if (ex[i].name == "m" && ex[i].size == m.size()) dsts[i] = m.data();
    }
    if (ex.size() != 2 || !dsts[0] || !dsts[1])
      return ShardFileName(rank) + ": extents differ from what step " + std::to_string(c.step) + " saved";
    s = r->Read(dsts, 1);
    if (!s.ok()) return "read: " + s.message();
    if (a != want_a || m != want_m)
      return ShardFileName(rank) + " holds other bytes than step " + std::to_string(c.step) + " saved";
  }
  return "";
}

// Recovers run_dir; "" if it satisfies every promise, else what is wrong. *newest: newest
// committed step (-1 if none). The quick scan classifies; every checkpoint it calls committed is
// then read back whole, every chunk CRC-checked (what a full verification does) and compared
// byte for byte with what its step saved.
std::string CheckRecovered(const std::string& run_dir, int64_t durable, int64_t* newest) {
  std::vector<CheckpointInfo> quick;
  Status s = ScanRunDir(Env::Default(), run_dir, false, 1, &quick);
  if (!s.ok()) return "scan: " + s.message();
  *newest = -1;
  int64_t newest_resumed = -1, abandoned = -1;
  for (const CheckpointInfo& c : quick) {
    if (c.state == CheckpointState::kCorrupt) return "corrupt checkpoint " + c.path + ": " + c.error;
    if (c.state != CheckpointState::kCommitted) continue;
    if (c.path.size() > 4 && c.path.compare(c.path.size() - 4, 4, ".tmp") == 0) return ".tmp reported valid: " + c.path;
    uint32_t history = 0;
    std::string bad = CheckContent(c, &history);
    if (!bad.empty()) return "committed checkpoint " + c.path + " fails verification: " + bad;
    *newest = std::max<int64_t>(*newest, static_cast<int64_t>(c.step));
    if (history == 1) newest_resumed = std::max<int64_t>(newest_resumed, static_cast<int64_t>(c.step));
    if (history == 0 && c.step < kRestartSteps && static_cast<int64_t>(c.step) > g_resumed_from)
      abandoned = std::max<int64_t>(abandoned, static_cast<int64_t>(c.step));
  }
  if (g_resumed_from >= 0 && newest_resumed >= 0 && abandoned >= 0)
    return "step " + std::to_string(abandoned) + " of the abandoned history is valid beside step " +
           std::to_string(newest_resumed) + " of the resumed one (restore would pick the abandoned one)";
  if (*newest < durable)
    return "newest valid step " + std::to_string(*newest) + " is older than step " + std::to_string(durable) +
           ", which was reported durable";
  std::string latest;
  if (ReadSmallFile(Env::Default(), JoinPath(run_dir, kLatestName), 64, &latest).ok() && !latest.empty()) {
    const long long l = std::strtoll(latest.c_str(), nullptr, 10);
    if (l > *newest) return "LATEST names step " + std::to_string(l) + ", newer than any valid checkpoint";
  }
  return "";
}

// A restarted engine on a recovered run dir saves again, commits, and that becomes the newest.
std::string CheckRestart(const std::string& run_dir, uint64_t step) {
  std::unique_ptr<Engine> e;
  EngineOptions o = Options(run_dir, nullptr);
  o.threads = 1;
  Status s = Engine::Open(o, &e);
  if (!s.ok()) return "restart: " + s.message();
  const auto a = StepData(step), m = StepSmall(step);
  std::shared_ptr<SaveHandle> h;
  s = e->Save(SaveReq(step, {{"a", a.data(), a.size()}, {"m", m.data(), m.size()}}, StepMeta(step), SaveMode::kSnapshot), &h);
  std::string warning;
  if (s.ok()) {
    h->Wait(-1);
    s = h->status();
    warning = h->result().warning;
  }
  e->Close();
  if (!s.ok()) return "save after restart: " + s.message();
  if (!warning.empty()) return "save after restart warns: " + warning;
  int64_t newest = -1;
  std::string bad = CheckRecovered(run_dir, static_cast<int64_t>(step), &newest);
  return bad.empty() ? "" : "after restart and save: " + bad;
}

// ---------------------------------------------------------------- the policies

Policy MinPolicy() {
  return {"min (every unsynced change lost)", [](int, size_t synced, size_t) { return synced; },
          [](int, const PowerLossModel::DataOp&) { return Fate::kDrop; },
          [](int, const PowerLossModel::DataOp&, uint64_t) { return false; }};
}
Policy MaxPolicy() {
  return {"max (every change kept)", [](int, size_t, size_t total) { return total; },
          [](int, const PowerLossModel::DataOp&) { return Fate::kApply; },
          [](int, const PowerLossModel::DataOp&, uint64_t) { return true; }};
}
// Directory `dir` keeps only `keep` of its changes; all other changes kept (data: apply) or all
// unsynced data lost (data_kept false).
Policy DirCutPolicy(int dir, size_t keep, bool data_kept) {
  return {"directory inode " + std::to_string(dir) + " keeps " + std::to_string(keep) + " changes, unsynced data " +
              (data_kept ? "kept" : "lost"),
          [=](int d, size_t, size_t total) { return d == dir ? keep : total; },
          [=](int, const PowerLossModel::DataOp&) { return data_kept ? Fate::kApply : Fate::kDrop; },
          [](int, const PowerLossModel::DataOp&, uint64_t) { return false; }};
}
Policy RandomPolicy(std::mt19937* rng, uint32_t seed) {
  return {"random (seed " + std::to_string(seed) + ")",
          [rng](int, size_t synced, size_t total) { return synced + (*rng)() % (total - synced + 1); },
          [rng](int, const PowerLossModel::DataOp&) { return static_cast<Fate>((*rng)() % 3); },
          [rng](int, const PowerLossModel::DataOp&, uint64_t) { return ((*rng)() & 1) != 0; }};
}

struct Explored {
  size_t crash_points = 0, states = 0, distinct = 0, restarts = 0;
};

// Where states are written: a tmpfs when there is one. On a disk, the O_DIRECT reads of the
// verification would first force each freshly written state out to the device.
std::string ScratchBase() {
  struct stat st;
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  return std::string();
}

// How much to explore per crash point: random states, both data variants of each directory
// cut (else only "unsynced data kept"), and a restart every restart_every distinct states.
struct Budget {
  uint32_t random_per_point = 12;
  bool cuts_with_data_lost = true;
  size_t cut_every = 1;  // directory cuts at every n-th crash point (the others: min, max, random)
  size_t restart_every = 4;
};

// Explores the states after every crash point of `model` (after every logged call); returns the
// first failure ("" if none).
std::string Explore(const PowerLossModel& model, const Budget& budget, Explored* ex) {
  std::set<std::pair<uint64_t, int64_t>> seen;  // (state, newest step reported durable)
  std::mt19937 rng(12345);
  TempDir scratch(ScratchBase());
  const std::string dir = scratch.sub("state");
  for (size_t k = 0; k <= model.num_ops(); ++k) {
    // After a call that changed nothing on disk (close, open of an existing file) the possible
    // states are those of the crash point before: skip it. After a Mark ("durable") they are
    // too, but must now keep a newer step: check the extremes again.
    const RecordedOp* last = k ? &model.ops()[k - 1] : nullptr;
    if (last && (last->kind == RecordedOp::Kind::kClose ||
                 (last->kind == RecordedOp::Kind::kOpen && !last->created && !(last->flags & O_TRUNC))))
      continue;
    const bool mark = last && last->kind == RecordedOp::Kind::kMark;
    ++ex->crash_points;
    // A resumed run gives up the abandoned history's promises: from then on the step it continues
    // from is the floor.
    const int64_t durable = model.LastMark(k, "durable", "resume");
    std::vector<Policy> policies = {MinPolicy(), MaxPolicy()};
    if (!mark && model.AnythingUnsynced(k)) {
      for (size_t ino = 0; ino < model.inodes().size() && ex->crash_points % budget.cut_every == 0; ++ino) {
        if (!model.inodes()[ino].dir) continue;
        size_t synced, total;
        model.Counts(model.inodes()[ino], k, &synced, &total);
        for (size_t keep = synced; keep < total; ++keep) {
          policies.push_back(DirCutPolicy(static_cast<int>(ino), keep, true));
          if (budget.cuts_with_data_lost) policies.push_back(DirCutPolicy(static_cast<int>(ino), keep, false));
        }
      }
      for (uint32_t r = 0; r < budget.random_per_point; ++r) policies.push_back(RandomPolicy(&rng, r));
    }
    for (const Policy& p : policies) {
      ++ex->states;
      PowerLossModel::State st = model.Generate(k, p);
      if (!seen.insert({st.hash, durable}).second) continue;
      ++ex->distinct;
      RemoveTree(dir);
      if (::mkdir(dir.c_str(), 0755) != 0 || !PowerLossModel::Materialize(st, dir))
        return "cannot write a state into " + dir;
      int64_t newest = -1;
      std::string bad = CheckRecovered(dir, durable, &newest);
      if (bad.empty() && budget.restart_every && ex->distinct % budget.restart_every == 0) {
        ++ex->restarts;
        bad = CheckRestart(dir, 100000 + k);
      }
      if (!bad.empty())
        return "power loss after call " + std::to_string(k) + " of " + std::to_string(model.num_ops()) + ", " + p.name +
               ":\n  " + bad + "\nlast calls:\n" + model.Tail(k) + "state on disk:\n" + st.Describe();
    }
  }
  return "";
}

// Records a hand-written commit sequence (for the checker's own tests): writes the files of a
// valid checkpoint of `step` (made by a real engine in `src`) into run_dir through rec.
struct Files {
  std::string shard, manifest;
};

Files MakeValidFiles(const std::string& src, uint64_t step) {
  EngineOptions o = Options(src, nullptr);
  std::unique_ptr<Engine> e;
  Files f;
  if (!Engine::Open(o, &e).ok()) return f;
  g_chunk = e->chunk_bytes();
  const auto a = StepData(step), m = StepSmall(step);
  std::shared_ptr<SaveHandle> h;
  if (!e->Save(SaveReq(step, {{"a", a.data(), a.size()}, {"m", m.data(), m.size()}}, StepMeta(step), SaveMode::kSnapshot), &h)
           .ok())
    return f;
  h->Wait(-1);
  e->Close();
  const std::string d = JoinPath(src, StepDirName(step));
  ReadSmallFile(Env::Default(), JoinPath(d, ShardFileName(0)), 1ull << 30, &f.shard);
  ReadSmallFile(Env::Default(), JoinPath(d, kManifestName), 1ull << 20, &f.manifest);
  return f;
}

void WriteAll(Env* env, const std::string& path, const std::string& data, bool sync) {
  int fd = env->Open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  WriteFull(env, fd, data.data(), data.size(), 0, path);
  if (sync) env->FSync(fd);
  env->Close(fd);
}

// Commits `step` by hand; each flag leaves out one fsync of the real protocol.
void HandCommit(RecordingEnv* rec, const std::string& run, uint64_t step, const Files& f, bool sync_data,
                bool sync_tmp_dir, bool sync_run_dir, bool mark_durable = true) {
  const std::string tmp = JoinPath(run, StepDirName(step) + ".tmp"), fin = JoinPath(run, StepDirName(step));
  rec->Mkdir(tmp);
  WriteAll(rec, JoinPath(tmp, ShardFileName(0)), f.shard, sync_data);
  WriteAll(rec, JoinPath(tmp, kManifestName), f.manifest, sync_data);
  if (sync_tmp_dir) SyncDir(rec, tmp);
  rec->Rename(tmp, fin);
  if (sync_run_dir) SyncDir(rec, run);
  if (mark_durable) rec->Mark("durable", step);
}

std::string ExploreHand(const std::string& run, RecordingEnv* rec) {
  PowerLossModel model;
  std::string err;
  if (!model.Build(run, rec->Ops(), &err)) return "model: " + err;
  Explored ex;
  Budget b;
  b.random_per_point = 8;
  b.restart_every = 0;
  return Explore(model, b, &ex);
}

}  // namespace

// ---------------------------------------------------------------- the model itself

TEST(model_keeps_synced_data_and_drops_or_tears_the_rest) {
  TempDir d;
  RecordingEnv rec;
  const std::string f = d.sub("f");
  int fd = rec.Open(f, O_WRONLY | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  const std::string a(8192, 'a'), b(8192, 'b');
  REQUIRE(rec.PWrite(fd, a.data(), a.size(), 0) == 8192);
  REQUIRE(rec.FDataSync(fd) == 0);
  REQUIRE(rec.PWrite(fd, b.data(), b.size(), 4096) == 8192);  // blocks 1-2, unsynced
  rec.Close(fd);
  SyncDir(&rec, d.path());
  PowerLossModel m;
  std::string err;
  REQUIRE(m.Build(d.path(), rec.Ops(), &err));
  const size_t k = m.num_ops();
  auto lo = m.Generate(k, MinPolicy()), hi = m.Generate(k, MaxPolicy());
  REQUIRE(lo.entries.size() == 1 && hi.entries.size() == 1);
  CHECK(lo.entries[0].content == a);
  CHECK(hi.entries[0].content == std::string(4096, 'a') + std::string(8192, 'b'));
  Policy torn = MaxPolicy();
  torn.data_fate = [](int, const PowerLossModel::DataOp&) { return Fate::kTorn; };
  torn.keep_block = [](int, const PowerLossModel::DataOp&, uint64_t b) { return b == 1; };  // only the 2nd block landed
  auto t = m.Generate(k, torn);
  REQUIRE(t.entries.size() == 1);
  CHECK(t.entries[0].content == a + std::string(4096, 'b'));
  // Before the directory fsync, the file's name itself may be lost.
  auto early = m.Generate(3, MinPolicy());
  CHECK(early.entries.empty());
}

TEST(model_loses_a_rename_whose_directory_was_not_synced) {
  TempDir d;
  RecordingEnv rec;
  WriteAll(&rec, d.sub("a"), "hello", true);
  SyncDir(&rec, d.path());
  REQUIRE(rec.Rename(d.sub("a"), d.sub("b")) == 0);
  PowerLossModel m;
  std::string err;
  REQUIRE(m.Build(d.path(), rec.Ops(), &err));
  auto lo = m.Generate(m.num_ops(), MinPolicy()), hi = m.Generate(m.num_ops(), MaxPolicy());
  REQUIRE(lo.entries.size() == 1 && hi.entries.size() == 1);
  CHECK_EQ(lo.entries[0].path, std::string("a"));
  CHECK_EQ(hi.entries[0].path, std::string("b"));
  CHECK_EQ(hi.entries[0].content, std::string("hello"));
  SyncDir(&rec, d.path());
  const bool built = m.Build(d.path(), rec.Ops(), &err);
  if (!built) std::fprintf(stderr, "model: %s\n", err.c_str());
  REQUIRE(built);
  const auto synced = m.Generate(m.num_ops(), MinPolicy());
  REQUIRE(synced.entries.size() == 1);
  CHECK_EQ(synced.entries[0].path, std::string("b"));
}

// ---------------------------------------------------------------- the checker catches broken protocols

TEST(checker_accepts_the_real_protocol_done_by_hand) {
  TempDir d;
  const Files f = MakeValidFiles(d.sub("src"), 1);
  REQUIRE(!f.shard.empty() && !f.manifest.empty());
  REQUIRE(::mkdir(d.sub("run").c_str(), 0755) == 0);
  RecordingEnv rec;
  HandCommit(&rec, d.sub("run"), 1, f, true, true, true);
  CHECK_EQ(ExploreHand(d.sub("run"), &rec), std::string());
}

TEST(checker_catches_every_missing_fsync_of_the_commit) {
  TempDir d;
  const Files f = MakeValidFiles(d.sub("src"), 1);
  REQUIRE(!f.shard.empty());
  struct Case {
    bool data, tmp_dir, run_dir;
    const char* expect;
  };
  for (Case c : {Case{false, true, true, "step-000000001"}, Case{true, false, true, "older than step 1"},
                 Case{true, true, false, "older than step 1"}}) {
    const std::string run = d.sub(std::string("run") + (c.data ? "1" : "0") + (c.tmp_dir ? "1" : "0") + (c.run_dir ? "1" : "0"));
    REQUIRE(::mkdir(run.c_str(), 0755) == 0);
    RecordingEnv rec;
    HandCommit(&rec, run, 1, f, c.data, c.tmp_dir, c.run_dir);
    const std::string bad = ExploreHand(run, &rec);
    CHECK(bad.find(c.expect) != std::string::npos);
    if (bad.find(c.expect) == std::string::npos) std::fprintf(stderr, "got: %s\n", bad.c_str());
  }
}

TEST(a_waiting_rank_reports_durable_only_once_the_commit_is_durable) {
  // Another rank sees the committed step as soon as the coordinator's rename is visible, which is
  // before the coordinator's fsync of RUN_DIR. WaitForCommit must not return OK (the engine then
  // reports that rank's save durable) while a power loss could still undo the rename.
  TempDir d;
  const Files f = MakeValidFiles(d.sub("src"), 1);
  REQUIRE(!f.shard.empty());
  const std::string run = d.sub("run");
  REQUIRE(::mkdir(run.c_str(), 0755) == 0);
  RecordingEnv rec;
  HandCommit(&rec, run, 1, f, true, true, /*sync_run_dir=*/false, /*mark_durable=*/false);
  const Status s = WaitForCommit(&rec, Attempt{run, 1, 0}, 1, 2, 5);
  CHECK(s.ok());
  rec.Mark("durable", 1);
  CHECK_EQ(ExploreHand(run, &rec), std::string());
}

TEST(checker_catches_reuse_of_an_expired_directory_before_its_expiry_is_durable) {
  // Retention renames step-1 away (free-0) and a new save reuses that directory, overwriting the
  // shard in place. Unless fsync(RUN_DIR) made the rename durable first, a power loss can bring
  // back step-1 with a half-overwritten shard: a corrupt checkpoint.
  TempDir d;
  const Files f1 = MakeValidFiles(d.sub("src1"), 1), f2 = MakeValidFiles(d.sub("src2"), 2);
  REQUIRE(!f1.shard.empty() && !f2.shard.empty());
  for (bool sync_expiry : {true, false}) {
    const std::string run = d.sub(sync_expiry ? "run-synced" : "run-unsynced");
    REQUIRE(::mkdir(run.c_str(), 0755) == 0);
    RecordingEnv rec;
    HandCommit(&rec, run, 1, f1, true, true, true);
    HandCommit(&rec, run, 2, f2, true, true, true);
    rec.Rename(JoinPath(run, StepDirName(1)), JoinPath(run, "free-0"));
    rec.Unlink(JoinPath(run, "free-0/" + std::string(kManifestName)));
    if (sync_expiry) SyncDir(&rec, run);
    rec.Rename(JoinPath(run, "free-0"), JoinPath(run, "step-000000003.tmp"));
    int fd = rec.Open(JoinPath(run, "step-000000003.tmp/" + ShardFileName(0)), O_WRONLY, 0);
    REQUIRE(fd >= 0);
    const std::string junk(4096, 'x');
    rec.PWrite(fd, junk.data(), junk.size(), 0);
    rec.Close(fd);
    const std::string bad = ExploreHand(run, &rec);
    if (sync_expiry) {
      CHECK_EQ(bad, std::string());
    } else {
      CHECK(bad.find("CRC mismatch") != std::string::npos && bad.find("step-000000001") != std::string::npos);
    }
  }
}

// ---------------------------------------------------------------- the engine

namespace {

// Sits above the RecordingEnv and widens one race: after retention renames an expired checkpoint
// to free-K, its fsync of RUN_DIR waits (up to 200 ms) until another thread has renamed a free-K
// directory and written into a file there, so a save that reuses the expired directory writes
// before the expiry is durable if the engine lets it.
class ExpiryRaceEnv : public Env {
 public:
  ExpiryRaceEnv(Env* base, std::string run_dir) : base_(base), run_dir_(std::move(run_dir)) {}
  int Open(const std::string& path, int flags, mode_t mode) override {
    int fd = base_->Open(path, flags, mode);
    std::lock_guard<std::mutex> l(mu_);
    if (fd >= 0 && path == run_dir_) run_fds_.insert(fd);
    if (fd >= 0 && !reused_.empty() && path.compare(0, reused_.size() + 1, reused_ + "/") == 0) reused_fds_.insert(fd);
    return fd;
  }
  int Close(int fd) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      run_fds_.erase(fd);
      reused_fds_.erase(fd);
    }
    return base_->Close(fd);
  }
  int FSync(int fd) override {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (run_fds_.count(fd) && expiry_pending_) {
        expiry_pending_ = false;
        ++expiries_;  // retention has renamed, unlinked and handed out the free directory: now its fsync
        cv_.notify_all();
        const uint64_t before = writes_;
        cv_.wait_for(l, std::chrono::milliseconds(200), [&] { return writes_ != before; });
      }
    }
    return base_->FSync(fd);
  }
  ssize_t PWrite(int fd, const void* buf, size_t n, uint64_t off) override {
    ssize_t r = base_->PWrite(fd, buf, n, off);
    std::lock_guard<std::mutex> l(mu_);
    if (reused_fds_.count(fd)) {
      ++writes_;
      cv_.notify_all();
    }
    return r;
  }
  int Rename(const std::string& from, const std::string& to) override {
    int r = base_->Rename(from, to);
    std::lock_guard<std::mutex> l(mu_);
    if (r == 0 && to.find("/free-") != std::string::npos && from.find("/step-") != std::string::npos)
      expiry_pending_ = true;
    if (r == 0 && from.find("/free-") != std::string::npos) reused_ = to;
    return r;
  }
  int RenameNoReplace(const std::string& from, const std::string& to) override {  // a claim
    int r = base_->RenameNoReplace(from, to);
    std::lock_guard<std::mutex> l(mu_);
    if (r == 0 && from.find("/free-") != std::string::npos) reused_ = to;
    return r;
  }
  uint64_t expiries() {
    std::lock_guard<std::mutex> l(mu_);
    return expiries_;
  }
  // Waits until a retention after `seen` reached its fsync of RUN_DIR, or `done` says to stop.
  void AwaitExpiry(uint64_t seen, const std::function<bool()>& done) {
    std::unique_lock<std::mutex> l(mu_);
    while (expiries_ == seen && !done()) cv_.wait_for(l, std::chrono::milliseconds(1));
  }
  ssize_t PRead(int fd, void* buf, size_t n, uint64_t off) override { return base_->PRead(fd, buf, n, off); }
  int FDataSync(int fd) override { return base_->FDataSync(fd); }
  int FAllocate(int fd, uint64_t len) override { return base_->FAllocate(fd, len); }
  int FTruncate(int fd, uint64_t len) override { return base_->FTruncate(fd, len); }
  int FileSize(int fd, uint64_t* size) override { return base_->FileSize(fd, size); }
  int FStat(int fd, FileStat* st) override { return base_->FStat(fd, st); }
  void Confine(const std::string& root) override { base_->Confine(root); }
  void Unconfine(const std::string& root) override { base_->Unconfine(root); }
  int DirectIo(int fd, DirectIoInfo* info) override { return base_->DirectIo(fd, info); }
  int Mkdir(const std::string& path) override { return base_->Mkdir(path); }
  int Unlink(const std::string& path) override { return base_->Unlink(path); }
  int Rmdir(const std::string& path) override { return base_->Rmdir(path); }
  int ListDir(const std::string& path, std::vector<std::string>* names) override { return base_->ListDir(path, names); }
  int IsDir(const std::string& path) override { return base_->IsDir(path); }
  int IsOwnDir(const std::string& path) override { return base_->IsOwnDir(path); }
  int LStat(const std::string& path, FileStat* st) override { return base_->LStat(path, st); }
  int Flock(int fd, int op) override { return base_->Flock(fd, op); }

 private:
  Env* base_;
  const std::string run_dir_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<int> run_fds_, reused_fds_;
  std::string reused_;  // the directory a free-K was last renamed to
  bool expiry_pending_ = false;
  uint64_t writes_ = 0;  // writes into files of reused directories
  uint64_t expiries_ = 0;
};

struct Scenario {
  uint32_t max_in_flight = 2, keep_last = 2, threads = 3;
  uint32_t world_size = 1;  // > 1: one Engine per rank on the shared run dir, each saving from its thread
  // Issue each save when the previous one's retention has just expired a checkpoint (instead of
  // back to back), through an ExpiryRaceEnv: the next save starts while the expiry is not durable.
  bool widen_expiry_race = false;
  // > 0 (several ranks): rank 1's first attempt at this step fails (ENOSPC), the coordinator
  // aborts it, and every rank saves the step again (a directory of its own per attempt).
  uint64_t abort_step = 0;
  // >= 0: the second session continues from this step (ContinueFrom) and saves history 1 from
  // the step after it, through Supersede, over the first session's newer checkpoints.
  int64_t resume_from = -1;
  // Several ranks agree through a store (as a multi-rank Checkpointer does) instead of DONE
  // records: each verdict names the free directory the ranks' next save claims.
  bool store = false;
};

// Saves steps 1-6, closes, reopens and saves 7-9, all through rec (and, for the race, an
// ExpiryRaceEnv above it). Saves are issued back to back, so several are in flight (or, for the
// race, as described at Scenario); modes rotate.
bool Record(const Scenario& sc, const std::string& run, RecordingEnv* rec) {
  ExpiryRaceEnv race(rec, run);
  Env* env = sc.widen_expiry_race ? static_cast<Env*>(&race) : rec;
  std::vector<std::vector<char>> keep_alive[8];  // per rank: zero-copy sources live until done
  FaultEnv faulty(env);  // rank 1's, when a step is to be aborted once
  if (sc.abort_step) {
    FaultRule full;
    full.op = FaultRule::Op::kPWrite;
    full.path_contains = TmpDirName(sc.abort_step) + "/" + ShardFileName(1);
    full.error = ENOSPC;
    full.count = UINT64_MAX;
    faulty.AddRule(full);
  }
  auto session = [&](uint64_t first, uint64_t last, uint32_t history) {
    std::vector<std::unique_ptr<Engine>> engines(sc.world_size);
    auto store = sc.store ? std::make_shared<MemoryKvStore>() : nullptr;  // one per session, as a job's
    for (uint32_t rank = 0; rank < sc.world_size; ++rank) {  // rank 0 first: it cleans up at Open
      EngineOptions o = Options(run, rank == 1 && sc.abort_step ? &faulty : env);
      o.max_in_flight = sc.max_in_flight;
      o.keep_last = sc.keep_last;
      o.threads = sc.threads;
      o.rank = rank;
      o.world_size = sc.world_size;
      o.commit_timeout_s = 120;
      o.one_history = history > 0;  // Save retires the abandoned history (Supersede) itself
      o.store = store;
      o.store_ns = "session-" + std::to_string(first) + "/";
      Status s = Engine::Open(o, &engines[rank]);
      if (!s.ok()) {
        std::fprintf(stderr, "open rank %u: %s\n", rank, s.message().c_str());
        return false;
      }
    }
    g_chunk = engines[0]->chunk_bytes();
    if (history) {
      for (auto& e : engines) e->ContinueFrom(sc.resume_from);
      rec->Mark("resume", static_cast<uint64_t>(sc.resume_from));
    }
    std::mutex mu;
    std::vector<std::thread> waiters;
    bool ok = true;
    auto saver = [&](uint32_t rank) {
      Engine* e = engines[rank].get();
      for (uint64_t step = first; step <= last; ++step) {
        const std::vector<char>* a;
        const std::vector<char>* m;
        {
          std::lock_guard<std::mutex> l(mu);  // StepData's cache is not thread-safe
          keep_alive[rank].push_back(StepData(RankKey(step, rank, history)));
          keep_alive[rank].push_back(StepSmall(RankKey(step, rank, history)));
          a = &keep_alive[rank][keep_alive[rank].size() - 2];
          m = &keep_alive[rank].back();
        }
        const SaveMode mode = step % 3 == 0 ? SaveMode::kZeroCopy : step % 3 == 1 ? SaveMode::kSnapshot : SaveMode::kSnapshotOverlap;
        std::shared_ptr<SaveHandle> h;
        const uint64_t expiries = race.expiries();
        Status s = e->Save(SaveReq(step, {{"a", a->data(), a->size()}, {"m", m->data(), m->size()}}, StepMeta(step, history), mode), &h);
        if (s.ok() && step == sc.abort_step) {  // the aborted attempt, then the retry
          h->Wait(-1);
          if (h->status().ok()) {
            std::fprintf(stderr, "rank %u: the first attempt at step %llu did not fail\n", rank,
                         static_cast<unsigned long long>(step));
            std::lock_guard<std::mutex> l(mu);
            ok = false;
            return;
          }
          s = e->Save(SaveReq(step, {{"a", a->data(), a->size()}, {"m", m->data(), m->size()}}, StepMeta(step, history), mode), &h);
          if (s.ok()) h->Wait(-1);
          if (s.ok() && !h->status().ok()) {
            std::fprintf(stderr, "rank %u: the retry of step %llu failed: %s\n", rank,
                         static_cast<unsigned long long>(step), h->status().message().c_str());
            std::lock_guard<std::mutex> l(mu);
            ok = false;
            return;
          }
        }
        std::unique_lock<std::mutex> l(mu);
        if (!s.ok()) {
          std::fprintf(stderr, "save %llu rank %u: %s\n", static_cast<unsigned long long>(step), rank, s.message().c_str());
          ok = false;
          return;
        }
        // The moment the save is reported durable goes into the log: crash points after it
        // must keep a checkpoint at least this new.
        waiters.emplace_back([rec, h, rank, &mu, &ok] {
          h->Wait(-1);
          if (h->status().ok()) {
            rec->Mark("durable", h->step());
            return;
          }
          // Every save here is meant to succeed (the aborted attempt was waited for above): a
          // failure, a commit timeout included, is a bug the power-loss states would not show.
          std::fprintf(stderr, "save %llu rank %u failed: %s\n", static_cast<unsigned long long>(h->step()), rank,
                       h->status().message().c_str());
          std::lock_guard<std::mutex> fl(mu);
          ok = false;
        });
        l.unlock();
        if (sc.widen_expiry_race) race.AwaitExpiry(expiries, [&] { return h->Done(); });
      }
    };
    std::vector<std::thread> savers;
    for (uint32_t rank = 1; rank < sc.world_size; ++rank) savers.emplace_back(saver, rank);
    saver(0);
    for (auto& t : savers) t.join();
    for (auto& w : waiters) w.join();
    for (auto& e : engines) e->Close();
    return ok;
  };
  if (sc.world_size > 8) return false;
  if (sc.resume_from >= 0) return session(1, 6, 0) && session(static_cast<uint64_t>(sc.resume_from) + 1, 8, 1);
  return session(1, 6, 0) && session(7, 9, 0);
}

// Reuses of a free-K directory (a rename from it to anything but another free-K name) while the
// rename that made it free-K was not yet made durable by an fsync of the run directory.
size_t ReusesBeforeExpiryDurable(const std::vector<RecordedOp>& ops, const std::string& run) {
  std::set<int> run_fds;
  std::set<std::string> undurable;  // free-K names whose expiry rename is not yet durable
  size_t n = 0;
  for (const RecordedOp& op : ops) {
    if (op.kind == RecordedOp::Kind::kOpen && op.path == run) run_fds.insert(op.fd);
    if (op.kind == RecordedOp::Kind::kClose) run_fds.erase(op.fd);
    if (op.kind == RecordedOp::Kind::kFSync && run_fds.count(op.fd)) undurable.clear();
    if (op.kind == RecordedOp::Kind::kRename) {
      if (op.path2.find("/free-") != std::string::npos && op.path.find("/step-") != std::string::npos &&
          op.path.find(".tmp") == std::string::npos)
        undurable.insert(op.path2);
      // free-K.new -> free-K (several ranks) only renames it: the expiry stays what it was.
      else if (undurable.erase(op.path)) {
        if (op.path2.find("/free-") != std::string::npos) undurable.insert(op.path2);
        else ++n;
      }
    }
  }
  return n;
}

// Saves that took an expired checkpoint's directory (a rename of a free-K to a step's .tmp).
size_t Reuses(const std::vector<RecordedOp>& ops) {
  size_t n = 0;
  for (const RecordedOp& op : ops)
    if (op.kind == RecordedOp::Kind::kRename && op.path.find("/free-") != std::string::npos &&
        op.path2.find("/step-") != std::string::npos && op.path2.find(".tmp") != std::string::npos)
      ++n;
  return n;
}

void RecordAndExplore(const Scenario& sc) {
  g_resumed_from = sc.resume_from;
  TempDir d;
  const std::string run = d.sub("run");
  REQUIRE(::mkdir(run.c_str(), 0755) == 0);
  RecordingEnv rec;
  REQUIRE(Record(sc, run, &rec));
  PowerLossModel model;
  std::string err;
  const bool built = model.Build(run, rec.Ops(), &err);
  if (!built) std::fprintf(stderr, "model: %s\n", err.c_str());
  REQUIRE(built);
  CHECK(model.LastMark(model.num_ops(), "durable") == (sc.resume_from >= 0 ? 8 : 9));
  if (std::getenv("ALPSCK_CRASH_DUMP"))  // the whole log, for debugging
    std::fprintf(stderr, "%s", model.Tail(model.num_ops(), model.num_ops()).c_str());
  // Less per crash point where each state costs more: files 16x larger (64 KiB pages, the
  // aarch64 run under qemu) or a sanitizer / unoptimised build; all crash points still.
  Budget budget;
  if (PageSize() > 4096 || kSlowBuild) {
    budget.random_per_point = 2;
    budget.restart_every = 16;
    if (sc.world_size > 1) {  // twice the calls and directories
      budget.cuts_with_data_lost = false;
      budget.cut_every = 2;
      budget.restart_every = 32;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  Explored ex;
  const std::string bad = Explore(model, budget, &ex);
  CHECK_EQ(bad, std::string());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr,
               "%zu calls logged (%zu reuses of expired directories, %zu before the expiry was durable); %zu crash "
               "points, %zu states (%zu distinct) recovered, %zu restarts, %.1f s\n",
               model.num_ops(), Reuses(model.ops()), ReusesBeforeExpiryDurable(model.ops(), run), ex.crash_points,
               ex.states, ex.distinct,
               ex.restarts, secs);
  CHECK(ex.distinct > 200);
  // The protocol rule behind the race scenario, checked on the log directly: an expired
  // directory is reused only after an fsync of RUN_DIR made its expiry durable.
  CHECK_EQ(ReusesBeforeExpiryDurable(model.ops(), run), size_t{0});
  // Every scenario with one rank, or several through a store, recycles (keep_last > 0). Ranks
  // agreeing through DONE records hear no verdict naming a free directory: only rank 0 claims
  // the one it named, when it comes first, so there reuse depends on timing.
  if (sc.world_size == 1 || sc.store) CHECK(Reuses(model.ops()) > 0);
}

}  // namespace

TEST(engine_saves_survive_every_power_loss_state) { RecordAndExplore(Scenario{}); }

TEST(two_rank_saves_survive_every_power_loss_state) {
  Scenario sc;
  sc.world_size = 2;  // each rank its shard and DONE record; rank 0 commits and expires
  sc.threads = 2;
  RecordAndExplore(sc);
}

TEST(two_rank_retry_of_an_aborted_step_survives_every_power_loss_state) {
  Scenario sc;
  sc.world_size = 2;
  sc.threads = 2;
  sc.abort_step = 4;
  RecordAndExplore(sc);
}

TEST(a_run_resumed_from_an_older_step_never_leaves_the_abandoned_history_in_front) {
  // Steps 1-6, then a restart that continues from step 4 (5 and 6 corrupt, or rolled back):
  // it saves 5-8 anew. Every state keeps the promises, and none holds a valid abandoned 5 or 6
  // beside a checkpoint of the resumed history.
  Scenario sc;
  sc.keep_last = 3;  // step 4 is still there when the run resumes from it
  sc.resume_from = 4;
  RecordAndExplore(sc);
}

TEST(recycling_survives_power_loss_while_an_expiry_is_not_yet_durable) {
  Scenario sc;
  sc.max_in_flight = 3;  // room for a save to start while retention is between rename and fsync
  sc.keep_last = 1;
  sc.widen_expiry_race = true;
  RecordAndExplore(sc);
}

TEST(two_rank_recycling_survives_power_loss_while_an_expiry_is_not_yet_durable) {
  // Rank 0 expires a step while both ranks already prepare the next ones: a free-K directory is
  // claimed (by either rank: the one a verdict named) only once its expiry is durable.
  Scenario sc;
  sc.world_size = 2;
  sc.store = true;
  sc.threads = 2;
  sc.max_in_flight = 3;
  sc.keep_last = 1;
  sc.widen_expiry_race = true;
  RecordAndExplore(sc);
}

ALPSCK_TEST_MAIN()
