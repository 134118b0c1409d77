// The commit protocol: the only code that turns written bytes into a checkpoint that recovery
// will trust. Its steps and their order are listed at CommitCheckpoint in commit.cc.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "env.h"
#include "format.h"
#include "json.h"
#include "run_dir.h"
#include "status.h"

namespace alpsck {

constexpr uint64_t kMaxManifestBytes = 16ull << 20;
// Manifest formats: /2 carries its own CRC32C (below); /1 (older builds) has none and is still read.
constexpr char kManifestFormat[] = "alpsck-checkpoint/2";
constexpr char kManifestFormatV1[] = "alpsck-checkpoint/1";
// The last member of a /2 manifest: "manifest_crc32c":"<8 lowercase hex digits>", the CRC32C of
// the file's exact bytes with those 8 digits read as "00000000". Any changed byte, a re-encoding
// included, fails the check, so no JSON canonicalisation is involved.
constexpr char kManifestCrcKey[] = "manifest_crc32c";

struct ShardRecord {
  std::string name;   // rank-NNNNN.bin
  uint64_t bytes = 0;
  uint32_t index_crc = 0;
  uint64_t data_bytes = 0;
  uint64_t extents = 0;
  bool direct_io = false;  // written with O_DIRECT
  // Informational, for naming stragglers (docs/stragglers.md): the rank's host, when it arrived at the
  // agreement (its shard sealed; unix seconds) and how long its own part of the save took (from its
  // admission to the arrival: the copy, the writes and the seal, no wait for a free slot or a peer).
  // Absent from a record (an older writer) they read as "", 0 and 0.
  std::string node;
  double arrived = 0;
  double work_seconds = 0;
};

// A small file committed with the shards (e.g. the DCP backend's metadata, as JSON). The
// manifest records its size and CRC32C, so recovery verifies it like a shard.
struct ExtraFile {
  std::string name;     // see IsExtraFileName
  std::string content;
};

// Numbers the caller records with a checkpoint (a training loss, a validation score), in the
// manifest's "metrics" object in this order. JSON has no literal for NaN or the infinities: those
// are written as the strings "nan", "inf" and "-inf" (a diverged run's loss is exactly what a
// health check must see).
using Metrics = std::vector<std::pair<std::string, double>>;
constexpr size_t kMaxMetrics = 64;
// kInvalidArgument unless the metrics can be committed: at most kMaxMetrics, names of 1-64
// printable ASCII characters (no space), each once.
Status CheckMetrics(const Metrics& metrics);
// The manifest's "metrics" member, parsed back (recovery): false if it is malformed.
bool ParseMetrics(const Json& j, Metrics* out);
// The health rule, stated once: a checkpoint whose metrics hold a NaN or an infinity is unhealthy
// (the picker's rule 5b, recovery.h; retention keeps the newest healthy step, history.h). Returns
// the non-finite ones ("loss=nan, grad_norm=inf"), or "" for a healthy checkpoint.
std::string NonFiniteMetrics(const Metrics& metrics);

// What a save records about its checkpoint besides its data: its metrics, why its caller judged
// it unhealthy besides them (a loss spike: the manifest's "unhealthy"; "" for none; the health
// rule: retention.h, Unhealthy), and a pin (the PINNED file, written before the commit rename).
struct SaveNotes {
  Metrics metrics;
  std::string unhealthy;
  bool pin = false;
};
constexpr size_t kMaxUnhealthyText = 1024;
// kInvalidArgument unless the notes can be committed (CheckMetrics; the text printable ASCII, at
// most kMaxUnhealthyText bytes).
Status CheckNotes(const SaveNotes& notes);

struct CommitRequest {
  std::string run_dir;
  std::string tmp_dir;    // RUN_DIR/step-N.tmp (holds the sealed shard files)
  std::string final_dir;  // RUN_DIR/step-N
  uint64_t step = 0;
  std::vector<ShardRecord> shards;  // one per rank, in rank order
  std::vector<ExtraFile> extra_files;
  SaveNotes notes;           // CheckNotes'ed by the caller
  double write_seconds = 0;  // from the start of the save to every shard durable
  // Not in the manifest: a free directory (its name in run_dir) the verdict names for the ranks'
  // next save to claim, where the agreement carries it (StoreAgreement); "" for none.
  std::string next_spare;
  // Whether tmp_dir is an expired checkpoint's, claimed: it still holds that checkpoint's
  // manifest (ExpireSteps keeps it), which this commit's replaces.
  bool recycled_dir = false;
};

// Extra files: [A-Za-z0-9._-], 1-64 characters, not starting with '.', not the manifest, a
// shard or a coordination record.
bool IsExtraFileName(const std::string& n);
// kInvalidArgument unless an extra file of this name and size can be committed (and read back:
// recovery reads at most kMaxManifestBytes of it).
Status CheckExtraFile(const std::string& name, uint64_t bytes);

// Writes the tail (index + footer) of a shard whose data chunks are all written, truncates the
// file to its exact size, fdatasyncs it. fd stays open (the caller closes it).
Status SealShard(Env* env, int fd, const std::string& path, const ShardIndex& idx, bool direct, uint64_t align,
                 ShardRecord* record);

// Steps 5-8 of the protocol: (extra files and) manifest, directory fsyncs, the rename that commits.
Status CommitCheckpoint(Env* env, const CommitRequest& req);

std::string EncodeManifest(const CommitRequest& req, double created_unix);
// Fills in (or refreshes) the CRC of a manifest text holding exactly one "manifest_crc32c":"<8 hex>".
Status SealManifest(std::string* text);
// OK when text holds exactly one "manifest_crc32c":"<8 hex>" and the CRC matches; else kCorrupt.
Status CheckManifestCrc(std::string_view text);

}  // namespace alpsck
