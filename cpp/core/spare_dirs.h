// SpareDirs: the recycling of expired checkpoints' directories, without listing RUN_DIR. A save
// that claims the directory of an expired checkpoint (a free-* name: run_dir.h) overwrites its
// shards in place, and so allocates no blocks. Rank 0 keeps the claimable free directories it
// knows (TidyRunDir's at open, then those its retention expires: run_dir_actions.h) and names one
// in each commit's verdict (Designate); every rank tries to claim the one named for its next save
// (Claim). At most max_free free directories are kept (the engine's max_in_flight).
//
// Threading: thread-safe; mu_ guards the state. Expire runs the renames and the fsync of an
// expiry outside mu_ (the caller serialises expiries: Engine's retention_mu_).
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "env.h"
#include "retention.h"

namespace alpsck {

class SpareDirs {
 public:
  // enabled: retention runs (keep_last > 0): otherwise nothing is kept, named or claimed.
  SpareDirs(Env* env, std::string run_dir, uint32_t rank, bool enabled, uint32_t max_free)
      : env_(env), run_dir_(std::move(run_dir)), rank_(rank), enabled_(enabled), max_free_(max_free) {}
  SpareDirs(const SpareDirs&) = delete;
  SpareDirs& operator=(const SpareDirs&) = delete;

  // Rank 0 at open, before any save on any rank: TidyRunDir (run_dir_actions.h), keeping up to
  // max_free claimable directories found there (none when disabled). `names`: RUN_DIR's entries, listed by
  // the caller (TidyRunDir).
  void Tidy(uint32_t world_size, const std::vector<std::string>* names = nullptr);

  // Any rank, preparing the attempt's directory tmp_dir: claims the free directory named for this
  // save (ClaimDir). kClaimed: this call renamed it to tmp_dir (ours, its shards in place).
  // kTakenByOther: it was gone, most likely claimed for this save by another rank (tmp_dir should
  // exist, recycled). kNone: nothing named, or the claim failed (the caller creates tmp_dir);
  // a spare still free is kept for a later save, and a file system that cannot rename without
  // replacing ends the claims.
  enum class Claim { kNone, kClaimed, kTakenByOther };
  Claim ClaimFor(const std::string& tmp_dir);

  // Rank 0, before it commits: the free directory to name in the verdict for the ranks' next save
  // ("" if none), taken from those kept.
  std::string Designate();
  // After a commit: the name its verdict carried (rank 0: its designation; other ranks: what the
  // verdict named). Not committed (rank 0's designation never announced): kept for later.
  void Committed(const std::string& name, bool committed);

  // Rank 0, after a commit: expires the victims retention decided (ExpireSteps), keeping as many
  // for reuse as there is room for (max_free, counting those kept and the one named). Returns a
  // warning ("" if none): retention never fails a save.
  std::string Expire(const std::vector<Expiry>& victims);

 private:
  Env* const env_;
  const std::string run_dir_;
  const uint32_t rank_;
  const bool enabled_;
  const uint32_t max_free_;
  std::mutex mu_;                     // guards the fields below
  std::deque<std::string> claimable_;  // rank 0: free directories not handed out, oldest first
  std::string named_;                 // the one named for the next save ("" if none)
  bool claims_work_ = true;           // false once a claim met a file system without RENAME_NOREPLACE
};

}  // namespace alpsck
