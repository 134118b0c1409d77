// What happens to the entries of a run directory (their names: run_dir.h): the housekeeping at
// open, the expiry of what retention decided (retention.h decides, without I/O; ExpireSteps and
// RetainNewest act), the claim of an expired directory for a new save, pins, and the removal of
// chosen entries (prune). Rank 0 runs these; any rank may claim a free directory rank 0 named.
// Every call goes through the Env it is given.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "env.h"
#include "retention.h"
#include "status.h"

namespace alpsck {

// Housekeeping when rank 0 opens a run directory (no save is running yet, on any rank): removes
// abandoned and aborted attempts and expiries that were never made durable. Expired directories
// (free-*) are kept for reuse when keep_free > 0, holding only shards of ranks below world_size,
// and only once a fsync of RUN_DIR made their expiry durable (the process that expired them may
// have died before its own fsync); otherwise they are removed too. Probe files (.alpsck-probe-*) of
// this user unchanged for kStaleProbeSeconds go as well: left by a process killed while it probed (a
// probe in progress, the health gate's, say, is never that old). Returns the names of the free
// directories kept (claimable), oldest name first. `names`: RUN_DIR's entries where the caller listed
// them already (the engine's open lists once for this and its history), else listed here.
std::deque<std::string> TidyRunDir(Env* env, const std::string& run_dir, uint32_t world_size, uint32_t keep_free,
                                   const std::vector<std::string>* names = nullptr);

// Retention from a listing (the DCP writer's, through the binding): the committed steps that no
// rule of `policy` keeps (retention.h: DecideRetention; each manifest is read only when the policy
// needs it) are expired (ExpireSteps), counting the claimable directories already there. Returns
// a warning (empty if none): retention never fails a save.
std::string RetainNewest(Env* env, const std::string& run_dir, const RetentionPolicy& policy, uint32_t keep_free = 0);

// Retention from what rank 0 knows, without listing RUN_DIR (the engine's, per save): each victim
// (first checked to be our own directory, not a link, and not pinned: a pin made since the
// decision holds) is expired by one rename. Up to `room` of
// them are kept for reuse: renamed to a claimable free-* name, with their shards (and their
// manifest, which the claiming save's commit replaces; a victim that is not plain loses every
// other file). The rest are renamed to free-*.new, lose their manifest first, and are removed.
// Then RUN_DIR is fsync'ed; only if that succeeds are the kept names appended to *kept (from then
// on a save may claim one: ClaimDir), otherwise they are removed too. A victim gone meanwhile (a
// prune) is skipped. Returns a warning (empty if none).
std::string ExpireSteps(Env* env, const std::string& run_dir, const std::vector<Expiry>& victims, uint32_t room,
                        std::vector<std::string>* kept);

// Removal of chosen entries (alpsck prune): each name in `names` (an entry directly in run_dir)
// is first renamed to a free .deleting-<name> (one already named .deleting-* keeps its name), so
// it leaves every scan at once; run_dir is fsync'ed (if that fails nothing is removed: a power
// loss could bring a half-removed checkpoint back); then each is removed, a directory tree
// bottom-up without following a symbolic link (a link is removed as the link, never walked), and
// run_dir is fsync'ed again. An entry gone meanwhile is skipped. A failed rename stops the
// renaming (those renamed before it are still removed); a failed removal leaves that entry as
// .deleting-* (the next call finishes it) and the others are still removed. The first failure is
// reported: `failed` names the path, `renaming` says whether a rename or a removal failed.
struct Removal {
  std::vector<size_t> removed;       // indices into `names`, in order, of the entries removed
  Status status;                     // the first failure (OK if none)
  std::string failed;                // its path
  bool renaming = false;
};
Removal RemoveEntries(Env* env, const std::string& run_dir, const std::vector<std::string>& names);

// Any rank, preparing the shared step-N.tmp of a save: renames the claimable directory free_name
// (a name in run_dir that rank 0 handed out: ExpireSteps made it, the commit verdict named it) to
// tmp_dir, never replacing anything there, so that the shards it holds are overwritten in place
// (no block allocation) and no listing of RUN_DIR is needed. 0: this call claimed it. -ENOENT: it
// is gone (another rank claimed it, for this save or another). -EEXIST: tmp_dir exists already (a
// rank created it): the directory stays free. -EINVAL: not a free directory's name, or the file
// system cannot rename without replacing (then nothing is claimed: the ranks create tmp_dir).
int ClaimDir(Env* env, const std::string& run_dir, const std::string& free_name, const std::string& tmp_dir);

// Pins. A pin is the file PINNED (run_dir.h: kPinName) in a committed step directory, written
// and fsync'ed (file and directory) by PinStep; UnpinStep removes it (and fsyncs the directory).
// kNotFound when run_dir has no committed step-N (no manifest).
Status PinStep(Env* env, const std::string& run_dir, uint64_t step);
Status UnpinStep(Env* env, const std::string& run_dir, uint64_t step);
// Whether checkpoint directory `dir` holds a pin (one stat).
bool IsPinned(Env* env, const std::string& dir);
// Writes the pin into a directory being committed (save(pin=True): before its commit rename).
Status WritePin(Env* env, const std::string& dir);

// The creation time, metrics and flag of checkpoint directory `dir` from its manifest (no shard
// is read), and its pin; false when the manifest cannot be read or parsed.
bool ReadRetainedStep(Env* env, const std::string& dir, uint64_t step, RetainedStep* out);

}  // namespace alpsck
