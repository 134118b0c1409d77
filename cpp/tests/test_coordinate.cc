// Multi-rank checkpoints: one Engine per rank on a shared run directory, one commit for all
// (coordinate.h). Ranks run as threads here; the protocol only meets through the file system,
// so the same holds for processes on several nodes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "commit.h"
#include "commit_attempt.h"
#include "coordinate.h"
#include "engine.h"
#include "env_fault.h"
#include "file_io.h"
#include "kv_store_memory.h"
#include "recovery.h"
#include "run_dir_actions.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::SaveReq;
using alpsck_test::Exists;
using alpsck_test::RandomBytes;
using alpsck_test::TempDir;

namespace {

std::unique_ptr<Engine> OpenRank(const std::string& dir, uint32_t rank, uint32_t world, Env* env = nullptr,
                                 uint32_t keep_last = 0, double timeout_s = 30, bool direct_io = true,
                                 bool one_history = false, std::shared_ptr<KvStore> store = nullptr) {
  EngineOptions o;
  o.run_dir = dir;
  o.chunk_bytes = 64 << 10;
  o.threads = 2;
  o.rank = rank;
  o.world_size = world;
  o.keep_last = keep_last;
  o.commit_timeout_s = timeout_s;
  o.env = env;
  o.direct_io = direct_io;
  o.one_history = one_history;
  o.store = std::move(store);  // as a multi-rank Checkpointer's engines (torch.distributed's store)
  o.store_ns = "test/";
  std::unique_ptr<Engine> e;
  Status s = Engine::Open(o, &e);
  if (!s.ok()) std::fprintf(stderr, "Engine::Open(rank %u): %s\n", rank, s.message().c_str());
  return e;
}

std::vector<char> Data(uint64_t step, uint32_t rank) { return RandomBytes(200000 + rank * 1000, static_cast<uint32_t>(step * 31 + rank)); }

bool ShardHolds(const std::string& dir, uint64_t step, uint32_t rank, const std::vector<char>& want) {
  std::unique_ptr<ShardReader> r;
  if (!ShardReader::Open(Env::Default(), JoinPath(JoinPath(dir, StepDirName(step)), ShardFileName(rank)), true, &r).ok())
    return false;
  if (r->index().rank != rank || r->index().layout.extents.size() != 1) return false;
  std::vector<char> got(want.size());
  std::vector<char*> dsts{got.data()};
  return r->index().layout.extents[0].size == want.size() && r->Read(dsts, 2).ok() && got == want;
}

std::vector<CheckpointInfo> Scan(const std::string& dir) {
  std::vector<CheckpointInfo> infos;
  Status s = ScanRunDir(Env::Default(), dir, true, 2, &infos);
  if (!s.ok()) std::fprintf(stderr, "scan: %s\n", s.message().c_str());
  return infos;
}

// Every rank saves `step` (its own data); returns each rank's final status (and in *results, if given, its result).
std::vector<Status> SaveAll(std::vector<std::unique_ptr<Engine>>& engines, uint64_t step, CommitMode mode = CommitMode::kAuto,
                            std::vector<SaveResult>* results = nullptr) {
  std::vector<Status> out(engines.size());
  if (results) results->assign(engines.size(), SaveResult{});
  std::vector<std::thread> ts;
  for (uint32_t r = 0; r < engines.size(); ++r) {
    ts.emplace_back([&, r] {
      if (!engines[r]) return;
      auto data = Data(step, r);
      std::shared_ptr<SaveHandle> h;
      Status s = engines[r]->Save(SaveReq(step, {{"w", data.data(), data.size()}}, "{\"rank\":" + std::to_string(r) + "}",
                                  SaveMode::kSnapshot, mode), &h);
      if (s.ok()) {
        h->Wait(-1);
        s = h->status();
        if (results) (*results)[r] = h->result();
      }
      out[r] = s;
    });
  }
  for (auto& t : ts) t.join();
  return out;
}

}  // namespace

TEST(three_ranks_commit_once_with_every_shard) {
  TempDir d;
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 3; ++r) e.push_back(OpenRank(d.path(), r, 3, nullptr, 2));
  for (auto& x : e) REQUIRE(x);
  for (uint64_t step : {10, 20, 30}) {
    for (const Status& s : SaveAll(e, step)) {
      if (!s.ok()) std::fprintf(stderr, "save of step %d: %s\n", static_cast<int>(step), s.message().c_str());
      CHECK(s.ok());
    }
    // A handle completes only once the whole checkpoint is committed, on every rank.
    CHECK(Exists(JoinPath(JoinPath(d.path(), StepDirName(step)), kManifestName)));
  }
  auto infos = Scan(d.path());
  REQUIRE(infos.size() == 2);  // keep_last 2: step 10 expired (kept as a free-K directory for reuse)
  for (const auto& i : infos) {
    CHECK(i.state == CheckpointState::kCommitted);
    CHECK_EQ(i.ranks, 3u);
    CHECK(i.verified);
  }
  CHECK_EQ(infos[0].step, uint64_t{20});
  for (uint32_t r = 0; r < 3; ++r) CHECK(ShardHolds(d.path(), 30, r, Data(30, r)));
  std::vector<std::string> names;
  REQUIRE(Env::Default()->ListDir(d.path(), &names) == 0);
  size_t free_dirs = 0;
  for (const auto& n : names) {
    CHECK(n.find(".tmp") == std::string::npos && n.find(".new") == std::string::npos);
    free_dirs += n.rfind("free-", 0) == 0;
  }
  CHECK_EQ(free_dirs, size_t{1});
  std::string latest;
  REQUIRE(ReadSmallFile(Env::Default(), JoinPath(d.path(), kLatestName), 64, &latest).ok());
  CHECK_EQ(latest, std::string("30\n"));
}

