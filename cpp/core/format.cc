#include "format.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include "crc32c.h"
#include "json.h"
#include "platform.h"

namespace alpsck {
namespace {

constexpr char kFooterMagic[8] = {'A', 'L', 'P', 'S', 'C', 'K', 'F', '1'};
constexpr uint32_t kFormatVersion = 1;
constexpr char kIndexFormat[] = "alpsck-shard/1";

bool IsPow2(uint64_t x) { return x && !(x & (x - 1)); }

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
void PutU64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

Status ValidateName(const std::string& n) {
  if (n.empty()) return Status::Invalid("extent name is empty");
  if (n.size() > kMaxNameBytes) return Status::Invalid("extent name longer than 4096 bytes: " + n.substr(0, 64) + "...");
  if (n.find('\0') != std::string::npos) return Status::Invalid("extent name contains a NUL byte");
  return Status::Ok();
}

// Index of the first extent that ends after position pos.
size_t FirstExtentEndingAfter(const ShardLayout& l, uint64_t pos) {
  auto it = std::upper_bound(l.extents.begin(), l.extents.end(), pos,
                             [](uint64_t p, const ExtentLayout& e) { return p < e.offset + e.size; });
  return static_cast<size_t>(it - l.extents.begin());
}

}  // namespace

Status PlanLayout(const std::vector<std::pair<std::string, uint64_t>>& sizes, uint64_t align,
                  uint64_t chunk_bytes, uint64_t pack_align, ShardLayout* out) {
  if (!IsPow2(align)) return Status::Invalid("alignment " + std::to_string(align) + " is not a power of two");
  if (chunk_bytes == 0 || chunk_bytes % align)
    return Status::Invalid("chunk_bytes " + std::to_string(chunk_bytes) + " is not a positive multiple of the alignment " +
                           std::to_string(align));
  if (!IsPow2(pack_align)) return Status::Invalid("pack alignment is not a power of two");
  ShardLayout l;
  l.align = align;
  l.chunk_bytes = chunk_bytes;
  std::unordered_set<std::string> seen;
  uint64_t pos = 0;
  for (const auto& [name, size] : sizes) {
    ALPSCK_RETURN_IF_ERROR(ValidateName(name));
    if (!seen.insert(name).second) return Status::Invalid("extent name appears twice: " + name);
    pos = RoundUp(pos, pack_align);
    if (size > (1ull << 62) || pos > (1ull << 62) - size)
      return Status::Invalid("extent " + name + " makes the shard larger than 2^62 bytes");
    l.extents.push_back({name, pos, size});
    pos += size;
  }
  l.data_bytes = pos;
  l.data_padded = RoundUp(pos, align);
  *out = std::move(l);
  return Status::Ok();
}

std::string EncodeIndex(const ShardIndex& idx) {
  const ShardLayout& l = idx.layout;
  Json root = Json::Object();
  root.set("format", Json::Str(kIndexFormat));
  root.set("rank", Json::UInt(idx.rank));
  root.set("align", Json::UInt(l.align));
  root.set("chunk_bytes", Json::UInt(l.chunk_bytes));
  root.set("data_bytes", Json::UInt(l.data_bytes));
  root.set("data_padded", Json::UInt(l.data_padded));
  Json& crcs = root.set("crcs", Json::Array());
  for (uint32_t c : idx.crcs) crcs.push(Json::UInt(c));
  Json& ex = root.set("extents", Json::Array());
  for (const auto& e : l.extents) {
    Json& o = ex.push(Json::Object());
    o.set("name", Json::Str(e.name));
    o.set("offset", Json::UInt(e.offset));
    o.set("size", Json::UInt(e.size));
  }
  root.set("meta", Json::Str(idx.meta));
  if (!idx.save_id.empty()) root.set("save_id", Json::Str(idx.save_id));
  return root.dump();
}

Status DecodeIndex(std::string_view text, uint64_t data_padded, ShardIndex* out) {
  Json root;
  ALPSCK_RETURN_IF_ERROR(ParseJson(text, &root));
  auto bad = [](const std::string& what) { return Status::Corrupt("index: " + what); };
  if (!root.is_object()) return bad("not a JSON object");
  const Json* fmt = root.find("format");
  if (!fmt || !fmt->get_string() || *fmt->get_string() != kIndexFormat) return bad("unknown format (want alpsck-shard/1)");
  ShardIndex idx;
  ShardLayout& l = idx.layout;
  uint64_t rank = 0;
  auto u64 = [&](const char* key, uint64_t* v) -> bool {
    const Json* j = root.find(key);
    return j && j->get_u64(v);
  };
  if (!u64("rank", &rank) || rank > UINT32_MAX) return bad("missing or bad 'rank'");
  idx.rank = static_cast<uint32_t>(rank);
  if (!u64("align", &l.align) || !IsPow2(l.align) || l.align > (1ull << 30)) return bad("missing or bad 'align'");
  if (!u64("chunk_bytes", &l.chunk_bytes) || l.chunk_bytes == 0 || l.chunk_bytes % l.align || l.chunk_bytes > (1ull << 34))
    return bad("missing or bad 'chunk_bytes'");
  if (!u64("data_bytes", &l.data_bytes) || !u64("data_padded", &l.data_padded)) return bad("missing 'data_bytes'/'data_padded'");
  if (l.data_padded != data_padded || l.data_padded != RoundUp(l.data_bytes, l.align) || l.data_bytes > l.data_padded)
    return bad("data size does not match the footer");
  const Json* crcs = root.find("crcs");
  const std::vector<Json>* ca = crcs ? crcs->get_array() : nullptr;
  if (!ca || ca->size() != l.num_chunks()) return bad("'crcs' missing or not one per chunk");
  idx.crcs.reserve(ca->size());
  for (const Json& c : *ca) {
    uint64_t v;
    if (!c.get_u64(&v) || v > UINT32_MAX) return bad("a CRC is not a 32-bit number");
    idx.crcs.push_back(static_cast<uint32_t>(v));
  }
  const Json* ex = root.find("extents");
  const std::vector<Json>* ea = ex ? ex->get_array() : nullptr;
  if (!ea) return bad("'extents' missing");
  std::unordered_set<std::string> seen;
  uint64_t prev_end = 0;
  for (const Json& e : *ea) {
    const Json* n = e.find("name");
    ExtentLayout el;
    if (!n || !n->get_string()) return bad("an extent has no name");
    el.name = *n->get_string();
    if (!ValidateName(el.name).ok() || !seen.insert(el.name).second) return bad("bad or duplicate extent name");
    const Json* o = e.find("offset");
    const Json* s = e.find("size");
    if (!o || !s || !o->get_u64(&el.offset) || !s->get_u64(&el.size)) return bad("extent " + el.name + " lacks offset/size");
    if (el.offset < prev_end || el.offset > l.data_bytes || el.size > l.data_bytes - el.offset)
      return bad("extent " + el.name + " lies outside the data region or overlaps another");
    prev_end = el.offset + el.size;
    l.extents.push_back(std::move(el));
  }
  const Json* meta = root.find("meta");
  if (!meta || !meta->get_string()) return bad("'meta' missing");
  idx.meta = *meta->get_string();
  if (const Json* id = root.find("save_id")) {  // optional (older builds wrote none)
    if (!id->get_string()) return bad("'save_id' is not a string");
    idx.save_id = *id->get_string();
  }
  *out = std::move(idx);
  return Status::Ok();
}

void EncodeFooter(const Footer& f, char out[kFooterBytes]) {
  std::memset(out, 0, kFooterBytes);
  std::memcpy(out, kFooterMagic, 8);
  PutU32(out + 8, kFormatVersion);
  PutU32(out + 12, 0);
  PutU64(out + 16, f.index_offset);
  PutU64(out + 24, f.index_bytes);
  PutU32(out + 32, f.index_crc);
  PutU64(out + 40, f.data_padded);
  PutU64(out + 48, f.file_bytes);
  PutU32(out + 60, Crc32c(out, 60));
}

Status DecodeFooter(const char in[kFooterBytes], uint64_t file_size, const std::string& path, Footer* out) {
  if (std::memcmp(in, kFooterMagic, 8) != 0) return Status::Corrupt(path + ": no alpsck footer (bad magic)");
  if (GetU32(in + 60) != Crc32c(in, 60)) return Status::Corrupt(path + ": footer CRC mismatch");
  uint32_t ver = GetU32(in + 8);
  if (ver != kFormatVersion) return Status::Corrupt(path + ": unsupported format version " + std::to_string(ver));
  Footer f;
  f.index_offset = GetU64(in + 16);
  f.index_bytes = GetU64(in + 24);
  f.index_crc = GetU32(in + 32);
  f.data_padded = GetU64(in + 40);
  f.file_bytes = GetU64(in + 48);
  if (f.file_bytes != file_size)
    return Status::Corrupt(path + ": size " + std::to_string(file_size) + " but the footer records " + std::to_string(f.file_bytes));
  if (f.index_offset != f.data_padded || f.index_bytes > kMaxIndexBytes || f.index_offset > file_size ||
      f.index_bytes > file_size - f.index_offset || file_size - f.index_offset - f.index_bytes < kFooterBytes)
    return Status::Corrupt(path + ": footer fields point outside the file");
  *out = f;
  return Status::Ok();
}

std::string BuildTail(const std::string& index_json, uint64_t data_padded, uint64_t align, uint64_t* file_bytes) {
  uint64_t tail = RoundUp(index_json.size() + kFooterBytes, align);
  std::string buf(static_cast<size_t>(tail), '\0');
  std::memcpy(buf.data(), index_json.data(), index_json.size());
  Footer f;
  f.index_offset = data_padded;
  f.index_bytes = index_json.size();
  f.index_crc = Crc32c(index_json.data(), index_json.size());
  f.data_padded = data_padded;
  f.file_bytes = data_padded + tail;
  EncodeFooter(f, buf.data() + tail - kFooterBytes);
  *file_bytes = f.file_bytes;
  return buf;
}

namespace {

// Copies bytes [b, e) of the data region from the extents' sources into dst (dst[0] is byte b),
// zero filling gaps and padding.
void GatherRange(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t b, uint64_t e, char* dst) {
  uint64_t pos = b;
  for (size_t k = FirstExtentEndingAfter(l, b); k < l.extents.size() && l.extents[k].offset < e; ++k) {
    const ExtentLayout& x = l.extents[k];
    uint64_t s = std::max(b, x.offset), t = std::min(e, x.offset + x.size);
    if (s > pos) std::memset(dst + (pos - b), 0, s - pos);
    if (t > s) std::memcpy(dst + (s - b), srcs[k] + (s - x.offset), t - s);  // empty extents may have no memory
    pos = std::max(pos, t);
  }
  if (pos < e) std::memset(dst + (pos - b), 0, e - pos);
}

}  // namespace

void GatherChunk(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t i, char* dst) {
  GatherRange(l, srcs, l.chunk_begin(i), l.chunk_begin(i) + l.chunk_len(i), dst);
}

uint32_t GatherChunkCrc(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t i, char* dst) {
  const uint64_t b = l.chunk_begin(i), e = b + l.chunk_len(i);
  uint32_t crc = 0;
  for (uint64_t p = b; p < e; p += kGatherCrcPiece) {
    const uint64_t q = std::min(e, p + kGatherCrcPiece);
    GatherRange(l, srcs, p, q, dst + (p - b));
    crc = Crc32cExtend(crc, dst + (p - b), q - p);  // the piece is still in cache
  }
  return crc;
}

void ZeroChunkGaps(const ShardLayout& l, uint64_t i, char* dst) {
  const uint64_t b = l.chunk_begin(i), e = b + l.chunk_len(i);
  uint64_t pos = b;
  for (size_t k = FirstExtentEndingAfter(l, b); k < l.extents.size() && l.extents[k].offset < e; ++k) {
    const ExtentLayout& x = l.extents[k];
    uint64_t s = std::max(b, x.offset), t = std::min(e, x.offset + x.size);
    if (s > pos) std::memset(dst + (pos - b), 0, s - pos);
    pos = std::max(pos, t);
  }
  if (pos < e) std::memset(dst + (pos - b), 0, e - pos);
}

void ScatterChunk(const ShardLayout& l, const std::vector<char*>& dsts, uint64_t i, const char* src) {
  const uint64_t b = l.chunk_begin(i), e = b + l.chunk_len(i);
  for (size_t k = FirstExtentEndingAfter(l, b); k < l.extents.size() && l.extents[k].offset < e; ++k) {
    const ExtentLayout& x = l.extents[k];
    if (!dsts[k]) continue;
    uint64_t s = std::max(b, x.offset), t = std::min(e, x.offset + x.size);
    if (t > s) std::memcpy(dsts[k] + (s - x.offset), src + (s - b), t - s);
  }
}

const char* DirectSource(const ShardLayout& l, const std::vector<const char*>& srcs, uint64_t i, uint64_t mem_align) {
  const uint64_t b = l.chunk_begin(i), e = b + l.chunk_len(i);
  size_t k = FirstExtentEndingAfter(l, b);
  if (k >= l.extents.size()) return nullptr;
  const ExtentLayout& x = l.extents[k];
  if (x.offset > b || x.offset + x.size < e) return nullptr;
  const char* p = srcs[k] + (b - x.offset);
  return (reinterpret_cast<uintptr_t>(p) % mem_align) == 0 ? p : nullptr;
}

}  // namespace alpsck
