// LATEST: read, published if newer, rewritten (run_dir.h, PublishedStep).
#include <algorithm>
#include <cstdlib>

#include "file_io.h"
#include "run_dir.h"

namespace alpsck {
namespace {

// Step 9 of the commit protocol: writes LATEST (a hint; recovery never trusts it blindly).
Status WriteLatest(Env* env, const std::string& run_dir, uint64_t step) {
  const std::string path = JoinPath(run_dir, kLatestName);
  return WriteFileAtomic(env, path, TempFileName(path), std::to_string(step) + "\n");
}

}  // namespace

void PublishedStep::Load(int64_t newest_committed) {
  int64_t step = -1;
  std::string latest;
  if (ReadSmallFile(env_, JoinPath(run_dir_, kLatestName), 64, &latest).ok())
    step = std::strtoll(latest.c_str(), nullptr, 10);
  if (newest_committed >= 0) step = std::max(step, newest_committed);
  Reset(step);
}

void PublishedStep::PublishIfNewer(uint64_t step, std::string* warning) {
  if (static_cast<int64_t>(step) <= this->step()) return;  // the common case of an older commit: no wait
  // Serialised so that two commits racing here cannot leave an older step in LATEST.
  std::lock_guard<std::mutex> l(mu_);
  if (static_cast<int64_t>(step) <= this->step()) return;
  Reset(static_cast<int64_t>(step));
  if (!writes_) return;
  Status p = WriteLatest(env_, run_dir_, step);
  if (!p.ok() && warning) *warning = "LATEST not updated: " + p.message();
}

void PublishedStep::Rewrite(int64_t step) {
  if (!writes_) return;
  std::lock_guard<std::mutex> l(mu_);
  if (step >= 0) WriteLatest(env_, run_dir_, static_cast<uint64_t>(step));
  else env_->Unlink(JoinPath(run_dir_, kLatestName));
}

}  // namespace alpsck
