// Recovery: classify the checkpoints of a run directory and read a shard back, verified.
//
// A checkpoint directory step-N/ is COMMITTED iff its MANIFEST.json parses and every shard it
// names exists with the recorded size, a valid footer and an index whose CRC matches (the quick
// check, reading only tails); with verify, every chunk's CRC32C is checked as well. A step-N/
// without its manifest is DAMAGED. Attempt directories (step-N.tmp, step-N.aborted) are INCOMPLETE
// (in flight, abandoned or aborted) and never read. Anything else that fails is CORRUPT, with a
// message naming the file and what was wrong. Nothing on disk is trusted:
// names in manifests must be plain rank-NNNNN.bin names (no paths), every size is bounds-checked.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commit.h"
#include "env.h"
#include "format.h"
#include "run_dir.h"
#include "status.h"

namespace alpsck {

// kUnreadable: reading it failed for a reason that says nothing about its bytes (permission
// denied, EIO, ESTALE, out of file descriptors): never used, never deleted by prune either.
// kDamaged: a step-N directory (committed by its name: only the commit rename makes one) whose
// manifest is gone: deleted by hand, a copy still in progress, or an expiry that a crash undid
// halfway. Never restored; reported, unlike an attempt (.tmp, .aborted), which is kIncomplete.
enum class CheckpointState { kCommitted, kIncomplete, kCorrupt, kUnreadable, kDamaged };
const char* CheckpointStateName(CheckpointState s);

struct CheckpointInfo {
  uint64_t step = 0;
  std::string path;
  CheckpointState state = CheckpointState::kIncomplete;
  std::string error;          // why it is not committed
  uint64_t bytes = 0;         // shard files, on disk
  uint64_t data_bytes = 0;
  double created = 0;         // unix seconds (manifest)
  uint32_t ranks = 0;
  uint64_t extents = 0;
  double write_seconds = 0;   // from the manifest, 0 if unknown
  bool direct_io = false;
  bool verified = false;      // every chunk CRC checked
  std::vector<std::string> shards;       // rank-00000.bin, rank-00001.bin, ...
  std::vector<std::string> extra_files;  // verified small files committed with the shards
  Metrics metrics;                       // what the save recorded (commit.h), in its order
  std::string flagged;                   // why its save judged it unhealthy besides its metrics (a spike), else ""
  bool pinned = false;                   // a PINNED file (run_dir_actions.h: pins): never expired
};

// Progress callback: bytes verified so far (called from worker threads, serialised). Returning
// false cancels: the readers stop at their next chunk and the read fails with kAborted.
using ProgressFn = std::function<bool(uint64_t)>;

// Reads one shard file. Open() reads the footer and index only.
class ShardReader {
 public:
  static Status Open(Env* env, const std::string& path, bool direct, std::unique_ptr<ShardReader>* out);
  ~ShardReader();
  const ShardIndex& index() const { return index_; }
  const std::string& path() const { return path_; }
  uint64_t file_bytes() const { return file_bytes_; }
  uint32_t index_crc() const { return index_crc_; }

  // Reads the chunks that hold the extents with a non-null dsts[k] (k as in index().layout),
  // checks each chunk's CRC and copies the extents' bytes into dsts. Chunks are spread over
  // `threads` threads through a shared counter. A CRC mismatch is kCorrupt naming the chunk and
  // the extents in it.
  Status Read(const std::vector<char*>& dsts, uint32_t threads, const ProgressFn& progress = nullptr);
  // Reads every chunk and checks every CRC.
  Status Verify(uint32_t threads, const ProgressFn& progress = nullptr);

