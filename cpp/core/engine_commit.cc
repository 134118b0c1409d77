// The end of a save, from its sealed shard: its commit attempt with the other ranks
// (commit_attempt.h: rank 0 commits for all, one rank is N = 1) on the committer thread, then the
// history, LATEST, retention, the handle completed.
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "engine.h"
#include "platform.h"
#include "save_job.h"

namespace alpsck {

void Engine::Sealed(std::unique_ptr<SaveJob> j, Status s) {
  SaveResult& r = j->result;
  r.step = j->step;
  r.direct_io = j->direct;
  r.snapshot_seconds = Seconds(j->t0, j->t_snap);
  r.bytes = j->record.bytes;

  // The shard is durable. The coordinator (rank 0) has its own record at hand; every other rank,
  // and every rank of a deferred commit, says so with a DONE record.
  const bool coordinator = opts_.rank == 0 && j->commit == CommitMode::kAuto;
  // Nothing inside RUN_DIR is durable before the names of the directories holding it are: the
  // committer synced them while this save was copied and written (dir_sync.h).
  if (s.ok()) s = dir_sync_.Wait();
  // This rank arrives at the agreement now: its pace goes with its record (commit.h).
  j->record.node = host_;
  j->record.arrived = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  j->record.work_seconds = Seconds(j->t_admitted, Clock::now());
  if (s.ok() && !coordinator) s = j->commit_attempt->Arrive(j->record);
  if (!s.ok()) {
    // (A failed DONE record may mean another rank aborted the attempt meanwhile: Fail reports
    // that verdict, not the failed rename.)
    s = j->commit_attempt->Fail(s);
    Complete(std::move(j), s, r);
    return;
  }
  if (j->commit == CommitMode::kDeferred) {
    r.path = j->tmp_dir;  // sealed, not committed
    Complete(std::move(j), s, r);
    return;
  }
  {
    std::lock_guard<std::mutex> l(c_mu_);
    commit_queue_.push_back(j.release());
  }
  c_cv_.notify_one();
}

void Engine::CommitterLoop() {
  EnterBackground(opts_.pin_cpus, opts_.background_nice, 0);
  dir_sync_.Run();  // first: while the first save is copied and written, off the opener's path
  for (;;) {
    std::unique_ptr<SaveJob> j;
    {
      std::unique_lock<std::mutex> l(c_mu_);
      c_cv_.wait(l, [&] { return c_stopping_ || !commit_queue_.empty(); });
      if (commit_queue_.empty()) return;
      j.reset(commit_queue_.front());
      commit_queue_.pop_front();
    }
    Status s;
    if (opts_.rank == 0) {
      // The verdict names the free directory the ranks' next save claims (none listing RUN_DIR).
      const std::string spare = spares_.Designate();
      s = j->commit_attempt->Commit(&j->record, {}, j->t0, 0, spare, j->recycled, j->notes, &j->result.ranks);
      spares_.Committed(spare, s.ok());
    } else {
      s = j->commit_attempt->AwaitVerdict();
      if (s.ok()) spares_.Committed(j->commit_attempt->spare(), true);
    }
    SaveResult r = j->result;
    Complete(std::move(j), s, r);
  }
}

void Engine::Complete(std::unique_ptr<SaveJob> j, Status s, SaveResult r) {
  const bool committed = s.ok() && j->commit == CommitMode::kAuto;
  if (committed) r.path = j->final_dir;
  if (!s.ok()) r.path.clear();
  std::vector<Expiry> victims;
  {
    std::lock_guard<std::mutex> l(mu_);
    // Before the handle completes: a caller that saw it fail may save the same step again at
    // once (nothing below touches this step's files).
    in_flight_steps_.erase(j->step);
    if (committed) {
      // Plain: shards and a manifest only (no DONE record: the store carried the records, or one
      // rank holds its own; no extra file: only the DCP backend's commits have them).
      RetainedStep facts;
      facts.step = j->step;
      facts.created = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      facts.metrics = j->notes.metrics;
      facts.flagged = j->notes.unhealthy;
      facts.pinned = j->notes.pin;
      victims = history_.Committed(facts, !j->notes.pin && (opts_.store != nullptr || opts_.world_size == 1));
      attempts_.erase(j->step);
    }
  }
  if (committed) j->commit_attempt->Publish(&published_, &r.warning);
  if (committed && opts_.rank == 0 && !victims.empty()) {
    // From what this process knows (History: the steps committed at open and since), not from a
    // listing of RUN_DIR; the expired directories kept for reuse go to the spares.
    std::lock_guard<std::mutex> rl(retention_mu_);  // Supersede renames step directories too
    const std::string w = spares_.Expire(victims);
    if (!w.empty() && r.warning.empty()) r.warning = w;
  }
  r.durable_seconds = Seconds(j->t0, Clock::now());
  // The attempt's store client goes back to the pool before the caller hears of the save, so the
  // next save reuses it instead of connecting again (KvClientPool).
  j->commit_attempt.reset();
  // Complete the handle before releasing the in-flight slot, so that WaitAll() returning
  // implies every handle is done.
  j->handle->Complete(s, r);
  {
    std::lock_guard<std::mutex> l(mu_);
    --in_flight_;
  }
  admit_cv_.notify_all();
}

}  // namespace alpsck
