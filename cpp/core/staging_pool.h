// StagingPool: a bounded set of equal, aligned, pre-faulted memory slots (one chunk each).
//
// A save copies its snapshot into slots; writer threads hand each slot back as soon as its chunk
// is written, so a state larger than the pool still streams through (pipelining) and the memory
// in use never exceeds the pool. Init makes one mapping, so callers may register it once with a
// GPU runtime as pinned memory (base(), size()). GrowTo adds slots in further mappings (base() and
// size() keep describing the first). A caller that registered the first mapping, or names slots
// by their offset from base(), acquires with first_mapping = true: it only ever gets slots there.
//
// A pool's first mapping outlives it: the pool destroyed, it becomes the process's spare (one at a
// time, the newest), which the next pool's Reserve or Init takes instead of mapping fresh memory
// when it is big enough (and at most twice what it needs) and on the same NUMA node. Its pages
// stay faulted, so an engine opened per checkpoint (Lightning's CheckpointIO, the Trainer: one
// per checkpoint path) does not fault a new pool for each save. ReleaseSpareStaging unmaps it.
//
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "platform.h"
#include "status.h"

namespace alpsck {

class StagingPool {
 public:
  StagingPool() = default;
  ~StagingPool();  // the first mapping becomes the process's spare (above)
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  // Where the memory of later Init/Reserve/GrowTo calls comes from: NUMA node `node` (>= 0, see
  // PreferNumaNode), or -1 (default) wherever the faulting thread runs.
  void SetNumaNode(int node) { numa_node_ = node; }
  // Reserve, then Fill (prefault) or, without it, every slot free at once: each page faults when a
  // save first copies into it (a pool that saves written in place never touch costs nothing).
  Status Init(uint64_t slot_bytes, uint64_t slots, bool prefault = true);
  // Init in two halves, for a pool made in the background: Reserve maps the memory (the pool is
  // initialized, with no free slot yet); Fill faults it in slot by slot, each slot free as soon as
  // it is faulted, so a save that comes meanwhile starts copying into the ready ones (Acquire
  // waits for the rest). Fill stops early once the pool is closed.
  Status Reserve(uint64_t slot_bytes, uint64_t slots);
  void Fill();
  // After Reserve, instead of Fill: every slot free at once, no page faulted (each faults when first written).
  void MarkFree();
  // A snapshot copy into the pool runs between these (a save's stall). Fill pauses meanwhile,
  // unless a slot is waited for that only faulting more can give: faulting competes with the
  // copy for the CPU. On this project's 2-vCPU VM the saves that came while a 4.3 GiB pool was
  // still being faulted stalled 18-29 % less with the pause (docs/benchmarks.md, stop 37).
  void BeginCopy();
  void EndCopy();
  // Adds slots (pre-faulted, in a new mapping) until the pool has `target`; slots in use are not
  // moved. Callers that race grow it once: the second finds the slots there.
  Status GrowTo(uint64_t target);
  // Releases GrowTo's mappings, newest first, while the pool keeps at least `target` slots and all
  // of a mapping's slots are free (one in use keeps its mapping until a later call). The first
  // mapping always stays.
  void Shrink(uint64_t target);
  bool initialized() const { return mem_.data() != nullptr; }
  // Blocks until a slot is free; nullptr once the pool is closed. first_mapping: a slot of the
  // first mapping (Init's) only.
  char* Acquire(bool first_mapping = false);
  // nullptr at once when no slot is free (or the pool is closed).
  char* TryAcquire(bool first_mapping = false);
  void Release(char* slot);
  void Close();
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t slots() const;
  uint64_t free_slots() const;
  char* base() const { return mem_.data(); }
  // The first mapping's slots (a spare taken may be larger: its rest stays unused, and unpinned).
  uint64_t size() const;

 private:
  PrefaultedMemory mem_;
  std::vector<PrefaultedMemory> more_;  // GrowTo's mappings (guarded by grow_mu_)
  std::mutex grow_mu_;
  uint64_t slot_bytes_ = 0;
  uint64_t slots_ = 0;
  uint64_t first_slots_ = 0;  // slots in mem_ (guarded by mu_)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char*> free_;
  // Takes a free slot (of the first mapping only, if asked); nullptr if none. Holds mu_.
  char* TakeLocked(bool first_mapping);
  bool closed_ = false;
  uint32_t copying_ = 0;         // BeginCopy calls not yet ended (guarded by mu_)
  uint64_t waiting_ = 0;         // Acquire calls waiting for a slot (guarded by mu_)
  uint64_t waiting_first_ = 0;   // those of them that want the first mapping (which Fill faults)
  int numa_node_ = -1;  // set before the pool is used
};

// Unmaps the process's spare staging memory (staging_pool.h); returns the bytes it held.
uint64_t ReleaseSpareStaging();
// The bytes of the process's spare staging memory (0: none).
uint64_t SpareStagingBytes();

// BeginCopy for the scope of one snapshot copy.
class PoolCopyScope {
 public:
  explicit PoolCopyScope(StagingPool* pool) : pool_(pool) { pool_->BeginCopy(); }
  ~PoolCopyScope() { pool_->EndCopy(); }
  PoolCopyScope(const PoolCopyScope&) = delete;
  PoolCopyScope& operator=(const PoolCopyScope&) = delete;

 private:
  StagingPool* pool_;
};

}  // namespace alpsck
