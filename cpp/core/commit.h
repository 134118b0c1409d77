// The commit protocol: the only code that turns written bytes into a checkpoint that recovery
// will trust. Its steps and their order are listed at CommitCheckpoint in commit.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "env.h"
#include "format.h"
#include "status.h"

namespace alpsck {

constexpr char kManifestName[] = "MANIFEST.json";
constexpr char kLatestName[] = "LATEST";
constexpr uint64_t kMaxManifestBytes = 16ull << 20;

struct ShardRecord {
  std::string name;   // rank-NNNNN.bin
  uint64_t bytes = 0;
  uint32_t index_crc = 0;
  uint64_t data_bytes = 0;
  uint64_t extents = 0;
};

struct CommitRequest {
  std::string run_dir;
  std::string tmp_dir;    // RUN_DIR/step-N.tmp (holds the sealed shard files)
  std::string final_dir;  // RUN_DIR/step-N
  uint64_t step = 0;
  std::vector<ShardRecord> shards;
  double write_seconds = 0;
  bool direct_io = false;
};

// Writes the tail (index + footer) of a shard whose data chunks are all written, truncates the
// file to its exact size, fdatasyncs it. fd stays open (the caller closes it).
Status SealShard(Env* env, int fd, const std::string& path, const ShardIndex& idx, bool direct, uint64_t align,
                 ShardRecord* record);

// Steps 5-8 of the protocol: manifest, directory fsyncs, the rename that commits.
Status CommitCheckpoint(Env* env, const CommitRequest& req);

// Step 9: writes LATEST (a hint; recovery never trusts it blindly).
Status PublishLatest(Env* env, const std::string& run_dir, uint64_t step);

std::string EncodeManifest(const CommitRequest& req, double created_unix);

}  // namespace alpsck
