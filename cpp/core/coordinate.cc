#include "coordinate.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "file_io.h"
#include "json.h"

namespace alpsck {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMaxRecordBytes = 64 << 10;

// Polls fn() (returning true when finished) with a backoff of 1 ms up to 20 ms until timeout_s.
template <typename Fn>
bool PollUntil(double timeout_s, Fn fn) {
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(std::max(0.0, timeout_s)));
  std::chrono::microseconds pause(1000);
  for (;;) {
    if (fn()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

std::string RankFileName(uint32_t rank, const char* suffix) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank-%05u.%s", rank, suffix);
  return buf;
}

bool Exists(Env* env, const std::string& path) { return env->IsDir(path) >= 0; }

}  // namespace

std::string DoneRecordName(uint32_t rank) { return RankFileName(rank, "done"); }
std::string FailedRecordName(uint32_t rank) { return RankFileName(rank, "failed"); }

std::string EncodeShardRecord(uint32_t rank, const ShardRecord& r) {
  Json j = Json::Object();
  j.set("rank", Json::UInt(rank));
  j.set("name", Json::Str(r.name));
  j.set("bytes", Json::UInt(r.bytes));
  j.set("index_crc", Json::UInt(r.index_crc));
  j.set("data_bytes", Json::UInt(r.data_bytes));
  j.set("extents", Json::UInt(r.extents));
  j.set("direct_io", Json::Bool(r.direct_io));
  return j.dump() + "\n";
}

Status DecodeShardRecord(const std::string& text, uint32_t rank, ShardRecord* out) {
  Json j;
  ALPSCK_RETURN_IF_ERROR(ParseJson(text, &j, JsonLimits{8, kMaxRecordBytes}));
  uint64_t r = 0, crc = 0;
  const Json* jr = j.find("rank");
  const Json* n = j.find("name");
  const Json* b = j.find("bytes");
  const Json* c = j.find("index_crc");
  const Json* d = j.find("data_bytes");
  const Json* e = j.find("extents");
  if (!jr || !jr->get_u64(&r) || r != rank || !n || !n->get_string() || *n->get_string() != ShardFileName(rank) ||
      !b || !b->get_u64(&out->bytes) || !c || !c->get_u64(&crc) || crc > 0xFFFFFFFFull || !d ||
      !d->get_u64(&out->data_bytes) || !e || !e->get_u64(&out->extents))
    return Status::Corrupt("the done record of rank " + std::to_string(rank) + " is malformed");
  out->name = *n->get_string();
  out->index_crc = static_cast<uint32_t>(crc);
  const Json* io = j.find("direct_io");  // informational: absent or malformed reads as false
  out->direct_io = false;
  if (io) io->get_bool(&out->direct_io);
  return Status::Ok();
}

// Records appear whole or not at all (written under a .tmp name, then renamed), so a reader never
// parses a half-written one. They need not be durable: a crash discards step-N.tmp anyway, and the
// coordinator fsyncs the directory before the commit rename.
Status PublishRecord(Env* env, const std::string& dir, const std::string& name, const std::string& content) {
  const std::string path = JoinPath(dir, name);
  ALPSCK_RETURN_IF_ERROR(WriteFileSynced(env, path + ".tmp", content));
  int r = env->Rename(path + ".tmp", path);
  if (r < 0) return Status::FromErrno(-r, "rename " + path + ".tmp -> " + path);
  return Status::Ok();
}

Status WriteDoneRecord(Env* env, const std::string& tmp_dir, uint32_t rank, const ShardRecord& r) {
  return PublishRecord(env, tmp_dir, DoneRecordName(rank), EncodeShardRecord(rank, r));
}

void WriteFailedRecord(Env* env, const std::string& tmp_dir, uint32_t rank, const std::string& why) {
  if (PublishRecord(env, tmp_dir, FailedRecordName(rank), why + "\n").ok()) return;
  // The disk may be what failed (ENOSPC): an empty record, which needs no data block, still says it.
  const std::string path = JoinPath(tmp_dir, FailedRecordName(rank));
  int fd = env->Open(path + ".tmp", O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0 && env->Close(fd) == 0) env->Rename(path + ".tmp", path);
}

Status WaitForShards(Env* env, const std::string& tmp_dir, uint32_t world_size, double timeout_s,
                     std::vector<ShardRecord>* records) {
  records->assign(world_size, ShardRecord());
  std::vector<bool> have(world_size, false);
  uint32_t missing = world_size;
  Status failure;
  const bool finished = PollUntil(timeout_s, [&] {
    std::vector<std::string> names;
    int r = env->ListDir(tmp_dir, &names);
    if (r < 0) {
      failure = Status::FromErrno(-r, "list " + tmp_dir);
      return true;
    }
    for (const std::string& n : names) {
      if (n == kAbortedName) {
        std::string why;
        ReadSmallFile(env, JoinPath(tmp_dir, n), kMaxRecordBytes, &why);
        failure = Status::Error(Code::kAborted, tmp_dir + " was aborted: " + why);
        return true;
      }
      unsigned rank = 0;
      char suffix[8] = {0};
      if (std::sscanf(n.c_str(), "rank-%u.%7s", &rank, suffix) != 2 || rank >= world_size) continue;
      const std::string s(suffix);
      if (s == "failed" && n == FailedRecordName(rank)) {
        std::string why;
        ReadSmallFile(env, JoinPath(tmp_dir, n), kMaxRecordBytes, &why);
        while (!why.empty() && why.back() == '\n') why.pop_back();
        failure = Status::Error(Code::kAborted, "rank " + std::to_string(rank) + " failed to write its shard: " +
                                                    (why.empty() ? std::string("(no reason recorded)") : why));
        return true;
      }
      if (s != "done" || n != DoneRecordName(rank) || have[rank]) continue;
      std::string text;
      Status st = ReadSmallFile(env, JoinPath(tmp_dir, n), kMaxRecordBytes, &text);
      if (st.ok()) st = DecodeShardRecord(text, rank, &(*records)[rank]);
      if (!st.ok()) {
        failure = st;
        return true;
      }
      // The record says the shard is sealed and durable; check its size before trusting it.
      int fd = env->Open(JoinPath(tmp_dir, (*records)[rank].name), O_RDONLY, 0);
      uint64_t size = 0;
      int e = fd < 0 ? fd : env->FileSize(fd, &size);
      if (fd >= 0) env->Close(fd);
      if (e < 0 || size != (*records)[rank].bytes) {
        failure = Status::Corrupt(JoinPath(tmp_dir, (*records)[rank].name) + ": missing or not the size its done record says");
        return true;
      }
      have[rank] = true;
      --missing;
    }
    return missing == 0;
  });
  if (!failure.ok()) return failure;
  if (!finished) {
    std::string which;
    for (uint32_t r = 0; r < world_size && which.size() < 200; ++r)
      if (!have[r]) which += (which.empty() ? "" : ", ") + std::to_string(r);
    return Status::Error(Code::kAborted, tmp_dir + ": no shard from rank(s) " + which + " after " +
                                             std::to_string(static_cast<int64_t>(timeout_s)) + " s");
  }
  return Status::Ok();
}

void AbortStep(Env* env, const std::string& tmp_dir, const std::string& why) {
  if (env->IsDir(tmp_dir) != 1) return;
  // ABORTED first, so a rank that is still waiting sees the verdict before the files vanish.
  PublishRecord(env, tmp_dir, kAbortedName, why + "\n");
  std::vector<std::string> names;
  if (env->ListDir(tmp_dir, &names) == 0)
    for (const std::string& n : names)
      if (n != kAbortedName) env->Unlink(JoinPath(tmp_dir, n));
}

bool AbortVerdict(Env* env, const std::string& tmp_dir, uint64_t step, Status* verdict) {
  const std::string aborted = JoinPath(tmp_dir, kAbortedName);
  if (!Exists(env, aborted)) return false;
  std::string why;
  ReadSmallFile(env, aborted, kMaxRecordBytes, &why);
  while (!why.empty() && why.back() == '\n') why.pop_back();
  *verdict = Status::Error(Code::kAborted, "step " + std::to_string(step) + " was aborted by the coordinator: " + why);
  return true;
}

namespace {

// True when final_dir's manifest lists `mine` as one of its shards (name, size and index CRC).
bool CommitHolds(Env* env, const std::string& final_dir, const ShardRecord& mine) {
  std::string text;
  if (!ReadSmallFile(env, JoinPath(final_dir, kManifestName), kMaxManifestBytes, &text).ok()) return false;
  Json m;
  if (!ParseJson(text, &m).ok()) return false;
  const Json* files = m.find("files");
  const std::vector<Json>* fa = files ? files->get_array() : nullptr;
  if (!fa) return false;
  for (const Json& f : *fa) {
    const Json* name = f.find("name");
    const Json* bytes = f.find("bytes");
    const Json* crc = f.find("index_crc");
    uint64_t b = 0, c = 0;
    if (name && name->get_string() && *name->get_string() == mine.name && bytes && bytes->get_u64(&b) &&
        b == mine.bytes && crc && crc->get_u64(&c) && c == mine.index_crc)
      return true;
  }
  return false;
}

}  // namespace

Status WaitForCommit(Env* env, const std::string& run_dir, uint64_t step, const std::string& tmp_dir,
                     double timeout_s, const ShardRecord* mine) {
  const std::string final_dir = JoinPath(run_dir, StepDirName(step));
  Status verdict;
  const bool finished = PollUntil(timeout_s, [&] {
    if (Exists(env, JoinPath(final_dir, kManifestName)) && (!mine || CommitHolds(env, final_dir, *mine))) return true;
    if (AbortVerdict(env, tmp_dir, step, &verdict)) return true;
    // Committed and already expired: with keep_last below the saves in flight, rank 0 may commit
    // newer steps and retire this one before this rank looks. Only the commit rename takes this
    // attempt's directory away while its ranks wait (an aborted one keeps its ABORTED verdict).
    return env->IsDir(tmp_dir) == -ENOENT;
  });
  if (!verdict.ok()) return verdict;
  if (!finished)
    return Status::Error(Code::kAborted, "step " + std::to_string(step) + " was not committed by the coordinator (rank 0) within " +
                                             std::to_string(static_cast<int64_t>(timeout_s)) + " s");
  // The rename that committed the step is visible before the coordinator's fsync of RUN_DIR has
  // made it durable: sync it from here too, so this rank never reports durable a commit that a
  // power loss could still undo (the crash-state checker found this window).
  return SyncDir(env, run_dir);
}

Status CommitStep(Env* env, const std::string& run_dir, uint64_t step, uint32_t world_size,
                  const std::vector<std::pair<std::string, std::string>>& extra_files, double timeout_s,
                  double elapsed_s) {
  const Clock::time_point t0 = Clock::now();
  CommitRequest req;
  req.run_dir = run_dir;
  req.final_dir = JoinPath(run_dir, StepDirName(step));
  req.tmp_dir = JoinPath(run_dir, TmpDirName(step));  // DCP: a fresh engine per save, attempt 0
  req.step = step;
  for (const auto& [name, content] : extra_files) {
    ALPSCK_RETURN_IF_ERROR(CheckExtraFile(name, content.size()));  // before waiting for anyone
    req.extra_files.push_back({name, content});
  }
  Status s = WaitForShards(env, req.tmp_dir, world_size, timeout_s, &req.shards);
  if (s.ok()) {
    req.write_seconds = std::max(0.0, elapsed_s) + std::chrono::duration<double>(Clock::now() - t0).count();
    s = CommitCheckpoint(env, req);
  }
  if (!s.ok()) {
    AbortStep(env, req.tmp_dir, s.message());
    return s;
  }
  std::string latest;
  if (!ReadSmallFile(env, JoinPath(run_dir, kLatestName), 64, &latest).ok() ||
      std::strtoll(latest.c_str(), nullptr, 10) < static_cast<int64_t>(step))
    PublishLatest(env, run_dir, step);  // a hint: failure to update it never fails the commit
  return Status::Ok();
}

namespace {

constexpr char kPendingSuffix[] = ".new";  // free-K.new: expired, expiry not yet durable

bool EndsWith(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// A free-K directory that a save may take (its expiry is durable).
bool IsClaimableFreeDir(const std::string& name) {
  return name.rfind(kFreePrefix, 0) == 0 && !EndsWith(name, kPendingSuffix);
}

// Keeps only the shard files of an expired checkpoint's directory: its DONE records, manifest and
// any extra file must not reach the step that reuses it.
void KeepOnlyShards(Env* env, const std::string& dir) {
  std::vector<std::string> names;
  if (env->ListDir(dir, &names) < 0) return;
  for (const std::string& n : names)
    if (!IsShardName(n)) env->Unlink(JoinPath(dir, n));
}

}  // namespace

std::string RetainNewest(Env* env, const std::string& run_dir, uint32_t keep_last, uint32_t keep_free) {
  if (keep_last == 0) return "";
  std::vector<std::string> names;
  int r = env->ListDir(run_dir, &names);
  if (r < 0) return Status::FromErrno(-r, "retention: list " + run_dir).message();
  std::vector<uint64_t> committed;
  std::vector<std::string> claimable;
  for (const std::string& n : names) {
    uint64_t step = 0;
    if (ParseStepDirName(n, &step) && Exists(env, JoinPath(JoinPath(run_dir, n), kManifestName)))
      committed.push_back(step);
    else if (IsClaimableFreeDir(n))
      claimable.push_back(n);
  }
  std::sort(committed.begin(), committed.end());
  std::string warning;
  auto warn = [&](const Status& s) {
    if (!s.ok() && warning.empty()) warning = "retention: " + s.message();
  };
  static std::atomic<uint64_t> seq{0};
  std::vector<std::string> pending;  // expired, to become claimable once the expiry is durable
  for (size_t i = 0; i + keep_last < committed.size(); ++i) {
    const std::string path = JoinPath(run_dir, StepDirName(committed[i]));
    const std::string base = kFreePrefix + std::to_string(committed[i]) + "-" + std::to_string(::getpid()) + "-" +
                             std::to_string(seq.fetch_add(1));
    const std::string gone = JoinPath(run_dir, base + kPendingSuffix);
    // Renaming first makes the expiry atomic: the directory stops being a checkpoint at once.
    int e = env->Rename(path, gone);
    if (e < 0) {
      warn(Status::FromErrno(-e, "rename " + path));
      continue;
    }
    // The manifest goes first: should a power loss undo the rename, the directory comes back as
    // step-N without a manifest (never committed, ignored), not as a manifest naming removed or
    // overwritten shards, a corrupt checkpoint (found by test_crash_states: two_rank_...).
    env->Unlink(JoinPath(gone, kManifestName));
    if (pending.size() + claimable.size() < keep_free) {
      KeepOnlyShards(env, gone);
      pending.push_back(base);
    } else {
      warn(RemoveDirFiles(env, gone));
    }
  }
  Status s = SyncDir(env, run_dir);
  warn(s);
  // Only once the expiry is durable may a save take the directory and overwrite its shards in
  // place (before, a power loss could bring step-N back over half-overwritten shards). A lost
  // rename below only leaves a free-K.new, which the next Open removes.
  for (const std::string& b : pending) {
    if (!s.ok() || env->Rename(JoinPath(run_dir, b + kPendingSuffix), JoinPath(run_dir, b)) < 0)
      RemoveDirFiles(env, JoinPath(run_dir, b + kPendingSuffix));
  }
  return warning;
}

bool ClaimFreeDir(Env* env, const std::string& run_dir, const std::string& tmp_dir) {
  std::vector<std::string> names;
  if (env->ListDir(run_dir, &names) < 0) return false;
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    if (!IsClaimableFreeDir(n)) continue;
    // Atomic: fails with ENOTEMPTY/EEXIST once another rank has made tmp_dir hold anything (that
    // rank's claim, or a shard it created), and with ENOENT if another rank took this one.
    const int r = env->Rename(JoinPath(run_dir, n), tmp_dir);
    if (r == 0) return true;
    if (r != -ENOENT) return false;
  }
  return false;
}

}  // namespace alpsck
