// libFuzzer target: DecodeShardRecord, the parser of the DONE records that ranks leave in
// step-N.tmp/ (coordinate.h) and that rank 0 reads before committing. Input: 1 byte of rank,
// then the record text. Whatever decodes must name exactly that rank's shard.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "coordinate.h"
#include "format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint32_t rank = data[0] % 8;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  alpsck::ShardRecord r;
  if (!alpsck::DecodeShardRecord(text, rank, &r).ok()) return 0;
  if (r.name != alpsck::ShardFileName(rank)) {
    std::fprintf(stderr, "record for rank %u names %s\n", rank, r.name.c_str());
    std::abort();
  }
  return 0;
}
