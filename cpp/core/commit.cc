#include "commit.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "crc32c.h"
#include "retention.h"
#include "run_dir_actions.h"
#include "file_io.h"
#include "json.h"
#include "platform.h"

namespace alpsck {

Status SealShard(Env* env, int fd, const std::string& path, const ShardIndex& idx, bool direct, uint64_t align,
                 ShardRecord* record) {
  const std::string index_json = EncodeIndex(idx);
  uint64_t file_bytes = 0;
  const std::string tail = BuildTail(index_json, idx.layout.data_padded, align, &file_bytes);
  // O_DIRECT needs an aligned buffer; the tail is small, so one aligned copy is cheap.
  const uint64_t mem_align = direct ? align : 64;
  void* raw = nullptr;
  if (posix_memalign(&raw, mem_align, tail.size()) != 0) return Status::FromErrno(ENOMEM, "allocate the index of " + path);
  std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
  std::memcpy(raw, tail.data(), tail.size());
  ALPSCK_RETURN_IF_ERROR(WriteFull(env, fd, raw, tail.size(), idx.layout.data_padded, path));
  int r = env->FTruncate(fd, file_bytes);  // a recycled file may have been longer
  if (r < 0) return Status::FromErrno(-r, "truncate " + path);
  r = SyncFd(env, fd, true);  // retries EINTR
  if (r < 0) return Status::FromErrno(-r, "fdatasync " + path);
  record->bytes = file_bytes;
  record->index_crc = Crc32c(index_json.data(), index_json.size());
  record->data_bytes = idx.layout.data_bytes;
  record->extents = idx.layout.extents.size();
  record->direct_io = direct;
  return Status::Ok();
}

bool IsExtraFileName(const std::string& n) {
  if (n.empty() || n.size() > 64 || n[0] == '.' || n == kManifestName || n.rfind("rank-", 0) == 0 ||
      n == kAbortedName)
    return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
          c == '-'))
      return false;
  return true;
}

Status CheckExtraFile(const std::string& name, uint64_t bytes) {
  if (!IsExtraFileName(name)) return Status::Invalid("extra checkpoint file name not allowed: " + name);
  if (bytes > kMaxManifestBytes)
    return Status::Invalid("extra checkpoint file " + name + " is larger than " + std::to_string(kMaxManifestBytes) +
                           " bytes");
  return Status::Ok();
}

namespace {

bool IsMetricName(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (char c : n)
    if (c < 0x21 || c > 0x7e) return false;
  return true;
}

Json MetricValue(double v) {
  if (std::isnan(v)) return Json::Str("nan");
  if (std::isinf(v)) return Json::Str(v > 0 ? "inf" : "-inf");
  return Json::Double(v);
}

}  // namespace

Status CheckMetrics(const Metrics& metrics) {
  if (metrics.size() > kMaxMetrics)
    return Status::Invalid("a checkpoint records at most " + std::to_string(kMaxMetrics) + " metrics, not " +
                           std::to_string(metrics.size()));
  for (size_t k = 0; k < metrics.size(); ++k) {
    const std::string& n = metrics[k].first;
    if (!IsMetricName(n))
      return Status::Invalid("metric name " + JsonEscape(n) + ": use 1-64 printable ASCII characters, no space");
    for (size_t j = 0; j < k; ++j)
      if (metrics[j].first == n) return Status::Invalid("metric " + n + " is given twice");
  }
  return Status::Ok();
}

Status CheckNotes(const SaveNotes& notes) {
  ALPSCK_RETURN_IF_ERROR(CheckMetrics(notes.metrics));
  if (notes.unhealthy.size() > kMaxUnhealthyText)
    return Status::Invalid("the unhealthy text is " + std::to_string(notes.unhealthy.size()) + " bytes: at most " +
                           std::to_string(kMaxUnhealthyText));
  for (char c : notes.unhealthy)
    if (c < 0x20 || c > 0x7e) return Status::Invalid("the unhealthy text holds a character that is not printable ASCII");
  return Status::Ok();
}

