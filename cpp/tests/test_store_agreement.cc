// The commit's ranks meeting through a key-value store (store_agreement.h) instead of the file
// system: real CommitAttempts on a real run directory (the default Env), ranks as threads, each
// with its own client of one MemoryKvStore (kv_store_memory.h). What must hold is what holds for
// FileAgreement (test_coordinate.cc): one verdict on every rank, the disk agreeing with it, nothing
// left behind; and besides, a bounded number of store operations per rank and no file-system
// polling by the ranks that wait.
#include <fcntl.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "commit.h"
#include "commit_attempt.h"
#include "coordinate.h"
#include "crc32c.h"
#include "env_fault.h"
#include "file_io.h"
#include "format.h"
#include "kv_store_memory.h"
#include "platform.h"
#include "recovery.h"
#include "run_dir.h"
#include "store_agreement.h"
#include "store_agreement_harness.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::Exists;
using alpsck_test::TempDir;

using namespace store_harness;

// ---------------------------------------------------------------- the store itself

TEST(memory_store_has_c10d_semantics) {
  MemoryKvStore s;
  std::string v;
  int64_t n = 0;
  CHECK(s.Get("k", 0, &v).code() == Code::kNotFound);
  CHECK(s.Set("k", "v1").ok() && s.Get("k", 0, &v).ok() && v == "v1");
  CHECK(s.Add("c", 5, &n).ok() && n == 5);  // a missing counter starts at 0
  CHECK(s.Add("c", -2, &n).ok() && n == 3);
  CHECK(s.Get("c", 0, &v).ok() && v == "3");  // stored as its decimal text, as c10d does
  CHECK(s.Add("k", 1, &n).code() == Code::kInvalidArgument);
  CHECK(s.Append("a", "x").ok() && s.Append("a", "y").ok() && s.Get("a", 0, &v).ok() && v == "xy");
  // compare_set: missing key, expected "": sets.
  CHECK(s.CompareSet("cs", "", "d1", &v).ok() && v == "d1");
  // present and equal: sets; present and different: returns what is there.
  CHECK(s.CompareSet("cs", "d1", "d2", &v).ok() && v == "d2");
  CHECK(s.CompareSet("cs", "d1", "d3", &v).ok() && v == "d2");
  // missing key, expected NOT empty: returns expected, sets nothing (c10d's quirk).
  CHECK(s.CompareSet("none", "e", "d", &v).ok() && v == "e");
  CHECK(s.Get("none", 0, &v).code() == Code::kNotFound);
  CHECK(s.DeleteKey("cs").ok() && s.DeleteKey("cs").ok());
  CHECK(s.Get("cs", 0, &v).code() == Code::kNotFound);
  // A timeout names the keys still missing.
  Status w = s.Wait({"k", "w1", "w2"}, 0.01);
  CHECK(w.code() == Code::kNotFound);
  CHECK(w.message().find("w1, w2") != std::string::npos && w.message().find("k,") == std::string::npos);
  // Clones share the store.
  std::unique_ptr<KvStore> c;
  REQUIRE(s.Clone(&c).ok());
  CHECK(c->Get("k", 0, &v).ok() && v == "v1");
}

