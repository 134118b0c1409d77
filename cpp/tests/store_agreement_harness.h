// The harness of the store agreement's tests and benchmark (test_store_agreement.cc,
// bench_protocol.cc): ranks as threads, each with its own client of one MemoryKvStore, running
// real CommitAttempts (store_agreement.h) on a real run directory, as the engine runs them.
#pragma once

#include <fcntl.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
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
#include "test_util.h"
#include "testing.h"

namespace store_harness {

using namespace alpsck;

using Clock = std::chrono::steady_clock;
constexpr char kNs[] = "alpsck/test/";

inline double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// n threads running fn(i), on small stacks (1,024 ranks as threads under the sanitizers and qemu
// would otherwise reserve 8 MiB each).
inline void RunThreads(uint32_t n, const std::function<void(uint32_t)>& fn) {
  struct Arg {
    const std::function<void(uint32_t)>* fn;
    uint32_t i;
  };
  std::vector<Arg> args(n);
  std::vector<pthread_t> ts(n);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 512 << 10);
  for (uint32_t i = 0; i < n; ++i) {
    args[i] = {&fn, i};
    int r = pthread_create(&ts[i], &attr, [](void* p) -> void* {
      Arg* a = static_cast<Arg*>(p);
      (*a->fn)(a->i);
      return nullptr;
    }, &args[i]);
    if (r != 0) {
      std::fprintf(stderr, "pthread_create: %d\n", r);
      std::abort();
    }
  }
  pthread_attr_destroy(&attr);
  for (auto& t : ts) pthread_join(t, nullptr);
}

// Store operations one rank made.
struct OpCounts {
  uint64_t set = 0, get = 0, add = 0, append = 0, cas = 0, wait = 0, del = 0;
  uint64_t del_acks = 0;  // deletes of the acknowledgement counter: the last reader's cleanup
  uint64_t total() const { return set + get + add + append + cas + wait + del; }
};

class CountingKvStore : public KvStore {
 public:
  CountingKvStore(std::unique_ptr<KvStore> base, OpCounts* c) : base_(std::move(base)), c_(c) {}
  Status Set(const std::string& k, const std::string& v) override { return ++c_->set, base_->Set(k, v); }
  Status Get(const std::string& k, double t, std::string* v) override { return ++c_->get, base_->Get(k, t, v); }
  Status Add(const std::string& k, int64_t d, int64_t* n) override { return ++c_->add, base_->Add(k, d, n); }
  Status Append(const std::string& k, const std::string& v) override { return ++c_->append, base_->Append(k, v); }
  Status CompareSet(const std::string& k, const std::string& e, const std::string& d, std::string* c) override {
    return ++c_->cas, base_->CompareSet(k, e, d, c);
  }
  Status Wait(const std::vector<std::string>& k, double t) override { return ++c_->wait, base_->Wait(k, t); }
  Status DeleteKey(const std::string& k) override {
    ++c_->del;
    if (k.size() >= 5 && k.compare(k.size() - 5, 5, "/acks") == 0) ++c_->del_acks;
    return base_->DeleteKey(k);
  }
  Status Clone(std::unique_ptr<KvStore>* out) override {
    std::unique_ptr<KvStore> b;
    ALPSCK_RETURN_IF_ERROR(base_->Clone(&b));
    out->reset(new CountingKvStore(std::move(b), c_));
    return Status::Ok();
  }

 private:
  std::unique_ptr<KvStore> base_;
  OpCounts* c_;
};

// The metadata calls a rank makes that would be polling (FileAgreement's are these).
class CountingEnv : public FaultEnv {
 public:
  std::atomic<uint64_t> list_dir{0}, is_dir{0};
  int ListDir(const std::string& path, std::vector<std::string>* names) override {
    ++list_dir;
    return FaultEnv::ListDir(path, names);
  }
  int IsDir(const std::string& path) override {
    ++is_dir;
    return FaultEnv::IsDir(path);
  }
  int IsOwnDir(const std::string& path) override {
    ++is_dir;
    return FaultEnv::IsOwnDir(path);
  }
};

// A rank's shard, sealed, in the attempt's directory (created by whichever rank comes first): a
// small valid one, so that the committed step verifies.
inline Status WriteShard(Env* env, const Attempt& a, uint32_t rank, ShardRecord* rec) {
  int r = env->Mkdir(a.tmp_dir());
  if (r < 0 && r != -EEXIST) return Status::FromErrno(-r, "mkdir " + a.tmp_dir());
  const std::string path = JoinPath(a.tmp_dir(), ShardFileName(rank));
  const uint64_t align = std::max<uint64_t>(4096, PageSize());
  ShardIndex idx;
  ALPSCK_RETURN_IF_ERROR(PlanLayout({{"w", 100 + rank % 1000}}, align, align, kDefaultPackAlign, &idx.layout));
  std::vector<char> data(idx.layout.data_padded, 0);
  for (uint64_t i = 0; i < 100 + rank % 1000; ++i) data[i] = static_cast<char>(rank * 7 + i);
  for (uint64_t i = 0; i < idx.layout.num_chunks(); ++i)
    idx.crcs.push_back(Crc32c(data.data() + idx.layout.chunk_begin(i), idx.layout.chunk_len(i)));
  idx.rank = rank;
  idx.meta = "{}";
  idx.save_id = "s" + std::to_string(a.step) + "-" + std::to_string(a.attempt);
  int fd = env->Open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Status::FromErrno(-fd, "open " + path);
  Status s = WriteFull(env, fd, data.data(), data.size(), 0, path);
  if (s.ok()) s = SealShard(env, fd, path, idx, false, align, rec);
  env->Close(fd);
  rec->name = ShardFileName(rank);
  return s;
}

