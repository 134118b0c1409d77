// KvStore: a key-value store that the ranks of a job share, with the semantics of
// torch.distributed's c10d Store (TCPStore, HashStore, PrefixStore), so that a client of a c10d
// store can implement it without translation. The commit's ranks can meet through one instead of
// polling the file system (StoreAgreement, store_agreement.h).
//
// Semantics (those of c10d; keys and values are byte strings):
//   Set          stores value under key (replaces).
//   Get          waits until key exists (up to timeout_s; 0: only looks), then reads it.
//   Add          adds delta to the int64 counter at key (a missing key counts as 0; the value is
//                its decimal text, as c10d stores it) and returns the new value.
//   Append       appends to the value at key (a missing key is created): c10d's append.
//   CompareSet   c10d's compare_set: key missing and expected empty: sets desired; key missing and
//                expected NOT empty: sets nothing and returns expected (not the absent value);
//                key present and equal to expected: sets desired; otherwise sets nothing. Returns
//                (*current) the value stored afterwards, with that one exception.
//   Wait         waits until every key exists (up to timeout_s): the store wakes the waiter when
//                the last one is set; a client never polls.
//   DeleteKey    removes key (a missing key is no error).
//   Clone        a new client of the same store (c10d's clone()): each thread uses its own.
//
// Errors: a Get or Wait that times out is kNotFound and names the keys it waited for; any other
// error means the store failed (unreachable, gone): its code is kIoError, and the caller cannot
// tell whether a write it issued took effect.
//
// Threading: a client (a KvStore object) is used by one thread at a time; clients made by Clone
// may be used concurrently, each by its own thread. The store behind them is shared by every
// rank and every client.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "status.h"

namespace alpsck {

class KvStore {
 public:
  virtual ~KvStore() = default;
  virtual Status Set(const std::string& key, const std::string& value) = 0;
  virtual Status Get(const std::string& key, double timeout_s, std::string* value) = 0;
  virtual Status Add(const std::string& key, int64_t delta, int64_t* new_value) = 0;
  virtual Status Append(const std::string& key, const std::string& value) = 0;
  virtual Status CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                            std::string* current) = 0;
  virtual Status Wait(const std::vector<std::string>& keys, double timeout_s) = 0;
  virtual Status DeleteKey(const std::string& key) = 0;
  virtual Status Clone(std::unique_ptr<KvStore>* out) = 0;
};

// KvClientPool: the clients of one store for the commit attempts of one engine. An attempt takes
// one for its life (Acquire) and the client goes back to the pool when the attempt's agreement
// drops it; a new client (base->Clone()) is made only when none is idle, so an engine holds about
// max_in_flight + 1 clients however many saves it makes (a clone of a TCPStore is a connection to
// its server). A client that returned any error (a timeout included: a c10d client may have an
// answer still on its way) is dropped, not reused; a Get that only looked (timeout 0) and found
// no key is not an error of the client.
//
// Threading: Acquire may be called from any thread; a client handed out is one thread's at a time
// (KvStore's rule), and may outlive the pool.
class KvClientPool {
 public:
  explicit KvClientPool(std::shared_ptr<KvStore> base);
  Status Acquire(std::unique_ptr<KvStore>* out);
  size_t clients_made() const;  // how many Clone()s so far (for tests)

  struct Shared;  // the base and the idle clients, shared with the clients handed out

 private:
  std::shared_ptr<Shared> shared_;
};

// PooledKvStore: a store whose Clone() lends a client from one KvClientPool, so that every user of
// it in a process (each engine's own pool, each CommitStep) shares the same few connections. Made
// once per process for torch.distributed's store (the binding's StoreClients): a DCP save opens a
// new engine on each rank and commits through a clone, and a c10d TCPStore clone is a new
// connection, which costs about 1 ms and, on torch 2.13, now and then 5 s (its ping waits on the
// server: 4 of 60 clones at 2 ranks on loopback, benchmarks/dcp_fixed_cost.py saw 5.03 s saves).
// Its other calls each borrow a client for the one call. Threading: any thread, any call.
class PooledKvStore : public KvStore {
 public:
  explicit PooledKvStore(std::shared_ptr<KvStore> base) : pool_(std::move(base)) {}
  Status Set(const std::string& key, const std::string& value) override;
  Status Get(const std::string& key, double timeout_s, std::string* value) override;
  Status Add(const std::string& key, int64_t delta, int64_t* new_value) override;
  Status Append(const std::string& key, const std::string& value) override;
  Status CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                    std::string* current) override;
  Status Wait(const std::vector<std::string>& keys, double timeout_s) override;
  Status DeleteKey(const std::string& key) override;
  Status Clone(std::unique_ptr<KvStore>* out) override { return pool_.Acquire(out); }
  size_t clients_made() const { return pool_.clients_made(); }

 private:
  KvClientPool pool_;
};

// The error of a Get or Wait that timed out: kNotFound naming the keys (the list cut at about
// 200 characters). For implementations, so that every client words it the same way.
Status KvTimeout(const std::vector<std::string>& keys, double timeout_s);

}  // namespace alpsck
