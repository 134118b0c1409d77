// The run directory's names: made and parsed in one place (run_dir.h), and every name alpsck
// writes is classified back to what it is; hostile look-alikes are not.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <memory>
#include <deque>
#include <string>
#include <thread>

#include "env_fault.h"
#include "file_io.h"
#include "run_dir.h"
#include "run_dir_actions.h"
#include "run_dir_latest.h"
#include "run_dir_lock.h"
#include "spare_dirs.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;

TEST(step_dir_names) {
  uint64_t s = 0;
  CHECK_EQ(StepDirName(150), std::string("step-000000150"));
  CHECK(ParseStepDirName("step-000000150", &s) && s == 150);
  CHECK(ParseStepDirName("step-12345678901", &s) && s == 12345678901ull);
  CHECK(!ParseStepDirName("step-000000150.tmp", &s));
  CHECK(!ParseStepDirName("step-", &s));
  CHECK(!ParseStepDirName("step-1a", &s));
  CHECK(!ParseStepDirName("step-99999999999999999999", &s));  // 20 digits, beyond 64 bits
  CHECK(ParseStepDirName(StepDirName(UINT64_MAX), &s) && s == UINT64_MAX);
  CHECK(!ParseStepDirName("step-18446744073709551616", &s));
  CHECK_EQ(ShardFileName(7), std::string("rank-00007.bin"));
}

TEST(tmp_dir_names_carry_the_attempt_and_round_trip) {
  CHECK_EQ(TmpDirName(150), std::string("step-000000150.tmp"));
  CHECK_EQ(TmpDirName(150, 3), std::string("step-000000150.a3.tmp"));
  for (uint32_t a : {0u, 1u, 9u, 10u, 4294967295u}) {
    uint64_t s = 0;
    uint32_t got = 99;
    CHECK(ParseTmpDirName(TmpDirName(12345678901ull, a), &s, &got) && s == 12345678901ull && got == a);
  }
  uint64_t s = 0;
  CHECK(ParseTmpDirName("step-000000007.tmp", &s) && s == 7);  // the attempt is optional to ask for
  for (const char* bad : {"step-000000007", "step-000000007.a0.tmp", "step-000000007.a.tmp", "step-000000007.b1.tmp",
                          "step-000000007.a01.tmp", "step-000000007.a1x.tmp", "step-000000007.a4294967296.tmp",
                          "step-000000007.a1.a1.tmp", ".tmp", "step-.tmp", "free-1-2.tmp", "step-000000007.tmpx"})
    CHECK(!ParseTmpDirName(bad, &s));
}

TEST(every_name_alpsck_writes_is_classified_back) {
  struct Case {
    std::string name;
    EntryKind kind;
    uint64_t step;
    uint32_t attempt;
  };
  const Case cases[] = {
      {StepDirName(7), EntryKind::kStep, 7, 0},
      {TmpDirName(7), EntryKind::kAttempt, 7, 0},
      {TmpDirName(7, 3), EntryKind::kAttempt, 7, 3},
      {AbortedDirName(7), EntryKind::kAborted, 7, 0},
      {AbortedDirName(18446744073709551615ull, 4294967295u), EntryKind::kAborted, 18446744073709551615ull, 4294967295u},
      {FreeDirName(7, 123, 4), EntryKind::kFree, 0, 0},
      {FreeDirName(7, 123, 4, true), EntryKind::kFreePending, 0, 0},
      {SupersededDirName(12, 99, 0), EntryKind::kSuperseded, 12, 0},
      {kLatestName, EntryKind::kLatest, 0, 0},
      {kLockName, EntryKind::kLock, 0, 0},
      {LockFileName(3), EntryKind::kLock, 0, 0},
      {kHistoryName, EntryKind::kHistory, 0, 0},
      {kRequeueRequestName, EntryKind::kJobRecord, 0, 0},
      {kStartDecisionName, EntryKind::kJobRecord, 0, 0},
      {TempFileName(kStartDecisionName), EntryKind::kJobRecord, 0, 0},
      {std::string(kDeletingPrefix) + "step-000000001", EntryKind::kDeleting, 0, 0},
      {ProbeFileName(3, 4242), EntryKind::kProbe, 0, 0},
      {HealthProbeFileName("nid001234", 77), EntryKind::kProbe, 0, 0},
      {TempFileName(HealthProbeFileName("nid001234", 77)), EntryKind::kProbe, 0, 0},
  };
  for (const Case& c : cases) {
    const RunDirEntry e = ParseRunDirName(c.name);
    CHECK(e.kind == c.kind);
    CHECK_EQ(e.step, c.step);
    CHECK_EQ(e.attempt, c.attempt);
  }
  for (const char* other : {"", "step-", "step-1x", "step-000000007.a0.aborted", "step-1.aborted.tmp", "free-",
                            "superseded-", "superseded-step-1", "superseded-x-1-2", "LATEST.tmp", ".lockx",
                            ".deleting-", "latest", "MANIFEST.json", "rank-00000.bin", "step-1.tmp.aborted",
                            ".start-decision.tmp.tmp", ".requeue-requests", ".metadata", ".alpsck-probe-"})
    CHECK(ParseRunDirName(other).kind == EntryKind::kOther);
  CHECK_EQ(std::string(EntryKindName(EntryKind::kAborted)), std::string("aborted"));
  CHECK_EQ(std::string(EntryKindName(EntryKind::kJobRecord)), std::string("job-record"));
  CHECK_EQ(std::string(EntryKindName(EntryKind::kProbe)), std::string("probe"));
  CHECK_EQ(TempFileName("LATEST"), std::string("LATEST.tmp"));
}

