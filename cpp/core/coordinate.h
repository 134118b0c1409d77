// Coordination of a checkpoint's ranks through the file system (one rank is N = 1): each writes
// its own shard, rank 0 commits for all, and every rank reports the one verdict the disk holds.
// The protocol, its verdict rule and why it closes the split verdict: docs/commit-protocol.md
// ("Several ranks, one verdict"); the names: run_dir.h. FileAgreement is the Agreement
// (agreement.h) built on these functions; CommitAttempt (commit_attempt.h) runs an attempt.
//
// In short: ranks > 0 publish a DONE record (WriteDoneRecord); rank 0 waits for them
// (WaitForShards) and commits by renaming step-N[.aK].tmp to step-N (commit.h); any rank that
// fails or gives up aborts by renaming it to step-N[.aK].aborted (Abort), and at most one rename
// wins. Every rank reads the verdict the same way (ReadVerdict), records that it did (SawAbort),
// and the last one removes the aborted directory.
//
// Threading: the free functions have no shared state; callers run them on their own threads (the
// engine's committer thread, or the caller of the DCP backend's finish()). A FileAgreement holds
// only its attempt's names: one thread at a time calls it (agreement.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "agreement.h"
#include "commit.h"
#include "run_dir.h"
#include "env.h"
#include "status.h"

namespace alpsck {

std::string EncodeShardRecord(uint32_t rank, const ShardRecord& r);
// Validates a record read from disk: the rank must match and the shard name be that rank's.
Status DecodeShardRecord(const std::string& text, uint32_t rank, ShardRecord* out);

// One attempt at committing a step: its directories' names.
struct Attempt {
  std::string run_dir;
  uint64_t step = 0;
  uint32_t attempt = 0;
  std::string tmp_dir() const;      // RUN_DIR/step-N[.aK].tmp
  std::string aborted_dir() const;  // RUN_DIR/step-N[.aK].aborted
  std::string final_dir() const;    // RUN_DIR/step-N
};

// Step 1: the DONE record of a sealed, closed shard (visible whole once it is visible at all).
Status WriteDoneRecord(Env* env, const std::string& tmp_dir, uint32_t rank, const ShardRecord& r);

// The attempt's verdict as the disk says it (see above). kAborted fills *why (code kAborted).
Verdict ReadVerdict(Env* env, const Attempt& a, Status* why);

// Tries to abort the attempt (the abort rename), with `why` as the reason when this call wins.
// Returns the verdict afterwards: kAborted (*why_out says why: this rank's reason or the winner's)
// or kCommitted (the commit rename won). An error that leaves the attempt undecided (the rename
// failed otherwise) reads as kAborted with that error: this rank fails its save.
// *won (if given): whether this call decided it (its rename won, or the attempt's name is not a
// directory alpsck made, which is never renamed nor written into).
Verdict Abort(Env* env, const Attempt& a, uint32_t rank, const std::string& why, Status* why_out,
              bool* won = nullptr);

// The winner of an abort, once its rename of the attempt's directory to aborted_dir() took
// effect: writes the reason (ABORTED) and removes the shards and any manifest from it.
void RecordAbort(Env* env, const Attempt& a, uint32_t rank, const std::string& why);

// This rank has read the abort verdict: records it in the aborted directory, and removes the
// directory once all world_size ranks have.
void SawAbort(Env* env, const Attempt& a, uint32_t rank, uint32_t world_size);

// Step 2, waiting part: polls the attempt's directory until the DONE records of ranks
// 0..world_size-1 are all there (then *records holds them, in rank order, each shard's size
// checked). Fails with kAborted when the attempt is aborted meanwhile, or "no shard from
// rank(s) ..." when timeout_s passes (the caller then tries Abort: the attempt is still open).
// own: the caller's own (rank 0's) record, which it need not read from disk (nullptr: read all).
Status WaitForShards(Env* env, const Attempt& a, uint32_t world_size, double timeout_s,
                     std::vector<ShardRecord>* records, const ShardRecord* own = nullptr);

// Step 3: polls until the attempt is decided. On a commit, syncs RUN_DIR and returns OK; on an
// abort, returns the verdict (kAborted). After timeout_s, tries to abort the attempt itself
// (Abort, its reason naming the ranks whose shard is missing) and returns whichever verdict won.
Status WaitForCommit(Env* env, const Attempt& a, uint32_t rank, uint32_t world_size, double timeout_s);

// The Agreement of one attempt through its directory: the functions above. world_size: the
// ranks that arrive (the coordinator among them unless it passes its own record to AwaitShards);
// readers: the ranks that read an abort verdict from the disk, whose acknowledgements (SawAbort)
// remove the aborted directory.
class FileAgreement : public Agreement {
 public:
  FileAgreement(Env* env, Attempt a, uint32_t world_size, uint32_t readers)
      : env_(env), a_(std::move(a)), world_size_(world_size), readers_(readers) {}
  Status Arrive(uint32_t rank, const ShardRecord& record) override;
  Status AwaitShards(double timeout_s, const ShardRecord* own, std::vector<ShardRecord>* records) override;
  Status Commit(const CommitRequest& req) override;
  Verdict Abort(uint32_t rank, const std::string& why, Status* verdict, bool* won = nullptr) override;
  Verdict Peek(Status* why) override;
  Status AwaitVerdict(uint32_t rank, double timeout_s) override;
  void Acknowledge(uint32_t rank) override;

 private:
  Env* const env_;
  const Attempt a_;
  const uint32_t world_size_;
  const uint32_t readers_;
};

}  // namespace alpsck
