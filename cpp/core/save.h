// What a caller hands to Engine::Save and gets back: the modes, the extents, the result and the
// handle that completes once the save is decided.
//
// Threading: SaveHandle is thread-safe (mu_ guards its state; cv_ wakes its waiters). The other
// types are plain values.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "status.h"

namespace alpsck {

// How a save hands over its memory (chunk_pipeline.h says what each mode costs): kSnapshot copies
// it into staging slots inside Save; kSnapshotOverlap queues each chunk as soon as it is copied;
// kZeroCopy writes from the caller's memory; kExternal lets the caller fill the staging slots
// (ExternalFill).
enum class SaveMode { kSnapshot, kSnapshotOverlap, kZeroCopy, kExternal };

// kAuto: the engine commits (rank 0 for all ranks, see engine.h). kDeferred: the shard is sealed
// and its DONE record written; someone else commits the step.
enum class CommitMode { kAuto, kDeferred };

struct SaveExtent {
  std::string name;
  const void* data = nullptr;
  uint64_t size = 0;
};

struct SaveResult {
  uint64_t step = 0;
  uint64_t bytes = 0;              // shard file size
  double snapshot_seconds = 0;     // inside Save (the caller's stall)
  double durable_seconds = 0;      // from the start of Save until the commit is durable
  bool direct_io = false;
  bool skipped = false;            // the step was already committed; nothing written
  std::string path;                // the committed checkpoint directory
  std::string warning;             // non-fatal trouble (retention), empty if none
};

class SaveHandle {
 public:
  explicit SaveHandle(uint64_t step) : step_(step) {}
  uint64_t step() const { return step_; }
  bool Done() const;
  // Waits up to timeout_s seconds (negative: no limit); true once done.
  bool Wait(double timeout_s) const;
  // Valid once Done().
  Status status() const;
  SaveResult result() const;
  void Complete(Status s, SaveResult r);

 private:
  const uint64_t step_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  SaveResult result_;
};

}  // namespace alpsck