uint64_t Inode(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::vector<std::string> FreeDirs(const std::string& dir) {
  std::vector<std::string> names, out;
  if (Env::Default()->ListDir(dir, &names) == 0)
    for (const auto& n : names)
      if (n.rfind("free-", 0) == 0) out.push_back(n);
  return out;
}

TEST(every_rank_overwrites_an_expired_checkpoints_shard_in_place) {
  // Through a store, as a multi-rank Checkpointer: each verdict names the expired directory the
  // next save claims, so no rank lists RUN_DIR. The directory expired when step s committed is
  // named in step s+1's verdict and taken by step s+2.
  TempDir d;
  auto store = std::make_shared<MemoryKvStore>();
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 3; ++r) e.push_back(OpenRank(d.path(), r, 3, nullptr, 1, 30, true, false, store));  // keep_last 1
  for (auto& x : e) REQUIRE(x);
  std::map<uint64_t, std::vector<uint64_t>> inodes;  // step -> each rank's shard's inode
  for (uint64_t step = 1; step <= 6; ++step) {
    for (const Status& s : SaveAll(e, step)) {
      if (!s.ok()) std::fprintf(stderr, "save of step %d: %s\n", static_cast<int>(step), s.message().c_str());
      REQUIRE(s.ok());
    }
    for (uint32_t r = 0; r < 3; ++r) {
      CHECK(ShardHolds(d.path(), step, r, Data(step, r)));
      inodes[step].push_back(Inode(JoinPath(JoinPath(d.path(), StepDirName(step)), ShardFileName(r))));
    }
    // The expired step became at most max_in_flight free-K directories holding its shards and
    // its manifest (replaced by the commit of the save that claims it; nothing is overwritten
    // before the expiry is durable), and nothing else: no DONE record that could pass for a
    // rank's record of the next step.
    const auto free_dirs = FreeDirs(d.path());
    CHECK(free_dirs.size() <= 2);
    for (const auto& f : free_dirs) {
      CHECK(f.find(".new") == std::string::npos);
      std::vector<std::string> names;
      REQUIRE(Env::Default()->ListDir(JoinPath(d.path(), f), &names) == 0);
      CHECK_EQ(names.size(), size_t{4});
      for (const auto& n : names)
        CHECK(n == kManifestName || (n.rfind("rank-", 0) == 0 && n.size() > 4 && n.compare(n.size() - 4, 4, ".bin") == 0));
    }
  }
  // Step s+3 took the directory of step s, expired when s+1 committed and named in the verdict of
  // s+2: the same files, overwritten.
  for (uint64_t step = 4; step <= 6; ++step)
    for (uint32_t r = 0; r < 3; ++r) {
      CHECK(inodes[step][r] != 0);
      CHECK_EQ(inodes[step][r], inodes[step - 3][r]);
    }
  auto infos = Scan(d.path());
  REQUIRE(infos.size() == 1);
  CHECK_EQ(infos[0].step, uint64_t{6});
  CHECK(infos[0].verified);
}

TEST(a_free_directory_is_claimed_once_and_never_over_a_started_step) {
  TempDir d;
  const std::string run = d.path();
  const std::string free_dir = JoinPath(run, "free-1-1-0");
  REQUIRE(Env::Default()->Mkdir(free_dir) == 0);
  REQUIRE(Env::Default()->Mkdir(JoinPath(run, "free-2-1-0.new")) == 0);  // expiry not yet durable
  const std::string tmp = JoinPath(run, TmpDirName(5));
  REQUIRE(Env::Default()->Mkdir(tmp) == 0);
  REQUIRE(alpsck_test::WriteText(JoinPath(tmp, ShardFileName(1)), "x"));  // rank 1 has started step 5
  CHECK_EQ(ClaimDir(Env::Default(), run, "free-1-1-0", tmp), -EEXIST);
  CHECK(Exists(free_dir));
  CHECK(Exists(JoinPath(tmp, ShardFileName(1))));
  const std::string tmp6 = JoinPath(run, TmpDirName(6));
  REQUIRE(Env::Default()->Mkdir(tmp6) == 0);  // empty: a rank has just made it; a plain rename would replace it
  CHECK_EQ(ClaimDir(Env::Default(), run, "free-1-1-0", tmp6), -EEXIST);
  CHECK(Exists(free_dir));
  const std::string tmp7 = JoinPath(run, TmpDirName(7));
  CHECK_EQ(ClaimDir(Env::Default(), run, "free-1-1-0", tmp7), 0);
  CHECK(!Exists(free_dir));
  CHECK(Exists(tmp7));
  CHECK_EQ(ClaimDir(Env::Default(), run, "free-1-1-0", JoinPath(run, TmpDirName(8))), -ENOENT);  // claimed once
  CHECK_EQ(ClaimDir(Env::Default(), run, "free-2-1-0.new", JoinPath(run, TmpDirName(8))), -EINVAL);  // not durable yet
  CHECK_EQ(ClaimDir(Env::Default(), run, "../x", JoinPath(run, TmpDirName(8))), -EINVAL);
  CHECK(Exists(JoinPath(run, "free-2-1-0.new")));
}

