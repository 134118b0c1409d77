// Agreement: how the ranks of one commit attempt agree on its verdict, so that every rank reports
// the one verdict the attempt has (docs/commit-protocol.md, "Several ranks, one verdict"). One
// rank is the case N = 1 of the same path. CommitAttempt (commit_attempt.h) runs an attempt
// through it; the protocol's order is CommitAttempt's, the meeting place is the Agreement's.
//
// FileAgreement (coordinate.h) meets through the attempt's directory: DONE records, the rename
// that commits against the rename to step-N[.aK].aborted, polling. StoreAgreement
// (store_agreement.h) meets through a key-value store (arrive: a record and a counter; the
// decision: a compare-and-set of the verdict key; waiting: a blocking get; acknowledging: a
// counter whose last increment removes the keys), and falls back on the directory's renames where
// the store cannot settle the verdict.
//
// Threading: an Agreement belongs to one attempt on one rank, and one thread at a time calls it
// (the thread driving the attempt, handed over as CommitAttempt says). The ranks share nothing
// else: every call may run concurrently with the other ranks' calls on the same attempt.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commit.h"
#include "status.h"

namespace alpsck {

enum class Verdict { kPending, kCommitted, kAborted };

class Agreement {
 public:
  virtual ~Agreement() = default;

  // This rank's shard is sealed and durable (closed, visible whole): tells the coordinator, with
  // its record. Every rank but a coordinator that holds its own record at hand.
  virtual Status Arrive(uint32_t rank, const ShardRecord& record) = 0;

  // The coordinator (rank 0): waits up to timeout_s until every rank has arrived; then *records
  // holds their records in rank order (each shard's size checked). own: the coordinator's own
  // record, which never arrives (nullptr: every rank arrives). Fails with kAborted when the
  // attempt is aborted meanwhile, or "no shard from rank(s) ..." once timeout_s passes (the
  // attempt is then still undecided: the caller aborts it).
  virtual Status AwaitShards(double timeout_s, const ShardRecord* own, std::vector<ShardRecord>* records) = 0;

  // The decision, once for every rank: the first Commit or Abort to take effect (any rank's)
  // wins, and every later one reads the winner.
  //
  // Commit (the coordinator): commits the step, steps 5-8 of the commit protocol (commit.h). OK:
  // committed and durable. An error: undecided, or committed without its durability confirmed;
  // the caller's Abort then says which.
  virtual Status Commit(const CommitRequest& req) = 0;
  // Tries to abort the attempt, with `why` as the reason when this call wins. Returns the verdict
  // afterwards: kAborted (*verdict says why: this rank's reason or the winner's) or kCommitted
  // (the commit won). An error that leaves the attempt undecided reads as kAborted with that error:
  // this rank fails its save. *won (if given): whether this call decided it.
  virtual Verdict Abort(uint32_t rank, const std::string& why, Status* verdict, bool* won = nullptr) = 0;

  // The verdict so far, without waiting: kPending while undecided; kAborted fills *why (code
  // kAborted).
  virtual Verdict Peek(Status* why) = 0;

  // A rank that does not commit: waits up to timeout_s for the verdict, and past it tries to abort
  // the attempt itself (Abort, its reason naming the ranks that have not arrived). OK once the
  // commit is durable as this rank sees it; else the abort's verdict.
  virtual Status AwaitVerdict(uint32_t rank, double timeout_s) = 0;

  // This rank has read the abort verdict. The agreement's record of it goes once every rank that
  // reads the verdict has acknowledged it (a normal run leaves nothing behind).
  virtual void Acknowledge(uint32_t rank) = 0;

  // After a committed verdict: the free directory the coordinator named in it for the next save
  // (CommitRequest::next_spare), where the agreement carries one; "" otherwise.
  virtual std::string Spare() const { return ""; }
};

}  // namespace alpsck
