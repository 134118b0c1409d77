#include "run_dir.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <utility>
#include <vector>

#include "file_io.h"
#include "retention.h"

namespace alpsck {

namespace {

constexpr std::string_view kStepPrefix = "step-";
constexpr std::string_view kAbortedSuffix = ".aborted";

bool StartsWith(std::string_view s, std::string_view p) { return s.size() >= p.size() && s.substr(0, p.size()) == p; }
bool EndsWith(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// "step-N" or "step-N.aK" (K > 0, as AttemptSuffix writes it) -> step, attempt.
bool ParseStepAttempt(std::string_view name, uint64_t* step, uint32_t* attempt) {
  uint64_t a = 0;
  const size_t dot = name.rfind('.');
  if (dot != std::string_view::npos) {
    std::string_view k = name.substr(dot + 1);
    if (k.size() < 2 || k.size() > 11 || k[0] != 'a' || k[1] == '0') return false;
    for (char c : k.substr(1)) {
      if (c < '0' || c > '9') return false;
      a = a * 10 + static_cast<uint64_t>(c - '0');
    }
    if (a > UINT32_MAX) return false;
    name = name.substr(0, dot);
  }
  if (!ParseStepDirName(name, step)) return false;
  if (attempt) *attempt = static_cast<uint32_t>(a);
  return true;
}

std::string AttemptSuffix(uint32_t attempt) { return attempt ? ".a" + std::to_string(attempt) : std::string(); }

std::string RankFileName(uint32_t rank, const char* suffix) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank-%05" PRIu32 ".%s", rank, suffix);
  return buf;
}

}  // namespace

std::string StepDirName(uint64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "step-%09" PRIu64, step);
  return buf;
}

bool ParseStepDirName(std::string_view name, uint64_t* step) {
  if (name.size() <= kStepPrefix.size() || !StartsWith(name, kStepPrefix)) return false;
  std::string_view d = name.substr(kStepPrefix.size());
  if (d.size() > 20) return false;  // UINT64_MAX has 20 digits
  uint64_t v = 0;
  for (char c : d) {
    if (c < '0' || c > '9') return false;
    const uint64_t digit = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - digit) / 10) return false;  // beyond 64 bits
    v = v * 10 + digit;
  }
  *step = v;
  return true;
}

std::string TmpDirName(uint64_t step, uint32_t attempt) {
  return StepDirName(step) + AttemptSuffix(attempt) + std::string(kTempSuffix);
}

bool ParseTmpDirName(std::string_view name, uint64_t* step, uint32_t* attempt) {
  if (!EndsWith(name, kTempSuffix)) return false;
  name.remove_suffix(std::string_view(kTempSuffix).size());
  return ParseStepAttempt(name, step, attempt);
}

std::string AbortedDirName(uint64_t step, uint32_t attempt) {
  return StepDirName(step) + AttemptSuffix(attempt) + std::string(kAbortedSuffix);
}

std::string FreeDirName(uint64_t step, uint64_t pid, uint64_t seq, bool pending) {
  return kFreePrefix + std::to_string(step) + "-" + std::to_string(pid) + "-" + std::to_string(seq) +
         (pending ? kFreePendingSuffix : "");
}

std::string SupersededDirName(uint64_t step, uint64_t pid, uint64_t seq) {
  return kSupersededPrefix + StepDirName(step) + "-" + std::to_string(pid) + "-" + std::to_string(seq);
}

std::string ProbeFileName(uint32_t rank, uint64_t pid) {
  return ".alpsck-probe-" + std::to_string(rank) + "-" + std::to_string(pid);
}

std::string DeletingName(const std::string& name, uint64_t pid, uint64_t seq) {
  if (seq == 0) return kDeletingPrefix + name;
  return kDeletingPrefix + name + "-" + std::to_string(pid) + "-" + std::to_string(seq);
}