 private:
  ShardReader() = default;
  Status ReadChunks(const std::vector<uint64_t>& chunks, const std::vector<char*>* dsts, uint32_t threads,
                    const ProgressFn& progress);
  Env* env_ = nullptr;
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  uint64_t file_bytes_ = 0;
  uint32_t index_crc_ = 0;
  ShardIndex index_;
};

// Checks one step-N directory (quick; with verify also every chunk CRC).
void CheckCheckpoint(Env* env, const std::string& dir, uint64_t step, bool verify, uint32_t threads,
                     CheckpointInfo* info, const ProgressFn& progress = nullptr);

// Lists every step-N and step-N.tmp directory of run_dir, ascending by step. kNotFound if
// run_dir does not exist.
Status ScanRunDir(Env* env, const std::string& run_dir, bool verify, uint32_t threads,
                  std::vector<CheckpointInfo>* out, const ProgressFn& progress = nullptr);

// ----------------------------------------------------------------------------- the picker
//
// THE answer to "which checkpoint would a restore use, and why not the newer ones": every reader
// (Checkpointer.restore, peek, latest_step, the DCP reader, inspect-checkpoints, export, the SLURM
// runner) asks PickCheckpoint and keeps no rule of its own. The rule (docs/guarantees.md):
//   1. Only step-N directories are checkpoints. An attempt (step-N.tmp, step-N.aK.tmp,
//      step-N.aborted) beside a step-N of the same step is irrelevant (attempt 0's .aborted is kept
//      until every rank saw it while attempt 1 commits step N); an attempt alone is skipped
//      (incomplete or aborted).
//   2. Newest step first, within `step` (exactly that one) or `max_step` (at most that one).
//   3. A step-N must pass the quick check (CheckCheckpoint without verify): otherwise skipped as
//      damaged (no manifest), corrupt (manifest, shard footer/index or extra file) or unreadable
//      (an access error, which says nothing about its bytes).
//   4. It must be of the kind asked for: a DCP checkpoint is one that committed dcp-metadata.json
//      (kDcpMetadataName) with its shards; anything else is an alpsck (Checkpointer) one. Else other_kind.
//   5. With world_size > 0 it must have been written by that many ranks, else other_world.
//   5b. Unless allow_unhealthy, the metrics its save recorded (commit.h: Metrics) must all be
//      finite, else unhealthy: a diverged run's checkpoint is never resumed from by default.
//   6. With verify_data, every chunk CRC of its shards must match (checked lazily, newest first, up
//      to the first that passes), else data_crc (or unreadable, for an access error).
// The first that passes is the pick; `candidates` are it and every older one passing 1-5, newest
// first: what a reader tries next when reading the pick's data then fails (a CRC, an I/O error).
// `skipped` explains every step newer than the pick (inside the step/max_step range), newest first.


enum class CheckpointKind { kAny, kAlpsck, kDcp };
const char* CheckpointKindName(CheckpointKind k);  // "any", "alpsck", "dcp"
// The kind of a committed checkpoint: kDcp when it committed dcp-metadata.json, else kAlpsck.
CheckpointKind KindOf(const CheckpointInfo& info);


struct PickOptions {
  bool verify_data = false;  // rule 6, lazily
  bool verify_all = false;   // verify every committed step-N (inspect --verify, prune --verify); implies verify_data
  CheckpointKind kind = CheckpointKind::kAny;
  std::optional<uint64_t> step;      // only this step
  std::optional<uint64_t> max_step;  // only steps <= this
  uint32_t world_size = 0;           // 0: any
  uint32_t threads = 0;              // verify threads (0: the reader's default)
  bool allow_unhealthy = false;      // rule 5b off: a checkpoint whose metrics hold NaN or an infinity passes
};

// Why a step newer than the pick was not picked. Stable strings (Python and --json see them):
// "damaged", "corrupt", "unreadable", "incomplete", "aborted", "other_kind", "other_world", "unhealthy",
// "data_crc".
struct Skipped {
  uint64_t step = 0;
  std::string path;
  std::string reason;
  std::string message;
};

struct Pick {
  std::optional<uint64_t> step;             // none: nothing passes (a fresh start, or NoCheckpoint for `step`)
  std::string path;                         // the pick's directory
  CheckpointInfo info;                      // the pick's (verified when its data was checked)
  std::vector<CheckpointInfo> candidates;   // the pick first, then older ones passing rules 1-5, newest first
  std::vector<Skipped> skipped;             // newer than the pick, newest first
  std::vector<CheckpointInfo> scanned;      // every entry ScanRunDir listed, ascending (verified ones updated)
};

// Applies the rule above to run_dir. kNotFound if run_dir does not exist; kAborted if `progress`
// (verification progress, as ScanRunDir's) cancels.
Status PickCheckpoint(Env* env, const std::string& run_dir, const PickOptions& opts, Pick* out,
                      const ProgressFn& progress = nullptr);

}  // namespace alpsck
