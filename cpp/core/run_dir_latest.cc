// LATEST: read, published if newer, rewritten (run_dir_latest.h, PublishedStep).
#include <fcntl.h>

#include <algorithm>
#include <cstdlib>

#include "file_io.h"
#include "run_dir.h"
#include "run_dir_latest.h"

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

PublishedStep::~PublishedStep() { CloseHeld(); }

void PublishedStep::CloseHeld() {
  if (fd_ >= 0) env_->Close(fd_);
  fd_ = -1;
}

Status PublishedStep::WriteInPlace(uint64_t step) {
  const std::string path = JoinPath(run_dir_, kLatestName);
  if (fd_ < 0) {  // OpenMaybeDirect's checks: never through a link, never another's or a shared file
    bool direct = false;
    ALPSCK_RETURN_IF_ERROR(OpenMaybeDirect(env_, path, O_WRONLY | O_CREAT, false, &fd_, &direct));
  }
  // Steps only grow here, so the new text is at least as long as the old: a crash leaves the
  // old text or the new one, never a mix of the two (a few bytes at offset 0, one sector).
  // Neither the text nor a new LATEST's name is synced: step N is committed and durable before it
  // is published (steps 7-8), so whatever a power loss leaves of this write (the old text, the
  // new, a longer size over the old text, no LATEST at all) names no step newer than a valid
  // checkpoint, and recovery scans (PublishedStep::Load takes the newest committed step too).
  // An fdatasync here cost every save a flush (and on Lustre a round trip) for a hint.
  const std::string text = std::to_string(step) + "\n";
  Status s = WriteFull(env_, fd_, text.data(), text.size(), 0, path);
  int r = s.ok() ? env_->FTruncate(fd_, text.size()) : 0;
  if (s.ok() && r < 0) s = Status::FromErrno(-r, "truncate " + path);
  if (!s.ok()) CloseHeld();  // the next publish opens it again
  return s;
}

void PublishedStep::PublishIfNewer(uint64_t step, std::string* warning) {
  if (static_cast<int64_t>(step) <= this->step()) return;  // the common case of an older commit: no wait
  // Serialised so that two commits racing here cannot leave an older step in LATEST.
  std::lock_guard<std::mutex> l(mu_);
  if (static_cast<int64_t>(step) <= this->step()) return;
  Reset(static_cast<int64_t>(step));
  if (!writes_) return;
  Status p = WriteInPlace(step);
  if (!p.ok() && warning) *warning = "LATEST not updated: " + p.message();
}

void PublishedStep::Rewrite(int64_t step) {
  if (!writes_) return;
  std::lock_guard<std::mutex> l(mu_);
  CloseHeld();  // an older step: written whole and renamed in; the next publish opens the new file
  if (step >= 0) WriteLatest(env_, run_dir_, static_cast<uint64_t>(step));
  else env_->Unlink(JoinPath(run_dir_, kLatestName));
}

}  // namespace alpsck
