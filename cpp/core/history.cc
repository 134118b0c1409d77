// Histories: ContinueFrom and Supersede (history.h says what a history is and why an abandoned
// one is retired).
#include "history.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "file_io.h"
#include "run_dir.h"
#include "run_dir_actions.h"

namespace alpsck {

Status History::Load(const std::vector<std::string>* listed) {
  std::vector<std::string> names;
  if (listed == nullptr) {
    int r = env_->ListDir(run_dir_, &names);
    if (r < 0) return Status::FromErrno(-r, "list run directory " + run_dir_);
  }
  std::map<uint64_t, RetainedStep> committed;
  std::set<uint64_t> found;
  for (const std::string& n : listed ? *listed : names) {
    uint64_t step = 0;
    if (!ParseStepDirName(n, &step)) continue;
    const std::string p = JoinPath(run_dir_, n);
    if (env_->IsDir(JoinPath(p, kManifestName)) == 0) {
      RetainedStep& rs = committed[step];
      rs.step = step;
      if (policy_.keep_last && policy_.NeedsManifest()) ReadRetainedStep(env_, p, step, &rs);
    }
    if (env_->IsDir(p) == 1) found.insert(step);
  }
  std::lock_guard<std::mutex> l(mu_);
  committed_.swap(committed);
  foreign_.swap(found);
  return Status::Ok();
}

int64_t History::newest() const {
  std::lock_guard<std::mutex> l(mu_);
  return committed_.empty() ? -1 : static_cast<int64_t>(committed_.rbegin()->first);
}

bool History::Skips(uint64_t step, bool one_history) const {
  std::lock_guard<std::mutex> l(mu_);
  return committed_.count(step) && !(one_history && foreign_.count(step));
}

std::vector<Expiry> History::Committed(const RetainedStep& step, bool plain) {
  std::lock_guard<std::mutex> l(mu_);
  committed_[step.step] = step;
  if (plain)
    plain_.insert(step.step);
  else
    plain_.erase(step.step);
  std::vector<Expiry> victims;
  if (!policy_.keep_last || committed_.size() <= policy_.keep_last) return victims;
  std::vector<RetainedStep> all;  // ascending
  all.reserve(committed_.size());
  for (const auto& c : committed_) all.push_back(c.second);
  const std::vector<std::string> rules = DecideRetention(policy_, all);
  for (size_t i = 0; i < all.size(); ++i) {
    if (!rules[i].empty()) continue;
    const uint64_t v = all[i].step;
    victims.push_back({v, plain_.count(v) > 0});
    plain_.erase(v);
    committed_.erase(v);
  }
  return victims;
}

void History::ContinueFrom(int64_t step) {
  std::lock_guard<std::mutex> l(mu_);
  base_ = step < 0 ? -1 : step;
  for (const auto& c : committed_)  // this process's own commits after S too (a rollback)
    if (static_cast<int64_t>(c.first) > base_) foreign_.insert(c.first);
  if (step >= 0) foreign_.erase(static_cast<uint64_t>(step));
}

bool History::HasForeign() const {
  std::lock_guard<std::mutex> l(mu_);
  return !foreign_.empty();
}

std::vector<uint64_t> History::Victims(uint64_t step) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<uint64_t> victims;
  for (auto it = foreign_.rbegin(); it != foreign_.rend(); ++it)
    if (*it >= step || (base_ != kNoBase && static_cast<int64_t>(*it) > base_)) victims.push_back(*it);
  return victims;
}

std::vector<std::pair<uint64_t, std::string>> History::TakeRetired() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::pair<uint64_t, std::string>> out;
  out.swap(retired_log_);
  return out;
}

Status History::Retire(const std::vector<uint64_t>& victims, PublishedStep* published,
                       std::vector<std::pair<uint64_t, std::string>>* retired) {
  if (rank_ == 0) {
    // LATEST (a hint) first: it must never name a step newer than every valid checkpoint, and a
    // power loss keeps the run directory's changes in order, so this one lands before the renames.
    int64_t remaining = -1;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (const auto& c : committed_)
        if (std::find(victims.begin(), victims.end(), c.first) == victims.end()) remaining = static_cast<int64_t>(c.first);
    }
    published->Rewrite(remaining);
  }
  Status failure;
  std::vector<uint64_t> gone;
  for (uint64_t v : victims) {
    std::string dest;
    if (rank_ == 0) {
      const std::string path = JoinPath(run_dir_, StepDirName(v));
      int r;
      for (int tries = 0;; ++tries) {  // an earlier job (same pid, say) may have left the name taken
        {
          std::lock_guard<std::mutex> l(mu_);
          dest = JoinPath(run_dir_, SupersededDirName(v, ::getpid(), name_seq_++));
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
    if (!dest.empty() || rank_ != 0) retired->emplace_back(v, dest);
  }
  // Durable before any later commit can be: a power loss must never leave the new history's
  // checkpoint beside an abandoned newer one (restore would pick the abandoned one).
  if (rank_ == 0 && !gone.empty()) {
    Status s = SyncDir(env_, run_dir_);
    if (!s.ok() && failure.ok()) failure = s;
  }
  std::lock_guard<std::mutex> l(mu_);
  for (uint64_t v : gone) {
    foreign_.erase(v);
    committed_.erase(v);
    plain_.erase(v);
  }
  retired_log_.insert(retired_log_.end(), retired->begin(), retired->end());
  published->Reset(committed_.empty() ? -1 : static_cast<int64_t>(committed_.rbegin()->first));
  return failure;  // on failure the renames done stay done, and the save must not proceed
}

}  // namespace alpsck
