// Shared by the libFuzzer targets: a scratch directory for targets that must go through files.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"

namespace alpsck_fuzz {

// A directory for this process's scratch files: $ALPSCK_FUZZ_TMP, else /dev/shm (a tmpfs: no
// disk I/O per input), else /tmp. Created once; never removed (the fuzz run's build dir owns it).
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    const char* env = std::getenv("ALPSCK_FUZZ_TMP");
    struct stat st;
    std::string base = env && *env ? env : (::stat("/dev/shm", &st) == 0 && ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    std::string tmpl = base + "/alpsck-fuzz-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) std::abort();
    return std::string(buf.data());
  }();
  return dir;
}

inline bool WriteFile(const std::string& path, const void* data, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = std::fwrite(data, 1, n, f) == n;
  return std::fclose(f) == 0 && ok;
}

inline uint64_t LoadU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// The checkpoints the seeds come from (fuzz_seeds) and that fuzz_manifest checks its manifests
// against: the same bytes, so a seed manifest names the right index CRC. Step 1 has several
// chunks and extents, step 2 no data, step 3 one tiny extent.
struct ReferenceSave {
  uint64_t step;
  std::vector<std::pair<std::string, uint64_t>> extents;  // name, size (chunk sizes added below)
  std::string meta;
};
inline std::vector<ReferenceSave> ReferenceSaves() {
  return {{1, {{"w", 2000}, {"b", 3}, {"empty", 0}}, "{\"format\":\"alpsck-tree/1\",\"step\":1}"},
          {2, {}, "{}"},
          {3, {{"x", 1}}, "[1,2.5,\"\\u00e9\",true,null,{\"k\":[]}]"}};
}

// Writes the reference checkpoints into run_dir (smallest chunks: 2 x chunk + 2000 bytes of w).
inline bool WriteReferenceCheckpoints(const std::string& run_dir) {
  alpsck::EngineOptions o;
  o.run_dir = run_dir;
  o.chunk_bytes = 1;
  o.threads = 1;
  o.keep_last = 0;
  o.direct_io = false;
  std::unique_ptr<alpsck::Engine> e;
  if (!alpsck::Engine::Open(o, &e).ok()) return false;
  const std::string bytes(2 * e->chunk_bytes() + 4096, 'a');
  for (const ReferenceSave& r : ReferenceSaves()) {
    std::vector<alpsck::SaveExtent> ex;
    for (const auto& [name, n] : r.extents) ex.push_back({name, bytes.data(), name == "w" ? 2 * e->chunk_bytes() + n : n});
    std::shared_ptr<alpsck::SaveHandle> h;
    if (!e->Save({r.step, std::move(ex), r.meta, alpsck::SaveMode::kSnapshot}, &h).ok()) return false;
    h->Wait(-1);
    if (!h->status().ok()) {
      std::fprintf(stderr, "%s\n", h->status().message().c_str());
      return false;
    }
  }
  e->Close();
  return true;
}

}  // namespace alpsck_fuzz
