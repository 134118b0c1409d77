#include "coordinate.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cerrno>
#include <chrono>
#include <cstdio>
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

}  // namespace

std::string EncodeShardRecord(uint32_t rank, const ShardRecord& r) {
  Json j = Json::Object();
  j.set("rank", Json::UInt(rank));
  j.set("name", Json::Str(r.name));
  j.set("bytes", Json::UInt(r.bytes));
  j.set("index_crc", Json::UInt(r.index_crc));
  j.set("data_bytes", Json::UInt(r.data_bytes));
  j.set("extents", Json::UInt(r.extents));
  j.set("direct_io", Json::Bool(r.direct_io));
  if (!r.node.empty()) j.set("node", Json::Str(r.node));
  if (r.arrived > 0) j.set("arrived", Json::Double(r.arrived));
  if (r.work_seconds > 0) j.set("work_seconds", Json::Double(r.work_seconds));
  return j.dump() + "\n";
}

namespace {

// A host name as a record may carry it: 1-255 characters of letters, digits, '.', '-' and '_'.
bool IsHostName(const std::string& s) {
  if (s.empty() || s.size() > 255) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') return false;
  return true;
}

// A finite, non-negative number below 1e12 (a time in unix seconds, or a duration), else 0.
double Informational(const Json* v) {
  double d = 0;
  if (!v || !v->get_double(&d) || !std::isfinite(d) || d < 0 || d >= 1e12) return 0;
  return d;
}

}  // namespace

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
  // The pace fields are informational too: a malformed one reads as absent.
  const Json* node = j.find("node");
  out->node = node && node->get_string() && IsHostName(*node->get_string()) ? *node->get_string() : "";
  out->arrived = Informational(j.find("arrived"));
  out->work_seconds = Informational(j.find("work_seconds"));
  return Status::Ok();
}

// Records appear whole or not at all (written under a .tmp name, then renamed), so a reader never
// parses a half-written one. They are not made durable (no fsync: 0.3 ms of a 2 MiB DCP save's 8 on
// this project's VM): a crash discards step-N.tmp (or the aborted directory) anyway, a DONE record
// is written only after its shard was fdatasync'ed, and what the coordinator read from the records
// is in the manifest it fsyncs before the commit rename.
Status PublishRecord(Env* env, const std::string& dir, const std::string& name, const std::string& content) {
  const std::string path = JoinPath(dir, name);
  const std::string tmp = TempFileName(path);
  ALPSCK_RETURN_IF_ERROR(WriteFileUnsynced(env, tmp, content));
  int r = env->Rename(tmp, path);
  if (r < 0) return Status::FromErrno(-r, "rename " + tmp + " -> " + path);
  return Status::Ok();
}

Status WriteDoneRecord(Env* env, const std::string& tmp_dir, uint32_t rank, const ShardRecord& r) {
  return PublishRecord(env, tmp_dir, DoneRecordName(rank), EncodeShardRecord(rank, r));
}

std::string Attempt::tmp_dir() const { return JoinPath(run_dir, TmpDirName(step, attempt)); }
std::string Attempt::aborted_dir() const { return JoinPath(run_dir, AbortedDirName(step, attempt)); }
std::string Attempt::final_dir() const { return JoinPath(run_dir, StepDirName(step)); }

namespace {

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

// The abort verdict of an aborted attempt: its reason, once the winner has written it (it does so
// right after its rename, so a reader that comes in between waits a moment for it).
Status AbortedStatus(Env* env, const Attempt& a) {
  std::string why;
  const std::string path = JoinPath(a.aborted_dir(), kAbortedName);
  PollUntil(2.0, [&] { return ReadSmallFile(env, path, kMaxRecordBytes, &why).ok() || env->IsDir(a.aborted_dir()) < 0; });
  while (!why.empty() && why.back() == '\n') why.pop_back();
  return Status::Error(Code::kAborted, "step " + std::to_string(a.step) + " was aborted: " +
                                           (why.empty() ? std::string("(no reason recorded)") : why));
}

// "no shard from rank(s) 2, 5" for the ranks among [first, world_size) that `missing` names
// (the list cut at about 200 characters); "" when there are none.
template <typename Missing>
std::string NoShardFrom(uint32_t first, uint32_t world_size, Missing missing) {
  std::string which;
  for (uint32_t r = first; r < world_size && which.size() < 200; ++r)
    if (missing(r)) which += (which.empty() ? "" : ", ") + std::to_string(r);
  return which.empty() ? "" : "no shard from rank(s) " + which;
}

// "; no shard from rank(s) 2, 5" for the ranks whose DONE record is not in the attempt's directory
// (rank 0, the coordinator, publishes none: its own record stays with it).
std::string MissingRanks(Env* env, const Attempt& a, uint32_t world_size) {
  std::vector<std::string> names;
  if (env->ListDir(a.tmp_dir(), &names) < 0) return "";
  const std::string which = NoShardFrom(1, world_size, [&](uint32_t r) {
    return std::find(names.begin(), names.end(), DoneRecordName(r)) == names.end();
  });
  return which.empty() ? "" : "; " + which;
}

}  // namespace