TEST(records_and_shards_are_named_by_rank) {
  CHECK_EQ(DoneRecordName(3), std::string("rank-00003.done"));
  CHECK_EQ(LockFileName(0), std::string(".lock"));
  CHECK_EQ(LockFileName(3), std::string(".lock-rank-00003"));
  CHECK_EQ(FailedRecordName(3), std::string("rank-00003.failed"));
  CHECK_EQ(SeenRecordName(123456), std::string("rank-123456.seen"));
  CHECK(IsShardName(ShardFileName(0)) && IsShardName("rank-123456.bin"));
  for (const char* bad : {"rank-0.bin", "rank-0000a.bin", "../rank-00000.bin", "rank-00000.bin.tmp"}) CHECK(!IsShardName(bad));
}

TEST(the_writer_lock_admits_one_writer_and_names_the_holder) {
  alpsck_test::TempDir d;
  std::unique_ptr<RunDirLock> a, b;
  const std::string me = "{\"pid\":" + std::to_string(::getpid()) + ",\"host\":\"h1\",\"job_id\":\"42\",\"rank\":0}";
  REQUIRE(RunDirLock::Acquire(d.path(), 0, me, &a).ok());
  Status s = RunDirLock::Acquire(d.path(), 0, "{}", &b);  // a second open file: refused, like another process
  CHECK(s.code() == Code::kBusy);
  CHECK(s.message().find("is being written by job 42 (pid " + std::to_string(::getpid()) + ") on host h1") !=
        std::string::npos);
  bool held = false;
  std::string owner;
  REQUIRE(RunDirLock::Probe(d.path(), 0, &held, &owner).ok());
  CHECK(held && owner.find("\"job_id\":\"42\"") != std::string::npos);
  CHECK(RunDirLock::Acquire(d.path(), 1, "{}", &b).ok());  // rank 1's lock is its own
  b.reset();
  a->Release();
  REQUIRE(RunDirLock::Probe(d.path(), 0, &held, &owner).ok());
  CHECK(!held && owner.empty());  // a clean release leaves no owner behind
  CHECK(RunDirLock::Acquire(d.path(), 0, "{}", &b).ok());
  CHECK_EQ(DescribeLockOwner("R", "not json"), std::string("R is being written by job ? (pid ?) on host ?"));
  // One parser for the record: numbers and strings are the fields' text, anything else is no field,
  // and a record that is not a JSON object (key=value lines, a bare pid, nesting past the limits) has none.
  const LockOwner o = ParseLockOwner("{\"pid\":7,\"host\":\"n1\",\"job_id\":[1],\"rank\":0}");
  CHECK(o.pid == "7" && o.host == "n1" && o.job_id.empty());
  for (const std::string& bad :
       {std::string("pid=7\nhost=n1"), std::string("7"), std::string("[7]"), std::string(100000, '[')}) {
    const LockOwner none = ParseLockOwner(bad);
    CHECK(none.pid.empty() && none.host.empty() && none.job_id.empty());
  }
}

