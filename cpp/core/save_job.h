// SaveJob: one save, from Save() to its handle's completion. Internal to the engine's units:
// engine.cc (Save makes it), chunk_pipeline.cc and external_fill.cc (its chunks and the sealed
// shard), engine_commit.cc (its commit attempt and the end of the save). Not for use outside them.
//
// Threading: one thread at a time owns a job (Save's thread, then the writers and copiers through
// the pipeline's queue, then the writer that seals it, then the committer thread), except for
// what the chunks share while they are written: `remaining` and `failed` (atomics), `error`
// (err_mu), and each chunk's own element of index.crcs.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "commit.h"
#include "commit_attempt.h"
#include "format.h"
#include "save.h"
#include "status.h"

namespace alpsck {

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct SaveJob {
  std::shared_ptr<SaveHandle> handle;
  uint64_t step = 0;
  uint32_t attempt = 0;              // several ranks: the how-manieth save of this step (TmpDirName)
  std::unique_ptr<CommitAttempt> commit_attempt;  // its directories and its verdict (commit_attempt.h)
  CommitMode commit = CommitMode::kAuto;
  Status refusal;  // not OK: a pre-flight check failed; the attempt is aborted before the shard is opened
  SaveNotes notes;  // rank 0's go into the manifest; every rank's retention reads its own (history.h)
  SaveResult result;                 // filled as the save goes (for the committer)
  std::string tmp_dir, final_dir, shard_path;
  int fd = -1;
  bool direct = false;
  bool recycled = false;  // the attempt's directory is an expired checkpoint's (PrepareDir): its files exist
  ShardIndex index;                  // layout + crcs + meta
  ShardRecord record;                // this rank's sealed shard (rank 0: its own entry in the manifest)
  std::vector<const char*> srcs;     // zero-copy sources, per extent
  std::atomic<uint64_t> remaining{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status error;
  Clock::time_point t0, t_snap;
  Clock::time_point t_admitted;  // its in-flight slot taken: its own work starts (ShardRecord::work_seconds)

  void Fail(const Status& s) {
    std::lock_guard<std::mutex> l(err_mu);
    if (error.ok()) error = s;
    failed.store(true, std::memory_order_release);
  }
};

}  // namespace alpsck