TEST(a_waiting_rank_takes_a_vanished_step_dir_for_a_commit_that_already_expired) {
  // With keep_last below the saves in flight, rank 0 can commit step 3, then newer steps, and
  // expire step 3 before a slow rank looks: neither step-3/ nor step-3.tmp/ is there any more.
  // That rank used to wait for the timeout and fail a save that had been committed.
  TempDir d;
  const std::string run = d.path();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(WaitForCommit(Env::Default(), Attempt{run, 3, 0}, 1, 2, 30).ok());
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // not its 30 s timeout
}

TEST(a_rank_that_gives_up_decides_the_abort_for_every_rank) {
  // Rank 1 waits 0.2 s for a commit that does not come: it does not just report failure (rank 0
  // could still commit, a split verdict); it aborts the attempt by renaming its directory, so
  // rank 0's commit can no longer happen, and rank 0 reads the same verdict.
  TempDir d;
  const std::string run = d.path();
  const Attempt a{run, 4, 0};
  REQUIRE(Env::Default()->Mkdir(a.tmp_dir()) == 0);
  Status s = WaitForCommit(Env::Default(), a, 1, 2, 0.2);
  CHECK(s.code() == Code::kAborted);
  CHECK(s.message().find("rank 1: no commit from rank 0 within 0.2 s") != std::string::npos);
  CHECK(!Exists(a.tmp_dir()) && Exists(JoinPath(a.aborted_dir(), kAbortedName)));
  Status verdict;
  CHECK(ReadVerdict(Env::Default(), a, &verdict) == Verdict::kAborted);
  CHECK(verdict.message() == s.message());
  // Rank 0 comes to commit now: its rename finds nothing, and its abort reads rank 1's verdict.
  bool won = true;
  CHECK(Abort(Env::Default(), a, 0, "late", &verdict, &won) == Verdict::kAborted && !won);
  CHECK(verdict.message().find("rank 1: no commit") != std::string::npos);
  // Each rank records that it saw the verdict; the last one removes it.
  SawAbort(Env::Default(), a, 1, 2);
  CHECK(Exists(a.aborted_dir()));
  SawAbort(Env::Default(), a, 0, 2);
  CHECK(!Exists(a.aborted_dir()));
}

TEST(a_rank_that_gives_up_after_the_commit_rename_reports_the_commit) {
  TempDir d;
  const std::string run = d.path();
  const Attempt a{run, 5, 2};
  REQUIRE(Env::Default()->Mkdir(a.final_dir()) == 0);  // the commit rename has happened
  Status why;
  bool won = true;
  CHECK(Abort(Env::Default(), a, 1, "tired", &why, &won) == Verdict::kCommitted && !won);
  CHECK(!Exists(a.aborted_dir()));
  CHECK(WaitForCommit(Env::Default(), a, 1, 2, 0.05).ok());
}

TEST(a_rank_arriving_after_the_abort_removes_its_part_and_reads_the_verdict) {
  // Rank 1 gave up before slow rank 2 had even created its shard: rank 2 re-creates step-6.tmp.
  TempDir d;
  const std::string run = d.path();
  const Attempt a{run, 6, 0};
  REQUIRE(Env::Default()->Mkdir(a.tmp_dir()) == 0);
  Status why;
  REQUIRE(Abort(Env::Default(), a, 1, "rank 1 gave up", &why) == Verdict::kAborted);
  REQUIRE(alpsck_test::WriteText(JoinPath(a.aborted_dir(), "x"), "keep the name taken"));
  REQUIRE(Env::Default()->Mkdir(a.tmp_dir()) == 0);
  REQUIRE(alpsck_test::WriteText(JoinPath(a.tmp_dir(), ShardFileName(2)), "late shard"));
  CHECK(ReadVerdict(Env::Default(), a, &why) == Verdict::kAborted);  // the verdict wins over the re-created dir
  CHECK(WaitForCommit(Env::Default(), a, 2, 3, 0.05).code() == Code::kAborted);
  CHECK(Abort(Env::Default(), a, 2, "too", &why) == Verdict::kAborted);
  CHECK(why.message().find("rank 1 gave up") != std::string::npos);
  CHECK(!Exists(a.tmp_dir()));  // rank 2's part removed, and with it the re-created directory
}

