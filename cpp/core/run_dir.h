// The run directory's names: every name alpsck gives an entry of a run directory, or of a
// checkpoint directory inside it, is made and parsed here and nowhere else (LevelDB's
// db/filename.h is the model). Python gets them through the binding (_core.run_dir_names,
// _core.parse_run_dir_name). What each entry means and how it moves is told in docs/format.md.
//
//   RUN_DIR/
//     step-N/                  a committed checkpoint (N zero-padded to 9 digits, up to 19)
//     step-N.tmp/              attempt 0 of a save of N, before its commit
//     step-N.aK.tmp/           attempt K > 0 (a multi-rank retry after an abort)
//     step-N[.aK].aborted/     an attempt the ranks gave up on (its verdict, until every rank saw it)
//     free-<...>/              an expired checkpoint kept for reuse (claimable)
//     free-<...>.new/          expired, the expiry not yet durable (never claimed)
//     superseded-step-N-<pid>-<seq>/   a checkpoint of an abandoned history (never restored)
//     LATEST                   the newest committed step, a hint
//     .lock, .lock-rank-RRRRR  the writers' locks
//     history.jsonl            the job layer's event log
//     .requeue-request         the job layer's: a requeue the batch script carries out (slurm/runner.py)
//     .start-decision          the job layer's: rank 0's decision of how a start goes on
//     .metadata                (a DCP checkpoint directory, docs/dcp.md) the marker DCP trainers look for
//     <name>.tmp               a small file being written, before the rename that publishes it
//     .deleting-<name>         an entry prune is removing
//   step-N/
//     MANIFEST.json            the commit record
//     dcp-metadata.json        (a DCP checkpoint) DCP's Metadata, committed with the shards
//     rank-RRRRR.bin           rank R's shard
//     rank-RRRRR.done|.failed  coordination records (not part of the checkpoint's contract)
//     ABORTED                  (in an aborted attempt) why
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "env.h"
#include "status.h"