// The lock makes its system calls through the Env it is given (env.h): a fault there is the lock's.
TEST(the_writer_lock_goes_through_its_env) {
  alpsck_test::TempDir d;
  FaultEnv env;
  FaultRule r;
  r.op = FaultRule::Op::kOpen;
  r.path_contains = kLockName;
  r.count = 2;
  env.AddRule(r);
  std::unique_ptr<RunDirLock> l;
  Status s = RunDirLock::Acquire(d.path(), 0, "{}", &l, RunDirLock::kOrphanLockWaitS, &env);
  CHECK(!s.ok() && s.err() == EIO && s.message().find("open " + d.path()) != std::string::npos);
  CHECK(!l);
  REQUIRE(::close(::open((d.path() + "/" + kLockName).c_str(), O_CREAT | O_WRONLY, 0644)) == 0);
  bool held = true;
  std::string owner;
  s = RunDirLock::Probe(d.path(), 0, &held, &owner, &env);
  CHECK(!s.ok() && s.err() == EIO);
  CHECK_EQ(env.FaultsInjected(), uint64_t{2});
  REQUIRE(RunDirLock::Acquire(d.path(), 0, "{\"job_id\":\"7\"}", &l, RunDirLock::kOrphanLockWaitS, &env).ok());
  REQUIRE(RunDirLock::Probe(d.path(), 0, &held, &owner, &env).ok());
  CHECK(held && owner.find("\"job_id\":\"7\"") != std::string::npos);
  l.reset();
  REQUIRE(RunDirLock::Probe(d.path(), 0, &held, &owner, &env).ok());
  CHECK(!held && owner.empty());
}

// A forked child (a DataLoader worker) inherits the lock's open file. Its release must neither
// empty the parent's owner record nor drop the parent's lock; and the parent's release must not
// leave the lock alive in a child that still has the file open.
TEST(the_writer_lock_and_a_forked_child) {
  alpsck_test::TempDir d;
  std::unique_ptr<RunDirLock> a, b;
  const std::string me = "{\"pid\":1,\"host\":\"h1\",\"job_id\":\"42\",\"rank\":0}";
  REQUIRE(RunDirLock::Acquire(d.path(), 0, me, &a).ok());
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    a->Release();  // the child lets go of its copy
    a.reset();
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  bool held = false;
  std::string owner;
  REQUIRE(RunDirLock::Probe(d.path(), 0, &held, &owner).ok());
  CHECK(held);
  CHECK(owner.find("\"job_id\":\"42\"") != std::string::npos);  // the record is the parent's still
  CHECK(RunDirLock::Acquire(d.path(), 0, "{}", &b).code() == Code::kBusy);

  int go[2];
  REQUIRE(pipe(go) == 0);
  pid = fork();  // a child that keeps the inherited file open while the parent releases
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(go[1]);
    char c;
    while (read(go[0], &c, 1) < 0 && errno == EINTR) {
    }
    _exit(0);
  }
  close(go[0]);
  a->Release();
  Status s = RunDirLock::Acquire(d.path(), 0, "{}", &b);  // the parent again, the child still alive
  CHECK(s.ok());
  if (!s.ok()) std::fprintf(stderr, "%s\n", s.message().c_str());
  close(go[1]);  // the child exits
  REQUIRE(waitpid(pid, &status, 0) == pid);
}

