#include "staging_pool.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace alpsck {

namespace {

// The process's spare staging memory (staging_pool.h). Measured with a Checkpointer per path, as
// Lightning's CheckpointIO opens them, 2 MiB states: see docs/benchmarks.md (stop 65).
struct Spare {
  std::mutex mu;
  PrefaultedMemory mem;  // guarded by mu
  int numa_node = -1;
  pid_t pid = 0;  // the process that put it here: a forked child does not have it mapped (MADV_DONTFORK)
};

// Never destroyed: a pool may be destroyed while the process exits, after static destructors ran.
Spare& TheSpare() {
  static Spare* spare = new Spare;
  return *spare;
}

// The spare's mapping, taken out of it (s.mu held): empty in a forked child, where the parent's is
// not mapped (and is forgotten, never unmapped: the range may hold another mapping there now).
PrefaultedMemory TakeOutLocked(Spare& s) {
  PrefaultedMemory m;
  if (s.pid == ::getpid()) {
    m = std::move(s.mem);
  } else {
    s.mem.Forget();
  }
  return m;
}

// Moves the spare into *out when it fits a pool of `bytes` on `numa_node`; false otherwise (the
// spare stays for a later pool).
bool TakeSpare(uint64_t bytes, int numa_node, PrefaultedMemory* out) {
  Spare& s = TheSpare();
  std::lock_guard<std::mutex> l(s.mu);
  if (s.pid != ::getpid()) {  // a fork: the parent's spare is not mapped here
    TakeOutLocked(s);
    return false;
  }
  const uint64_t have = s.mem.size();
  if (!s.mem.data() || s.numa_node != numa_node || have < bytes || have / 2 > bytes) return false;
  *out = TakeOutLocked(s);
  return true;
}

void GiveSpare(PrefaultedMemory* mem, int numa_node) {
  Spare& s = TheSpare();
  std::unique_lock<std::mutex> l(s.mu);
  PrefaultedMemory old = TakeOutLocked(s);  // the spare it replaces, unmapped after the lock
  s.mem = std::move(*mem);
  s.numa_node = numa_node;
  s.pid = ::getpid();
  l.unlock();
}

}  // namespace

uint64_t ReleaseSpareStaging() {
  Spare& s = TheSpare();
  std::unique_lock<std::mutex> l(s.mu);
  const uint64_t bytes = s.mem.size();
  PrefaultedMemory old = TakeOutLocked(s);
  l.unlock();  // unmapped outside the lock
  return bytes;
}

uint64_t SpareStagingBytes() {
  Spare& s = TheSpare();
  std::lock_guard<std::mutex> l(s.mu);
  return s.pid == ::getpid() ? s.mem.size() : 0;
}

StagingPool::~StagingPool() {
  if (mem_.data()) GiveSpare(&mem_, numa_node_);
}

Status StagingPool::Init(uint64_t slot_bytes, uint64_t slots, bool prefault) {
  ALPSCK_RETURN_IF_ERROR(Reserve(slot_bytes, slots));
  if (prefault) {
    Fill();
  } else {
    MarkFree();
  }
  return Status::Ok();
}

void StagingPool::MarkFree() {
  {
    std::lock_guard<std::mutex> l(mu_);
    for (uint64_t i = first_slots_; i-- > 0;) free_.push_back(mem_.data() + i * slot_bytes_);
  }
  cv_.notify_all();
}

Status StagingPool::Reserve(uint64_t slot_bytes, uint64_t slots) {
  if (slot_bytes == 0 || slots == 0) return Status::Invalid("staging pool needs at least one slot of non-zero size");
  if (slots > (1ull << 40) / slot_bytes) return Status::Invalid("staging pool larger than 1 TiB");
  if (!TakeSpare(slot_bytes * slots, numa_node_, &mem_) && !mem_.Map(slot_bytes * slots, numa_node_))
    return Status::FromErrno(errno, "allocate " + std::to_string(slot_bytes * slots) + " bytes of staging memory");
  std::lock_guard<std::mutex> l(mu_);
  slot_bytes_ = slot_bytes;
  slots_ = slots;
  first_slots_ = slots;  // a spare taken may be larger: the rest of it stays unused
  free_.clear();
  closed_ = false;
  return Status::Ok();
}