TEST(a_rank_that_fails_aborts_the_step_everywhere_and_the_next_step_commits) {
  TempDir d;
  FaultEnv faulty;
  FaultRule full;  // rank 1's shard of step 2 hits ENOSPC
  full.op = FaultRule::Op::kPWrite;
  full.path_contains = "step-000000002.tmp/rank-00001";
  full.error = ENOSPC;
  full.count = UINT64_MAX;
  faulty.AddRule(full);
  std::vector<std::unique_ptr<Engine>> e;
  e.push_back(OpenRank(d.path(), 0, 2));
  e.push_back(OpenRank(d.path(), 1, 2, &faulty));
  for (auto& x : e) REQUIRE(x);
  for (const Status& s : SaveAll(e, 1)) CHECK(s.ok());
  auto st = SaveAll(e, 2);
  CHECK(st[1].code() == Code::kNoSpace);
  CHECK(st[0].code() == Code::kAborted);
  CHECK(st[0].message().find("rank 1") != std::string::npos);
  CHECK(!Exists(JoinPath(d.path(), StepDirName(2))));
  // Nothing is left of step 2: both ranks read the verdict, so its record went too.
  std::vector<std::string> left;
  REQUIRE(Env::Default()->ListDir(d.path(), &left) == 0);
  for (const auto& n : left) CHECK(n.rfind(StepDirName(2), 0) != 0);
  faulty.ClearRules();
  for (const Status& s : SaveAll(e, 3)) CHECK(s.ok());
  auto infos = Scan(d.path());
  std::vector<uint64_t> committed;
  for (const auto& i : infos)
    if (i.state == CheckpointState::kCommitted) committed.push_back(i.step);
  CHECK(committed == std::vector<uint64_t>({1, 3}));
}

TEST(a_step_aborted_by_any_rank_can_be_saved_again_by_every_rank) {
  // A transient failure (ENOSPC here) aborts the step; the ranks retry the same step in the same
  // processes. Each attempt has its own directory, so the retry neither sees the old ABORTED
  // verdict nor mixes with late files of the aborted attempt.
  TempDir d;
  FaultEnv env0, env1;
  FaultRule full;
  full.op = FaultRule::Op::kPWrite;
  full.error = ENOSPC;
  full.count = UINT64_MAX;
  std::vector<std::unique_ptr<Engine>> e;
  e.push_back(OpenRank(d.path(), 0, 2, &env0));
  e.push_back(OpenRank(d.path(), 1, 2, &env1));
  for (auto& x : e) REQUIRE(x);
  for (const Status& s : SaveAll(e, 1)) CHECK(s.ok());
  full.path_contains = "rank-00001.bin";  // attempt 1: rank 1 fails, the coordinator aborts
  env1.AddRule(full);
  auto st = SaveAll(e, 2);
  CHECK(st[1].code() == Code::kNoSpace);
  CHECK(st[0].code() == Code::kAborted);
  env1.ClearRules();
  full.path_contains = "rank-00000.bin";  // attempt 2: the coordinator itself fails
  env0.AddRule(full);
  st = SaveAll(e, 2);
  CHECK(st[0].code() == Code::kNoSpace);
  if (st[1].code() != Code::kAborted) std::fprintf(stderr, "rank 1: %s\n", st[1].message().c_str());
  CHECK(st[1].code() == Code::kAborted);
  CHECK(st[1].message().find("was aborted: rank 0: ") != std::string::npos);
  env0.ClearRules();
  for (const Status& s : SaveAll(e, 2)) {  // attempt 3 commits
    if (!s.ok()) std::fprintf(stderr, "retry of step 2: %s\n", s.message().c_str());
    CHECK(s.ok());
  }
  for (uint32_t r = 0; r < 2; ++r) CHECK(ShardHolds(d.path(), 2, r, Data(2, r)));
  // The aborted attempts' directories went with the commit (every rank had moved past them).
  std::vector<std::string> names;
  REQUIRE(Env::Default()->ListDir(d.path(), &names) == 0);
  for (const auto& n : names) CHECK(n.find(".tmp") == std::string::npos);
  for (const Status& s : SaveAll(e, 2)) {  // a committed step: skipped, as before
    if (!s.ok()) std::fprintf(stderr, "step 2 again: %s\n", s.message().c_str());
    CHECK(s.ok());
  }
  for (const Status& s : SaveAll(e, 3)) CHECK(s.ok());
  std::vector<uint64_t> committed;
  for (const auto& i : Scan(d.path()))
    if (i.state == CheckpointState::kCommitted) committed.push_back(i.step);
  CHECK(committed == std::vector<uint64_t>({1, 2, 3}));
}

