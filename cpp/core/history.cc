// Histories: ContinueFrom and Supersede (engine.h says what a history is and why an abandoned
// one is retired).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "engine_job.h"
#include "file_io.h"
#include "run_dir.h"

namespace alpsck {

void Engine::ContinueFrom(int64_t step) {
  std::lock_guard<std::mutex> l(mu_);
  base_ = step < 0 ? -1 : step;
  for (uint64_t c : committed_)  // this process's own commits after S too (a rollback)
    if (static_cast<int64_t>(c) > base_) foreign_.insert(c);
  if (step >= 0) foreign_.erase(static_cast<uint64_t>(step));
}

std::vector<std::pair<uint64_t, std::string>> Engine::TakeRetired() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::pair<uint64_t, std::string>> out;
  out.swap(retired_log_);
  return out;
}

Status Engine::Supersede(uint64_t step, std::vector<std::pair<uint64_t, std::string>>* retired) {
  retired->clear();
  if (Forked()) return ForkedError();  // renames belong to the parent's history (engine.h)
  {
    // Every one_history save comes here: the common case (nothing of another history left) must
    // not wait behind a retention in progress (its renames and fsync) for retention_mu_.
    std::lock_guard<std::mutex> l(mu_);
    if (foreign_.empty()) return closed_ ? Status::Error(Code::kAborted, "engine is closed") : Status::Ok();
  }
  std::lock_guard<std::mutex> rl(retention_mu_);  // retention renames step directories too
  std::vector<uint64_t> victims;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return Status::Error(Code::kAborted, "engine is closed");
    for (auto it = foreign_.rbegin(); it != foreign_.rend(); ++it)
      if (*it >= step || (base_ != kNoBase && static_cast<int64_t>(*it) > base_)) victims.push_back(*it);
    for (uint64_t v : victims)
      if (v != step && in_flight_steps_.count(v))  // (step itself: Save calls this for it)
        return Status::Invalid("step " + std::to_string(v) + " of an earlier history is being saved; call Supersede "
                               "before saving it");
  }
  if (victims.empty()) return Status::Ok();
  if (opts_.rank == 0) {
    // LATEST (a hint) first: it must never name a step newer than every valid checkpoint, and a
    // power loss keeps the run directory's changes in order, so this one lands before the renames.
    int64_t remaining = -1;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (uint64_t c : committed_)
        if (std::find(victims.begin(), victims.end(), c) == victims.end()) remaining = static_cast<int64_t>(c);
    }
    published_.Rewrite(remaining);
  }
  Status failure;
  std::vector<uint64_t> gone;
  for (uint64_t v : victims) {
    std::string dest;
    if (opts_.rank == 0) {
      const std::string path = JoinPath(opts_.run_dir, StepDirName(v));
      int r;
      for (int tries = 0;; ++tries) {  // an earlier job (same pid, say) may have left the name taken
        {
          std::lock_guard<std::mutex> l(mu_);
          dest = JoinPath(opts_.run_dir, SupersededDirName(v, ::getpid(), name_seq_++));
        }
        r = env_->Rename(path, dest);
        if ((r != -EEXIST && r != -ENOTEMPTY) || tries == 1000) break;
      }
      if (r == -ENOENT) {
        dest.clear();  // removed meanwhile (a prune): nothing left to retire
      } else if (r < 0) {
        failure = Status::FromErrno(-r, "retire " + path + " (a checkpoint of an abandoned history) to " + dest);
        break;
      }
    }
    gone.push_back(v);
    if (!dest.empty() || opts_.rank != 0) retired->emplace_back(v, dest);
  }
  // Durable before any later commit can be: a power loss must never leave the new history's
  // checkpoint beside an abandoned newer one (restore would pick the abandoned one).
  if (opts_.rank == 0 && !gone.empty()) {
    Status s = SyncDir(env_, opts_.run_dir);
    if (!s.ok() && failure.ok()) failure = s;
  }
  std::lock_guard<std::mutex> l(mu_);
  for (uint64_t v : gone) {
    foreign_.erase(v);
    committed_.erase(v);
  }
  retired_log_.insert(retired_log_.end(), retired->begin(), retired->end());
  published_.Reset(committed_.empty() ? -1 : static_cast<int64_t>(*committed_.rbegin()));
  return failure;  // on failure the renames done stay done, and the save must not proceed
}

}  // namespace alpsck
