// The run directory's names (run_dir.h): made and parsed, no file-system access.
#include "run_dir.h"

#include <cinttypes>
#include <cstdio>

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
  return kProbePrefix + std::to_string(rank) + "-" + std::to_string(pid);
}

std::string HealthProbeFileName(const std::string& node, uint64_t pid) {
  return kProbePrefix + std::string("health-") + node + "-" + std::to_string(pid);
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
  } else if (StartsWith(name, kProbePrefix) && name.size() > std::string_view(kProbePrefix).size()) {
    e.kind = EntryKind::kProbe;
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
    case EntryKind::kProbe: return "probe";
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

}  // namespace alpsck
