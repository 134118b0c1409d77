#include "kv_store_memory.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace alpsck {

namespace {

using Clock = std::chrono::steady_clock;

Status Gone() { return Status::Error(Code::kIoError, "the key-value store is gone"); }

}  // namespace

struct MemoryKvStore::Shared {
  struct RuleState {
    Rule rule;
    uint64_t seen = 0;  // matching calls so far
  };
  mutable std::mutex mu;
  std::map<std::string, std::string> data;
  // The waiters still needing a key, each on its own condition variable: a write wakes only those
  // of its key.
  std::multimap<std::string, std::condition_variable*> waiters;
  std::vector<RuleState> rules;
  bool vanished = false;
  uint64_t faults = 0;

  void Wake(const std::string& key) {
    auto range = waiters.equal_range(key);
    for (auto it = range.first; it != range.second; ++it) it->second->notify_one();
  }

  // The rule that decides a call, if any: applies its delay (unlocked) and returns its action.
  Action Enter(Op op, const std::vector<std::string>& keys, std::unique_lock<std::mutex>& l) {
    Action act = Action::kNone;
    double delay = 0;
    for (RuleState& rs : rules) {
      const Rule& r = rs.rule;
      if (r.op != Op::kAny && r.op != op) continue;
      const bool key_matches = r.key_contains.empty() || std::any_of(keys.begin(), keys.end(), [&](const std::string& k) {
                                 return k.find(r.key_contains) != std::string::npos;
                               });
      if (!key_matches) continue;
      const uint64_t n = rs.seen++;
      if (n < r.skip || n - r.skip >= r.count) continue;
      ++faults;
      act = r.action;
      delay = r.delay_s;
      break;
    }
    if (delay > 0) {
      l.unlock();
      std::this_thread::sleep_for(std::chrono::duration<double>(delay));
      l.lock();
    }
    if (act == Action::kVanish) {
      vanished = true;
      for (auto& w : waiters) w.second->notify_one();
    }
    return act;
  }

  // Until every key exists: OK, kNotFound past the deadline, kIoError once the store is gone.
  Status WaitLocked(const std::vector<std::string>& keys, double timeout_s, std::unique_lock<std::mutex>& l) {
    const Clock::time_point deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::max(0.0, timeout_s)));
    std::condition_variable cv;
    for (;;) {
      if (vanished) return Gone();
      auto missing = std::find_if(keys.begin(), keys.end(), [&](const std::string& k) { return !data.count(k); });
      if (missing == keys.end()) return Status::Ok();
      if (Clock::now() >= deadline) {
        std::vector<std::string> left;
        for (const std::string& k : keys)
          if (!data.count(k)) left.push_back(k);
        return KvTimeout(left, timeout_s);
      }
      auto it = waiters.emplace(*missing, &cv);
      cv.wait_until(l, deadline);
      waiters.erase(it);
    }
  }
};

MemoryKvStore::MemoryKvStore() : shared_(std::make_shared<Shared>()) {}

Status MemoryKvStore::Set(const std::string& key, const std::string& value) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kSet, {key}, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return Status::Error(Code::kIoError, "set " + key + ": timed out");
  shared_->data[key] = value;
  shared_->Wake(key);
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "set " + key + ": no reply");
  return Status::Ok();
}

Status MemoryKvStore::Get(const std::string& key, double timeout_s, std::string* value) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kGet, {key}, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return KvTimeout({key}, timeout_s);
  ALPSCK_RETURN_IF_ERROR(shared_->WaitLocked({key}, timeout_s, l));
  *value = shared_->data[key];
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "get " + key + ": no reply");
  return Status::Ok();
}

Status MemoryKvStore::Add(const std::string& key, int64_t delta, int64_t* new_value) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kAdd, {key}, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return Status::Error(Code::kIoError, "add " + key + ": timed out");
  int64_t v = 0;
  auto it = shared_->data.find(key);
  if (it != shared_->data.end()) {
    char* end = nullptr;
    errno = 0;
    const long long parsed = std::strtoll(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0' || errno != 0)
      return Status::Invalid("add " + key + ": the value is not a counter");
    v = parsed;
  }
  v += delta;
  shared_->data[key] = std::to_string(v);
  shared_->Wake(key);
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "add " + key + ": no reply");
  *new_value = v;
  return Status::Ok();
}

Status MemoryKvStore::Append(const std::string& key, const std::string& value) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kAppend, {key}, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return Status::Error(Code::kIoError, "append " + key + ": timed out");
  shared_->data[key] += value;
  shared_->Wake(key);
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "append " + key + ": no reply");
  return Status::Ok();
}

Status MemoryKvStore::CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                                 std::string* current) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kCompareSet, {key}, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return Status::Error(Code::kIoError, "compare_set " + key + ": timed out");
  std::string now;
  auto it = shared_->data.find(key);
  if (it == shared_->data.end()) {
    if (expected.empty()) {
      shared_->data[key] = desired;
      shared_->Wake(key);
      now = desired;
    } else {
      now = expected;  // c10d's answer for a missing key: expected, and nothing set
    }
  } else if (it->second == expected) {
    it->second = desired;
    shared_->Wake(key);
    now = desired;
  } else {
    now = it->second;
  }
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "compare_set " + key + ": no reply");
  *current = std::move(now);
  return Status::Ok();
}

Status MemoryKvStore::Wait(const std::vector<std::string>& keys, double timeout_s) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kWait, keys, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return KvTimeout(keys, timeout_s);
  ALPSCK_RETURN_IF_ERROR(shared_->WaitLocked(keys, timeout_s, l));
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "wait: no reply");
  return Status::Ok();
}

Status MemoryKvStore::DeleteKey(const std::string& key) {
  std::unique_lock<std::mutex> l(shared_->mu);
  const Action act = shared_->Enter(Op::kDelete, {key}, l);
  if (shared_->vanished) return Gone();
  if (act == Action::kTimeout) return Status::Error(Code::kIoError, "delete_key " + key + ": timed out");
  shared_->data.erase(key);
  if (act == Action::kLoseReply) return Status::Error(Code::kIoError, "delete_key " + key + ": no reply");
  return Status::Ok();
}

Status MemoryKvStore::Clone(std::unique_ptr<KvStore>* out) {
  std::lock_guard<std::mutex> l(shared_->mu);
  if (shared_->vanished) return Gone();
  out->reset(new MemoryKvStore(shared_));
  return Status::Ok();
}

void MemoryKvStore::AddRule(const Rule& r) {
  std::lock_guard<std::mutex> l(shared_->mu);
  shared_->rules.push_back({r, 0});
}

void MemoryKvStore::ClearRules() {
  std::lock_guard<std::mutex> l(shared_->mu);
  shared_->rules.clear();
}

void MemoryKvStore::Vanish() {
  std::lock_guard<std::mutex> l(shared_->mu);
  shared_->vanished = true;
  for (auto& w : shared_->waiters) w.second->notify_one();
}

std::vector<std::string> MemoryKvStore::Keys() const {
  std::lock_guard<std::mutex> l(shared_->mu);
  std::vector<std::string> out;
  for (const auto& kv : shared_->data) out.push_back(kv.first);
  return out;
}

uint64_t MemoryKvStore::FaultsInjected() const {
  std::lock_guard<std::mutex> l(shared_->mu);
  return shared_->faults;
}

}  // namespace alpsck