namespace alpsck {

constexpr char kManifestName[] = "MANIFEST.json";
constexpr char kLatestName[] = "LATEST";
constexpr char kPinName[] = "PINNED";  // in a step directory: a pin (retention.h)
constexpr char kLockName[] = ".lock";
constexpr char kHistoryName[] = "history.jsonl";
constexpr char kRequeueRequestName[] = ".requeue-request";
constexpr char kStartDecisionName[] = ".start-decision";
constexpr char kRollbacksName[] = "rollbacks.json";  // the training's in-process rollbacks (alpsck.restore.Rollback)
constexpr char kDcpMarkerName[] = ".metadata";
constexpr char kDcpMetadataName[] = "dcp-metadata.json";  // a DCP checkpoint's extra file (its Metadata, JSON)
constexpr char kTempSuffix[] = ".tmp";  // a file written whole, then renamed to the name without it
constexpr char kDeletingPrefix[] = ".deleting-";
constexpr char kFreePrefix[] = "free-";
constexpr char kFreePendingSuffix[] = ".new";
constexpr char kSupersededPrefix[] = "superseded-";
constexpr char kAbortedName[] = "ABORTED";  // inside an aborted attempt: the reason

enum class EntryKind {
  kOther,        // not alpsck's
  kStep,         // step-N
  kAttempt,      // step-N.tmp, step-N.aK.tmp
  kAborted,      // step-N.aborted, step-N.aK.aborted
  kFree,         // free-* (claimable)
  kFreePending,  // free-*.new
  kSuperseded,   // superseded-step-N-*
  kLatest,
  kLock,         // .lock, .lock-rank-RRRRR
  kHistory,
  kJobRecord,    // .requeue-request, .start-decision, rollbacks.json (and each being written: <name>.tmp)
  kDeleting,     // .deleting-*
};

struct RunDirEntry {
  EntryKind kind = EntryKind::kOther;
  uint64_t step = 0;     // kStep, kAttempt, kAborted, kSuperseded
  uint32_t attempt = 0;  // kAttempt, kAborted
};

// Classifies one name of RUN_DIR (no file-system access). Unknown names are kOther.
RunDirEntry ParseRunDirName(std::string_view name);
const char* EntryKindName(EntryKind k);  // "step", "attempt", ... (stable: Python sees these)

std::string StepDirName(uint64_t step);
// Parses "step-<digits>" (returns true) — anything else, including "step-12.tmp", is false.
bool ParseStepDirName(std::string_view name, uint64_t* step);
// Where a save of `step` is written before its commit renames it to StepDirName(step):
// "step-N.tmp" for attempt 0, "step-N.aK.tmp" for attempt K > 0 (coordinate.h).
std::string TmpDirName(uint64_t step, uint32_t attempt = 0);
// Parses either form of TmpDirName (returns true, with the step and attempt).
bool ParseTmpDirName(std::string_view name, uint64_t* step, uint32_t* attempt = nullptr);
// What an attempt's directory is renamed to when the ranks abort it: "step-N[.aK].aborted".
std::string AbortedDirName(uint64_t step, uint32_t attempt = 0);
// An expired checkpoint's directory: free-<step>-<pid>-<seq> (claimable); with pending, the
// same plus ".new" (expired, not yet durably so).
std::string FreeDirName(uint64_t step, uint64_t pid, uint64_t seq, bool pending = false);
// superseded-step-N-<pid>-<seq>.
std::string SupersededDirName(uint64_t step, uint64_t pid, uint64_t seq);
// What prune renames an entry to before it removes it: .deleting-<name>, or with seq > 0
// .deleting-<name>-<pid>-<seq> (when the first is taken).
std::string DeletingName(const std::string& name, uint64_t pid = 0, uint64_t seq = 0);

// The name a small file is written under before the rename that publishes it: <name>.tmp.
std::string TempFileName(const std::string& name);
// The file the engine writes and removes when it opens RUN_DIR, to learn whether O_DIRECT works
// there and with which alignment: .alpsck-probe-<rank>-<pid>.
std::string ProbeFileName(uint32_t rank, uint64_t pid);

// The writer lock of rank R: .lock for rank 0, .lock-rank-RRRRR for the others.
std::string LockFileName(uint32_t rank);

// Inside a checkpoint directory.
std::string ShardFileName(uint32_t rank);     // rank-RRRRR.bin
bool IsShardName(const std::string& n);       // rank-<5+ digits>.bin: never a path outside its directory
std::string DoneRecordName(uint32_t rank);    // rank-RRRRR.done
std::string FailedRecordName(uint32_t rank);  // rank-RRRRR.failed
std::string SeenRecordName(uint32_t rank);    // rank-RRRRR.seen (in an aborted attempt: rank R read the verdict)

// ---- The writer lock

// One writer per run directory, whatever kind (the engine, the DCP backend, the torch.save
// baseline, prune): an exclusive flock on RUN_DIR/.lock (LockFileName: rank R > 0 has its own),
// a regular file holding its owner (JSON: pid, host, job_id, rank), emptied on release. The kernel
// drops the flock when its owner dies, so a lock left by a crash is taken over at once. The name
// is never followed if it is a symlink, and never opened if it is not a regular file (a FIFO
// would block the open; a device would be opened), so taking or probing a lock never hangs and
// never touches anything outside the run directory.
class RunDirLock {
 public:
  // kBusy naming the holder (job, pid, host) when a live process holds it; kInvalidArgument when
  // the name is a symlink or not a regular file (saying what it is); errno errors otherwise.
  // When the owner recorded is a process of this host that has exited, a process it forked (a
  // DataLoader worker) holds the lock until it exits too: that is waited for up to
  // orphan_wait_s, then refused saying so.
  static Status Acquire(const std::string& run_dir, uint32_t rank, const std::string& owner_json,
                        std::unique_ptr<RunDirLock>* out, double orphan_wait_s = kOrphanLockWaitS);
  static constexpr double kOrphanLockWaitS = 30;
  // Whether a live process holds rank's lock, and the owner it recorded ("" when none); the
  // same refusals as Acquire. Takes nothing and changes nothing.
  static Status Probe(const std::string& run_dir, uint32_t rank, bool* held, std::string* owner);
  ~RunDirLock();  // Release()
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  // Empties the owner record and drops the flock (idempotent). In a process forked from the one
  // that took it, only closes that process's copy of the descriptor: the lock stays the parent's.
  void Release();
  const std::string& path() const { return path_; }

