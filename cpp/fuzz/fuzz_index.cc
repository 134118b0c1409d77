// libFuzzer target: DecodeIndex on hostile JSON. Input: 8 bytes of data_padded (little endian,
// as the footer would give it), then the index text. Whatever decodes must be a layout that the
// reader can use without leaving its buffers: every extent inside the data region, in order, one
// CRC per chunk. For small regions every chunk is then scattered into per-extent buffers of
// exactly the extents' sizes (ASan catches any write outside them).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "format.h"
#include "fuzz_util.h"

namespace {
void Fail(const char* what) {
  std::fprintf(stderr, "accepted a bad index: %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  const uint64_t data_padded = alpsck_fuzz::LoadU64(data);
  const std::string_view text(reinterpret_cast<const char*>(data + 8), size - 8);
  alpsck::ShardIndex idx;
  if (!alpsck::DecodeIndex(text, data_padded, &idx).ok()) return 0;
  const alpsck::ShardLayout& l = idx.layout;
  if (l.data_padded != data_padded || l.data_bytes > l.data_padded) Fail("sizes");
  if (l.chunk_bytes == 0 || l.chunk_bytes % l.align) Fail("chunk size");
  if (idx.crcs.size() != l.num_chunks()) Fail("crc count");
  uint64_t prev_end = 0;
  for (const auto& e : l.extents) {
    if (e.offset < prev_end || e.offset > l.data_bytes || e.size > l.data_bytes - e.offset) Fail("extent bounds");
    prev_end = e.offset + e.size;
  }
  if (l.data_padded > (1u << 20) || l.chunk_bytes > (1u << 20)) return 0;
  std::vector<std::vector<char>> bufs;
  std::vector<char*> dsts;
  for (const auto& e : l.extents) {
    bufs.emplace_back(static_cast<size_t>(e.size));
    dsts.push_back(bufs.back().data());
  }
  std::vector<char> chunk(static_cast<size_t>(l.chunk_bytes), 'x');
  for (uint64_t i = 0; i < l.num_chunks(); ++i) alpsck::ScatterChunk(l, dsts, i, chunk.data());
  return 0;
}
