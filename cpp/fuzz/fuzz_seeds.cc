// Writes seed corpora for the fuzz targets from real checkpoints: fuzz_seeds OUT_DIR creates
// OUT_DIR/{json,footer,index,shard,manifest,record}/ with valid inputs of each kind (the fuzzers then
// mutate from something that parses, instead of from nothing).
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "commit.h"
#include "coordinate.h"
#include "file_io.h"
#include "format.h"
#include "fuzz_util.h"

namespace {

void Put(const std::string& dir, const std::string& name, const std::string& bytes) {
  ::mkdir(dir.c_str(), 0755);
  if (!alpsck_fuzz::WriteFile(dir + "/" + name, bytes.data(), bytes.size())) {
    std::perror((dir + "/" + name).c_str());
    std::exit(1);
  }
}

std::string U64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

std::string Slurp(const std::string& path) {
  std::string s;
  if (!alpsck::ReadSmallFile(alpsck::Env::Default(), path, 1ull << 30, &s).ok()) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(1);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[1];
  ::mkdir(out.c_str(), 0755);
  const std::string run = alpsck_fuzz::ScratchDir() + "/seeds";
  if (!alpsck_fuzz::WriteReferenceCheckpoints(run)) return 1;
  for (const alpsck_fuzz::ReferenceSave& s : alpsck_fuzz::ReferenceSaves()) {
    const std::string dir = alpsck::JoinPath(run, alpsck::StepDirName(s.step));
    const std::string shard = Slurp(alpsck::JoinPath(dir, alpsck::ShardFileName(0)));
    const std::string manifest = Slurp(alpsck::JoinPath(dir, alpsck::kManifestName));
    char fb[alpsck::kFooterBytes];
    std::memcpy(fb, shard.data() + shard.size() - alpsck::kFooterBytes, alpsck::kFooterBytes);
    alpsck::Footer f;
    if (!alpsck::DecodeFooter(fb, shard.size(), "seed", &f).ok()) return 1;
    const std::string index = shard.substr(static_cast<size_t>(f.index_offset), static_cast<size_t>(f.index_bytes));
    const std::string n = std::to_string(s.step);
    Put(out + "/json", "manifest-" + n, manifest);
    Put(out + "/json", "index-" + n, index);
    Put(out + "/json", "meta-" + n, s.meta);
    Put(out + "/footer", n, U64(shard.size()) + std::string(fb, sizeof(fb)));
    Put(out + "/index", n, U64(f.data_padded) + index);
    Put(out + "/shard", "raw-" + n, std::string(1, '\0') + shard);
    Put(out + "/shard", "built-" + n, std::string(1, '\1') + U64(f.data_padded) + index);
    Put(out + "/manifest", n, manifest);
    // A manifest listing an extra file (the DCP backend's), so the fuzzer reaches that parser,
    // and one in the older /1 format, read without a CRC of its own.
    const std::string crc_member = std::string(",\"") + alpsck::kManifestCrcKey + "\":";
    const size_t at = manifest.find(crc_member);
    if (at == std::string::npos) return 1;
    std::string extra = manifest;
    extra.insert(at, ",\"extra\":[{\"name\":\"dcp-metadata.json\",\"bytes\":2,\"crc\":0}]");
    if (!alpsck::SealManifest(&extra).ok()) return 1;
    Put(out + "/manifest", "extra-" + n, extra);
    std::string v1 = manifest.substr(0, at) + "}\n";
    const size_t fmt = v1.find(alpsck::kManifestFormat);
    if (fmt == std::string::npos) return 1;
    v1.replace(fmt, std::strlen(alpsck::kManifestFormat), alpsck::kManifestFormatV1);
    Put(out + "/manifest", "v1-" + n, v1);
    alpsck::ShardRecord rec;
    rec.name = alpsck::ShardFileName(0);
    rec.bytes = shard.size();
    rec.index_crc = f.index_crc;
    Put(out + "/record", n, std::string(1, '\0') + alpsck::EncodeShardRecord(0, rec));
  }
  // A crafted index that once made the reader allocate 16 GiB (regression seed).
  Put(out + "/shard", "built-huge-chunk",
      std::string(1, '\1') + U64(512) +
          "{\"format\":\"alpsck-shard/1\",\"rank\":0,\"align\":512,\"chunk_bytes\":17179869184,\"data_bytes\":512,"
          "\"data_padded\":512,\"crcs\":[0],\"extents\":[{\"name\":\"w\",\"offset\":0,\"size\":512}],\"meta\":\"\"}");
  std::printf("seeds written to %s\n", out.c_str());
  return 0;
}
