// What happens to the entries of a run directory (run_dir_actions.h): tidying, expiry, claims,
// pins and removal, each through the Env given.
#include "run_dir_actions.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <ctime>
#include <utility>
#include <vector>

#include "file_io.h"
#include "json.h"
#include "run_dir.h"

namespace alpsck {

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

namespace {

// A probe file that a process killed while probing left: a regular file of this user, unchanged for
// kStaleProbeSeconds (run_dir.h). A link at such a name, or another user's file, is left alone.
bool StaleProbe(Env* env, const std::string& path) {
  FileStat st;
  return env->LStat(path, &st) == 0 && S_ISREG(st.mode) && st.uid == static_cast<uint64_t>(::geteuid()) &&
         static_cast<int64_t>(::time(nullptr)) - st.mtime_s >= kStaleProbeSeconds;
}

}  // namespace

std::deque<std::string> TidyRunDir(Env* env, const std::string& run_dir, uint32_t world_size, uint32_t keep_free,
                                   const std::vector<std::string>* listed) {
  std::vector<std::string> names;
  if (listed == nullptr && env->ListDir(run_dir, &names) < 0) return {};
  std::vector<std::string> kept;  // names of the free directories kept
  for (const std::string& n : listed ? *listed : names) {
    const EntryKind kind = ParseRunDirName(n).kind;
    const std::string p = JoinPath(run_dir, n);
    if (kind == EntryKind::kProbe) {
      if (StaleProbe(env, p)) env->Unlink(p);
      continue;
    }
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

namespace {

Status CommittedDir(Env* env, const std::string& run_dir, uint64_t step, std::string* dir) {
  *dir = JoinPath(run_dir, StepDirName(step));
  const int own = env->IsOwnDir(*dir);
  if (own < 0 && own != -ENOENT) return Status::FromErrno(-own, "inspect " + *dir);
  if (own != 1 || env->IsDir(JoinPath(*dir, kManifestName)) != 0)
    return Status::Error(Code::kNotFound, "step " + std::to_string(step) + " is not a committed checkpoint of " +
                                              run_dir + " (no " + StepDirName(step) + "/" + kManifestName + ")");
  return Status::Ok();
}

}  // namespace

Status WritePin(Env* env, const std::string& dir) {
  return WriteFileSynced(env, JoinPath(dir, kPinName), "pinned: never expired by retention (alpsck unpin)\n");
}

Status PinStep(Env* env, const std::string& run_dir, uint64_t step) {
  std::string dir;
  ALPSCK_RETURN_IF_ERROR(CommittedDir(env, run_dir, step, &dir));
  ALPSCK_RETURN_IF_ERROR(WritePin(env, dir));
  ALPSCK_RETURN_IF_ERROR(SyncDir(env, dir));
  // Expired meanwhile (a retention that decided before the pin): say so rather than report a pin.
  if (!IsPinned(env, dir))
    return Status::Error(Code::kNotFound, "step " + std::to_string(step) + " of " + run_dir +
                                              " was expired while it was being pinned");
  return Status::Ok();
}

Status UnpinStep(Env* env, const std::string& run_dir, uint64_t step) {
  std::string dir;
  ALPSCK_RETURN_IF_ERROR(CommittedDir(env, run_dir, step, &dir));
  const int r = env->Unlink(JoinPath(dir, kPinName));
  if (r < 0 && r != -ENOENT) return Status::FromErrno(-r, "unpin " + dir);
  return SyncDir(env, dir);
}

bool IsPinned(Env* env, const std::string& dir) { return env->IsDir(JoinPath(dir, kPinName)) == 0; }

bool ReadRetainedStep(Env* env, const std::string& dir, uint64_t step, RetainedStep* out) {
  *out = RetainedStep{};
  out->step = step;
  out->pinned = IsPinned(env, dir);
  std::string text;
  Json m;
  if (!ReadSmallFile(env, JoinPath(dir, kManifestName), kMaxManifestBytes, &text).ok() || !ParseJson(text, &m).ok())
    return false;
  if (const Json* c = m.find("created")) c->get_double(&out->created);
  if (const Json* j = m.find("metrics")) ParseMetrics(*j, &out->metrics);
  if (const Json* u = m.find("unhealthy"))
    if (const std::string* s = u->get_string()) out->flagged = *s;
  return true;
}

}  // namespace alpsck
