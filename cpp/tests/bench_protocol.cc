// The commit protocol's time per save against the number of ranks (issue 40): ranks as threads,
// each with its own client of one in-process MemoryKvStore, run real CommitAttempts through the
// StoreAgreement on a real run directory (store_agreement_harness.h). Each rank first writes and
// seals its small shard; once every rank has (a barrier), the clock starts, and the protocol's
// time is until the last rank knows the verdict: the arrivals, rank 0's wait and its commit on
// disk (manifest, fsyncs, the rename), the verdict reaching every rank. Shard writes are outside
// it: they are the disk's, and grow with the ranks on one machine. Not a test (no assertion on
// time): CI builds it; run it by hand.
//
//   ./bench_protocol [saves per size, default 5] [largest world, default 1024] [run dir parent]
#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "store_agreement_harness.h"

using namespace store_harness;

namespace {

class Barrier {
 public:
  explicit Barrier(uint32_t n) : n_(n) {}
  // Returns true on the thread that arrived last (after which all go on).
  bool ArriveAndWait() {
    std::unique_lock<std::mutex> l(mu_);
    if (++count_ == n_) {
      cv_.notify_all();
      return true;
    }
    cv_.wait(l, [&] { return count_ == n_; });
    return false;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const uint32_t n_;
  uint32_t count_ = 0;
};

// One save of `step` by `world` ranks; returns the protocol's seconds (or -1 on a failed rank).
double OneSave(const std::string& run, MemoryKvStore* store, uint32_t world, uint64_t step) {
  Barrier shards_done(world);
  Clock::time_point start;
  std::vector<Clock::time_point> verdict(world);
  std::atomic<bool> failed{false};
  RunThreads(world, [&](uint32_t rank) {
    std::unique_ptr<KvStore> client;
    Status s = store->Clone(&client);
    const Attempt at{run, step, 0};
    std::unique_ptr<CommitAttempt> ca;
    if (s.ok())
      ca = std::make_unique<CommitAttempt>(
          Env::Default(), at, rank, 60,
          std::make_unique<StoreAgreement>(Env::Default(), at, std::move(client), "bench/", world, world - 1, world, 60));
    Status late;
    ShardRecord rec;
    if (s.ok() && ca->AbortedAlready(&late)) s = late;
    if (s.ok()) s = WriteShard(Env::Default(), at, rank, &rec);
    if (shards_done.ArriveAndWait()) start = Clock::now();  // the last one sets it before any goes on
    if (s.ok()) {
      if (rank == 0) {
        s = ca->Commit(&rec, {}, Clock::now());
      } else {
        s = ca->Arrive(rec);
        if (s.ok()) s = ca->AwaitVerdict();
      }
    }
    verdict[rank] = Clock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "world %u step %llu rank %u: %s\n", world, static_cast<unsigned long long>(step), rank,
                   s.message().c_str());
      failed = true;
    }
  });
  if (failed) return -1;
  Clock::time_point last = start;
  for (const auto& t : verdict) last = std::max(last, t);
  return std::chrono::duration<double>(last - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int saves = argc > 1 ? std::atoi(argv[1]) : 5;
  const uint32_t largest = argc > 2 ? static_cast<uint32_t>(std::atoi(argv[2])) : 1024;
  const std::string parent = argc > 3 ? argv[3] : "";
  if (saves < 1 || largest < 1) {
    std::fprintf(stderr, "usage: bench_protocol [saves >= 1] [largest world >= 1] [run dir parent]\n");
    return 2;
  }
  std::printf("%7s %12s %12s %12s\n", "ranks", "median ms", "min ms", "max ms");
  double first = 0, lo = 1e30, hi = 0;
  for (uint32_t world = 1; world <= largest; world *= 2) {
    alpsck_test::TempDir d(parent);
    MemoryKvStore store;
    std::vector<double> t;
    for (int i = 0; i < saves; ++i) {
      const double s = OneSave(d.path(), &store, world, static_cast<uint64_t>(i + 1));
      if (s < 0) return 1;
      t.push_back(s * 1e3);
    }
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2];
    if (world == 1) first = med;
    lo = std::min(lo, med);
    hi = std::max(hi, med);
    std::printf("%7u %12.2f %12.2f %12.2f\n", world, med, t.front(), t.back());
    std::fflush(stdout);
  }
  std::printf("largest median / smallest: %.2fx; largest / 1 rank: %.2fx\n", hi / lo, hi / first);
  return 0;
}