struct SaveSpec {
  uint32_t world = 2;
  uint64_t step = 1;
  uint32_t attempt = 0;
  double timeout_s = 30;              // how long each rank waits for the others
  double coordinator_timeout_s = -1;  // rank 0's (-1: timeout_s)
  double settle_s = 30;               // how long a rank waits once the commit is claimed
  std::set<uint32_t> absent;          // ranks that died before this save: never run
  std::set<uint32_t> skip_peek;       // ranks already past AbortedAlready (they come late)
  Env* env0 = nullptr;                // rank 0's Env (nullptr: the default)
  std::vector<OpCounts>* counts = nullptr;       // store operations per rank
  std::vector<CountingEnv>* envs = nullptr;      // each rank's Env (counts its polling calls)
  std::function<Status(uint32_t, KvStore*)> fake;  // replaces ranks for which it is set and returns true
  std::set<uint32_t> faked;
};

// Rank `rank`'s save of spec.step, as the engine runs it: the late check, the shard, then the
// coordinator commits and every other rank arrives and waits for the verdict.
inline Status SaveRank(const std::string& run, MemoryKvStore* root, const SaveSpec& spec, uint32_t rank) {
  std::unique_ptr<KvStore> client;
  Status s = root->Clone(&client);
  if (!s.ok()) return s;
  if (spec.counts) client.reset(new CountingKvStore(std::move(client), &(*spec.counts)[rank]));
  if (spec.faked.count(rank)) return spec.fake(rank, client.get());
  Env* env = spec.envs ? &(*spec.envs)[rank] : rank == 0 && spec.env0 ? spec.env0 : Env::Default();
  const double timeout = rank == 0 && spec.coordinator_timeout_s >= 0 ? spec.coordinator_timeout_s : spec.timeout_s;
  const Attempt at{run, spec.step, spec.attempt};
  const Clock::time_point t0 = Clock::now();
  CommitAttempt ca(env, at, rank, timeout,
                   std::make_unique<StoreAgreement>(env, at, std::move(client), kNs, spec.world, spec.world - 1, spec.world,
                                                    spec.settle_s));
  Status verdict;
  if (!spec.skip_peek.count(rank) && ca.AbortedAlready(&verdict)) return verdict;
  ShardRecord rec;
  s = WriteShard(env, at, rank, &rec);
  if (!s.ok()) return ca.Fail(s);
  if (rank == 0) return ca.Commit(&rec, {}, t0);
  s = ca.Arrive(rec);
  if (!s.ok()) return ca.Fail(s);
  return ca.AwaitVerdict();
}

inline std::vector<Status> SaveAll(const std::string& run, MemoryKvStore* root, const SaveSpec& spec) {
  std::vector<Status> out(spec.world);
  RunThreads(spec.world, [&](uint32_t r) {
    if (!spec.absent.count(r)) out[r] = SaveRank(run, root, spec, r);
  });
  return out;
}

// The step's state on disk: kCommitted, or kIncomplete when no step-N is there.
inline CheckpointState OnDisk(const std::string& run, uint64_t step, bool verify = false, uint32_t* ranks = nullptr) {
  std::vector<CheckpointInfo> infos;
  if (!ScanRunDir(Env::Default(), run, verify, 2, &infos).ok()) return CheckpointState::kUnreadable;
  for (const auto& i : infos)
    if (i.step == step && i.path == JoinPath(run, StepDirName(step))) {
      if (ranks) *ranks = i.ranks;
      if (i.state != CheckpointState::kCommitted) std::fprintf(stderr, "step %llu: %s\n", (unsigned long long)step, i.error.c_str());
      return i.state;
    }
  return CheckpointState::kIncomplete;
}

inline std::vector<std::string> Entries(const std::string& run) {
  std::vector<std::string> names;
  Env::Default()->ListDir(run, &names);
  std::sort(names.begin(), names.end());
  return names;
}

inline std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

// One verdict: every live rank succeeded and step-N is committed, or every one failed and it is not.
inline void CheckOneVerdict(const std::vector<Status>& st, const SaveSpec& spec, const std::string& run, bool want_commit) {
  const bool committed = OnDisk(run, spec.step) == CheckpointState::kCommitted;
  CHECK_EQ(committed, want_commit);
  for (uint32_t r = 0; r < st.size(); ++r) {
    if (spec.absent.count(r) || spec.faked.count(r)) continue;
    if (st[r].ok() != committed) std::fprintf(stderr, "rank %u: %s (disk: %s)\n", r, st[r].ToString().c_str(),
                                              committed ? "committed" : "not committed");
    CHECK_EQ(st[r].ok(), committed);
  }
}

inline void CheckNoKeys(MemoryKvStore* store) {
  const auto keys = store->Keys();
  if (!keys.empty()) std::fprintf(stderr, "keys left: %s\n", Join(keys).c_str());
  CHECK(keys.empty());
}

}  // namespace store_harness