std::string NonFiniteMetrics(const Metrics& metrics) {
  std::string out;
  for (const auto& [name, value] : metrics) {
    if (std::isfinite(value)) continue;
    out += (out.empty() ? "" : ", ") + name + "=" + (std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf");
  }
  return out;
}

bool ParseMetrics(const Json& j, Metrics* out) {
  const auto* members = j.members();
  if (!members || members->size() > kMaxMetrics) return false;
  Metrics m;
  for (const auto& [name, value] : *members) {
    double v = 0;
    if (const std::string* s = value.get_string()) {
      if (*s == "nan") v = std::nan("");
      else if (*s == "inf") v = HUGE_VAL;
      else if (*s == "-inf") v = -HUGE_VAL;
      else return false;
    } else if (!value.get_double(&v)) {
      return false;
    }
    m.emplace_back(name, v);
  }
  if (!CheckMetrics(m).ok()) return false;
  *out = std::move(m);
  return true;
}

std::string EncodeManifest(const CommitRequest& req, double created_unix) {
  Json m = Json::Object();
  m.set("format", Json::Str(kManifestFormat));
  m.set("step", Json::UInt(req.step));
  m.set("created", Json::Double(created_unix));
  m.set("ranks", Json::UInt(req.shards.size()));
  uint64_t total = 0, data = 0;
  Json& files = m.set("files", Json::Array());
  for (const ShardRecord& s : req.shards) {
    Json& f = files.push(Json::Object());
    f.set("name", Json::Str(s.name));
    f.set("bytes", Json::UInt(s.bytes));
    f.set("index_crc", Json::UInt(s.index_crc));
    f.set("data_bytes", Json::UInt(s.data_bytes));
    f.set("extents", Json::UInt(s.extents));
    total += s.bytes;
    data += s.data_bytes;
  }
  if (!req.extra_files.empty()) {
    Json& extra = m.set("extra", Json::Array());
    for (const ExtraFile& x : req.extra_files) {
      Json& f = extra.push(Json::Object());
      f.set("name", Json::Str(x.name));
      f.set("bytes", Json::UInt(x.content.size()));
      f.set("crc", Json::UInt(Crc32c(x.content.data(), x.content.size())));
    }
  }
  if (!req.notes.metrics.empty()) {
    Json& metrics = m.set("metrics", Json::Object());
    for (const auto& [name, value] : req.notes.metrics) metrics.set(name, MetricValue(value));
  }
  if (!req.notes.unhealthy.empty()) m.set("unhealthy", Json::Str(req.notes.unhealthy));
  m.set("bytes", Json::UInt(total));
  m.set("data_bytes", Json::UInt(data));
  m.set("write_seconds", Json::Double(req.write_seconds));
  // O_DIRECT only if every rank wrote its shard that way (each rank's record says how).
  bool direct = !req.shards.empty();
  for (const ShardRecord& s : req.shards) direct = direct && s.direct_io;
  m.set("direct_io", Json::Bool(direct));
  m.set(kManifestCrcKey, Json::Str("00000000"));  // last, sealed below
  std::string text = m.dump() + "\n";
  Status s = SealManifest(&text);  // cannot fail: the placeholder is there exactly once
  (void)s;
  return text;
}

namespace {

// The offset of the 8 digits of the one "manifest_crc32c":"........" in text, or npos when it is
// missing, repeated or malformed. A key can occur only once unescaped: inside JSON strings every
// '"' is escaped, so the pattern cannot appear within a value.
size_t FindManifestCrc(std::string_view text) {
  const std::string pat = std::string("\"") + kManifestCrcKey + "\":\"";
  const size_t at = text.find(pat);
  if (at == std::string_view::npos || text.find(pat, at + 1) != std::string_view::npos) return std::string_view::npos;
  const size_t d = at + pat.size();
  if (d + 9 > text.size() || text[d + 8] != '"') return std::string_view::npos;
  for (size_t i = d; i < d + 8; ++i)
    if (!((text[i] >= '0' && text[i] <= '9') || (text[i] >= 'a' && text[i] <= 'f'))) return std::string_view::npos;
  return d;
}

uint32_t ManifestCrc(std::string_view text, size_t digits) {
  std::string zeroed(text);
  zeroed.replace(digits, 8, "00000000");
  return Crc32c(zeroed.data(), zeroed.size());
}

}  // namespace

Status SealManifest(std::string* text) {
  const size_t d = FindManifestCrc(*text);
  if (d == std::string::npos) return Status::Invalid("manifest has no single manifest_crc32c member");
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08x", ManifestCrc(*text, d));
  text->replace(d, 8, hex);
  return Status::Ok();
}

Status CheckManifestCrc(std::string_view text) {
  const size_t d = FindManifestCrc(text);
  if (d == std::string_view::npos)
    return Status::Corrupt(std::string("no single valid \"") + kManifestCrcKey + "\" (8 hex digits)");
  const uint32_t want = static_cast<uint32_t>(std::strtoul(std::string(text.substr(d, 8)).c_str(), nullptr, 16));
  const uint32_t got = ManifestCrc(text, d);
  if (want != got) {
    char msg[96];
    std::snprintf(msg, sizeof msg, "CRC32C mismatch (recorded %08x, content %08x)", want, got);
    return Status::Corrupt(msg);
  }
  return Status::Ok();
}

// Steps 5-8 of the commit protocol (docs/commit-protocol.md, "One save, start to finish"): extra
// files and MANIFEST.json into step-N.tmp/ (each fsync'ed), fsync(step-N.tmp/), the rename that
// commits, fsync(RUN_DIR). Steps 1-4 ran per shard before (SealShard); 9-10 (LATEST, retention)
// follow in the engine. A crash anywhere leaves the earlier checkpoints untouched: nothing before
// the rename is visible, and the rename is atomic.
Status CommitCheckpoint(Env* env, const CommitRequest& req) {
  const double created = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const ExtraFile& x : req.extra_files) {
    ALPSCK_RETURN_IF_ERROR(CheckExtraFile(x.name, x.content.size()));
    ALPSCK_RETURN_IF_ERROR(WriteFileSynced(env, JoinPath(req.tmp_dir, x.name), x.content));
  }
  if (req.notes.pin) ALPSCK_RETURN_IF_ERROR(WritePin(env, req.tmp_dir));  // committed with it: never expired before
  ALPSCK_RETURN_IF_ERROR(
      WriteFileSynced(env, JoinPath(req.tmp_dir, kManifestName), EncodeManifest(req, created), !req.recycled_dir));
  ALPSCK_RETURN_IF_ERROR(SyncDir(env, req.tmp_dir));
  int r = env->Rename(req.tmp_dir, req.final_dir);
  if (r < 0) return Status::FromErrno(-r, "rename " + req.tmp_dir + " -> " + req.final_dir);
  return SyncDir(env, req.run_dir);
}


}  // namespace alpsck
