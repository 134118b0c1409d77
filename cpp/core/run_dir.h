// The run directory's names: every name alpsck gives an entry of a run directory, or of a
// checkpoint directory inside it, is made and parsed here and nowhere else (LevelDB's
// db/filename.h is the model). Python gets them through the binding (_core.run_dir_names,
// _core.parse_run_dir_name). What each entry means and how it moves is told in docs/format.md.
// Names only, no file-system access: what is done with the entries lives beside it, each its own
// unit: the writer lock (run_dir_lock.h), LATEST (run_dir_latest.h), and the actions on the
// entries, tidying, expiry, claims, pins and removal (run_dir_actions.h).
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

#include <cstdint>
#include <string>
#include <string_view>

namespace alpsck {

constexpr char kManifestName[] = "MANIFEST.json";
constexpr char kLatestName[] = "LATEST";
constexpr char kPinName[] = "PINNED";  // in a step directory: a pin (run_dir_actions.h: PinStep)
constexpr char kLockName[] = ".lock";
constexpr char kHistoryName[] = "history.jsonl";
constexpr char kRequeueRequestName[] = ".requeue-request";
constexpr char kStartDecisionName[] = ".start-decision";
constexpr char kRollbacksName[] = "rollbacks.json";  // the training's in-process rollbacks (alpsck.restore.Rollback)
constexpr char kDcpMarkerName[] = ".metadata";
constexpr char kDcpMetadataName[] = "dcp-metadata.json";  // a DCP checkpoint's extra file (its Metadata, JSON)
constexpr char kTempSuffix[] = ".tmp";  // a file written whole, then renamed to the name without it
constexpr char kDeletingPrefix[] = ".deleting-";
constexpr char kProbePrefix[] = ".alpsck-probe-";
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
  kProbe,        // .alpsck-probe-R-PID: the engine's O_DIRECT probe, left behind by a process killed while probing
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
// The file the node health gate writes, fsyncs, reads back and removes in RUN_DIR (alpsck.node_health):
// .alpsck-probe-health-<node>-<pid>; a probe like the engine's.
std::string HealthProbeFileName(const std::string& node, uint64_t pid);
// A probe lives for milliseconds: one this many seconds old is what a process killed while probing left,
// which rank 0 removes when its engine opens (TidyRunDir, run_dir_actions.h).
constexpr int64_t kStaleProbeSeconds = 600;

// The writer lock of rank R: .lock for rank 0, .lock-rank-RRRRR for the others.
std::string LockFileName(uint32_t rank);

// Inside a checkpoint directory.
std::string ShardFileName(uint32_t rank);     // rank-RRRRR.bin
bool IsShardName(const std::string& n);       // rank-<5+ digits>.bin: never a path outside its directory
std::string DoneRecordName(uint32_t rank);    // rank-RRRRR.done
std::string FailedRecordName(uint32_t rank);  // rank-RRRRR.failed
std::string SeenRecordName(uint32_t rank);    // rank-RRRRR.seen (in an aborted attempt: rank R read the verdict)

}  // namespace alpsck