// The owner recorded exited, but the lock is still held: by a process it forked (a DataLoader
// worker outliving a killed training). A restart on the same host waits for that process, up to
// a bound, and then says what holds the lock. A live owner is refused at once, as before.
TEST(the_writer_lock_waits_for_a_dead_owners_children) {
  alpsck_test::TempDir d;
  const pid_t dead = fork();
  REQUIRE(dead >= 0);
  if (dead == 0) _exit(0);
  int status = 0;
  REQUIRE(waitpid(dead, &status, 0) == dead);  // reaped: no process has this pid now
  char host[256] = {};
  REQUIRE(gethostname(host, sizeof(host) - 1) == 0);
  const std::string gone = "{\"pid\":" + std::to_string(dead) + ",\"host\":\"" + host + "\",\"job_id\":\"7\"}";
  // The dead owner's child: holds the lock (with the dead owner's record) until told to exit.
  int ready[2], go[2];
  REQUIRE(pipe(ready) == 0 && pipe(go) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(go[1]);  // or its read would never see the end
    close(ready[0]);
    std::unique_ptr<RunDirLock> l;
    const char ok = RunDirLock::Acquire(d.path(), 0, gone, &l).ok() ? 'y' : 'n';
    if (write(ready[1], &ok, 1) != 1) _exit(3);
    char c;
    while (read(go[0], &c, 1) < 0 && errno == EINTR) {
    }
    _exit(0);  // no Release: the kernel drops the flock as the process ends
  }
  close(go[0]);
  close(ready[1]);
  char ok = 0;
  REQUIRE(read(ready[0], &ok, 1) == 1 && ok == 'y');
  std::unique_ptr<RunDirLock> b, held;

  auto t0 = std::chrono::steady_clock::now();
  Status s = RunDirLock::Acquire(d.path(), 0, "{}", &b, 0.5);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s.code() == Code::kBusy);
  CHECK(waited >= 0.5 && waited < 20);
  CHECK(s.message().find("pid " + std::to_string(dead) + ") on host " + host +
                         "; that process has exited, but one it forked") != std::string::npos);

  // The lock is taken once the child has exited, not before: the thread says when it lets the
  // child go, and no clock is read against a bound a loaded machine could miss (a TSan build on
  // two busy CPUs stalled this thread 50 ms between starting the other and reading the time).
  std::atomic<bool> let_go{false};
  t0 = std::chrono::steady_clock::now();
  std::thread exits([&] {  // the child exits a moment later
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    let_go = true;
    close(go[1]);
  });
  s = RunDirLock::Acquire(d.path(), 0, "{}", &b, 30);
  const bool after_the_child = let_go;
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  exits.join();
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(s.ok());
  CHECK(after_the_child);
  CHECK(took < 25);  // it did not wait out its bound of 30 s
  b.reset();
  close(ready[0]);

  // A live owner (this process's pid), or one on another host: refused at once.
  for (const std::string& owner : {"{\"pid\":" + std::to_string(getpid()) + ",\"host\":\"" + host + "\"}",
                                   "{\"pid\":" + std::to_string(dead) + ",\"host\":\"elsewhere\"}",
                                   std::string("not json")}) {
    REQUIRE(RunDirLock::Acquire(d.path(), 0, owner, &held).ok());
    t0 = std::chrono::steady_clock::now();
    CHECK(RunDirLock::Acquire(d.path(), 0, "{}", &b, 30).code() == Code::kBusy);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));  // not its 30 s
    held.reset();
  }
}

TEST(the_writer_lock_never_follows_a_symlink_nor_opens_a_fifo_or_directory) {
  alpsck_test::TempDir d;
  const std::string outside = d.sub("outside"), run = d.sub("run");
  REQUIRE(::mkdir(run.c_str(), 0755) == 0);
  REQUIRE(alpsck_test::WriteText(outside, "sentinel"));
  const std::string lock = run + "/" + kLockName;
  struct Case {
    std::function<bool()> make;
    const char* says;
  };
  const Case cases[] = {
      {[&] { return ::symlink(outside.c_str(), lock.c_str()) == 0; }, "a symbolic link"},
      {[&] { return ::symlink((d.path() + "/nowhere").c_str(), lock.c_str()) == 0; }, "a symbolic link"},
      {[&] { return ::mkfifo(lock.c_str(), 0644) == 0; }, "a FIFO"},
      {[&] { return ::mkdir(lock.c_str(), 0755) == 0; }, "a directory"},
  };
  for (const Case& c : cases) {
    REQUIRE(c.make());
    std::unique_ptr<RunDirLock> l;
    Status s = RunDirLock::Acquire(run, 0, "{}", &l);
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK(s.message().find(c.says) != std::string::npos);
    bool held = true;
    std::string owner;
    CHECK(RunDirLock::Probe(run, 0, &held, &owner).code() == Code::kInvalidArgument);
    std::string text;
    REQUIRE(ReadSmallFile(Env::Default(), outside, 100, &text).ok());
    CHECK_EQ(text, std::string("sentinel"));
    CHECK(::access((d.path() + "/nowhere").c_str(), F_OK) != 0);  // a dangling link was not created through
    if (::unlink(lock.c_str()) != 0) ::rmdir(lock.c_str());
  }
}