 private:
  RunDirLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_;
  std::string path_;
  const pid_t owner_pid_ = ::getpid();  // the process that took it (Release)
};

// The fields of an owner record (JSON {"pid", "host", "job_id"}, as the holder wrote it); a field
// that is missing or neither a string nor a number is empty, and so is every field of a record that
// is not a JSON object within the record's limits. The one parser of the record: the lock's
// messages, its orphan check and Python's lock_holder (through the binding) read it here.
struct LockOwner {
  std::string pid, host, job_id;
};
LockOwner ParseLockOwner(const std::string& owner_json);

// "{run_dir} is being written by job J (pid P) on host H" from an owner record (fields missing: ?).
std::string DescribeLockOwner(const std::string& run_dir, const std::string& owner_json);

// ---- LATEST (run_dir_latest.cc)

// PublishedStep: the newest step published as RUN_DIR/LATEST, step 9 of the commit protocol
// (commit.h): LATEST := N only if N is newer than what was published ("newest wins": a checkpoint
// that finishes after a newer one never becomes latest). LATEST is a hint; recovery scans. The
// writer opens LATEST once and rewrites it in place (a pwrite, a truncate, an fdatasync: no
// metadata call per save; steps only grow, so a crash leaves the old text or the new); a
// rewrite to an older step (Rewrite) writes a new file and renames it in. A LATEST replaced
// behind the writer's back (by hand) is not written again until the writer reopens it.
//
// Threading: thread-safe. mu_ serialises the writes of LATEST, so that two commits racing to
// publish cannot leave an older step in it; step_ is atomic, read without waiting for a write.
class PublishedStep {
 public:
  // writes: whether this process writes LATEST (rank 0); the other ranks only track the step.
  PublishedStep(Env* env, std::string run_dir, bool writes)
      : env_(env), run_dir_(std::move(run_dir)), writes_(writes) {}
  PublishedStep(const PublishedStep&) = delete;
  PublishedStep& operator=(const PublishedStep&) = delete;
  ~PublishedStep();

  // The step LATEST names (-1: none, or unreadable), raised to newest_committed when that is
  // >= 0 (a commit LATEST missed).
  void Load(int64_t newest_committed);
  // The newest step published; -1 if none.
  int64_t step() const { return step_.load(std::memory_order_acquire); }
  // Publishes `step` if it is newer than the newest published. A failed write of LATEST is only
  // a warning (into *warning, if given): it never fails the commit.
  void PublishIfNewer(uint64_t step, std::string* warning);
  // Retiring an abandoned history (History::Retire): LATEST rewritten to name `step` (-1:
  // removed; by the writer only), serialised with the commits' writes.
  void Rewrite(int64_t step);
  // The newest step published, as the caller knows it (after a retirement); nothing written.
  void Reset(int64_t step) { step_.store(step, std::memory_order_release); }

 private:
  Status WriteInPlace(uint64_t step);  // under mu_
  void CloseHeld();                    // under mu_ (or in the destructor)

  Env* const env_;
  const std::string run_dir_;
  const bool writes_;
  std::mutex mu_;  // serialises the writes of LATEST, and guards fd_
  int fd_ = -1;    // LATEST, held open by the writer from its first publish
  std::atomic<int64_t> step_{-1};
};


// ---- What happens to the entries (rank 0 runs these; any rank may claim a free directory rank 0 named)

// Housekeeping when rank 0 opens a run directory (no save is running yet, on any rank): removes
// abandoned and aborted attempts and expiries that were never made durable. Expired directories
// (free-*) are kept for reuse when keep_free > 0, holding only shards of ranks below world_size,
// and only once a fsync of RUN_DIR made their expiry durable (the process that expired them may
// have died before its own fsync); otherwise they are removed too. Returns the names of the free
// directories kept (claimable), oldest name first.
std::deque<std::string> TidyRunDir(Env* env, const std::string& run_dir, uint32_t world_size, uint32_t keep_free);

// Retention from a listing (the DCP writer's, through the binding): the committed steps that no
// rule of `policy` keeps (retention.h: DecideRetention; each manifest is read only when the policy
// needs it) are expired (ExpireSteps), counting the claimable directories already there. Returns
// a warning (empty if none): retention never fails a save.
struct RetentionPolicy;
std::string RetainNewest(Env* env, const std::string& run_dir, const RetentionPolicy& policy, uint32_t keep_free = 0);

// One committed step to expire. plain: the caller committed it itself with nothing but its shards
// and manifest (no DONE record, no extra file), so its directory is not listed to strip the rest.
struct Expiry {
  uint64_t step = 0;
  bool plain = false;
};

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

}  // namespace alpsck
