// libFuzzer target: CheckCheckpoint (verify on) with a hostile MANIFEST.json next to a valid
// shard. A manifest must never make recovery open a file outside its directory (names like
// ../x, /etc/passwd), crash, or call a checkpoint committed unless every file it names exists
// with the recorded size and index CRC.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "commit.h"
#include "file_io.h"
#include "fuzz_util.h"
#include "recovery.h"

namespace {

// step-000000001/ holding the rank-00000.bin of a real save; its size.
std::string g_dir;
uint64_t g_shard_bytes = 0;

void Setup() {
  const std::string run = alpsck_fuzz::ScratchDir() + "/run";
  if (!alpsck_fuzz::WriteReferenceCheckpoints(run)) std::abort();
  g_dir = alpsck::JoinPath(run, alpsck::StepDirName(1));
  struct stat st;
  if (::stat(alpsck::JoinPath(g_dir, alpsck::ShardFileName(0)).c_str(), &st) != 0) std::abort();
  g_shard_bytes = static_cast<uint64_t>(st.st_size);
}

void Check(const std::string& text) {
  if (!alpsck_fuzz::WriteFile(alpsck::JoinPath(g_dir, alpsck::kManifestName),
                              reinterpret_cast<const uint8_t*>(text.data()), text.size()))
    return;
  alpsck::CheckpointInfo info;
  alpsck::CheckCheckpoint(alpsck::Env::Default(), g_dir, 1, true, 1, &info);
  if (info.state != alpsck::CheckpointState::kCommitted) return;
  // Committed: it can only be the one real shard, possibly listed more than once.
  for (const std::string& s : info.shards)
    if (s != alpsck::ShardFileName(0)) {
      std::fprintf(stderr, "committed with a shard named %s\n", s.c_str());
      std::abort();
    }
  if (info.shards.empty() || info.bytes != g_shard_bytes * info.shards.size()) {
    std::fprintf(stderr, "committed with %llu bytes\n", static_cast<unsigned long long>(info.bytes));
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (g_dir.empty()) Setup();
  const std::string text(reinterpret_cast<const char*>(data), size);
  Check(text);  // as given: a mutated /2 manifest almost always fails its own CRC here
  // Resealed, the same mutation reaches the checks behind the CRC (names, sizes, shards).
  std::string sealed = text;
  if (alpsck::SealManifest(&sealed).ok() && sealed != text) Check(sealed);
  return 0;
}
