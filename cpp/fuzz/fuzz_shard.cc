// libFuzzer target: a whole shard file through ShardReader (Open reads footer and index; Verify
// reads every chunk and checks its CRC; Read scatters the extents into buffers of their exact
// sizes). The first input byte picks the mode:
//   even: the rest is the file, byte for byte (mostly stops at the footer and index CRCs);
//   odd:  8 bytes of data size (mod 1 MiB) and an index text; the target builds a file around
//         them with a valid footer and index CRC, so the fuzzer reaches the index decoder and the
//         chunk reader with hostile layouts (huge chunk sizes, extents past the end, ...).
// Nothing a file holds may crash the reader, make it read outside its buffers or allocate
// without bound (libFuzzer's -rss_limit_mb catches that).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "crc32c.h"
#include "env.h"
#include "format.h"
#include "fuzz_util.h"
#include "recovery.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::string file;
  if ((data[0] & 1) == 0) {
    file.assign(reinterpret_cast<const char*>(data + 1), size - 1);
  } else {
    if (size < 9) return 0;
    const uint64_t data_padded = alpsck_fuzz::LoadU64(data + 1) % (1u << 20);
    const std::string index(reinterpret_cast<const char*>(data + 9), size - 9);
    file.assign(static_cast<size_t>(data_padded), '\x5a');
    uint64_t file_bytes = 0;
    file += alpsck::BuildTail(index, data_padded, 512, &file_bytes);
  }
  const std::string path = alpsck_fuzz::ScratchDir() + "/rank-00000.bin";
  if (!alpsck_fuzz::WriteFile(path, file.data(), file.size())) return 0;
  std::unique_ptr<alpsck::ShardReader> r;
  if (!alpsck::ShardReader::Open(alpsck::Env::Default(), path, false, &r).ok()) return 0;
  r->Verify(1);
  const auto& ex = r->index().layout.extents;
  std::vector<std::vector<char>> bufs;
  std::vector<char*> dsts;
  uint64_t total = 0;
  for (const auto& e : ex) total += e.size;
  if (total > (4u << 20)) return 0;
  for (const auto& e : ex) {
    bufs.emplace_back(static_cast<size_t>(e.size));
    dsts.push_back(e.size ? bufs.back().data() : nullptr);
  }
  r->Read(dsts, 1);
  return 0;
}