// Retention and tidying touch only directories of this process's user: in a shared (group
// writable) run directory, another user's free-K is never claimed and another user's leftover
// attempt never emptied. Needs a directory owned by someone else: as root (CI), one is chowned to
// nobody; otherwise "/" stands in for it.
TEST(directories_of_another_user_are_never_claimed_nor_emptied) {
  alpsck_test::TempDir d;
  Env* env = Env::Default();
  CHECK_EQ(env->IsOwnDir(d.path()), 1);
  if (::geteuid() != 0) {
    std::fprintf(stderr, "not root: no foreign directory can be made here; checking / instead\n");
    CHECK_EQ(env->IsOwnDir("/"), 0);
    return;
  }
  const std::string free_dir = d.sub(FreeDirName(1, 99, 0)), tmp = d.sub(TmpDirName(5, 0));
  const std::string attempt = d.sub(TmpDirName(3, 0));
  for (const std::string& p : {free_dir, attempt}) {
    REQUIRE(::mkdir(p.c_str(), 0777) == 0);
    REQUIRE(WriteFileSynced(env, JoinPath(p, ShardFileName(0)), "theirs").ok());
    REQUIRE(::chown(p.c_str(), 65534, 65534) == 0);
  }
  CHECK_EQ(env->IsOwnDir(free_dir), 0);
  CHECK(!RemoveDirFiles(env, attempt).ok());
  CHECK(TidyRunDir(env, d.path(), 1, 2).empty());  // never handed out for a claim
  CHECK(alpsck_test::Exists(JoinPath(attempt, ShardFileName(0))));
  CHECK(alpsck_test::Exists(JoinPath(free_dir, ShardFileName(0))));
  REQUIRE(::chown(free_dir.c_str(), 0, 0) == 0);  // the same directory, ours: handed out, claimed
  const std::deque<std::string> kept = TidyRunDir(env, d.path(), 1, 2);
  REQUIRE(kept.size() == 1);
  CHECK_EQ(kept.front(), FreeDirName(1, 99, 0));
  CHECK_EQ(ClaimDir(env, d.path(), kept.front(), tmp), 0);
}

// A probe lives for milliseconds: rank 0's tidying removes the probe files a killed process left (the
// engine's and the health gate's, its temp file too) once they are kStaleProbeSeconds old, never a newer
// one (a probe in progress), a link at such a name, or a directory.
TEST(tidying_removes_stale_probe_files_only) {
  alpsck_test::TempDir d;
  Env* env = Env::Default();
  const std::string stale[] = {ProbeFileName(1, 4242), HealthProbeFileName("nid001", 7),
                               TempFileName(HealthProbeFileName("nid002", 8))};
  const std::string fresh = ProbeFileName(2, 4243), link = ProbeFileName(3, 4244), dir = HealthProbeFileName("x", 9);
  const struct timespec old_times[2] = {{::time(nullptr) - kStaleProbeSeconds - 5, 0},
                                        {::time(nullptr) - kStaleProbeSeconds - 5, 0}};
  for (const std::string& n : stale) {
    REQUIRE(WriteFileSynced(env, d.sub(n), "probe").ok());
    REQUIRE(::utimensat(AT_FDCWD, d.sub(n).c_str(), old_times, 0) == 0);
  }
  REQUIRE(WriteFileSynced(env, d.sub(fresh), "probe").ok());
  REQUIRE(WriteFileSynced(env, d.sub("target"), "not a probe").ok());
  REQUIRE(::symlink("target", d.sub(link).c_str()) == 0);
  REQUIRE(::utimensat(AT_FDCWD, d.sub(link).c_str(), old_times, AT_SYMLINK_NOFOLLOW) == 0);
  REQUIRE(::mkdir(d.sub(dir).c_str(), 0755) == 0);
  REQUIRE(::utimensat(AT_FDCWD, d.sub(dir).c_str(), old_times, 0) == 0);
  CHECK(TidyRunDir(env, d.path(), 1, 2).empty());
  for (const std::string& n : stale) CHECK(!alpsck_test::Exists(d.sub(n)));
  CHECK(alpsck_test::Exists(d.sub(fresh)));
  CHECK(alpsck_test::Exists(d.sub(link)) && alpsck_test::Exists(d.sub("target")));
  CHECK(alpsck_test::Exists(d.sub(dir)));
}