TEST(a_rank_whose_attempt_is_aborted_while_it_starts_hears_the_verdict_from_its_handle) {
  // CI found the race: rank 0 joined step 2's attempt (its directory was there), then rank 1
  // failed and renamed the directory to its aborted name before rank 0 created its shard in it.
  // Rank 0's Save returned the abort as its own error while a rank that came a moment later got
  // it from its handle, so a caller that retries a step whose handle failed never retried.
  // Every rank that did not decide the abort itself hears it the same way: from the handle.
  TempDir d;
  FaultEnv env0, env1;
  FaultRule slow_open;  // holds rank 0 between joining the attempt and creating its shard
  slow_open.op = FaultRule::Op::kOpen;
  slow_open.path_contains = TmpDirName(2) + "/" + ShardFileName(0);
  slow_open.error = 0;
  slow_open.delay_us = 3000000;
  env0.AddRule(slow_open);
  FaultRule full;
  full.op = FaultRule::Op::kPWrite;
  full.path_contains = TmpDirName(2) + "/" + ShardFileName(1);
  full.error = ENOSPC;
  full.count = UINT64_MAX;
  env1.AddRule(full);
  std::vector<std::unique_ptr<Engine>> e;
  e.push_back(OpenRank(d.path(), 0, 2, &env0));
  e.push_back(OpenRank(d.path(), 1, 2, &env1));
  for (auto& x : e) REQUIRE(x);
  const auto data0 = Data(2, 0), data1 = Data(2, 1);
  Status sync0;
  std::shared_ptr<SaveHandle> h0, h1;
  std::atomic<bool> rank0_returned{false};
  std::thread t0([&] {
    sync0 = e[0]->Save(SaveReq(2, {{"w", data0.data(), data0.size()}}, "{}", SaveMode::kSnapshot), &h0);
    rank0_returned = true;
  });
  while (env0.FaultsInjected() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(e[1]->Save(SaveReq(2, {{"w", data1.data(), data1.size()}}, "{}", SaveMode::kSnapshot), &h1).ok());
  h1->Wait(-1);
  CHECK(h1->status().code() == Code::kNoSpace);  // rank 1 decided the abort
  const bool in_the_window = !rank0_returned;  // rank 0 still held before its open
  t0.join();
  CHECK(in_the_window);
  if (!sync0.ok()) std::fprintf(stderr, "rank 0's Save: %s\n", sync0.message().c_str());
  REQUIRE(sync0.ok());
  h0->Wait(-1);
  CHECK(h0->status().code() == Code::kAborted);
  CHECK(h0->status().message().find("was aborted: rank 1: ") != std::string::npos);
  env0.ClearRules();
  env1.ClearRules();
  for (const Status& s : SaveAll(e, 2)) {  // the retry, by both, commits
    if (!s.ok()) std::fprintf(stderr, "retry of step 2: %s\n", s.message().c_str());
    CHECK(s.ok());
  }
  for (uint32_t r = 0; r < 2; ++r) CHECK(ShardHolds(d.path(), 2, r, Data(2, r)));
}

TEST(skewed_ranks_with_tiny_timeouts_always_agree_with_each_other_and_the_disk) {
  // The split verdict: rank 1 (a tiny shard) gave up on its own clock while rank 0 (slow: its
  // fdatasync and its commit rename held up) went on to commit. Every outcome must now be one
  // verdict: both ranks succeed and step-N is committed, or both fail and it is not; nothing of
  // an attempt is left behind; retries of an aborted step use the next attempt and agree too.
  TempDir d;
  FaultEnv slow0;
  std::vector<std::unique_ptr<Engine>> e;
  e.push_back(OpenRank(d.path(), 0, 2, &slow0, 0, 5));
  std::mt19937 rng(20261124);
  int committed = 0, aborted = 0;
  for (uint64_t step = 1; step <= 40; ++step) {
    const double timeout1 = 0.002 * (1 + rng() % 40);  // 2 to 80 ms
    e.resize(1);
    e.push_back(OpenRank(d.path(), 1, 2, nullptr, 0, timeout1));
    REQUIRE(e[0] && e[1]);
    slow0.ClearRules();
    FaultRule r;
    r.error = 0;
    r.count = UINT64_MAX;
    r.op = FaultRule::Op::kFDataSync;
    r.delay_us = 1000 * (rng() % 60);
    slow0.AddRule(r);
    r.op = FaultRule::Op::kRename;
    r.path_contains = StepDirName(step);
    r.delay_us = 1000 * (rng() % 60);
    slow0.AddRule(r);
    for (int attempt = 0; attempt < 2; ++attempt) {  // an aborted step is saved again once
      const auto st = SaveAll(e, step);
      if (st[0].ok() != st[1].ok())
        std::fprintf(stderr, "step %d: rank 0: %s / rank 1: %s\n", static_cast<int>(step), st[0].message().c_str(),
                     st[1].message().c_str());
      CHECK_EQ(st[0].ok(), st[1].ok());
      bool on_disk = false;
      for (const auto& i : Scan(d.path()))
        if (i.step == step && i.state == CheckpointState::kCommitted) on_disk = true;
      CHECK_EQ(on_disk, st[0].ok() && st[1].ok());
      if (st[0].ok()) {
        ++committed;
        break;
      }
      ++aborted;
      for (const Status& s : st) CHECK(s.code() == Code::kAborted || s.message().find("aborted") != std::string::npos);
    }
  }
  e.clear();
  std::fprintf(stderr, "skew: %d commits, %d aborted attempts\n", committed, aborted);
  CHECK(committed > 0 && aborted > 0);  // both outcomes were exercised
  std::vector<std::string> names;
  REQUIRE(Env::Default()->ListDir(d.path(), &names) == 0);
  for (const auto& n : names) {
    const EntryKind k = ParseRunDirName(n).kind;
    if (k != EntryKind::kStep && k != EntryKind::kLatest) std::fprintf(stderr, "left behind: %s\n", n.c_str());
    CHECK(k == EntryKind::kStep || k == EntryKind::kLatest);
  }
}

TEST(a_missing_rank_times_out_and_earlier_checkpoints_stay_valid) {
  TempDir d;
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 3; ++r) e.push_back(OpenRank(d.path(), r, 3));  // step 1 commits, however slow the disk
  for (auto& x : e) REQUIRE(x);
  for (const Status& s : SaveAll(e, 1)) CHECK(s.ok());
  e.clear();  // rank 2 dies: it never saves step 2; the others wait 2 s for it
  e.push_back(OpenRank(d.path(), 0, 3, nullptr, 0, 2));
  e.push_back(OpenRank(d.path(), 1, 3, nullptr, 0, 2));
  for (size_t r = 0; r < 2; ++r) REQUIRE(e[r]);
  e.emplace_back();
  auto st = SaveAll(e, 2);
  CHECK(st[0].code() == Code::kAborted);
  CHECK(st[0].message().find("rank(s) 2") != std::string::npos);
  CHECK(st[1].code() == Code::kAborted);
  auto infos = Scan(d.path());
  REQUIRE(!infos.empty());
  CHECK(infos[0].step == 1 && infos[0].state == CheckpointState::kCommitted);
  for (const auto& i : infos) CHECK(i.step != 2 || i.state != CheckpointState::kCommitted);
}

