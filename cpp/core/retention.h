// Retention: which committed checkpoints of a run directory stay. A pure decision (no I/O: what
// follows it, the expiry and the pins, is run_dir_actions.h's). The one rule, asked by the
// engine after each commit (History::Committed, from what the process knows: no listing), by the
// DCP writer's retention (RetainNewest, from a listing) and by `alpsck prune` (from its scan,
// through the binding), and checked by the property test (tests/unit/test_retention.py).
//
// A committed checkpoint is kept when any rule keeps it (the rules are ORed, as Orbax composes its
// policies); DecideRetention names every rule that keeps each one:
//   - "pinned": `alpsck pin`, or save(..., pin=True) (a PINNED file in the step directory);
//   - "newest healthy": the newest checkpoint whose metrics are all finite — the one a restore
//     would use (recovery.h, rule 5b), so no rule can leave a run with nothing to resume from;
//   - "keep_last K": the newest K by step, healthy or not (a newer unhealthy one stays for inspection);
//   - "keep_every_steps N": the milestones, step % N == 0;
//   - "keep_every_seconds T": the oldest, then each created at least T seconds after the last one
//     this rule kept (the same decisions whether made at each save or again over the survivors);
//   - "keep_best METRIC MODE K": the K best by that metric (lowest for min, highest for max; a
//     tie goes to the newer step). A checkpoint without the metric, or with a NaN or an infinite
//     value of it, is never among the best: it ranks worst in either mode (an infinity is not a
//     "best" loss, and NaN has no order).
// keep_last 0 keeps every checkpoint ("keep all"): the other rules then have nothing to add, so a
// policy that sets them with keep_last 0 is refused (CheckRetention) rather than silently moot.
//
// Saves in flight are never subject to it (they are not committed: attempts are not checkpoints),
// and a pinned step is checked again on disk right before it would be expired (ExpireSteps), so a
// pin made by another process since the decision still holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "commit.h"
#include "status.h"

namespace alpsck {

struct RetentionPolicy {
  uint32_t keep_last = 0;          // newest K by step; 0: keep every checkpoint
  uint64_t keep_every_steps = 0;   // 0: off
  double keep_every_seconds = 0;   // 0: off
  std::string best_metric;         // keep_best: empty: off
  bool best_max = false;           // the highest value is best (else the lowest)
  uint32_t keep_best = 0;          // K best; 0: off
  // Whether the rules need each checkpoint's creation time or metrics (the manifest's).
  bool NeedsManifest() const { return keep_every_seconds > 0 || keep_best > 0; }
};

// keep_best's text form, "METRIC:min:K" or "METRIC:max:K" (split at the last two colons; "" is
// off), into p's best_* fields; kInvalidArgument naming what is wrong.
Status ParseKeepBest(const std::string& text, RetentionPolicy* p);
// kInvalidArgument when the policy's rules cannot all take effect (see above), naming the option.
Status CheckRetention(const RetentionPolicy& p);

// What the rules look at, of one committed checkpoint.
struct RetainedStep {
  uint64_t step = 0;
  double created = 0;  // unix seconds (its manifest's "created")
  Metrics metrics;     // its manifest's "metrics"
  std::string flagged; // why its save recorded it unhealthy besides its metrics (a loss spike), else ""
  bool pinned = false;
};

// The health rule of a checkpoint (recovery.h, rule 5b; commit.h: NonFiniteMetrics): "" when
// healthy, else why not.
std::string Unhealthy(const Metrics& metrics, const std::string& flagged);

// For steps (ascending by step, each once), the rules that keep each one, joined by ", " ("" :
// none keeps it, it expires).
std::vector<std::string> DecideRetention(const RetentionPolicy& p, const std::vector<RetainedStep>& steps);

// One committed step to expire (what the rule decided; run_dir_actions.h: ExpireSteps does it). plain: the caller committed it itself with nothing but its shards
// and manifest (no DONE record, no extra file), so its directory is not listed to strip the rest.
struct Expiry {
  uint64_t step = 0;
  bool plain = false;
};

}  // namespace alpsck