// SpareDirs on its own: rank 0 keeps what its retention expired (up to max_free), names one in a
// verdict, and the save after it claims that one; a claim that finds the attempt's directory made
// keeps the spare for later; with retention off nothing is kept, named or claimed.
TEST(spare_dirs_keep_name_and_claim_expired_directories) {
  alpsck_test::TempDir d;
  Env* env = Env::Default();
  auto committed = [&](uint64_t step) {
    const std::string dir = d.sub(StepDirName(step));
    REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
    REQUIRE(WriteFileSynced(env, JoinPath(dir, ShardFileName(0)), "shard").ok());
    REQUIRE(WriteFileSynced(env, JoinPath(dir, kManifestName), "{}").ok());
  };
  committed(1);
  committed(2);
  committed(3);
  SpareDirs spares(env, d.path(), 0, true, 1);
  spares.Tidy(1);
  CHECK_EQ(spares.Designate(), std::string());  // nothing expired yet
  CHECK_EQ(spares.Expire({{1, true}, {2, true}}), std::string());
  CHECK(!alpsck_test::Exists(d.sub(StepDirName(1))) && !alpsck_test::Exists(d.sub(StepDirName(2))));
  const std::string name = spares.Designate();  // one kept (max_free 1), the other removed
  REQUIRE(ParseRunDirName(name).kind == EntryKind::kFree);
  CHECK_EQ(spares.Designate(), std::string());
  CHECK(alpsck_test::Exists(JoinPath(d.sub(name), ShardFileName(0))));
  std::vector<std::string> names;
  REQUIRE(env->ListDir(d.path(), &names) == 0);
  CHECK_EQ(names.size(), size_t{2});  // step-3 and the kept one
  // The directory of the next save exists already: the spare stays free, kept for later.
  const std::string tmp4 = d.sub(TmpDirName(4)), tmp5 = d.sub(TmpDirName(5));
  REQUIRE(::mkdir(tmp4.c_str(), 0755) == 0);
  spares.Committed(name, true);
  CHECK(spares.ClaimFor(tmp4) == SpareDirs::Claim::kNone);
  CHECK_EQ(spares.Designate(), name);
  spares.Committed(name, true);
  CHECK(spares.ClaimFor(tmp5) == SpareDirs::Claim::kClaimed);
  CHECK(alpsck_test::Exists(JoinPath(tmp5, ShardFileName(0))));  // overwritten in place by the save
  CHECK(spares.ClaimFor(d.sub(TmpDirName(6))) == SpareDirs::Claim::kNone);  // named once, claimed once
  spares.Committed(name, true);  // named again (another rank claimed it meanwhile): gone
  CHECK(spares.ClaimFor(d.sub(TmpDirName(6))) == SpareDirs::Claim::kTakenByOther);
  spares.Committed(name, false);  // a designation never announced goes back to the kept ones
  CHECK_EQ(spares.Designate(), name);
  SpareDirs off(env, d.path(), 0, false, 4);
  CHECK_EQ(off.Expire({{3, true}}), std::string());
  CHECK(alpsck_test::Exists(d.sub(StepDirName(3))));  // retention off: nothing expired
  off.Committed(name, true);
  CHECK(off.ClaimFor(d.sub(TmpDirName(7))) == SpareDirs::Claim::kNone);
}