Verdict ReadVerdict(Env* env, const Attempt& a, Status* why) {
  // The aborted name first (a slow rank may have re-created the attempt's directory after the
  // abort), then the attempt's directory, then the aborted name again: a rename between the
  // first two looks is seen by the third.
  for (int look = 0; look < 2; ++look) {
    if (env->IsDir(a.aborted_dir()) == 1) {
      *why = AbortedStatus(env, a);
      return Verdict::kAborted;
    }
    if (look == 0 && env->IsDir(a.tmp_dir()) != -ENOENT) return Verdict::kPending;
  }
  return Verdict::kCommitted;
}

// Won: the reason, then the shards go (their blocks are freed now; a rank still writing holds an
// unlinked file). Records stay: a rank's .seen joins them.
void RecordAbort(Env* env, const Attempt& a, uint32_t rank, const std::string& why) {
  const std::string aborted = a.aborted_dir();
  PublishRecord(env, aborted, kAbortedName, "rank " + std::to_string(rank) + ": " + why + "\n");
  std::vector<std::string> names;
  if (env->ListDir(aborted, &names) == 0)
    for (const std::string& n : names)
      if (IsShardName(n) || n == kManifestName) env->Unlink(JoinPath(aborted, n));
}

Verdict Abort(Env* env, const Attempt& a, uint32_t rank, const std::string& why, Status* why_out, bool* won) {
  const std::string tmp = a.tmp_dir(), aborted = a.aborted_dir();
  if (env->IsOwnDir(tmp) == 0) {
    // Not an attempt directory alpsck made (a symlink, say): never renamed nor written into. No
    // rank can have written there (PrepareDir refuses it), so this rank's reason is the verdict.
    if (won) *won = true;
    *why_out = Status::Error(Code::kAborted, "step " + std::to_string(a.step) + " failed: " + why);
    return Verdict::kAborted;
  }
  const int r = env->Rename(tmp, aborted);
  if (won) *won = r == 0;
  if (r == 0) {
    RecordAbort(env, a, rank, why);
    *why_out = Status::Error(Code::kAborted, "step " + std::to_string(a.step) + " was aborted: rank " +
                                                 std::to_string(rank) + ": " + why);
    return Verdict::kAborted;
  }
  // ENOENT: decided already. EEXIST/ENOTEMPTY: the aborted name exists, so this directory is one
  // a slow rank re-created after the abort: remove this rank's part of it.
  if (r == -EEXIST || r == -ENOTEMPTY) {
    env->Unlink(JoinPath(tmp, ShardFileName(rank)));
    env->Unlink(JoinPath(tmp, DoneRecordName(rank)));
    env->Rmdir(tmp);  // the last one out (fails harmlessly while others' files are there)
  }
  if (r == -ENOENT || r == -EEXIST || r == -ENOTEMPTY) {
    Status verdict;
    const Verdict v = ReadVerdict(env, a, &verdict);
    if (v == Verdict::kAborted) {
      *why_out = verdict;
      return v;
    }
    if (v == Verdict::kCommitted) return v;
  }
  *why_out = Status::FromErrno(-r, "abort step " + std::to_string(a.step) + ": rename " + tmp + " -> " + aborted +
                                       " (this rank gives up: " + why + ")");
  return Verdict::kAborted;
}

