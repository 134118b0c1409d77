// Coordination of a multi-rank checkpoint: every rank writes its own shard, one commit for all.
//
// Each rank writes RUN_DIR/step-N.tmp/rank-RRRRR.bin through its own Engine and seals it
// (commit.h: data, index and footer durable). Then, with no collective and nothing that could
// block training, the ranks meet through the file system:
//
//   1. every rank publishes a DONE record, step-N.tmp/rank-RRRRR.done (its ShardRecord as JSON;
//      written under a .tmp name and renamed, so it is never seen half-written). A rank whose
//      save failed publishes rank-RRRRR.failed instead (best effort: it may be the disk that
//      failed). Records need not be durable: the coordinator fsyncs step-N.tmp/ before it
//      commits, and a crash before that discards the directory anyway;
//   2. the coordinator (rank 0) polls the directory until all world_size DONE records are there,
//      checks each shard's size against its record, and runs the commit protocol (commit.cc)
//      with every shard in the manifest. A FAILED record, or the timeout, aborts the step: the
//      coordinator writes step-N.tmp/ABORTED (with the reason), removes the shards, and the
//      directory is never committed;
//   3. every other rank polls for step-N/MANIFEST.json (committed) or step-N.tmp/ABORTED; on
//      seeing the manifest it fsyncs RUN_DIR itself before reporting the save durable (the
//      rename is visible before the coordinator's own fsync has made it durable). A step-N.tmp
//      that is gone also means committed: rank 0 may have committed newer steps and expired
//      step-N before this rank looked (keep_last below the saves in flight).
//
// Retry: the ranks may save an aborted step again. Attempt K > 0 of a step uses step-N.aK.tmp
// (TmpDirName) instead of step-N.tmp; each Engine counts its saves of the step, so the ranks
// agree on K without a collective as long as every rank retries. An attempt thus never meets an
// earlier one's ABORTED verdict, nor a late record or shard of it. Once attempt K commits, rank 0
// removes the earlier attempts' directories: every rank's DONE record for K says it is done with
// them (a rank saves one attempt of a step at a time).
//
// So a checkpoint is committed only when every rank's shard is durable, and a rank killed
// mid-save leaves a step-N.tmp that recovery never reads. DONE records are not part of the
// committed checkpoint's contract (the manifest is); they stay in the directory, harmless.
//
// Threading: these are free functions with no shared state; callers run them on their own
// threads (the engine's committer thread, or the caller of the DCP backend's finish()).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "commit.h"
#include "env.h"
#include "status.h"

namespace alpsck {

constexpr char kAbortedName[] = "ABORTED";

std::string DoneRecordName(uint32_t rank);    // rank-RRRRR.done
std::string FailedRecordName(uint32_t rank);  // rank-RRRRR.failed

std::string EncodeShardRecord(uint32_t rank, const ShardRecord& r);
// Validates a record read from disk: the rank must match and the shard name be that rank's.
Status DecodeShardRecord(const std::string& text, uint32_t rank, ShardRecord* out);

// Step 1: the DONE record of a sealed, closed shard (visible whole once it is visible at all).
Status WriteDoneRecord(Env* env, const std::string& tmp_dir, uint32_t rank, const ShardRecord& r);
// Step 1, failure: best effort (errors ignored), so the coordinator aborts without waiting.
void WriteFailedRecord(Env* env, const std::string& tmp_dir, uint32_t rank, const std::string& why);

// Step 2, waiting part: polls tmp_dir until the DONE records of ranks 0..world_size-1 are all
// there (then *records holds them, in rank order, each shard's size checked), a FAILED record
// appears, the directory is ABORTED, or timeout_s passes (kAborted naming the missing ranks).
Status WaitForShards(Env* env, const std::string& tmp_dir, uint32_t world_size, double timeout_s,
                     std::vector<ShardRecord>* records);

// Step 2, abort: writes ABORTED with the reason and removes every other file of tmp_dir.
void AbortStep(Env* env, const std::string& tmp_dir, const std::string& why);

// True when the coordinator aborted tmp_dir (a step's attempt); *verdict then says why (kAborted).
bool AbortVerdict(Env* env, const std::string& tmp_dir, uint64_t step, Status* verdict);

// Step 3: polls until step-N is committed (its manifest seen, or tmp_dir renamed away: committed
// and maybe already expired) and RUN_DIR synced (OK), or tmp_dir (this rank's attempt at it) is
// aborted, or timeout_s passes (kAborted, with why). With `mine` (this rank's
// sealed shard), only a manifest that lists exactly that shard counts: a step-N of an earlier
// history that rank 0 has yet to retire (Engine::Supersede) is not this save's commit. Every
// save's index carries a unique save_id, so even the same bytes saved again differ in index_crc.
Status WaitForCommit(Env* env, const std::string& run_dir, uint64_t step, const std::string& tmp_dir,
                     double timeout_s, const ShardRecord* mine = nullptr);

// The whole of step 2 for a caller that is not an Engine (the DCP backend's finish()): waits for
// the shards, writes the extra files (name, content) into step-N.tmp, commits with everything in
// the manifest, publishes LATEST if newer. On failure the step is aborted. elapsed_s: how long
// the save ran before this call (the manifest's write_seconds counts from the save's start).
Status CommitStep(Env* env, const std::string& run_dir, uint64_t step, uint32_t world_size,
                  const std::vector<std::pair<std::string, std::string>>& extra_files, double timeout_s,
                  double elapsed_s = 0);

// Retention for several ranks (rank 0 runs it after a commit, the DCP backend after its own):
// keeps the newest keep_last committed steps (0 keeps all) and expires the older ones. Each is
// renamed to free-K.new (atomic expiry), loses its manifest, then RUN_DIR is fsync'ed. Up to
// keep_free of them (counting claimable ones already there) keep their shard files and are then
// renamed to free-K: claimable by ClaimFreeDir. The rest, and any whose expiry could not be made
// durable, are removed. Returns a warning (empty if none): retention trouble never fails a save.
std::string RetainNewest(Env* env, const std::string& run_dir, uint32_t keep_last, uint32_t keep_free = 0);

// Any rank, preparing the shared step-N.tmp of a save: renames a claimable free-K directory to
// tmp_dir, so that the shards it holds are overwritten in place (no block allocation). True if
// this call did; false if none was free or tmp_dir already exists with something in it (another
// rank claimed one, or created its shard): the caller then creates or joins tmp_dir as usual.
// Safe against every other rank doing the same, and against rank 0 removing free directories.
bool ClaimFreeDir(Env* env, const std::string& run_dir, const std::string& tmp_dir);

}  // namespace alpsck
