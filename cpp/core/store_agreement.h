// StoreAgreement: the Agreement (agreement.h) of one commit attempt through a key-value store
// (kv_store.h, c10d's semantics) instead of the attempt's directory: the ranks meet without
// polling the file system, and a rank other than the coordinator touches the disk for the
// agreement only when something failed. The disk stays the truth: the commit is still the rename
// of step-N[.aK].tmp (commit.h), claimed in the store before it happens; where the store cannot
// settle the verdict (it failed, or the coordinator went silent after its claim) a rank settles it
// on the disk exactly as FileAgreement does (coordinate.h: the abort rename against the commit
// rename), so a crash or a lost store never splits the verdict. The protocol:
// docs/commit-protocol.md ("Several ranks, one verdict", "Through a key-value store").
//
// Keys, under P = KeyPrefix(ns, step, attempt):
//   P records       every arriving rank's ShardRecord, a JSON line each (Append)
//   P arrived       the arrivals (Add); a coordinator holding its own record does not count itself
//   P all-arrived   set by the rank whose Add reached the arrivals expected ("all"), or by an
//                   abort's winner ("aborted"): the coordinator waits on it
//   P verdict       the decision, one CompareSet(verdict, "", X) for all: "committing" (the
//                   coordinator's claim, before its commit rename) or "aborted:<why>"
//   P final         the verdict once final: "committed" (followed by "\nspare:<name>" when it names
//                   a free directory for the ranks' next save to claim, run_dir_actions.h: ClaimDir),
//                   "committed-unsynced:<error>" (the rename
//                   happened, rank 0's fsync of RUN_DIR failed: each rank syncs it) or
//                   "aborted:<why>". The other ranks Get it.
//   P acks          the ranks that read the verdict (Add): after a commit every reader but the
//                   coordinator, after an abort every reader; the one whose Add completes the
//                   count deletes every key (after an abort, the aborted directory too).
//
// Store operations per save on the happy path, none growing with the number of ranks: the
// coordinator makes 5 (Peek's Get, the wait for all-arrived, the Get of the records, the claim,
// the final verdict); a rank > 0 makes 5 (Peek's Get, Append, Add, the Get of the final verdict,
// the Add of its acknowledgement), the last to arrive 1 more (all-arrived), the last to
// acknowledge 6 deletes more. test_store_agreement.cc counts them.
//
// Keys of an attempt that a crash interrupted stay in the store (as its directory stays on disk
// until rank 0's next open): ns must be unique to the run directory and to this incarnation of
// the job (e.g. alpsck/<job id>/<restart count>/), so a restarted job never reads them.
//
// Threading: as every Agreement's: one thread at a time calls it. It owns its client of the store
// (a Clone for this attempt's thread) and shares nothing else in this process.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "agreement.h"
#include "coordinate.h"
#include "env.h"
#include "kv_store.h"
#include "status.h"

namespace alpsck {

class StoreAgreement : public Agreement {
 public:
  // world_size: the ranks of the attempt; arrivals: those that arrive through the store (all of
  // them, or all but a coordinator that holds its own record: world_size - 1); readers: the ranks
  // that read the verdict through their agreement, the coordinator among them, whose
  // acknowledgements remove its keys (a commit's by all but the coordinator, an abort's by all).
  // settle_timeout_s: how long a rank that finds the commit claimed waits for its outcome before
  // it settles the verdict on the disk.
  StoreAgreement(Env* env, Attempt a, std::unique_ptr<KvStore> store, const std::string& ns, uint32_t world_size,
                 uint32_t arrivals, uint32_t readers, double settle_timeout_s);

  // "<ns>step-N/aK/": every key of the attempt starts with it.
  static std::string KeyPrefix(const std::string& ns, uint64_t step, uint32_t attempt);

  Status Arrive(uint32_t rank, const ShardRecord& record) override;
  Status AwaitShards(double timeout_s, const ShardRecord* own, std::vector<ShardRecord>* records) override;
  Status Commit(const CommitRequest& req) override;
  Verdict Abort(uint32_t rank, const std::string& why, Status* verdict, bool* won = nullptr) override;
  Verdict Peek(Status* why) override;
  Status AwaitVerdict(uint32_t rank, double timeout_s) override;
  void Acknowledge(uint32_t rank) override;
  std::string Spare() const override { return spare_; }

 private:
  std::string Key(const char* name) const { return prefix_ + name; }
  Status Aborted(const std::string& why) const;  // "step N was aborted: <why>" (kAborted)
  std::string AbortReason(const Status& verdict) const;
  Status TooMany(int64_t arrivals) const;  // the <why> of an Aborted status (else its message)
  // The verdict a final value says (kPending: not a value this agreement writes).
  Verdict FromFinal(const std::string& value, Status* verdict);
  // The records in the store: fills (*records)[r] and have[r] for every rank that arrived.
  Status ReadRecords(double timeout_s, std::vector<ShardRecord>* records, std::vector<bool>* have);
  // "; no shard from rank(s) 2, 5" for the ranks > 0 whose record is not in the store.
  std::string MissingRanks();
  // The verdict from the disk (FileAgreement's abort rename), for when the store cannot settle it.
  Verdict SettleOnDisk(uint32_t rank, const std::string& why, Status* verdict, bool* won);
  // This rank won the abort: its verdict on disk (the rename to the aborted name) and in the store.
  Verdict RecordWon(uint32_t rank, const std::string& why, Status* verdict, bool* won);
  Verdict Remember(Verdict v, const Status& verdict, bool won);
  void Ack(uint32_t rank);
  // Removes the attempt's keys (after an abort, its directories too): every reader has the verdict.
  void Forget(bool aborted);

  Env* const env_;
  const Attempt a_;
  const std::unique_ptr<KvStore> store_;
  const std::string prefix_;
  const uint32_t world_size_;
  const uint32_t arrivals_;
  const uint32_t readers_;
  const double settle_timeout_s_;

  // What this rank did and learnt (one thread at a time: no lock).
  bool claim_tried_ = false;       // the coordinator's CompareSet of "committing" was issued
  bool commit_ran_ = false;        // ... and it went on to the disk commit
  bool read_disk_ = false;         // the verdict was settled on the disk (the store failed or went silent)
  bool unsynced_ = false;          // committed, the rename's durability not confirmed by rank 0
  bool acked_ = false;
  Verdict settled_ = Verdict::kPending;  // the verdict, once this rank knows it
  Status settled_status_;
  std::string spare_;  // the free directory a committed verdict named (a free-* name, checked)
  bool settled_won_ = false;
};

}  // namespace alpsck
