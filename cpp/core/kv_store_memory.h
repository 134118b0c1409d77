// MemoryKvStore: a KvStore (kv_store.h) in this process's memory, like c10d's HashStore, for
// ranks that run as threads of one process: the tests, and a run on one process. Wait truly
// blocks: a waiter sleeps on its own condition variable, registered under the key it still needs,
// and the write of that key wakes it (a write wakes only the waiters of its key, so a thousand
// ranks waiting for one verdict are not woken by every arrival).
//
// Fault injection, for the tests of what the ranks do when the store fails: the store can vanish
// (every later call of every client fails with kIoError, and blocked waiters wake to fail), and a
// Rule can delay chosen calls, time them out (no effect), lose their reply (the effect happens,
// the caller gets an error) or make the store vanish at them.
//
// Threading: as KvStore's: a client is used by one thread at a time, clients made by Clone
// concurrently. AddRule, ClearRules, Vanish, Keys and FaultsInjected may be called from any thread
// (they act on the store every client shares); one mutex guards it all.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv_store.h"

namespace alpsck {

class MemoryKvStore : public KvStore {
 public:
  MemoryKvStore();  // a new, empty store, and its first client

  Status Set(const std::string& key, const std::string& value) override;
  Status Get(const std::string& key, double timeout_s, std::string* value) override;
  Status Add(const std::string& key, int64_t delta, int64_t* new_value) override;
  Status Append(const std::string& key, const std::string& value) override;
  Status CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                    std::string* current) override;
  Status Wait(const std::vector<std::string>& keys, double timeout_s) override;
  Status DeleteKey(const std::string& key) override;
  Status Clone(std::unique_ptr<KvStore>* out) override;

  enum class Op { kAny, kSet, kGet, kAdd, kAppend, kCompareSet, kWait, kDelete };
  enum class Action {
    kNone,       // only the delay
    kTimeout,    // no effect; Get and Wait fail as timed out (kNotFound), the others with kIoError
    kLoseReply,  // the call takes effect, then fails with kIoError (the caller cannot tell)
    kVanish,     // the store vanishes before this call
  };
  struct Rule {
    Op op = Op::kAny;
    std::string key_contains;  // "" matches every key; Wait: any of its keys
    uint64_t skip = 0;         // matching calls let through first
    uint64_t count = 1;        // then this many are affected (UINT64_MAX: all)
    double delay_s = 0;        // before the call, the store unlocked meanwhile
    Action action = Action::kNone;
  };
  // Rules are matched in the order added; the first that matches a call decides it.
  void AddRule(const Rule& r);
  void ClearRules();
  void Vanish();
  // Every key stored now, sorted (a test's "nothing left behind").
  std::vector<std::string> Keys() const;
  uint64_t FaultsInjected() const;

 private:
  struct Shared;  // the store every client of it shares (kv_store_memory.cc)
  explicit MemoryKvStore(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  std::shared_ptr<Shared> shared_;
};

}  // namespace alpsck
