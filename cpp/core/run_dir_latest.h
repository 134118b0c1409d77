// LATEST: the run directory's hint of its newest committed step (its name: run_dir.h, kLatestName).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "env.h"
#include "status.h"

namespace alpsck {

// PublishedStep: the newest step published as RUN_DIR/LATEST, step 9 of the commit protocol
// (commit.h): LATEST := N only if N is newer than what was published ("newest wins": a checkpoint
// that finishes after a newer one never becomes latest). LATEST is a hint; recovery scans. The
// writer opens LATEST once and rewrites it in place (a pwrite and a truncate, not synced: no
// metadata call and no flush per save; steps only grow, so a crash leaves the old text or the new); a
// rewrite to an older step (Rewrite) writes a new file and renames it in. A LATEST replaced
// behind the writer's back (by hand) is not written again until the writer reopens it.
//
// Threading: thread-safe. mu_ serialises the writes of LATEST, so that two commits racing to
// publish cannot leave an older step in it; step_ is atomic, read without waiting for a write.
class PublishedStep {
 public:
  // writes: whether this process writes LATEST (rank 0); the other ranks only track the step.
  PublishedStep(Env* env, std::string run_dir, bool writes)
      : env_(env), run_dir_(std::move(run_dir)), writes_(writes) {}
  PublishedStep(const PublishedStep&) = delete;
  PublishedStep& operator=(const PublishedStep&) = delete;
  ~PublishedStep();

  // The step LATEST names (-1: none, or unreadable), raised to newest_committed when that is
  // >= 0 (a commit LATEST missed).
  void Load(int64_t newest_committed);
  // The newest step published; -1 if none.
  int64_t step() const { return step_.load(std::memory_order_acquire); }
  // Publishes `step` if it is newer than the newest published. A failed write of LATEST is only
  // a warning (into *warning, if given): it never fails the commit.
  void PublishIfNewer(uint64_t step, std::string* warning);
  // Retiring an abandoned history (History::Retire): LATEST rewritten to name `step` (-1:
  // removed; by the writer only), serialised with the commits' writes.
  void Rewrite(int64_t step);
  // The newest step published, as the caller knows it (after a retirement); nothing written.
  void Reset(int64_t step) { step_.store(step, std::memory_order_release); }

 private:
  Status WriteInPlace(uint64_t step);  // under mu_
  void CloseHeld();                    // under mu_ (or in the destructor)

  Env* const env_;
  const std::string run_dir_;
  const bool writes_;
  std::mutex mu_;  // serialises the writes of LATEST, and guards fd_
  int fd_ = -1;    // LATEST, held open by the writer from its first publish
  std::atomic<int64_t> step_{-1};
};

}  // namespace alpsck
