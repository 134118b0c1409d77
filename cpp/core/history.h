// History: which step directories of RUN_DIR belong to this run's history, and the retirement of
// those that do not (Engine::ContinueFrom, Supersede, TakeRetired run it).
//
// A run directory holds one history: a resumed run continues from the step it restored, and the
// checkpoint directories found at Open that are newer than that step (the newest was corrupt and
// restore fell back, or an older step was restored on purpose) belong to an abandoned future.
// Left in place they would shadow the new history's checkpoints in restore (newest wins), take
// their places in retention, and make a save of the same step a silent no-op. So:
//  - ContinueFrom(S): the run continues from step S (-1: from nothing, every checkpoint found
//    is abandoned). S itself stays a checkpoint of this history; every other step directory
//    newer than S, found at Open or committed since (a rollback in the same process), is not
//    of it. Call it (on every rank) after restoring, before the next save.
//  - Supersede(step), before saving `step`: retires the step directories not of this history
//    that are newer than S (when ContinueFrom was called) or at or after `step` (a save never
//    lands beside or below a newer checkpoint of another history). Rank 0 renames each to
//    superseded-step-N-<pid>-<seq> (a free name) and fsyncs RUN_DIR before returning, so no
//    later commit is durable while an abandoned newer checkpoint still is; the other ranks only
//    forget them (a waiting rank reads its commit from its attempt's directory, never from a
//    step-N's manifest: coordinate.h). *retired gets (step, new path; empty on ranks > 0), newest
//    first; TakeRetired() hands out every retirement so far once. An error (a rename refused)
//    leaves the step unsaveable.
//  - With EngineOptions::one_history, Save(step) runs Supersede itself, after its step
//    directory is prepared: a failure then fails the save like any other (with several ranks,
//    the step is aborted on every rank, and every rank counts the attempt), and a step not of
//    this history is saved anew instead of skipped as committed.
//
// Threading: thread-safe. mu_ guards every field and is never held during I/O: Retire renames and
// fsyncs without it, and its caller serialises it with retention, which renames step directories
// too (Engine::retention_mu_). The engine asks it while holding Engine::mu_ (so that admission
// and the history change together); it never calls back.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "env.h"
#include "retention.h"
#include "run_dir.h"
#include "run_dir_latest.h"
#include "status.h"

namespace alpsck {

class History {
 public:
  History(Env* env, std::string run_dir, uint32_t rank, RetentionPolicy policy)
      : env_(env), run_dir_(std::move(run_dir)), rank_(rank), policy_(std::move(policy)) {}
  History(const History&) = delete;
  History& operator=(const History&) = delete;

  // Open: what RUN_DIR already holds. Committed steps: a manifest exists (recovery does the deep
  // checks); their manifests are read (creation time, metrics) only when the retention policy
  // needs them (RetentionPolicy::NeedsManifest), else they count as healthy (a restore retires
  // the newer unhealthy ones: ContinueFrom). Every step directory found counts as not of this
  // history (what Supersede may retire) until ContinueFrom says which stays. `names`: RUN_DIR's entries,
  // where the caller listed them already; else listed here.
  Status Load(const std::vector<std::string>* names = nullptr);
  // The newest committed step; -1 if none.
  int64_t newest() const;
  // Whether a save of `step` is skipped as committed. With one_history, a step of another history
  // is saved anew (Supersede retires the old one first).
  bool Skips(uint64_t step, bool one_history) const;
  // This process committed `step` (its creation time, metrics and pin: RetainedStep); the steps
  // no rule of the retention policy keeps now (retention.h: DecideRetention, over the steps this
  // process knows: those found at Load and committed since) are forgotten and returned, for rank
  // 0 to expire on disk (ExpireSteps). Every rank decides alike from the same inputs (the metrics
  // are passed alike to every rank's save; only keep_every_seconds reads each rank's own clock),
  // and only rank 0 touches the disk. plain: this process committed it with nothing but shards
  // and a manifest.
  std::vector<Expiry> Committed(const RetainedStep& step, bool plain = false);

  void ContinueFrom(int64_t step);
  // Whether any step directory is not of this history (else Supersede has nothing to do).
  bool HasForeign() const;
  // What Supersede(step) retires (see above), newest first.
  std::vector<uint64_t> Victims(uint64_t step) const;
  // Retires the victims: rank 0 rewrites LATEST to the newest step it keeps, renames each, fsyncs
  // RUN_DIR; every rank forgets them, and *published becomes the newest step kept. On failure the
  // renames done stay done (and the save must not proceed).
  Status Retire(const std::vector<uint64_t>& victims, PublishedStep* published,
                std::vector<std::pair<uint64_t, std::string>>* retired);
  std::vector<std::pair<uint64_t, std::string>> TakeRetired();

 private:
  static constexpr int64_t kNoBase = INT64_MIN;

  Env* const env_;
  const std::string run_dir_;
  const uint32_t rank_;
  const RetentionPolicy policy_;
  mutable std::mutex mu_;                 // guards the fields below
  std::map<uint64_t, RetainedStep> committed_;  // steps whose directory holds a manifest, with what retention looks at
  std::set<uint64_t> plain_;              // those of committed_ this process committed plainly
  std::set<uint64_t> foreign_;            // step-N directories not of this history (see ContinueFrom)
  std::vector<std::pair<uint64_t, std::string>> retired_log_;  // for TakeRetired
  int64_t base_ = kNoBase;                // ContinueFrom's step
  uint64_t name_seq_ = 0;                 // for SupersededDirName
};

}  // namespace alpsck
