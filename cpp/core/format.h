// The on-disk format of one shard file (rank-NNNNN.bin) — documented in docs/format.md.
//
//   [ data region: extents packed at pack_align, zero-padded to a multiple of align ]
//   [ tail: index JSON | zero padding | footer (64 bytes) ], tail length a multiple of align
//
// The data region is cut into fixed chunks of chunk_bytes (a multiple of align; the last one is
// shorter); each chunk has a CRC32C in the index. Every offset and length in the file is a
// multiple of align, so the whole file can be written and read with O_DIRECT. Nothing on disk is
// a pointer. Decoding treats the file as hostile: every number is bounds-checked.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "status.h"

namespace alpsck {

constexpr uint64_t kFooterBytes = 64;
constexpr uint64_t kMaxIndexBytes = 1ull << 30;
constexpr uint64_t kMaxNameBytes = 4096;
constexpr uint64_t kDefaultPackAlign = 64;

struct ExtentLayout {
  std::string name;
  uint64_t offset = 0;  // within the data region (== within the file)
  uint64_t size = 0;
};

struct ShardLayout {
  uint64_t align = 4096;
  uint64_t chunk_bytes = 0;
  std::vector<ExtentLayout> extents;  // in offset order
  uint64_t data_bytes = 0;            // end of the last extent
  uint64_t data_padded = 0;           // RoundUp(data_bytes, align)

  uint64_t num_chunks() const { return chunk_bytes ? (data_padded + chunk_bytes - 1) / chunk_bytes : 0; }
  uint64_t chunk_begin(uint64_t i) const { return i * chunk_bytes; }
  uint64_t chunk_len(uint64_t i) const {
    uint64_t b = chunk_begin(i);
    return data_padded - b < chunk_bytes ? data_padded - b : chunk_bytes;
  }
};

// Lays out named extents of the given sizes. align must be a power of two; chunk_bytes a
// positive multiple of align. Names must be unique, non-empty, without NUL, at most 4 KiB.
Status PlanLayout(const std::vector<std::pair<std::string, uint64_t>>& sizes, uint64_t align,
                  uint64_t chunk_bytes, uint64_t pack_align, ShardLayout* out);

struct ShardIndex {
  ShardLayout layout;
  std::vector<uint32_t> crcs;  // one per chunk
  std::string meta;            // opaque to the core (the Python layer's JSON tree)
  uint32_t rank = 0;
  // Unique per save (written when non-empty): two saves of the same bytes still differ in their
  // index CRC, so a rank can tell its own commit from an earlier one of the same step.
  std::string save_id;
};

std::string EncodeIndex(const ShardIndex& idx);
// Parses and validates an index read from a file whose data region is data_padded bytes.
Status DecodeIndex(std::string_view json, uint64_t data_padded, ShardIndex* out);

struct Footer {
  uint64_t index_offset = 0;
  uint64_t index_bytes = 0;
  uint32_t index_crc = 0;
  uint64_t data_padded = 0;
  uint64_t file_bytes = 0;
};

void EncodeFooter(const Footer& f, char out[kFooterBytes]);
// Checks magic, version, the footer's own CRC and that every field fits a file of file_size.
Status DecodeFooter(const char in[kFooterBytes], uint64_t file_size, const std::string& path, Footer* out);

// The tail (index + padding + footer) for an index at data_padded; its length is a multiple
// of align. *file_bytes receives the total file size.
std::string BuildTail(const std::string& index_json, uint64_t data_padded, uint64_t align, uint64_t* file_bytes);

// Zeroes the bytes of chunk i in dst that belong to no extent (padding); the rest is untouched.
void ZeroChunkGaps(const ShardLayout& l, uint64_t i, char* dst);

// Copies the bytes of chunk i from the extents' sources into dst (chunk_len(i) bytes), zero
// filling gaps and padding. srcs[k] is the memory of layout.extents[k].
void GatherChunk(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t i, char* dst);
// GatherChunk and the CRC32C of the bytes it wrote, in one pass over memory: each piece of
// kGatherCrcPiece bytes is checksummed right after it is copied, while it is still in the core's
// cache, instead of read back from memory later (the CRC of a cold 167 MB state cost more CPU
// than copying it: docs/benchmarks.md).
constexpr uint64_t kGatherCrcPiece = 96 << 10;  // 8 x the CRC's three 4 KiB streams; fits L2
uint32_t GatherChunkCrc(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t i, char* dst);
// The reverse: copies the parts of chunk i that belong to extents with a non-null dsts[k].
void ScatterChunk(const ShardLayout& l, const std::vector<char*>& dsts, uint64_t i, const char* src);
// True when chunk i lies inside one extent whose source is aligned for direct I/O at
// src + (chunk offset), so it can be written from the caller's memory without a copy.
const char* DirectSource(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t i, uint64_t mem_align);

}  // namespace alpsck