TEST(deferred_shards_commit_with_extra_files_through_commit_step) {
  TempDir d;
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 2; ++r) e.push_back(OpenRank(d.path(), r, 2));
  for (auto& x : e) REQUIRE(x);
  for (const Status& s : SaveAll(e, 7, CommitMode::kDeferred)) CHECK(s.ok());
  CHECK(!Exists(JoinPath(d.path(), StepDirName(7))));  // sealed, not committed
  Status s = CommitStep(Env::Default(), d.path(), 7, 2, {{"dcp.json", "{\"planner\":1}"}}, 5);
  REQUIRE(s.ok());
  auto infos = Scan(d.path());
  REQUIRE(infos.size() == 1);
  CHECK(infos[0].state == CheckpointState::kCommitted);
  CHECK(infos[0].extra_files == std::vector<std::string>({"dcp.json"}));
  // The extra file is verified like a shard.
  const std::string extra = JoinPath(JoinPath(d.path(), StepDirName(7)), "dcp.json");
  REQUIRE(alpsck_test::FlipBit(extra, 3));
  infos = Scan(d.path());
  CHECK(infos[0].state == CheckpointState::kCorrupt);
  CHECK(infos[0].error.find("dcp.json") != std::string::npos);
  // Names that could leave the directory are refused before anything is written.
  CHECK(CommitStep(Env::Default(), d.path(), 8, 1, {{"../x", "y"}}, 1).code() == Code::kInvalidArgument);
  // So is a file larger than recovery reads: it would commit a checkpoint that scans as corrupt.
  CHECK(CommitStep(Env::Default(), d.path(), 8, 1, {{"big.json", std::string(kMaxManifestBytes + 1, 'x')}}, 1).code() ==
        Code::kInvalidArgument);
}

TEST(done_records_carry_how_the_shard_was_written) {
  ShardRecord r;
  r.name = ShardFileName(3);
  r.bytes = 4096;
  r.direct_io = true;
  ShardRecord back;
  REQUIRE(DecodeShardRecord(EncodeShardRecord(3, r), 3, &back).ok());
  CHECK(back.direct_io && back.bytes == 4096);
  // A record without the field (an older writer) reads as buffered, not as an error.
  back.direct_io = true;
  REQUIRE(DecodeShardRecord("{\"rank\":3,\"name\":\"rank-00003.bin\",\"bytes\":1,\"index_crc\":2,\"data_bytes\":0,"
                            "\"extents\":0}",
                            3, &back)
              .ok());
  CHECK(!back.direct_io);
  CHECK(back.node.empty() && back.arrived == 0 && back.work_seconds == 0);
}

TEST(done_records_carry_their_ranks_pace_and_the_committer_hears_every_ranks) {
  ShardRecord r;
  r.name = ShardFileName(1);
  r.node = "nid001234";
  r.arrived = 1796000000.25;
  r.work_seconds = 0.125;
  ShardRecord back;
  REQUIRE(DecodeShardRecord(EncodeShardRecord(1, r), 1, &back).ok());
  CHECK(back.node == "nid001234" && back.arrived == 1796000000.25 && back.work_seconds == 0.125);
  // Informational: a malformed pace reads as absent, never as a bad record (the shard is still good).
  REQUIRE(DecodeShardRecord("{\"rank\":1,\"name\":\"rank-00001.bin\",\"bytes\":1,\"index_crc\":2,\"data_bytes\":0,"
                            "\"extents\":0,\"node\":\"a b/../c\",\"arrived\":-5,\"work_seconds\":\"x\"}",
                            1, &back)
              .ok());
  CHECK(back.node.empty() && back.arrived == 0 && back.work_seconds == 0);

  // Three ranks save: rank 0, which commits, hears each rank's node, arrival and own work; the others nothing.
  TempDir d;
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t k = 0; k < 3; ++k) e.push_back(OpenRank(d.path(), k, 3));
  for (auto& x : e) REQUIRE(x);
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::vector<SaveResult> results;
  for (const Status& s : SaveAll(e, 7, CommitMode::kAuto, &results)) CHECK(s.ok());
  const double after = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  REQUIRE(results[0].ranks.size() == 3);
  for (const ShardRecord& k : results[0].ranks) {
    CHECK(k.node == HostName());
    CHECK(k.arrived >= before && k.arrived <= after);
    CHECK(k.work_seconds > 0 && k.work_seconds <= results[0].durable_seconds + (after - before));
  }
  CHECK(results[1].ranks.empty() && results[2].ranks.empty());
}