void StagingPool::Fill() {
  uint64_t slot_bytes, n;
  {
    std::lock_guard<std::mutex> l(mu_);
    slot_bytes = slot_bytes_;
    n = first_slots_;  // the first mapping's slots (GrowTo may add others meanwhile)
  }
  for (uint64_t i = 0; i < n; ++i) {
    {
      // During a copy, on only while a waiting Acquire cannot be served from the free slots
      // (first-mapping waiters always count: the free slots may all be GrowTo's).
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return closed_ || copying_ == 0 || waiting_first_ > 0 || waiting_ > free_.size(); });
      if (closed_) return;
    }
    mem_.Fault(i * slot_bytes, slot_bytes);
    Release(mem_.data() + i * slot_bytes);
  }
}

Status StagingPool::GrowTo(uint64_t target) {
  if (!initialized()) return Status::Invalid("staging pool grown before Init");
  std::lock_guard<std::mutex> g(grow_mu_);  // one GrowTo at a time: slots_ changes only under it (and mu_)
  if (target <= slots_) return Status::Ok();
  const uint64_t more = target - slots_;
  if (target > (1ull << 40) / slot_bytes_) return Status::Invalid("staging pool larger than 1 TiB");
  PrefaultedMemory m;
  if (!m.Allocate(slot_bytes_ * more, numa_node_))
    return Status::FromErrno(errno, "allocate " + std::to_string(slot_bytes_ * more) + " more bytes of staging memory");
  {
    std::lock_guard<std::mutex> l(mu_);
    for (uint64_t i = more; i-- > 0;) free_.push_back(m.data() + i * slot_bytes_);
    slots_ += more;
  }
  more_.push_back(std::move(m));
  cv_.notify_all();
  return Status::Ok();
}

void StagingPool::Shrink(uint64_t target) {
  std::vector<PrefaultedMemory> gone;
  {
    std::lock_guard<std::mutex> g(grow_mu_);
    std::lock_guard<std::mutex> l(mu_);
    while (!more_.empty()) {
      const PrefaultedMemory& m = more_.back();
      const uint64_t n = m.size() / slot_bytes_;
      if (slots_ - n < target) break;
      auto inside = [&](char* p) { return p >= m.data() && p < m.data() + m.size(); };
      uint64_t free_here = 0;
      for (char* p : free_) free_here += inside(p);
      if (free_here != n) break;  // a slot of it is in use: next time
      free_.erase(std::remove_if(free_.begin(), free_.end(), inside), free_.end());
      slots_ -= n;
      gone.push_back(std::move(more_.back()));
      more_.pop_back();
    }
  }
  // unmapped here, outside the locks
}

char* StagingPool::TakeLocked(bool first_mapping) {
  for (size_t i = free_.size(); i-- > 0;) {
    char* slot = free_[i];
    if (first_mapping && (slot < mem_.data() || slot >= mem_.data() + mem_.size())) continue;
    free_[i] = free_.back();
    free_.pop_back();
    return slot;
  }
  return nullptr;
}

char* StagingPool::Acquire(bool first_mapping) {
  std::unique_lock<std::mutex> l(mu_);
  if (closed_) return nullptr;
  char* s = TakeLocked(first_mapping);
  if (s) return s;
  ++waiting_;
  waiting_first_ += first_mapping;
  cv_.notify_all();  // a Fill paused for a copy: this waiter may need it
  cv_.wait(l, [&] { return closed_ || (s = TakeLocked(first_mapping)) != nullptr; });
  --waiting_;
  waiting_first_ -= first_mapping;
  return s;  // nullptr only when closed
}

void StagingPool::BeginCopy() {
  std::lock_guard<std::mutex> l(mu_);
  ++copying_;
}

void StagingPool::EndCopy() {
  {
    std::lock_guard<std::mutex> l(mu_);
    --copying_;
  }
  cv_.notify_all();  // a paused Fill goes on
}

char* StagingPool::TryAcquire(bool first_mapping) {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) return nullptr;
  return TakeLocked(first_mapping);
}

void StagingPool::Release(char* slot) {
  {
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(slot);
  }
  cv_.notify_all();  // waiters may want only slots of the first mapping
}

void StagingPool::Close() {
  {
    std::lock_guard<std::mutex> l(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

uint64_t StagingPool::slots() const {
  std::lock_guard<std::mutex> l(mu_);
  return slots_;
}

uint64_t StagingPool::size() const {
  std::lock_guard<std::mutex> l(mu_);
  return first_slots_ * slot_bytes_;
}

uint64_t StagingPool::free_slots() const {
  std::lock_guard<std::mutex> l(mu_);
  return free_.size();
}

}  // namespace alpsck
