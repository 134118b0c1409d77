#include "commit_attempt.h"

#include <algorithm>

#include "file_io.h"
#include "store_agreement.h"

namespace alpsck {

using Clock = std::chrono::steady_clock;

bool CommitAttempt::AbortedAlready(Status* verdict) {
  if (agreement_->Peek(verdict) != Verdict::kAborted) return false;
  agreement_->Acknowledge(rank_);
  return true;
}

Status CommitAttempt::Arrive(const ShardRecord& record) {
  contributed_ = true;  // from the call on: a record may be out even if it reports failure
  return agreement_->Arrive(rank_, record);
}

Status CommitAttempt::Commit(const ShardRecord* own, std::vector<ExtraFile> extra, Clock::time_point since,
                             double earlier_s, const std::string& spare, bool recycled, SaveNotes notes,
                             std::vector<ShardRecord>* records) {
  contributed_ = true;
  CommitRequest req;
  req.run_dir = at_.run_dir;
  req.tmp_dir = at_.tmp_dir();
  req.final_dir = at_.final_dir();
  req.step = at_.step;
  req.extra_files = std::move(extra);
  req.notes = std::move(notes);
  req.next_spare = spare;
  req.recycled_dir = recycled;
  Status s = agreement_->AwaitShards(timeout_s_, own, &req.shards);
  if (s.ok()) {
    req.write_seconds = earlier_s + std::chrono::duration<double>(Clock::now() - since).count();
    s = agreement_->Commit(req);
  }
  if (!s.ok()) return Fail(s);
  if (records) *records = std::move(req.shards);
  // What is left of this step's earlier attempts: every rank's DONE record for this attempt
  // says it finished them, so nothing writes there any more.
  for (uint32_t a = 0; a < at_.attempt; ++a) {
    const Attempt old{at_.run_dir, at_.step, a};
    for (const std::string& d : {old.tmp_dir(), old.aborted_dir()})
      if (env_->IsOwnDir(d) == 1) RemoveDirFiles(env_, d);
  }
  return Status::Ok();
}

Status CommitAttempt::AwaitVerdict() {
  Status s = agreement_->AwaitVerdict(rank_, timeout_s_);
  if (!s.ok()) agreement_->Acknowledge(rank_);
  return s;
}

Status CommitAttempt::Fail(const Status& cause, bool* by_other) {
  if (by_other) *by_other = false;
  const std::string why =
      rank_ == 0 ? cause.message() : "rank " + std::to_string(rank_) + " failed to write its shard: " + cause.message();
  bool won = false;
  const Verdict v = agreement_->Abort(rank_, why, &verdict_, &won);
  if (v == Verdict::kCommitted && !contributed_) {
    // The disk shows neither the attempt's directory nor its abort, which reads as "committed
    // (and maybe expired since)"; but this rank's shard never reached the agreement, so no
    // commit of this attempt exists: it never started on disk (its directory could not even be
    // made). This rank's own error is the verdict.
    verdict_ = cause;
    return cause;
  }
  if (v == Verdict::kCommitted) {  // only after the commit rename
    verdict_ = Status::Error(cause.code(),
                             "step " + std::to_string(at_.step) + " is committed, durability unconfirmed: " + cause.message(),
                             cause.err());
    return verdict_;
  }
  agreement_->Acknowledge(rank_);
  if (won) return cause;  // this rank decided: its own error
  // Another rank's verdict reads as kAborted; this rank's failed abort rename (FromErrno) never does.
  if (by_other) *by_other = verdict_.code() == Code::kAborted;
  return verdict_;
}

std::unique_ptr<Agreement> MakeAgreement(Env* env, const Attempt& a, std::unique_ptr<KvStore> client,
                                         const std::string& store_ns, uint32_t world_size, uint32_t arrivals,
                                         uint32_t readers, double settle_timeout_s) {
  if (client)
    return std::make_unique<StoreAgreement>(env, a, std::move(client), store_ns, world_size, arrivals, readers,
                                            settle_timeout_s);
  return std::make_unique<FileAgreement>(env, a, world_size, readers);
}

Status StoreClientError(const Status& s) {
  return Status::Error(s.code(), "the store the ranks agree through: " + s.message(), s.err());
}

Status CommitStep(Env* env, const std::string& run_dir, uint64_t step, uint32_t world_size,
                  const std::vector<std::pair<std::string, std::string>>& extra_files, double timeout_s,
                  double elapsed_s, const std::shared_ptr<KvStore>& store, const std::string& store_ns,
                  const SaveNotes& notes) {
  const Clock::time_point t0 = Clock::now();
  ALPSCK_RETURN_IF_ERROR(CheckNotes(notes));  // before waiting for anyone
  std::vector<ExtraFile> extra;
  for (const auto& [name, content] : extra_files) {
    ALPSCK_RETURN_IF_ERROR(CheckExtraFile(name, content.size()));  // before waiting for anyone
    extra.push_back({name, content});
  }
  // DCP: a fresh engine per save, attempt 0. Every rank arrived (their saves were deferred), and
  // only this caller reads an abort from the disk: the other ranks learn the outcome from the
  // caller (DCP's collectives), so its acknowledgement alone removes the aborted directory.
  const Attempt a{run_dir, step, 0};
  std::unique_ptr<KvStore> client;  // the records the ranks' deferred saves appended: no DONE record is read
  if (store) {
    Status cs = store->Clone(&client);
    if (!cs.ok()) return StoreClientError(cs);
  }
  CommitAttempt attempt(env, a, 0, timeout_s, MakeAgreement(env, a, std::move(client), store_ns, world_size, world_size, 1, timeout_s));
  // The DCP caller reports the verdict, also where its own abort decided it.
  if (!attempt.Commit(nullptr, std::move(extra), t0, std::max(0.0, elapsed_s), "", false, notes).ok())
    return attempt.verdict();
  PublishedStep published(env, run_dir, true);
  published.Load(-1);
  attempt.Publish(&published, nullptr);  // a hint: failure to update it never fails the commit
  return Status::Ok();
}

}  // namespace alpsck