TEST(commit_step_manifest_says_direct_io_only_if_every_rank_wrote_so_and_counts_the_whole_save) {
  for (bool mixed : {false, true}) {
    TempDir d;
    std::vector<std::unique_ptr<Engine>> e;
    e.push_back(OpenRank(d.path(), 0, 2));
    e.push_back(OpenRank(d.path(), 1, 2, nullptr, 0, 30, /*direct_io=*/!mixed));
    for (auto& x : e) REQUIRE(x);
    for (const Status& s : SaveAll(e, 5, CommitMode::kDeferred)) CHECK(s.ok());
    REQUIRE(CommitStep(Env::Default(), d.path(), 5, 2, {}, 5, /*elapsed_s=*/100).ok());
    auto infos = Scan(d.path());
    REQUIRE(infos.size() == 1);
    CHECK(infos[0].direct_io == (e[0]->direct_io() && e[1]->direct_io()));
    if (mixed) CHECK(!infos[0].direct_io);
    CHECK(infos[0].write_seconds >= 100 && infos[0].write_seconds < 200);
  }
}

TEST(manifests_must_list_one_shard_per_rank_in_order) {
  TempDir d;
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 2; ++r) e.push_back(OpenRank(d.path(), r, 2));
  for (const Status& s : SaveAll(e, 4)) CHECK(s.ok());
  e.clear();
  const std::string m = JoinPath(JoinPath(d.path(), StepDirName(4)), kManifestName);
  std::string text;
  REQUIRE(ReadSmallFile(Env::Default(), m, 1 << 20, &text).ok());
  const std::string good = text;
  for (auto [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"rank-00001.bin", "rank-00000.bin"},  // a duplicate shard, rank 1 missing
           {"\"ranks\":2", "\"ranks\":3"}}) {      // a count that does not match
    text = good;
    size_t p = text.find(from);
    REQUIRE(p != std::string::npos);
    text.replace(p, from.size(), to);
    REQUIRE(alpsck_test::WriteText(m, text));
    auto infos = Scan(d.path());
    REQUIRE(infos.size() == 1);
    CHECK(infos[0].state == CheckpointState::kCorrupt);
  }
}

TEST(a_waiting_rank_never_takes_an_earlier_historys_manifest_for_its_commit) {
  // Ranks 0 and 1 wrote steps 1-3; the resumed run continues from step 1 and saves step 2 again,
  // with the very same bytes. Rank 1 finishes first, while the abandoned step-2 (with its
  // manifest) is still there: it must wait for rank 0 to retire it and commit the new one.
  TempDir d;
  {
    std::vector<std::unique_ptr<Engine>> e;
    for (uint32_t r = 0; r < 2; ++r) e.push_back(OpenRank(d.path(), r, 2, nullptr, 0));
    for (auto& x : e) REQUIRE(x);
    for (uint64_t step : {1, 2, 3})
      for (const Status& s : SaveAll(e, step)) CHECK(s.ok());
  }
  const std::string old_manifest = JoinPath(JoinPath(d.path(), StepDirName(2)), kManifestName);
  std::string before;
  REQUIRE(ReadSmallFile(Env::Default(), old_manifest, 1 << 20, &before).ok());
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 2; ++r) e.push_back(OpenRank(d.path(), r, 2, nullptr, 0));
  for (auto& x : e) REQUIRE(x);
  std::vector<std::pair<uint64_t, std::string>> retired;
  e[1]->ContinueFrom(1);
  REQUIRE(e[1]->Supersede(2, &retired).ok());  // rank 1 touches nothing on disk
  REQUIRE(retired.size() == 2u);
  CHECK(retired[0].second.empty());
  CHECK(Exists(old_manifest));
  auto data1 = Data(2, 1);
  std::shared_ptr<SaveHandle> h1;
  REQUIRE(e[1]->Save(SaveReq(2, {{"w", data1.data(), data1.size()}}, "{\"rank\":1}", SaveMode::kSnapshot), &h1).ok());
  // Without the shard-record check, rank 1 reported this durable at once, on the old manifest.
  CHECK(!h1->Wait(0.3));
  e[0]->ContinueFrom(1);
  REQUIRE(e[0]->Supersede(2, &retired).ok());
  REQUIRE(retired.size() == 2u);
  CHECK(!retired[0].second.empty());
  auto data0 = Data(2, 0);
  std::shared_ptr<SaveHandle> h0;
  REQUIRE(e[0]->Save(SaveReq(2, {{"w", data0.data(), data0.size()}}, "{\"rank\":0}", SaveMode::kSnapshot), &h0).ok());
  REQUIRE(h0->Wait(30) && h1->Wait(30));
  CHECK(h0->status().ok());
  CHECK(h1->status().ok());
  CHECK(!h1->result().skipped);
  std::string after;
  REQUIRE(ReadSmallFile(Env::Default(), old_manifest, 1 << 20, &after).ok());
  CHECK(after != before);  // a new commit (same bytes, new save ids)
  for (uint32_t r = 0; r < 2; ++r) CHECK(ShardHolds(d.path(), 2, r, Data(2, r)));
  auto infos = Scan(d.path());
  REQUIRE(infos.size() == 2u);  // 1 and the new 2; the abandoned 3 is retired
  CHECK_EQ(infos[1].step, uint64_t{2});
}