RunDirEntry ParseRunDirName(std::string_view name) {
  RunDirEntry e;
  if (ParseStepDirName(name, &e.step)) {
    e.kind = EntryKind::kStep;
  } else if (ParseTmpDirName(name, &e.step, &e.attempt)) {
    e.kind = EntryKind::kAttempt;
  } else if (EndsWith(name, kAbortedSuffix) &&
             ParseStepAttempt(name.substr(0, name.size() - kAbortedSuffix.size()), &e.step, &e.attempt)) {
    e.kind = EntryKind::kAborted;
  } else if (StartsWith(name, kFreePrefix) && name.size() > std::string_view(kFreePrefix).size()) {
    e.kind = EndsWith(name, kFreePendingSuffix) ? EntryKind::kFreePending : EntryKind::kFree;
  } else if (StartsWith(name, kSupersededPrefix)) {
    // superseded-step-N-<pid>-<seq>: the step is what follows the prefix, up to the next '-'.
    std::string_view rest = name.substr(std::string_view(kSupersededPrefix).size());
    const size_t dash = rest.find('-', kStepPrefix.size());
    if (dash != std::string_view::npos && ParseStepDirName(rest.substr(0, dash), &e.step))
      e.kind = EntryKind::kSuperseded;
  } else if (name == kLatestName) {
    e.kind = EntryKind::kLatest;
  } else if (name == kLockName || StartsWith(name, std::string(kLockName) + "-rank-")) {
    e.kind = EntryKind::kLock;
  } else if (name == kHistoryName) {
    e.kind = EntryKind::kHistory;
  } else if (name == kRequeueRequestName || name == kStartDecisionName || name == kRollbacksName ||
             name == TempFileName(kRequeueRequestName) || name == TempFileName(kStartDecisionName) ||
             name == TempFileName(kRollbacksName)) {
    e.kind = EntryKind::kJobRecord;
  } else if (StartsWith(name, kDeletingPrefix) && name.size() > std::string_view(kDeletingPrefix).size()) {
    e.kind = EntryKind::kDeleting;
  }
  return e;
}

const char* EntryKindName(EntryKind k) {
  switch (k) {
    case EntryKind::kStep: return "step";
    case EntryKind::kAttempt: return "attempt";
    case EntryKind::kAborted: return "aborted";
    case EntryKind::kFree: return "free";
    case EntryKind::kFreePending: return "free-pending";
    case EntryKind::kSuperseded: return "superseded";
    case EntryKind::kLatest: return "latest";
    case EntryKind::kLock: return "lock";
    case EntryKind::kHistory: return "history";
    case EntryKind::kJobRecord: return "job-record";
    case EntryKind::kDeleting: return "deleting";
    case EntryKind::kOther: break;
  }
  return "other";
}

std::string TempFileName(const std::string& name) { return name + kTempSuffix; }

std::string LockFileName(uint32_t rank) {
  if (rank == 0) return kLockName;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%s-rank-%05" PRIu32, kLockName, rank);
  return buf;
}

std::string ShardFileName(uint32_t rank) { return RankFileName(rank, "bin"); }