TEST(memory_store_waiters_are_woken_not_polling_and_a_vanished_store_fails_every_call) {
  MemoryKvStore s;
  std::unique_ptr<KvStore> c1, c2;
  REQUIRE(s.Clone(&c1).ok() && s.Clone(&c2).ok());
  Status got;
  std::string v;
  double waited = 0;
  std::thread t([&] {
    const Clock::time_point t0 = Clock::now();
    got = c1->Get("late", 30, &v);
    waited = Since(t0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(c2->Set("late", "here").ok());
  t.join();
  CHECK(got.ok() && v == "here");
  CHECK(waited < 10);
  // Wait for several keys: woken once the last is set.
  std::thread t2([&] { got = c1->Wait({"w1", "w2"}, 30); });
  REQUIRE(c2->Set("w2", "x").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  int64_t n = 0;
  REQUIRE(c2->Add("w1", 1, &n).ok());
  t2.join();
  CHECK(got.ok());
  // A blocked waiter wakes when the store vanishes, and fails; so does every later call.
  std::thread t3([&] { got = c1->Get("never", 30, &v); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  s.Vanish();
  t3.join();
  CHECK(got.code() == Code::kIoError);
  CHECK(c2->Set("x", "y").code() == Code::kIoError);
  std::unique_ptr<KvStore> c3;
  CHECK(!s.Clone(&c3).ok());
}

// The engine's clients (KvClientPool): one attempt's client goes back to the pool and the next
// attempt reuses it (a TCPStore clone is a connection); one that saw any error is dropped.
TEST(client_pool_reuses_clients_and_drops_one_that_failed) {
  auto store = std::make_shared<MemoryKvStore>();
  KvClientPool pool(store);
  std::string v;
  for (int i = 0; i < 5; ++i) {
    std::unique_ptr<KvStore> c;
    REQUIRE(pool.Acquire(&c).ok());
    CHECK(c->Set("k", std::to_string(i)).ok());
  }
  CHECK_EQ(pool.clients_made(), size_t{1});
  {
    std::unique_ptr<KvStore> a, b;  // two at once: two clients
    REQUIRE(pool.Acquire(&a).ok() && pool.Acquire(&b).ok());
    CHECK(a->Get("k", 0, &v).ok() && v == "4");
    CHECK(a->Get("missing", 0, &v).code() == Code::kNotFound);  // only looked: a is kept
    CHECK(b->Get("missing", 0.01, &v).code() == Code::kNotFound);  // a wait timed out: b is dropped when it goes
  }
  CHECK_EQ(pool.clients_made(), size_t{2});
  std::unique_ptr<KvStore> c1, c2;
  REQUIRE(pool.Acquire(&c1).ok() && pool.Acquire(&c2).ok());  // a came back; b did not
  CHECK_EQ(pool.clients_made(), size_t{3});
  c1.reset();
  c2.reset();
  store->Vanish();
  std::unique_ptr<KvStore> c3;
  REQUIRE(pool.Acquire(&c3).ok());  // an idle one: its first call fails
  CHECK(c3->Set("k", "x").code() == Code::kIoError);
}

// PooledKvStore: the process's one set of connections. Two engines' pools (each built on it, as the
// DCP writer's engine per save is) and a commit's clone, one after the other, all reuse one client; its
// own calls borrow one.
TEST(pooled_store_shares_its_clients_between_engines_and_commits) {
  auto base = std::make_shared<MemoryKvStore>();
  auto pooled = std::make_shared<PooledKvStore>(base);
  for (int save = 0; save < 3; ++save) {
    {
      KvClientPool engine_pool(pooled);  // a new engine per save, closed before the commit (as the writer's)
      std::unique_ptr<KvStore> attempt;
      REQUIRE(engine_pool.Acquire(&attempt).ok());
      CHECK(attempt->Set("k", std::to_string(save)).ok());
    }
    std::unique_ptr<KvStore> commit;
    REQUIRE(pooled->Clone(&commit).ok());  // commit_step's client
    std::string v;
    CHECK(commit->Get("k", 0, &v).ok() && v == std::to_string(save));
  }
  CHECK_EQ(pooled->clients_made(), size_t{1});
  int64_t n = 0;
  CHECK(pooled->Add("n", 2, &n).ok() && n == 2);
  std::string v;
  CHECK(pooled->Get("absent", 0, &v).code() == Code::kNotFound);  // only looked: the client stays
  CHECK_EQ(pooled->clients_made(), size_t{1});
  CHECK(pooled->Get("absent", 0.01, &v).code() == Code::kNotFound);  // a timed-out wait: that client is dropped
  CHECK(pooled->Set("k", "x").ok());
  CHECK_EQ(pooled->clients_made(), size_t{2});
}

TEST(memory_store_rules_delay_time_out_and_lose_replies) {
  MemoryKvStore s;
  MemoryKvStore::Rule r;
  r.op = MemoryKvStore::Op::kSet;
  r.key_contains = "t";
  r.action = MemoryKvStore::Action::kTimeout;
  s.AddRule(r);
  std::string v;
  CHECK(s.Set("t1", "x").code() == Code::kIoError);
  CHECK(s.Get("t1", 0, &v).code() == Code::kNotFound);  // no effect
  CHECK(s.Set("t1", "x").ok());                         // count 1: only the first
  s.ClearRules();
  r.op = MemoryKvStore::Op::kCompareSet;
  r.action = MemoryKvStore::Action::kLoseReply;
  s.AddRule(r);
  CHECK(s.CompareSet("t2", "", "mine", &v).code() == Code::kIoError);
  CHECK(s.Get("t2", 0, &v).ok() && v == "mine");  // the effect happened
  s.ClearRules();
  r.op = MemoryKvStore::Op::kAny;
  r.key_contains = "";
  r.action = MemoryKvStore::Action::kNone;
  r.delay_s = 0.05;
  s.AddRule(r);
  const Clock::time_point t0 = Clock::now();
  CHECK(s.Set("d", "x").ok());
  CHECK(Since(t0) >= 0.04);
  CHECK_EQ(s.FaultsInjected(), uint64_t{3});
}

// ---------------------------------------------------------------- the happy path

TEST(ranks_commit_once_through_the_store_and_leave_no_keys) {
  for (uint32_t world : {1u, 2u, 8u}) {
    TempDir d;
    MemoryKvStore store;
    SaveSpec spec;
    spec.world = world;
    for (uint64_t step : {1, 2}) {  // two saves: keys of one never meet the next
      spec.step = step;
      auto st = SaveAll(d.path(), &store, spec);
      for (uint32_t r = 0; r < world; ++r) {
        if (!st[r].ok()) std::fprintf(stderr, "world %u rank %u: %s\n", world, r, st[r].message().c_str());
        CHECK(st[r].ok());
      }
      uint32_t ranks = 0;
      CHECK(OnDisk(d.path(), step, true, &ranks) == CheckpointState::kCommitted);
      CHECK_EQ(ranks, world);
      CheckNoKeys(&store);
    }
    CHECK_EQ(Join(Entries(d.path())), StepDirName(1) + " " + StepDirName(2));
  }
}

TEST(a_thousand_ranks_as_threads_commit_once) {
  // 1,024 ranks, each a thread with its own client: one verdict, the disk committed, no key left.
  const uint32_t world = 1024;
  TempDir d;
  MemoryKvStore store;
  SaveSpec spec;
  spec.world = world;
  std::vector<OpCounts> counts(world);
  spec.counts = &counts;
  const Clock::time_point t0 = Clock::now();
  auto st = SaveAll(d.path(), &store, spec);
  const double secs = Since(t0);
  size_t failed = 0;
  for (uint32_t r = 0; r < world; ++r)
    if (!st[r].ok() && failed++ < 5) std::fprintf(stderr, "rank %u: %s\n", r, st[r].message().c_str());
  CHECK_EQ(failed, size_t{0});
  uint32_t ranks = 0;
  CHECK(OnDisk(d.path(), 1, false, &ranks) == CheckpointState::kCommitted);
  CHECK_EQ(ranks, world);
  CheckNoKeys(&store);
  uint64_t total = 0, most = 0;
  for (uint32_t r = 1; r < world; ++r) {
    total += counts[r].total();
    most = std::max(most, counts[r].total());
  }
  std::fprintf(stderr, "%u ranks: %.2f s; store operations: rank 0 %llu, ranks > 0 %llu in all (at most %llu)\n", world,
               secs, (unsigned long long)counts[0].total(), (unsigned long long)total, (unsigned long long)most);
  CHECK(secs < 60);
  CHECK(counts[0].total() <= 5);
  CHECK(total <= 5ull * (world - 1) + 7);  // 5 each, 1 more for the last arrival, 6 deletes for the last ack
}

TEST(store_operations_per_rank_are_few_and_do_not_grow_with_the_ranks) {
  for (uint32_t world : {2u, 8u, 64u}) {
    TempDir d;
    MemoryKvStore store;
    SaveSpec spec;
    spec.world = world;
    std::vector<OpCounts> counts(world);
    std::vector<CountingEnv> envs(world);
    spec.counts = &counts;
    spec.envs = &envs;
    for (const Status& s : SaveAll(d.path(), &store, spec)) CHECK(s.ok());
    uint32_t last_arrival = 0, last_ack = 0;
    for (uint32_t r = 1; r < world; ++r) {
      const OpCounts& c = counts[r];
      // Peek (get), record (append), arrival (add), the verdict (get), the acknowledgement (add).
      CHECK_EQ(c.get, uint64_t{2});
      CHECK_EQ(c.append, uint64_t{1});
      CHECK_EQ(c.add, uint64_t{2});
      CHECK_EQ(c.cas + c.wait, uint64_t{0});
      last_arrival += c.set == 1;  // says every rank arrived
      last_ack += c.del_acks;      // removes the keys
      CHECK(c.set <= 1 && c.del == 6 * c.del_acks);
      CHECK_EQ(c.total() - c.set - c.del, uint64_t{5});
      // No polling, no listing: a waiting rank's agreement does not look at the disk at all.
      CHECK_EQ(envs[r].list_dir.load(), uint64_t{0});
      CHECK_EQ(envs[r].is_dir.load(), uint64_t{0});
    }
    CHECK_EQ(last_arrival, 1u);  // the coordinator does not count itself
    CHECK_EQ(last_ack, 1u);
    const OpCounts& c0 = counts[0];
    std::fprintf(stderr,
                 "world %u: rank 0: %llu store operations (get %llu add %llu cas %llu del %llu), a rank > 0: 5 "
                 "(+1 set by the last to arrive, +6 deletes by the last to acknowledge)\n",
                 world, (unsigned long long)c0.total(), (unsigned long long)c0.get, (unsigned long long)c0.add,
                 (unsigned long long)c0.cas, (unsigned long long)c0.del);
    // Peek, the wait for every arrival, the records, the claim, the final verdict: 5, always; it
    // neither counts itself, nor acknowledges its own commit, nor deletes.
    CHECK_EQ(c0.get, uint64_t{3});
    CHECK_EQ(c0.cas, uint64_t{2});
    CHECK_EQ(c0.total(), uint64_t{5});
    CHECK_EQ(envs[0].list_dir.load(), uint64_t{0});
  }
}

// ---------------------------------------------------------------- faults

TEST(a_rank_that_dies_mid_save_aborts_the_step_on_every_live_rank_and_the_late_one_reads_it) {
  for (bool past_the_peek : {false, true}) {
    TempDir d;
    MemoryKvStore store;
    SaveSpec spec;
    spec.world = 4;
    spec.coordinator_timeout_s = 0.5;
    spec.absent = {3};  // rank 3 never arrives
    auto st = SaveAll(d.path(), &store, spec);
    CheckOneVerdict(st, spec, d.path(), false);
    // Rank 0 gave up and decided: its own reason; the others read that verdict.
    CHECK(st[0].code() == Code::kAborted);
    // (Rank 3 at least: a live rank slower than 0.5 s on a loaded machine is named too.)
    CHECK(st[0].message().find("no shard from rank(s) ") != std::string::npos &&
          st[0].message().find("3 after 0.5 s") != std::string::npos);
    for (uint32_t r : {1u, 2u}) {
      CHECK(st[r].code() == Code::kAborted);
      CHECK(st[r].message() == "step 1 was aborted: rank 0: " + st[0].message());
    }
    // On disk as with FileAgreement: the aborted attempt, kept until every rank has read it.
    const Attempt a{d.path(), 1, 0};
    CHECK(!Exists(a.tmp_dir()) && Exists(JoinPath(a.aborted_dir(), kAbortedName)));
    CHECK(!store.Keys().empty());
    const std::string st0 = st[0].message();
    // Rank 3 comes late: it reads the abort (before it writes anything, or after it has written its
    // shard and arrived), and as the last reader removes the attempt's keys and directories.
    spec.absent = {0, 1, 2};
    if (past_the_peek) spec.skip_peek = {3};
    st = SaveAll(d.path(), &store, spec);
    CHECK(st[3].code() == Code::kAborted);
    CHECK(st[3].message().find("rank 0: " + st0) != std::string::npos);
    CheckNoKeys(&store);
    CHECK(Entries(d.path()).empty());
  }
}

TEST(a_store_that_vanishes_mid_save_fails_every_rank_with_one_verdict_on_disk) {
  struct Case {
    const char* name;
    MemoryKvStore::Op op;
    const char* key;
    uint64_t skip;
    bool commits;  // whether the commit rename happens before the store goes
  };
  const Case cases[] = {
      {"at the first record", MemoryKvStore::Op::kAppend, "records", 0, false},
      {"at the third arrival", MemoryKvStore::Op::kAdd, "arrived", 2, false},
      {"at the claim of the commit", MemoryKvStore::Op::kCompareSet, "verdict", 0, false},
      {"after the commit rename", MemoryKvStore::Op::kCompareSet, "final", 0, true},
  };
  for (const Case& c : cases) {
    TempDir d;
    MemoryKvStore store;
    MemoryKvStore::Rule rule;
    rule.op = c.op;
    rule.key_contains = c.key;
    rule.skip = c.skip;
    rule.action = MemoryKvStore::Action::kVanish;
    store.AddRule(rule);
    SaveSpec spec;
    spec.world = 4;
    spec.timeout_s = 30;  // far above what the save takes, even under TSan on a loaded machine
    const Clock::time_point t0 = Clock::now();
    auto st = SaveAll(d.path(), &store, spec);
    std::fprintf(stderr, "vanished %s: %.2f s; rank 0: %s; rank 1: %s\n", c.name, Since(t0), st[0].ToString().c_str(),
                 st[1].ToString().c_str());
    CHECK(store.FaultsInjected() == 1);
    CheckOneVerdict(st, spec, d.path(), c.commits);
    CHECK(Since(t0) < 20);  // nobody waited out a timeout: a vanished store wakes its waiters
    // Nothing but the one outcome: step-N, or the aborted attempt (and a directory a rank
    // re-created after the abort rename, rank 0's next open removes both).
    for (const std::string& n : Entries(d.path())) {
      const RunDirEntry e = ParseRunDirName(n);
      CHECK(e.kind == (c.commits ? EntryKind::kStep : EntryKind::kAborted) || (!c.commits && e.kind == EntryKind::kAttempt));
    }
  }
}

TEST(a_store_that_times_out_or_loses_the_claim_aborts_every_rank_promptly) {
  for (MemoryKvStore::Action act : {MemoryKvStore::Action::kTimeout, MemoryKvStore::Action::kLoseReply}) {
    TempDir d;
    MemoryKvStore store;
    MemoryKvStore::Rule rule;
    rule.op = MemoryKvStore::Op::kCompareSet;
    rule.key_contains = "verdict";
    rule.action = act;  // the claim: not made (timeout) or made without the coordinator hearing it
    store.AddRule(rule);
    SaveSpec spec;
    spec.world = 3;
    spec.settle_s = 20;
    const Clock::time_point t0 = Clock::now();
    auto st = SaveAll(d.path(), &store, spec);
    CheckOneVerdict(st, spec, d.path(), false);
    CHECK(Since(t0) < 10);  // the coordinator settled its own lost claim: nobody waited for it
    CHECK(st[0].message().find("claim the commit") != std::string::npos);
    for (uint32_t r : {1u, 2u}) CHECK(st[r].message() == "step 1 was aborted: rank 0: " + st[0].message());
    CheckNoKeys(&store);
    CHECK(Entries(d.path()).empty());
  }
}

TEST(a_coordinator_silent_after_its_claim_leaves_the_verdict_to_the_disk) {
  // Rank 0 claims the commit and dies (before the rename, or after it, before the final verdict):
  // the others wait settle_s, then settle it on the disk as FileAgreement's ranks do.
  for (bool renamed : {false, true}) {
    TempDir d;
    MemoryKvStore store;
    SaveSpec spec;
    spec.world = 4;
    spec.timeout_s = 0.3;
    spec.settle_s = 0.3;
    if (renamed) {
      // The real coordinator, whose final verdict never reaches the store.
      MemoryKvStore::Rule rule;
      rule.op = MemoryKvStore::Op::kCompareSet;
      rule.key_contains = "final";
      rule.action = MemoryKvStore::Action::kTimeout;
      rule.count = 1;
      store.AddRule(rule);
      // The others give up on the final verdict after 3 s (rank 0 has claimed the commit by then:
      // it needs only their records), then wait settle_s more.
      spec.timeout_s = 3;
      spec.coordinator_timeout_s = 30;
      spec.settle_s = 0.3;
    } else {
      spec.faked = {0};
      spec.fake = [&](uint32_t, KvStore* kv) {
        std::string cur;
        return kv->CompareSet(StoreAgreement::KeyPrefix(kNs, 1, 0) + "verdict", "", "committing", &cur);
      };
    }
    auto st = SaveAll(d.path(), &store, spec);
    if (renamed) {
      // The final never came, but the disk says committed: rank 0 and the others succeed, after
      // the others waited for it (timeout_s for the verdict, then settle_s).
      CheckOneVerdict(st, spec, d.path(), true);
    } else {
      CheckOneVerdict(st, spec, d.path(), false);
      // One of them won the abort rename; every other one read its reason from the disk or the store.
      std::set<std::string> verdicts;
      for (uint32_t r = 1; r < 4; ++r) {
        CHECK(st[r].code() == Code::kAborted);
        CHECK(st[r].message().find("rank 0 claimed the commit and gave no verdict within 0.3 s") != std::string::npos);
        verdicts.insert(st[r].message());
      }
      CHECK_EQ(verdicts.size(), size_t{1});
    }
  }
}

TEST(a_failed_disk_commit_aborts_or_reports_the_unconfirmed_commit_as_the_docs_say) {
  // Before the rename (the manifest cannot be written): an abort, rank 0's own error. After it
  // (its fsync of RUN_DIR fails): committed, rank 0 says durability unconfirmed, the others sync
  // RUN_DIR themselves and succeed.
  for (bool after_rename : {false, true}) {
    TempDir d;
    MemoryKvStore store;
    FaultEnv env0;
    FaultRule rule;
    if (after_rename) {
      rule.op = FaultRule::Op::kFSync;
      rule.skip = 2;  // the manifest's fsync, step-N.tmp's, then RUN_DIR's
      rule.error = EIO;
    } else {
      rule.op = FaultRule::Op::kOpen;
      rule.path_contains = kManifestName;
      rule.error = ENOSPC;
    }
    env0.AddRule(rule);
    SaveSpec spec;
    spec.world = 3;
    spec.env0 = &env0;
    auto st = SaveAll(d.path(), &store, spec);
    CHECK_EQ(env0.FaultsInjected(), uint64_t{1});
    if (after_rename) {
      CHECK(OnDisk(d.path(), 1) == CheckpointState::kCommitted);
      CHECK(!st[0].ok() && st[0].message().find("step 1 is committed, durability unconfirmed") == 0);
      CHECK(st[1].ok() && st[2].ok());
      CHECK_EQ(Join(Entries(d.path())), StepDirName(1));
    } else {
      CheckOneVerdict(st, spec, d.path(), false);
      CHECK(st[0].code() == Code::kNoSpace);
      for (uint32_t r : {1u, 2u}) CHECK(st[r].message() == "step 1 was aborted: rank 0: " + st[0].message());
      CHECK(Entries(d.path()).empty());
    }
    CheckNoKeys(&store);
  }
}

TEST(skewed_ranks_with_tiny_timeouts_and_a_slow_store_always_agree_with_each_other_and_the_disk) {
  // As FileAgreement's skew test: random timeouts, a slow store and slow disk commit. Every
  // outcome must be one verdict that the disk agrees with, and an aborted step is saved again.
  TempDir d;
  std::mt19937 rng(20260601);
  int committed = 0, aborted = 0;
  for (uint64_t step = 1; step <= 25; ++step) {
    MemoryKvStore store;
    FaultEnv slow0;
    FaultRule slow;
    slow.op = FaultRule::Op::kRename;
    slow.error = 0;
    slow.count = UINT64_MAX;
    slow.delay_us = 1000 * (rng() % 60);
    slow0.AddRule(slow);
    MemoryKvStore::Rule lag;
    lag.count = UINT64_MAX;
    lag.delay_s = 0.001 * (rng() % 40);
    lag.key_contains = rng() % 2 ? "verdict" : "all-arrived";
    store.AddRule(lag);
    for (uint32_t attempt = 0; attempt < 2; ++attempt) {
      SaveSpec spec;
      spec.world = 3;
      spec.step = step;
      spec.attempt = attempt;
      spec.env0 = &slow0;
      spec.timeout_s = 0.002 * (1 + rng() % 40);
      spec.coordinator_timeout_s = 5;
      spec.settle_s = 0.002 * (1 + rng() % 40);
      auto st = SaveAll(d.path(), &store, spec);
      const bool ok = st[0].ok();
      CheckOneVerdict(st, spec, d.path(), ok);
      if (ok) {
        ++committed;
        break;
      }
      ++aborted;
    }
  }
  std::fprintf(stderr, "skew: %d commits, %d aborted attempts\n", committed, aborted);
  CHECK(committed > 0 && aborted > 0);
  for (const std::string& n : Entries(d.path())) {
    const EntryKind k = ParseRunDirName(n).kind;
    if (k != EntryKind::kStep) std::fprintf(stderr, "left behind: %s\n", n.c_str());
    CHECK(k == EntryKind::kStep);
  }
}

ALPSCK_TEST_MAIN()
