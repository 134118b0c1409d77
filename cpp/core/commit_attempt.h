// CommitAttempt: one attempt at committing a step, on one rank, from "this rank's shard is sealed"
// to the verdict this rank reports. The coordinator (rank 0) waits for every shard and commits
// (steps 5-8 of the protocol, commit.h) or aborts; every other rank arrives and waits for the
// verdict; a rank that fails or gives up aborts (the first decision wins); a rank that read an
// abort acknowledges it; after a commit, LATEST (step 9, run_dir_latest.h). The ranks meet
// through an Agreement (agreement.h); the protocol: docs/commit-protocol.md ("Several ranks, one
// verdict").
//
// Both commit paths run it, and nothing else orchestrates a commit: the engine's (engine.h: Save
// starts the attempt, the writer that seals the shard arrives, the committer thread commits or
// waits) and CommitStep below (the DCP backend's finish(), whose ranks saved with
// CommitMode::kDeferred and so only arrived).
//
// Threading: one thread at a time drives an attempt (the engine hands it from Save's thread to the
// writer that seals the shard, then to the committer thread, through its queues). It holds no lock
// and no state but its Agreement and the verdict of Fail. PublishedStep, which the attempts of an
// engine share, is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "agreement.h"
#include "commit.h"
#include "coordinate.h"
#include "env.h"
#include "kv_store.h"
#include "run_dir.h"
#include "run_dir_latest.h"
#include "status.h"

namespace alpsck {

class CommitAttempt {
 public:
  // timeout_s: how long a rank waits for the others (the shards, the verdict) before it aborts.
  CommitAttempt(Env* env, Attempt at, uint32_t rank, double timeout_s, std::unique_ptr<Agreement> agreement)
      : env_(env), at_(std::move(at)), rank_(rank), timeout_s_(timeout_s), agreement_(std::move(agreement)) {}
  CommitAttempt(const CommitAttempt&) = delete;
  CommitAttempt& operator=(const CommitAttempt&) = delete;

  const Attempt& attempt() const { return at_; }

  // Before this rank writes anything: true when the attempt is aborted already (this rank comes
  // late to it); *verdict then says why, and this rank has acknowledged it.
  bool AbortedAlready(Status* verdict);
  // This rank's shard is sealed and durable: tells the coordinator (Agreement::Arrive).
  Status Arrive(const ShardRecord& record);
  // The coordinator: waits for every rank's shard (own: its own record, which it does not publish;
  // nullptr: every rank arrives), commits the step with them and the extra files, and once it is
  // committed removes what is left of the step's earlier attempts. A failure aborts the attempt
  // (Fail, whose result it returns). The manifest's write_seconds: earlier_s plus the time since
  // `since`. spare: a free directory the verdict names for the ranks' next save to claim ("": none).
  // recycled: the attempt's directory is an expired checkpoint's (it still holds that manifest).
  // notes: recorded with the checkpoint (CheckNotes'ed by the caller). records (if given): every rank's
  // record, in rank order, once the step is committed.
  Status Commit(const ShardRecord* own, std::vector<ExtraFile> extra, std::chrono::steady_clock::time_point since,
                double earlier_s = 0, const std::string& spare = "", bool recycled = false, SaveNotes notes = {},
                std::vector<ShardRecord>* records = nullptr);
  // Every other rank: waits for the verdict (past the timeout it aborts the attempt itself); an
  // abort read is acknowledged. OK once the commit is durable.
  Status AwaitVerdict();
  // After a committed AwaitVerdict: the free directory the verdict named for the next save ("").
  std::string spare() const { return agreement_->Spare(); }
  // This rank's part failed with `cause` (or it gave up): aborts the attempt and acknowledges the
  // abort. Returns what this rank reports: its own error when its abort decided the attempt; "step
  // N is committed, durability unconfirmed: ..." when the commit won (only after the commit
  // rename); else the verdict (another rank's abort, or the error of this rank's failed abort).
  // *by_other (if given): the verdict is an abort another rank decided.
  Status Fail(const Status& cause, bool* by_other = nullptr);
  // After Fail: the verdict as every other rank reads it (also where this rank's abort decided it).
  const Status& verdict() const { return verdict_; }
  // Step 9, once the step is committed (and the caller has recorded it): LATEST names the step,
  // unless it names a newer one.
  void Publish(PublishedStep* published, std::string* warning) const {
    published->PublishIfNewer(at_.step, warning);
  }

 private:
  Env* const env_;
  const Attempt at_;
  const uint32_t rank_;
  const double timeout_s_;
  const std::unique_ptr<Agreement> agreement_;
  Status verdict_;
  // This rank's shard reached the agreement (Arrive was called, or the coordinator's Commit ran).
  // Until then no commit of this attempt can exist: it needs this rank's shard.
  bool contributed_ = false;
};

// The agreement of one attempt (agreement.h): through the store when the caller has a client of it
// (StoreAgreement, under store_ns), else through the attempt's directory (FileAgreement).
// arrivals: the ranks that arrive (world_size, or world_size - 1 where the coordinator holds its
// own record); readers: the ranks that read the verdict through it; settle_timeout_s:
// StoreAgreement's.
std::unique_ptr<Agreement> MakeAgreement(Env* env, const Attempt& a, std::unique_ptr<KvStore> client,
                                         const std::string& store_ns, uint32_t world_size, uint32_t arrivals,
                                         uint32_t readers, double settle_timeout_s);
// The error of a store that gave no client for an attempt: "the store the ranks agree through: ...".
Status StoreClientError(const Status& s);

// The whole commit for a caller that is not an Engine (the DCP backend's finish(), on rank 0):
// waits for the shards, writes the extra files (name, content) into step-N.tmp, commits with
// everything in the manifest, publishes LATEST if newer. On failure the step is aborted. elapsed_s:
// how long the save ran before this call (the manifest's write_seconds counts from the save's
// start). store: where the ranks' deferred saves arrived (their engines' EngineOptions::store,
// under the same store_ns): the shards' records are read there (StoreAgreement), not from DONE
// records; null: from DONE records in step-N.tmp (FileAgreement). notes: recorded in the manifest
// (metrics, ...), checked (CheckNotes) before anything is waited for.
Status CommitStep(Env* env, const std::string& run_dir, uint64_t step, uint32_t world_size,
                  const std::vector<std::pair<std::string, std::string>>& extra_files, double timeout_s,
                  double elapsed_s = 0, const std::shared_ptr<KvStore>& store = nullptr,
                  const std::string& store_ns = "", const SaveNotes& notes = {});

}  // namespace alpsck
