#include "recovery.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <thread>

#include "commit.h"
#include "crc32c.h"
#include "file_io.h"
#include "json.h"
#include "platform.h"
#include "retention.h"
#include "run_dir_actions.h"

namespace alpsck {

const char* CheckpointStateName(CheckpointState s) {
  switch (s) {
    case CheckpointState::kCommitted: return "committed";
    case CheckpointState::kIncomplete: return "incomplete";
    case CheckpointState::kCorrupt: return "corrupt";
    case CheckpointState::kUnreadable: return "unreadable";
    case CheckpointState::kDamaged: return "damaged";
  }
  return "unknown";
}

ShardReader::~ShardReader() {
  if (fd_ >= 0) env_->Close(fd_);
}

Status ShardReader::Open(Env* env, const std::string& path, bool direct, std::unique_ptr<ShardReader>* out) {
  std::unique_ptr<ShardReader> r(new ShardReader());
  r->env_ = env;
  r->path_ = path;
  ALPSCK_RETURN_IF_ERROR(OpenMaybeDirect(env, path, O_RDONLY | O_NONBLOCK, direct, &r->fd_, &r->direct_));
  int e = env->FileSize(r->fd_, &r->file_bytes_);
  if (e < 0) return Status::FromErrno(-e, "stat " + path);
  if (r->file_bytes_ < kFooterBytes) return Status::Corrupt(path + ": truncated (" + std::to_string(r->file_bytes_) + " bytes, no footer)");
  // The tail is read through a buffered descriptor: it is small and need not be aligned.
  int bfd = env->Open(path, O_RDONLY | O_NONBLOCK, 0);
  if (bfd < 0) return Status::FromErrno(-bfd, "open " + path);
  ScopedFd g(env, bfd);
  char fb[kFooterBytes];
  ALPSCK_RETURN_IF_ERROR(ReadFull(env, bfd, fb, kFooterBytes, r->file_bytes_ - kFooterBytes, path));
  Footer f;
  ALPSCK_RETURN_IF_ERROR(DecodeFooter(fb, r->file_bytes_, path, &f));
  std::string idx(static_cast<size_t>(f.index_bytes), '\0');
  ALPSCK_RETURN_IF_ERROR(ReadFull(env, bfd, idx.data(), f.index_bytes, f.index_offset, path));
  r->index_crc_ = Crc32c(idx.data(), idx.size());
  if (r->index_crc_ != f.index_crc) return Status::Corrupt(path + ": index CRC mismatch");
  Status s = DecodeIndex(idx, f.data_padded, &r->index_);
  if (!s.ok()) return Status::Corrupt(path + ": " + s.message());
  if (r->direct_ && (f.data_padded % r->index_.layout.align || r->index_.layout.align < PageSize())) {
    // Written with a smaller alignment than this machine's O_DIRECT needs: read buffered.
    env->Close(r->fd_);
    r->fd_ = -1;
    ALPSCK_RETURN_IF_ERROR(OpenMaybeDirect(env, path, O_RDONLY | O_NONBLOCK, false, &r->fd_, &r->direct_));
  }
  *out = std::move(r);
  return Status::Ok();
}

Status ShardReader::ReadChunks(const std::vector<uint64_t>& chunks, const std::vector<char*>* dsts, uint32_t threads,
                               const ProgressFn& progress) {
  const ShardLayout& l = index_.layout;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first;
  uint64_t done_bytes = 0;
  // The buffer fits the largest chunk actually read, never more: chunk_bytes comes from the file
  // (up to 16 GiB in a crafted index), while a chunk never extends past the file's data region.
  uint64_t buf_bytes = 1;
  for (uint64_t i : chunks) buf_bytes = std::max(buf_bytes, l.chunk_len(i));
  auto worker = [&] {
    PrefaultedMemory buf;
    if (!buf.Allocate(buf_bytes, -1, /*huge_pages=*/true)) {
      std::lock_guard<std::mutex> g(mu);
      if (first.ok()) first = Status::FromErrno(errno, "allocate a read buffer");
      failed = true;
      return;
    }
    for (;;) {
      size_t k = next.fetch_add(1);
      if (k >= chunks.size() || failed.load()) return;
      const uint64_t i = chunks[k], len = l.chunk_len(i);
      Status s = ReadFull(env_, fd_, buf.data(), len, l.chunk_begin(i), path_);
      if (s.ok() && Crc32c(buf.data(), len) != index_.crcs[i]) {
        std::string names;
        uint64_t unnamed = 0;  // tensors in the chunk past the first ~120 characters of names
        for (const auto& e : l.extents) {
          if (e.offset >= l.chunk_begin(i) + len || e.offset + e.size <= l.chunk_begin(i)) continue;
          if (names.size() < 120) names += (names.empty() ? "" : ", ") + e.name;
          else ++unnamed;
        }
        if (unnamed) names += " and " + std::to_string(unnamed) + " more";
        s = Status::Corrupt(path_ + ": CRC mismatch in chunk " + std::to_string(i) + " (bytes " +
                            std::to_string(l.chunk_begin(i)) + "-" + std::to_string(l.chunk_begin(i) + len) +
                            (names.empty() ? std::string(")") : ", holding " + names + ")"));
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> g(mu);
        if (first.ok()) first = s;
        failed = true;
        return;
      }
      if (dsts) ScatterChunk(l, *dsts, i, buf.data());
      if (progress) {
        std::lock_guard<std::mutex> g(mu);
        done_bytes += len;
        if (!progress(done_bytes)) {
          if (first.ok()) first = Status::Error(Code::kAborted, "cancelled");
          failed = true;
          return;
        }
      }
    }
  };
  uint32_t t = std::max<uint32_t>(1, std::min<uint32_t>(threads ? threads : 4, static_cast<uint32_t>(chunks.size())));
  std::vector<std::thread> pool;
  for (uint32_t i = 1; i < t; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  return first;
}

Status ShardReader::Read(const std::vector<char*>& dsts, uint32_t threads, const ProgressFn& progress) {
  const ShardLayout& l = index_.layout;
  if (dsts.size() != l.extents.size()) return Status::Invalid("Read: one destination per extent expected");
  std::vector<uint64_t> chunks;
  for (size_t k = 0; k < l.extents.size(); ++k) {
    const ExtentLayout& e = l.extents[k];
    if (!dsts[k] || e.size == 0) continue;
    uint64_t a = e.offset / l.chunk_bytes, b = (e.offset + e.size - 1) / l.chunk_bytes;
    for (uint64_t i = a; i <= b; ++i)
      if (chunks.empty() || chunks.back() < i) chunks.push_back(i);
  }
  return ReadChunks(chunks, &dsts, threads, progress);
}

Status ShardReader::Verify(uint32_t threads, const ProgressFn& progress) {
  std::vector<uint64_t> chunks(index_.layout.num_chunks());
  for (uint64_t i = 0; i < chunks.size(); ++i) chunks[i] = i;
  return ReadChunks(chunks, nullptr, threads, progress);
}

void CheckCheckpoint(Env* env, const std::string& dir, uint64_t step, bool verify, uint32_t threads,
                     CheckpointInfo* info, const ProgressFn& progress) {
  info->step = step;
  info->path = dir;
  auto corrupt = [&](const std::string& why) {
    info->state = CheckpointState::kCorrupt;
    info->error = why;
  };
  // A failed read: corrupt when the failure is about the files themselves (truncated, wrong
  // size, a CRC, a directory where a file belongs, missing); unreadable when it is about access
  // (EACCES, EIO, ESTALE, EMFILE...), which a later attempt may not meet.
  auto failed = [&](const Status& st, const std::string& why) {
    const bool structural = st.code() != Code::kIoError || st.err() == EISDIR || st.err() == ENOTDIR ||
                            st.err() == ELOOP || st.err() == EINVAL;
    info->state = structural ? CheckpointState::kCorrupt : CheckpointState::kUnreadable;
    info->error = why;
  };
  std::string text;
  Status s = ReadSmallFile(env, JoinPath(dir, kManifestName), kMaxManifestBytes, &text);
  if (!s.ok()) {
    if (s.code() == Code::kNotFound) {
      info->state = CheckpointState::kDamaged;
      info->error = "no MANIFEST.json: a step directory without its manifest (deleted, a copy still in progress, "
                    "or an expiry a crash interrupted); never restored";
    } else {
      failed(s, "MANIFEST.json: " + s.message());
    }
    return;
  }
  Json m;
  s = ParseJson(text, &m);
  if (!s.ok()) return corrupt("MANIFEST.json: " + s.message());
  const Json* fmt = m.find("format");
  const std::string* fs = fmt ? fmt->get_string() : nullptr;
  if (!fs || (*fs != kManifestFormat && *fs != kManifestFormatV1)) return corrupt("MANIFEST.json: unknown format");
  if (*fs == kManifestFormat) {  // /1 manifests (older builds) carry no CRC of their own
    s = CheckManifestCrc(text);
    if (!s.ok()) return corrupt("MANIFEST.json: " + s.message());
  }
  uint64_t mstep = 0;
  const Json* js = m.find("step");
  if (!js || !js->get_u64(&mstep) || mstep != step)
    return corrupt("MANIFEST.json: step does not match the directory name");
  if (const Json* c = m.find("created")) c->get_double(&info->created);
  if (const Json* w = m.find("write_seconds")) w->get_double(&info->write_seconds);
  if (const Json* d = m.find("direct_io")) d->get_bool(&info->direct_io);
  const Json* files = m.find("files");
  const std::vector<Json>* fa = files ? files->get_array() : nullptr;
  if (!fa || fa->empty()) return corrupt("MANIFEST.json: no shard files listed");
  info->ranks = static_cast<uint32_t>(fa->size());
  uint64_t ranks = 0;
  const Json* jr = m.find("ranks");
  if (!jr || !jr->get_u64(&ranks) || ranks != fa->size())
    return corrupt("MANIFEST.json: 'ranks' does not match the number of shard files listed");
  for (size_t k = 0; k < fa->size(); ++k) {
    const Json& f = (*fa)[k];
    const Json* n = f.find("name");
    const Json* b = f.find("bytes");
    const Json* c = f.find("index_crc");
    uint64_t bytes = 0, crc = 0;
    if (!n || !n->get_string() || !IsShardName(*n->get_string()) || !b || !b->get_u64(&bytes) || !c || !c->get_u64(&crc))
      return corrupt("MANIFEST.json: a file entry is malformed (name must be rank-NNNNN.bin)");
    // One shard per rank, in rank order: no duplicates, no gaps.
    if (*n->get_string() != ShardFileName(static_cast<uint32_t>(k)))
      return corrupt("MANIFEST.json: file entry " + std::to_string(k) + " is " + *n->get_string() + ", expected " +
                     ShardFileName(static_cast<uint32_t>(k)));
    const std::string path = JoinPath(dir, *n->get_string());
    std::unique_ptr<ShardReader> r;
    s = ShardReader::Open(env, path, verify, &r);
    if (!s.ok()) return failed(s, s.code() == Code::kNotFound ? path + ": missing" : s.message());
    if (r->file_bytes() != bytes) return corrupt(path + ": size differs from the manifest");
    if (r->index_crc() != crc) return corrupt(path + ": index differs from the one the manifest recorded");
    info->bytes += bytes;
    info->data_bytes += r->index().layout.data_bytes;
    info->extents += r->index().layout.extents.size();
    info->shards.push_back(*n->get_string());
    if (verify) {
      s = r->Verify(threads, progress);
      if (!s.ok()) return failed(s, s.message());
    }
  }
  if (const Json* extra = m.find("extra")) {
    const std::vector<Json>* xa = extra->get_array();
    if (!xa) return corrupt("MANIFEST.json: 'extra' is not a list");
    for (const Json& f : *xa) {
      const Json* n = f.find("name");
      const Json* b = f.find("bytes");
      const Json* c = f.find("crc");
      uint64_t bytes = 0, crc = 0;
      if (!n || !n->get_string() || !IsExtraFileName(*n->get_string()) || !b || !b->get_u64(&bytes) || !c ||
          !c->get_u64(&crc) || bytes > kMaxManifestBytes)
        return corrupt("MANIFEST.json: an extra file entry is malformed");
      const std::string path = JoinPath(dir, *n->get_string());
      std::string content;
      s = ReadSmallFile(env, path, kMaxManifestBytes, &content);
      if (!s.ok()) return failed(s, s.code() == Code::kNotFound ? path + ": missing" : s.message());
      if (content.size() != bytes) return corrupt(path + ": size differs from the manifest");
      if (Crc32c(content.data(), content.size()) != crc) return corrupt(path + ": CRC mismatch");
      info->extra_files.push_back(*n->get_string());
    }
  }
  if (const Json* metrics = m.find("metrics")) {
    if (!ParseMetrics(*metrics, &info->metrics)) return corrupt("MANIFEST.json: 'metrics' is malformed");
  }
  if (const Json* u = m.find("unhealthy")) {
    const std::string* t = u->get_string();
    if (!t || t->size() > kMaxUnhealthyText) return corrupt("MANIFEST.json: 'unhealthy' is malformed");
    info->flagged = *t;
  }
  info->pinned = IsPinned(env, dir);
  info->state = CheckpointState::kCommitted;
  info->verified = verify;
}

Status ScanRunDir(Env* env, const std::string& run_dir, bool verify, uint32_t threads,
                  std::vector<CheckpointInfo>* out, const ProgressFn& progress) {
  out->clear();
  int d = env->IsDir(run_dir);
  if (d < 0) return Status::FromErrno(-d, "run directory " + run_dir);
  if (d == 0) return Status::Invalid(run_dir + " is not a directory");
  std::vector<std::string> names;
  int r = env->ListDir(run_dir, &names);
  if (r < 0) return Status::FromErrno(-r, "list " + run_dir);
  bool cancelled = false;  // the caller's progress callback said stop: the whole scan ends
  ProgressFn watched;
  if (progress) watched = [&](uint64_t done) { return (cancelled = !progress(done)) == false; };
  for (const std::string& n : names) {
    uint64_t step = 0;
    const std::string p = JoinPath(run_dir, n);
    if (ParseStepDirName(n, &step)) {
      if (env->IsDir(p) != 1) continue;
      CheckpointInfo info;
      CheckCheckpoint(env, p, step, verify, threads, &info, watched);
      if (cancelled) return Status::Error(Code::kAborted, "scan of " + run_dir + " cancelled");
      out->push_back(std::move(info));
    } else if (const RunDirEntry e = ParseRunDirName(n);
               (e.kind == EntryKind::kAttempt || e.kind == EntryKind::kAborted) && env->IsDir(p) == 1) {
      CheckpointInfo info;
      info.step = e.step;
      info.path = p;
      info.state = CheckpointState::kIncomplete;
      info.error = e.kind == EntryKind::kAttempt ? "in flight or abandoned (.tmp)"
                                                 : "an aborted attempt (.aborted), kept until every rank has seen it";
      out->push_back(std::move(info));
    }
  }
  std::sort(out->begin(), out->end(), [](const CheckpointInfo& a, const CheckpointInfo& b) {
    return a.step != b.step ? a.step < b.step : a.state < b.state;
  });
  return Status::Ok();
}

// ----------------------------------------------------------------------------- the picker

const char* CheckpointKindName(CheckpointKind k) {
  switch (k) {
    case CheckpointKind::kAny: return "any";
    case CheckpointKind::kAlpsck: return "alpsck";
    case CheckpointKind::kDcp: return "dcp";
  }
  return "unknown";
}

CheckpointKind KindOf(const CheckpointInfo& info) {
  for (const std::string& n : info.extra_files)
    if (n == kDcpMetadataName) return CheckpointKind::kDcp;
  return CheckpointKind::kAlpsck;
}

Status PickCheckpoint(Env* env, const std::string& run_dir, const PickOptions& opts, Pick* out,
                      const ProgressFn& progress) {
  *out = Pick();
  ALPSCK_RETURN_IF_ERROR(ScanRunDir(env, run_dir, /*verify=*/false, opts.threads, &out->scanned));
  std::vector<CheckpointInfo>& all = out->scanned;
  bool cancelled = false;
  ProgressFn watched;
  if (progress) watched = [&](uint64_t done) { return (cancelled = !progress(done)) == false; };
  // data_failed[k]: entry k passed the quick check and then failed the data check.
  std::vector<char> data_failed(all.size(), 0);
  auto verify = [&](size_t k) {
    CheckpointInfo v;
    CheckCheckpoint(env, all[k].path, all[k].step, /*verify=*/true, opts.threads, &v, watched);
    if (cancelled) return;
    data_failed[k] = v.state != CheckpointState::kCommitted;
    all[k] = std::move(v);
  };
  const Status cancel = Status::Error(Code::kAborted, "pick in " + run_dir + " cancelled");
  if (opts.verify_all) {
    for (size_t k = 0; k < all.size(); ++k) {
      if (all[k].state != CheckpointState::kCommitted) continue;
      verify(k);
      if (cancelled) return cancel;
    }
  }
  const bool check_data = opts.verify_data || opts.verify_all;
  // Newest step first; ScanRunDir sorted ascending by step, so a step's entries are adjacent.
  for (size_t end = all.size(); end > 0;) {
    const uint64_t step = all[end - 1].step;
    size_t begin = end;
    while (begin > 0 && all[begin - 1].step == step) --begin;
    const size_t b = begin, e = end;
    end = begin;
    if ((opts.step && step != *opts.step) || (opts.max_step && step > *opts.max_step)) continue;
    size_t dir = e, attempt = e;  // the step-N entry; the attempt that speaks for the step without one
    for (size_t k = b; k < e; ++k) {
      if (all[k].state != CheckpointState::kIncomplete) {  // ScanRunDir: only attempts are incomplete
        dir = k;
        continue;
      }
      const std::string& p = all[k].path;
      const RunDirEntry a = ParseRunDirName(std::string_view(p).substr(p.rfind('/') + 1));
      if (attempt == e || a.kind == EntryKind::kAttempt) attempt = k;  // one in flight says more than an aborted one
    }
    Skipped why;
    why.step = step;
    if (dir == e) {  // rule 1: no step-N, only attempts
      const std::string& p = all[attempt].path;
      const bool in_flight = ParseRunDirName(std::string_view(p).substr(p.rfind('/') + 1)).kind == EntryKind::kAttempt;
      why.path = p;
      why.reason = in_flight ? "incomplete" : "aborted";
      why.message = all[attempt].error;
    } else {
      why.path = all[dir].path;
      if (all[dir].state == CheckpointState::kCommitted && check_data && !all[dir].verified && !out->step &&
          (opts.kind == CheckpointKind::kAny || KindOf(all[dir]) == opts.kind) &&
          (opts.world_size == 0 || all[dir].ranks == opts.world_size)) {
        verify(dir);  // rule 6, lazily: only a step that would otherwise be the pick
        if (cancelled) return cancel;
      }
      const CheckpointInfo& i = all[dir];
      if (i.state != CheckpointState::kCommitted) {  // rule 3 (or 6)
        why.reason = !data_failed[dir] ? CheckpointStateName(i.state)
                     : i.state == CheckpointState::kUnreadable ? "unreadable" : "data_crc";
        why.message = i.error;
      } else if (opts.kind != CheckpointKind::kAny && KindOf(i) != opts.kind) {  // rule 4
        why.reason = "other_kind";
        why.message = KindOf(i) == CheckpointKind::kDcp
                          ? std::string("a DCP checkpoint (it committed ") + kDcpMetadataName +
                                "), written by AlpsckStorageWriter: load it with dcp.load and AlpsckStorageReader"
                          : std::string("an alpsck.Checkpointer checkpoint (no ") + kDcpMetadataName +
                                "): restore it with Checkpointer.restore";
      } else if (opts.world_size != 0 && i.ranks != opts.world_size) {  // rule 5
        why.reason = "other_world";
        why.message = "written by " + std::to_string(i.ranks) + " rank(s), not " + std::to_string(opts.world_size);
      } else if (!opts.allow_unhealthy && !Unhealthy(i.metrics, i.flagged).empty()) {  // rule 5b
        why.reason = "unhealthy";
        why.message = Unhealthy(i.metrics, i.flagged) + "; allow_unhealthy=True restores it";
      } else {
        if (!out->step) {
          out->step = step;
          out->path = i.path;
          out->info = i;
        }
        out->candidates.push_back(i);
        continue;
      }
    }
    if (!out->step) out->skipped.push_back(std::move(why));
  }
  return Status::Ok();
}

}  // namespace alpsck