// Prune's removal (RemoveEntries): a nested tree goes whole; a symlink goes as the link, its
// target untouched; a .deleting-* leftover is finished under its own name; a taken .deleting-
// name is not overwritten; nothing of the run directory outside the names is touched.
TEST(remove_entries_removes_trees_links_and_leftovers_only) {
  alpsck_test::TempDir d, elsewhere;
  Env* env = Env::Default();
  const std::string step = d.sub(StepDirName(1)), nested = JoinPath(step, "a");
  REQUIRE(::mkdir(step.c_str(), 0777) == 0 && ::mkdir(nested.c_str(), 0777) == 0);
  REQUIRE(::mkdir(JoinPath(nested, "b").c_str(), 0777) == 0);
  REQUIRE(alpsck_test::WriteText(JoinPath(JoinPath(nested, "b"), "deep"), "x"));
  REQUIRE(alpsck_test::WriteText(JoinPath(step, kManifestName), "{}"));
  REQUIRE(::symlink(elsewhere.path().c_str(), JoinPath(nested, "out").c_str()) == 0);  // inside the tree
  REQUIRE(alpsck_test::WriteText(elsewhere.sub("keep"), "theirs"));
  REQUIRE(::symlink(elsewhere.path().c_str(), d.sub(StepDirName(2)).c_str()) == 0);  // the entry itself
  const std::string leftover = d.sub(DeletingName(StepDirName(3)));
  REQUIRE(::mkdir(leftover.c_str(), 0777) == 0);
  REQUIRE(alpsck_test::WriteText(JoinPath(leftover, ShardFileName(0)), "x"));
  const std::string taken = d.sub(DeletingName(StepDirName(4)));  // a file at the name prune would take
  REQUIRE(alpsck_test::WriteText(taken, "not prune's"));
  REQUIRE(::mkdir(d.sub(StepDirName(4)).c_str(), 0777) == 0);
  REQUIRE(::mkdir(d.sub(StepDirName(5)).c_str(), 0777) == 0);  // not named: kept
  ConfinedRoot confined(env, d.path());
  const Removal r = RemoveEntries(env, d.path(),
                                  {StepDirName(1), StepDirName(2), DeletingName(StepDirName(3)), StepDirName(4),
                                   StepDirName(9)});  // step 9: gone meanwhile, skipped
  CHECK(r.status.ok());
  CHECK(r.removed == (std::vector<size_t>{0, 1, 2, 3}));
  for (uint64_t s : {1, 2, 4}) CHECK(!alpsck_test::Exists(d.sub(StepDirName(s))));
  CHECK(!alpsck_test::Exists(leftover));
  CHECK(alpsck_test::Exists(d.sub(StepDirName(5))));
  std::string text;
  CHECK(ReadSmallFile(env, taken, 100, &text).ok() && text == "not prune's");
  CHECK(ReadSmallFile(env, elsewhere.sub("keep"), 100, &text).ok() && text == "theirs");
  std::vector<std::string> names;
  CHECK_EQ(env->ListDir(d.path(), &names), 0);
  CHECK_EQ(names.size(), size_t{2});  // step-5 and the file at .deleting-step-4
  CHECK(!RemoveEntries(env, d.path(), {"../x"}).status.ok());
}

// A failed rename stops the renaming, yet what was renamed before it is removed and the failure
// names the entry; a failed fsync of RUN_DIR removes nothing (the renames may not be durable: a
// power loss could bring back a half-removed checkpoint).
TEST(remove_entries_reports_the_first_failure_and_loses_nothing) {
  alpsck_test::TempDir d;
  FaultEnv env;
  for (uint64_t s : {1, 2, 3}) {
    REQUIRE(::mkdir(d.sub(StepDirName(s)).c_str(), 0777) == 0);
    REQUIRE(alpsck_test::WriteText(JoinPath(d.sub(StepDirName(s)), ShardFileName(0)), "x"));
  }
  FaultRule rename;
  rename.op = FaultRule::Op::kRename;
  rename.path_contains = StepDirName(2);
  rename.error = EACCES;
  env.AddRule(rename);
  Removal r = RemoveEntries(&env, d.path(), {StepDirName(1), StepDirName(2), StepDirName(3)});
  CHECK_EQ(r.status.err(), EACCES);
  CHECK(r.renaming && r.failed == d.sub(StepDirName(2)));
  CHECK(r.removed == (std::vector<size_t>{0}));
  CHECK(!alpsck_test::Exists(d.sub(StepDirName(1))));
  CHECK(alpsck_test::Exists(JoinPath(d.sub(StepDirName(2)), ShardFileName(0))));
  CHECK(alpsck_test::Exists(JoinPath(d.sub(StepDirName(3)), ShardFileName(0))));
  env.ClearRules();
  FaultRule sync;
  sync.op = FaultRule::Op::kFSync;
  env.AddRule(sync);
  r = RemoveEntries(&env, d.path(), {StepDirName(2)});
  CHECK_EQ(r.status.err(), EIO);
  CHECK(r.removed.empty());
  CHECK(alpsck_test::Exists(JoinPath(d.sub(DeletingName(StepDirName(2))), ShardFileName(0))));  // expired, kept
  env.ClearRules();
  r = RemoveEntries(&env, d.path(), {DeletingName(StepDirName(2)), StepDirName(3)});  // the next prune finishes
  CHECK(r.status.ok() && r.removed.size() == 2);
  std::vector<std::string> names;
  CHECK_EQ(Env::Default()->ListDir(d.path(), &names), 0);
  CHECK(names.empty());
}

ALPSCK_TEST_MAIN()
