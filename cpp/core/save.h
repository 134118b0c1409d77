// What a caller hands to Engine::Save and gets back: the request (its modes, its extents), the
// result and the handle that completes once the save is decided.
//
// Threading: SaveHandle is thread-safe (mu_ guards its state; cv_ wakes its waiters). The other
// types are plain values.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "commit.h"
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

// One save, as Engine::Save takes it. Every field has a default (so a braced request may stop
// after any field without -Wmissing-field-initializers).
struct SaveRequest {
  uint64_t step = 0;
  // The state, in this order. Each extent's memory is read during Save (the snapshot modes) or
  // until the handle completes (kZeroCopy); kExternal needs no memory (the filler writes).
  std::vector<SaveExtent> extents{};
  std::string meta{};  // the caller's, stored with the shard's index
  SaveMode mode = SaveMode::kSnapshot;
  CommitMode commit = CommitMode::kAuto;
  // Not OK: the caller's pre-flight check failed (e.g. no room for what retention holds): the
  // attempt is aborted on every rank with it, before this rank opens its shard, and it is Save's
  // error; the other ranks hear the abort verdict at once instead of waiting out the commit timeout.
  Status refusal = Status::Ok();
  // Metrics recorded in the manifest, an unhealthy flag, a pin (commit.h). Rank 0's count (the
  // coordinator writes the manifest), so every rank passes the same, e.g. a loss all-reduced
  // already (every rank's retention decides from its own: history.h).
  SaveNotes notes{};
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
  // The committing rank's (rank 0 of an engine's own commit): every rank's record, in rank order, for
  // their pace (ShardRecord::node, arrived, work_seconds); empty on the other ranks.
  std::vector<ShardRecord> ranks;
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