TEST(a_retirement_that_fails_on_rank_0_aborts_the_step_on_every_rank_and_the_retry_commits) {
  // Found by a review: the Python layer ran Supersede before Save, so a refused rename on rank 0
  // raised there without counting the attempt or aborting: rank 1 waited out commit_timeout_s,
  // and the retry mixed attempts (rank 0's attempt 0 with rank 1's stale shard). Save now runs it
  // (one_history), so the failure aborts the step like any other.
  TempDir d;
  {
    std::vector<std::unique_ptr<Engine>> e;
    for (uint32_t r = 0; r < 2; ++r) e.push_back(OpenRank(d.path(), r, 2));
    for (uint64_t step : {4, 5})
      for (const Status& s : SaveAll(e, step)) CHECK(s.ok());
  }
  FaultEnv faulty;
  FaultRule deny;
  deny.op = FaultRule::Op::kRename;
  deny.path_contains = JoinPath(d.path(), StepDirName(5));
  deny.error = EIO;
  deny.count = 1;
  faulty.AddRule(deny);
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 2; ++r) {
    e.push_back(OpenRank(d.path(), r, 2, r == 0 ? &faulty : nullptr, 0, 60, true, /*one_history=*/true));
    REQUIRE(e.back());
    e.back()->ContinueFrom(4);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> first = SaveAll(e, 5);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(!first[0].ok() && first[0].message().find("abandoned history") != std::string::npos);
  CHECK(!first[1].ok());  // aborted, promptly: not after commit_timeout_s
  CHECK(secs < 30);
  for (const Status& s : SaveAll(e, 5)) CHECK(s.ok());  // attempt 1 on both ranks
  for (uint32_t r = 0; r < 2; ++r) CHECK(ShardHolds(d.path(), 5, r, Data(5, r)));
  auto infos = Scan(d.path());
  REQUIRE(infos.size() == 2u);
  CHECK(infos[1].state == CheckpointState::kCommitted && infos[1].ranks == 2u);
  std::vector<std::string> names;
  REQUIRE(Env::Default()->ListDir(d.path(), &names) == 0);
  for (const auto& n : names) CHECK(n.find(".tmp") == std::string::npos);  // no attempt left behind
}

// Several ranks in one recycled directory that someone tampered with: rank 0's shard hard-linked
// to a file outside, rank 1's a symlink out. Nothing outside changes; rank 0 writes a new file,
// rank 1 refuses and aborts the step for both (one verdict), the aborted attempt goes (the link
// itself, never its target), the checkpoint before stays valid and the next step commits.
TEST(ranks_in_a_tampered_recycled_directory_never_write_outside_and_agree) {
  TempDir d, out;
  const std::string linked = out.sub("linked.bin"), target = out.sub("target.bin");
  const std::string keep = "outside bytes, not a shard";
  for (const std::string& p : {linked, target}) {
    int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0 && ::write(fd, keep.data(), keep.size()) == static_cast<ssize_t>(keep.size()));
    ::close(fd);
  }
  auto store = std::make_shared<MemoryKvStore>();
  std::vector<std::unique_ptr<Engine>> e;
  for (uint32_t r = 0; r < 2; ++r) e.push_back(OpenRank(d.path(), r, 2, nullptr, 1, 30, true, false, store));
  for (auto& x : e) REQUIRE(x);
  for (uint64_t step : {1, 2})
    for (const Status& s : SaveAll(e, step)) CHECK(s.ok());
  // Step 1 expired when step 2 committed; step 2's verdict named no directory (none was free
  // then), so step 3 makes a new one and its verdict names step 1's for step 4.
  std::vector<std::string> free_dirs = FreeDirs(d.path());
  REQUIRE(free_dirs.size() == 1u);
  const std::string recycled = free_dirs[0];
  for (const Status& s : SaveAll(e, 3)) CHECK(s.ok());
  const std::string fd0 = JoinPath(JoinPath(d.path(), recycled), ShardFileName(0));
  const std::string fd1 = JoinPath(JoinPath(d.path(), recycled), ShardFileName(1));
  REQUIRE(::unlink(fd0.c_str()) == 0 && ::link(linked.c_str(), fd0.c_str()) == 0);
  REQUIRE(::unlink(fd1.c_str()) == 0 && ::symlink(target.c_str(), fd1.c_str()) == 0);
  auto st = SaveAll(e, 4);
  CHECK(!st[0].ok() && !st[1].ok());
  CHECK(st[1].message().find("symbolic link") != std::string::npos);
  CHECK(st[0].code() == Code::kAborted);
  for (const std::string& p : {linked, target}) {
    std::string got;
    REQUIRE(ReadSmallFile(Env::Default(), p, 1024, &got).ok());
    CHECK_EQ(got, keep);
  }
  CHECK(!Exists(JoinPath(d.path(), StepDirName(4))));
  for (uint32_t r = 0; r < 2; ++r) CHECK(ShardHolds(d.path(), 3, r, Data(3, r)));
  for (const Status& s : SaveAll(e, 5)) CHECK(s.ok());
  for (uint32_t r = 0; r < 2; ++r) CHECK(ShardHolds(d.path(), 5, r, Data(5, r)));
  std::vector<std::string> left;
  REQUIRE(Env::Default()->ListDir(d.path(), &left) == 0);
  for (const auto& n : left) CHECK(n.rfind(StepDirName(4), 0) != 0);
}

TEST(rank_must_be_below_world_size) {
  TempDir d;
  EngineOptions o;
  o.run_dir = d.path();
  o.rank = 2;
  o.world_size = 2;
  std::unique_ptr<Engine> e;
  CHECK(Engine::Open(o, &e).code() == Code::kInvalidArgument);
}

ALPSCK_TEST_MAIN()