void SawAbort(Env* env, const Attempt& a, uint32_t rank, uint32_t world_size) {
  const std::string dir = a.aborted_dir();
  if (env->IsOwnDir(dir) != 1) return;  // gone (the others saw it all), or not ours to write in
  int fd = env->Open(JoinPath(dir, SeenRecordName(rank)), O_WRONLY | O_CREAT, 0644);
  if (fd < 0) return;  // gone (the others saw it all) or unwritable: rank 0's next Open removes it
  env->Close(fd);
  std::vector<std::string> names;
  if (env->ListDir(dir, &names) < 0) return;
  uint32_t seen = 0;
  for (uint32_t r = 0; r < world_size; ++r)
    if (std::find(names.begin(), names.end(), SeenRecordName(r)) != names.end()) ++seen;
  if (seen == world_size) RemoveDirFiles(env, dir);  // two ranks may both get here: both remove
}

Status WaitForShards(Env* env, const Attempt& a, uint32_t world_size, double timeout_s,
                     std::vector<ShardRecord>* records, const ShardRecord* own) {
  const std::string tmp_dir = a.tmp_dir();
  records->assign(world_size, ShardRecord());
  std::vector<bool> have(world_size, false);
  uint32_t missing = world_size;
  if (own) {
    (*records)[0] = *own;
    have[0] = true;
    --missing;
  }
  if (missing == 0) return Status::Ok();  // one rank: nobody else to wait for
  Status failure;
  const bool finished = PollUntil(timeout_s, [&] {
    if (ReadVerdict(env, a, &failure) == Verdict::kAborted) return true;
    std::vector<std::string> names;
    int r = env->ListDir(tmp_dir, &names);
    if (r < 0) {
      failure = Status::FromErrno(-r, "list " + tmp_dir);
      if (r == -ENOENT && ReadVerdict(env, a, &failure) != Verdict::kAborted)
        failure = Status::Error(Code::kAborted, tmp_dir + " vanished before its commit");
      return true;
    }
    for (const std::string& n : names) {
      unsigned rank = 0;
      char suffix[8] = {0};
      if (std::sscanf(n.c_str(), "rank-%u.%7s", &rank, suffix) != 2 || rank >= world_size) continue;
      if (n != DoneRecordName(rank) || have[rank]) continue;
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
    return Status::Error(Code::kAborted, NoShardFrom(0, world_size, [&](uint32_t r) { return !have[r]; }) + " after " +
                                             Seconds(timeout_s) + " s");
  }
  return Status::Ok();
}

Status WaitForCommit(Env* env, const Attempt& a, uint32_t rank, uint32_t world_size, double timeout_s) {
  Status why;
  Verdict v = Verdict::kPending;
  PollUntil(timeout_s, [&] { return (v = ReadVerdict(env, a, &why)) != Verdict::kPending; });
  if (v == Verdict::kPending)  // this rank gives up, unless the commit wins the rename
    v = Abort(env, a, rank, "no commit from rank 0 within " + Seconds(timeout_s) + " s" + MissingRanks(env, a, world_size),
              &why);
  if (v == Verdict::kAborted) return why;
  // The rename that committed the step is visible before the coordinator's fsync of RUN_DIR has
  // made it durable: sync it from here too, so this rank never reports durable a commit that a
  // power loss could still undo (the crash-state checker found this window).
  return SyncDir(env, a.run_dir);
}

// ---------------------------------------------------------------- FileAgreement

Status FileAgreement::Arrive(uint32_t rank, const ShardRecord& record) {
  return WriteDoneRecord(env_, a_.tmp_dir(), rank, record);
}

Status FileAgreement::AwaitShards(double timeout_s, const ShardRecord* own, std::vector<ShardRecord>* records) {
  return WaitForShards(env_, a_, world_size_, timeout_s, records, own);
}

// The commit's rename of step-N[.aK].tmp (step 7) competes with Abort's rename of the same
// directory: at most one of them happens.
Status FileAgreement::Commit(const CommitRequest& req) { return CommitCheckpoint(env_, req); }

Verdict FileAgreement::Abort(uint32_t rank, const std::string& why, Status* verdict, bool* won) {
  return alpsck::Abort(env_, a_, rank, why, verdict, won);
}

Verdict FileAgreement::Peek(Status* why) { return ReadVerdict(env_, a_, why); }

Status FileAgreement::AwaitVerdict(uint32_t rank, double timeout_s) {
  return WaitForCommit(env_, a_, rank, world_size_, timeout_s);
}

void FileAgreement::Acknowledge(uint32_t rank) { SawAbort(env_, a_, rank, readers_); }

}  // namespace alpsck
