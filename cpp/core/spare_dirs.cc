// SpareDirs (spare_dirs.h): the expired checkpoints' directories, kept, named and claimed.
#include "spare_dirs.h"

#include <cerrno>
#include <utility>

#include "run_dir_actions.h"

namespace alpsck {

void SpareDirs::Tidy(uint32_t world_size, const std::vector<std::string>* names) {
  std::deque<std::string> kept = TidyRunDir(env_, run_dir_, world_size, enabled_ ? max_free_ : 0, names);
  std::lock_guard<std::mutex> l(mu_);
  claimable_ = std::move(kept);
}

SpareDirs::Claim SpareDirs::ClaimFor(const std::string& tmp_dir) {
  std::string name;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!enabled_) return Claim::kNone;
    name.swap(named_);
  }
  if (name.empty()) return Claim::kNone;
  const int r = ClaimDir(env_, run_dir_, name, tmp_dir);
  if (r == 0) return Claim::kClaimed;
  if (r == -ENOENT) return Claim::kTakenByOther;
  std::lock_guard<std::mutex> l(mu_);
  if (r == -EINVAL || r == -ENOSYS) claims_work_ = false;
  if (rank_ == 0 && r == -EEXIST) claimable_.push_front(name);  // still free: for a later save
  return Claim::kNone;
}

std::string SpareDirs::Designate() {
  std::lock_guard<std::mutex> l(mu_);
  if (rank_ != 0 || !enabled_ || !claims_work_ || claimable_.empty()) return "";
  std::string s = claimable_.front();
  claimable_.pop_front();
  return s;
}

void SpareDirs::Committed(const std::string& name, bool committed) {
  if (name.empty()) return;
  std::lock_guard<std::mutex> l(mu_);
  if (!committed) {  // rank 0's designation, never announced
    if (rank_ == 0) claimable_.push_front(name);
    return;
  }
  // A spare named earlier and not yet tried is replaced: rank 0 keeps it for later.
  if (rank_ == 0 && !named_.empty()) claimable_.push_front(named_);
  named_ = name;
}

std::string SpareDirs::Expire(const std::vector<Expiry>& victims) {
  if (!enabled_ || victims.empty()) return "";
  // At most max_free free directories: those not handed out, and the one named for the next
  // save, count.
  uint32_t room = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    const size_t free_now = claimable_.size() + (named_.empty() ? 0 : 1);
    room = max_free_ > free_now ? max_free_ - static_cast<uint32_t>(free_now) : 0;
  }
  std::vector<std::string> kept;
  const std::string warning = ExpireSteps(env_, run_dir_, victims, room, &kept);
  std::lock_guard<std::mutex> l(mu_);
  claimable_.insert(claimable_.end(), kept.begin(), kept.end());
  return warning;
}

}  // namespace alpsck