bool IsShardName(const std::string& n) {
  if (n.size() < 14 || n.rfind("rank-", 0) != 0 || n.compare(n.size() - 4, 4, ".bin") != 0) return false;
  for (size_t i = 5; i + 4 < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return false;
  return true;
}

std::string DoneRecordName(uint32_t rank) { return RankFileName(rank, "done"); }
std::string FailedRecordName(uint32_t rank) { return RankFileName(rank, "failed"); }
std::string SeenRecordName(uint32_t rank) { return RankFileName(rank, "seen"); }

namespace {

// A free-K directory that a save may take (its expiry is durable).
bool IsClaimableFreeDir(const std::string& name) { return ParseRunDirName(name).kind == EntryKind::kFree; }

// Keeps only the shard files of an expired checkpoint's directory: its DONE records, manifest and
// any extra file must not reach the step that reuses it.
void KeepOnlyShards(Env* env, const std::string& dir) {
  std::vector<std::string> names;
  if (env->ListDir(dir, &names) < 0) return;
  for (const std::string& n : names)
    if (!IsShardName(n)) env->Unlink(JoinPath(dir, n));
}

}  // namespace

std::string RetainNewest(Env* env, const std::string& run_dir, const RetentionPolicy& policy, uint32_t keep_free) {
  if (policy.keep_last == 0) return "";
  std::vector<std::string> names;
  int r = env->ListDir(run_dir, &names);
  if (r < 0) return Status::FromErrno(-r, "retention: list " + run_dir).message();
  std::vector<RetainedStep> committed;
  uint32_t claimable = 0;
  for (const std::string& n : names) {
    uint64_t step = 0;
    const bool is_step = ParseStepDirName(n, &step);
    if (!is_step && !IsClaimableFreeDir(n)) continue;  // no call for the locks, LATEST, ...: one per rank
    const std::string p = JoinPath(run_dir, n);
    const bool real = env->IsOwnDir(p) == 1;  // a symlinked or foreign checkpoint is never expired nor recycled
    if (is_step && real && env->IsDir(JoinPath(p, kManifestName)) >= 0) {
      RetainedStep rs;
      rs.step = step;
      // Unreadable (vanished, damaged): it counts as healthy, created at 0, without metrics.
      if (policy.NeedsManifest()) ReadRetainedStep(env, p, step, &rs);
      committed.push_back(rs);
    } else if (!is_step && real) {
      ++claimable;
    }
  }
  std::sort(committed.begin(), committed.end(), [](const RetainedStep& a, const RetainedStep& b) { return a.step < b.step; });
  const std::vector<std::string> rules = DecideRetention(policy, committed);
  std::vector<Expiry> victims;
  for (size_t i = 0; i < committed.size(); ++i)
    if (rules[i].empty()) victims.push_back({committed[i].step, false});
  std::vector<std::string> kept;
  return ExpireSteps(env, run_dir, victims, keep_free > claimable ? keep_free - claimable : 0, &kept);
}

std::string ExpireSteps(Env* env, const std::string& run_dir, const std::vector<Expiry>& victims, uint32_t room,
                        std::vector<std::string>* kept) {
  std::string warning;
  auto warn = [&](const Status& s) {
    if (!s.ok() && warning.empty()) warning = "retention: " + s.message();
  };
  if (victims.empty()) return warning;
  static std::atomic<uint64_t> seq{0};
  std::vector<std::string> pending;  // expired under a claimable name: handed out once durable
  for (const Expiry& v : victims) {
    const std::string path = JoinPath(run_dir, StepDirName(v.step));
    // Looked at first, even one this process committed (it may have been swapped for a link to
    // a copy since): a symlinked or foreign checkpoint is never expired nor recycled.
    if (env->IsOwnDir(path) != 1 || IsPinned(env, path)) continue;
    const uint64_t n = seq.fetch_add(1);
    // A directory kept for reuse is renamed to its claimable name at once: nothing claims it
    // before the caller hands the name out, after the fsync below (and TidyRunDir fsyncs before
    // it keeps one found at open). One to be removed is renamed to free-*.new, never claimable.
    const bool keep = pending.size() < room;
    const std::string name = FreeDirName(v.step, ::getpid(), n, !keep);
    const std::string gone = JoinPath(run_dir, name);
    // Renaming first makes the expiry atomic: the directory stops being a checkpoint at once.
    int e = env->Rename(path, gone);
    if (e < 0) {
      if (e != -ENOENT) warn(Status::FromErrno(-e, "rename " + path));  // ENOENT: removed meanwhile (a prune)
      continue;
    }
    if (keep) {
      // Its manifest stays until the save that claims it commits its own over it: nothing is
      // overwritten before the fsync below makes the expiry durable, so a power loss that undoes
      // the rename brings back step-K whole, a valid checkpoint. (A plain one holds nothing else;
      // DONE records and extra files go, so that none reaches the next step.)
      if (!v.plain) KeepOnlyShards(env, gone);
      pending.push_back(name);
    } else {
      // The manifest goes first: should a power loss undo the rename, the directory comes back as
      // step-K without a manifest (never committed, ignored), not as a manifest naming removed
      // shards, a corrupt checkpoint (found by test_crash_states: two_rank_...).
      env->Unlink(JoinPath(gone, kManifestName));
      warn(RemoveDirFiles(env, gone));
    }
  }
  Status s = SyncDir(env, run_dir);
  warn(s);
  // Only once the expiry is durable may a save take the directory and overwrite its shards in
  // place (before, a power loss could bring step-N back over half-overwritten shards).
  for (const std::string& name : pending) {
    if (s.ok())
      kept->push_back(name);
    else
      RemoveDirFiles(env, JoinPath(run_dir, name));
  }
  return warning;
}

int ClaimDir(Env* env, const std::string& run_dir, const std::string& free_name, const std::string& tmp_dir) {
  if (!IsClaimableFreeDir(free_name)) return -EINVAL;
  // Never replaces: a plain rename would replace an empty tmp_dir that another rank has just made,
  // under that rank's shard (a CI run once caught "open .../rank-00001.bin: No such file").
  return env->RenameNoReplace(JoinPath(run_dir, free_name), tmp_dir);
}

std::deque<std::string> TidyRunDir(Env* env, const std::string& run_dir, uint32_t world_size, uint32_t keep_free) {
  std::vector<std::string> names;
  if (env->ListDir(run_dir, &names) < 0) return {};
  std::vector<std::string> kept;  // names of the free directories kept
  for (const std::string& n : names) {
    const EntryKind kind = ParseRunDirName(n).kind;
    const std::string p = JoinPath(run_dir, n);
    if ((kind != EntryKind::kAttempt && kind != EntryKind::kAborted && kind != EntryKind::kFree &&
         kind != EntryKind::kFreePending) ||
        env->IsOwnDir(p) != 1)  // a symlink or anything else at such a name: left alone
      continue;
    if (kind != EntryKind::kFree || kept.size() >= keep_free) {
      RemoveDirFiles(env, p);
      continue;
    }
    // Only the shards this world size overwrites: nothing else may reach the step that reuses it.
    std::vector<std::string> files;
    if (env->ListDir(p, &files) == 0)
      for (const std::string& f : files) {
        bool ours = false;
        for (uint32_t r = 0; r < world_size && !ours; ++r) ours = f == ShardFileName(r);
        if (!ours) env->Unlink(JoinPath(p, f));
      }
    kept.push_back(n);
  }
  if (!kept.empty() && !SyncDir(env, run_dir).ok()) {
    for (const std::string& n : kept) RemoveDirFiles(env, JoinPath(run_dir, n));
    kept.clear();
  }
  std::sort(kept.begin(), kept.end());
  return std::deque<std::string>(kept.begin(), kept.end());
}

namespace {

// Removes path and everything below it, deepest first, never following a symbolic link: an unlink
// comes first (a file or a link goes at once; a directory answers EISDIR, or EPERM where POSIX
// says so), and only a directory is listed. Iterative: a hostile tree's depth cannot exhaust the
// stack.
Status RemoveTree(Env* env, const std::string& path) {
  std::vector<std::pair<std::string, bool>> stack{{path, false}};  // (path, its entries are on the stack)
  while (!stack.empty()) {
    const std::string p = stack.back().first;
    if (stack.back().second) {
      stack.pop_back();
      const int r = env->Rmdir(p);
      if (r < 0 && r != -ENOENT) return Status::FromErrno(-r, "remove directory " + p);
      continue;
    }
    const int r = env->Unlink(p);
    if (r == 0 || r == -ENOENT) {
      stack.pop_back();
      continue;
    }
    if (r != -EISDIR && r != -EPERM) return Status::FromErrno(-r, "remove " + p);
    std::vector<std::string> names;
    const int l = env->ListDir(p, &names);
    if (l == -ENOENT) {
      stack.pop_back();
      continue;
    }
    if (l == -ENOTDIR) return Status::FromErrno(-r, "remove " + p);  // EPERM on a file: that is the error
    if (l < 0) return Status::FromErrno(-l, "list " + p);
    stack.back().second = true;
    for (const std::string& n : names) stack.emplace_back(JoinPath(p, n), false);
  }
  return Status::Ok();
}

}  // namespace

Removal RemoveEntries(Env* env, const std::string& run_dir, const std::vector<std::string>& names) {
  Removal out;
  auto fail = [&](Status s, std::string path, bool renaming) {
    if (!out.status.ok()) return;
    out.status = std::move(s);
    out.failed = std::move(path);
    out.renaming = renaming;
  };
  static std::atomic<uint64_t> seq{0};
  std::vector<std::pair<size_t, std::string>> renamed;  // (index, where it is now)
  for (size_t i = 0; i < names.size() && out.status.ok(); ++i) {
    const std::string& name = names[i];
    const std::string from = JoinPath(run_dir, name);
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      fail(Status::Invalid("not an entry of " + run_dir + ": '" + name + "'"), from, true);
      break;
    }
    if (ParseRunDirName(name).kind == EntryKind::kDeleting) {  // an interrupted prune's: expired already
      renamed.emplace_back(i, from);
      continue;
    }
    std::string to = JoinPath(run_dir, DeletingName(name));
    int there = env->IsOwnDir(to);  // lstat: a symlink at the name counts as taken
    while (there >= 0) {
      to = JoinPath(run_dir, DeletingName(name, static_cast<uint64_t>(::getpid()), seq.fetch_add(1) + 1));
      there = env->IsOwnDir(to);
    }
    if (there != -ENOENT) {
      fail(Status::FromErrno(-there, "stat " + to), from, true);
      break;
    }
    const int r = env->Rename(from, to);  // atomic expiry: scans stop seeing it at once
    if (r == -ENOENT) continue;           // gone meanwhile
    if (r < 0) {
      fail(Status::FromErrno(-r, "rename " + from + " -> " + to), from, true);
      break;
    }
    renamed.emplace_back(i, to);
  }
  if (renamed.empty()) return out;
  Status s = SyncDir(env, run_dir);
  if (!s.ok()) {
    fail(std::move(s), run_dir, true);
    return out;
  }
  for (const auto& [i, now] : renamed) {
    s = RemoveTree(env, now);
    if (s.ok()) out.removed.push_back(i);
    else fail(std::move(s), now, false);  // the others are still removed: expired, they free space
  }
  s = SyncDir(env, run_dir);
  if (!s.ok()) fail(std::move(s), run_dir, false);
  return out;
}

}  // namespace alpsck
