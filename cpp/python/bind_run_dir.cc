// alpsck._core: the run directory (run_dir.h): its names, the writer lock, pins, the retention
// rule, removal.
#include "binding.h"

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "env.h"
#include "retention.h"
#include "run_dir.h"
#include "run_dir_actions.h"
#include "run_dir_latest.h"
#include "run_dir_lock.h"

namespace alpsck::binding {
namespace {

using namespace nb::literals;

// The run directory's writer lock (run_dir.h), held while the Python object lives or until release().
class PyLock {
 public:
  PyLock(const FsPath& run_dir, uint32_t rank, const std::string& owner_json) {
    Status s;
    {
      nb::gil_scoped_release nogil;
      s = RunDirLock::Acquire(run_dir, rank, owner_json, &lock_);
    }
    if (!s.ok()) RaiseStatus(s, true);
  }
  void release() { lock_.reset(); }
  bool held() const { return lock_ != nullptr; }
  std::string path() const { return lock_ ? lock_->path() : std::string(); }

 private:
  std::unique_ptr<RunDirLock> lock_;
};

}  // namespace

void BindRunDir(nb::module_& m) {
  // The run directory's names (run_dir.h owns them; Python spells none of its own).
  m.def("step_dir_name", &StepDirName, "step"_a, "step-N, as a committed checkpoint's directory is named.");
  m.def("tmp_dir_name", &TmpDirName, "step"_a, "attempt"_a = 0, "Where attempt K of a save of step N is written.");
  m.def("lock_file_name", &LockFileName, "rank"_a, "The writer lock of rank R in a run directory.");
  m.def("shard_file_name", &ShardFileName, "rank"_a, "rank-RRRRR.bin, rank R's shard in a checkpoint directory.");
  m.def("health_probe_file_name", &HealthProbeFileName, "node"_a, "pid"_a,
        "The node health gate's probe file in a run directory: .alpsck-probe-health-NODE-PID (rank 0's engine removes "
        "one a killed probe left, once it is kStaleProbeSeconds old).");
  m.def("parse_run_dir_name", [](const FsPath& name) {
        const RunDirEntry e = ParseRunDirName(name.bytes);
        return std::make_tuple(std::string(EntryKindName(e.kind)), e.step, e.attempt);
      }, "name"_a,
      "What an entry of a run directory is, from its name alone: (kind, step, attempt). kind is one of "
      "'step', 'attempt', 'aborted', 'free', 'free-pending', 'superseded', 'latest', 'lock', 'history', "
      "'deleting' or 'other' (not alpsck's); step and attempt are 0 where the kind has none.");
  m.attr("run_dir_names") = std::map<std::string, std::string>{
      {"manifest", kManifestName}, {"latest", kLatestName}, {"lock", kLockName}, {"history", kHistoryName},
      {"deleting_prefix", kDeletingPrefix}, {"superseded_prefix", kSupersededPrefix},
      {"requeue_request", kRequeueRequestName}, {"start_decision", kStartDecisionName}, {"dcp_marker", kDcpMarkerName},
      {"dcp_metadata", kDcpMetadataName}, {"rollbacks", kRollbacksName}, {"pin", kPinName},
      {"temp_suffix", kTempSuffix}};
  m.def("pin_step",
        [](const FsPath& run_dir, uint64_t step, bool pin) {
          Status s;
          {
            nb::gil_scoped_release nogil;
            ConfinedRoot confined(Env::Default(), run_dir.bytes);
            s = pin ? PinStep(Env::Default(), run_dir.bytes, step) : UnpinStep(Env::Default(), run_dir.bytes, step);
          }
          if (s.code() == Code::kNotFound) return Text(s.message());
          if (!s.ok()) RaiseStatus(s, true);
          return Text("");
        },
        "run_dir"_a, "step"_a, "pin"_a = true,
        "Pin (pin=False: unpin) committed step `step` of run_dir: a pinned checkpoint is never expired by retention "
        "(retention.h). Returns '' or, when step-N is not a committed checkpoint, why; other failures raise.");
  m.def("decide_retention",
        [](const std::vector<std::tuple<uint64_t, double, Metrics, std::string, bool>>& steps, uint32_t keep_last,
           uint64_t keep_every_steps, double keep_every_seconds, const std::string& keep_best) {
          RetentionPolicy p;
          Status s = ParseKeepBest(keep_best, &p);
          p.keep_last = keep_last;
          p.keep_every_steps = keep_every_steps;
          p.keep_every_seconds = keep_every_seconds;
          if (s.ok()) s = CheckRetention(p);
          if (!s.ok()) RaiseStatus(s, false);
          std::vector<RetainedStep> in;
          for (const auto& [step, created, metrics, flagged, pinned] : steps) {
            if (!in.empty() && step <= in.back().step) throw nb::value_error("steps must be ascending, each once");
            in.push_back({step, created, metrics, flagged, pinned});
          }
          return DecideRetention(p, in);
        },
        "steps"_a, "keep_last"_a, "keep_every_steps"_a = 0, "keep_every_seconds"_a = 0.0, "keep_best"_a = "",
        "The retention rule (retention.h), over committed checkpoints given ascending by step as (step, created, "
        "metrics, unhealthy flag, pinned): for each, the rules that keep it joined by ', ' ('': it expires). A "
        "policy whose rules cannot take effect raises ValueError naming the option.");

  m.def("remove_entries",
        [](const FsPath& run_dir, const std::vector<FsPath>& names) {
          std::vector<std::string> n;
          for (const FsPath& x : names) n.push_back(x.bytes);
          Removal r;
          {
            nb::gil_scoped_release nogil;
            ConfinedRoot confined(Env::Default(), run_dir.bytes);
            r = RemoveEntries(Env::Default(), run_dir.bytes, n);
          }
          nb::object failure = nb::none();
          if (!r.status.ok())
            failure = nb::make_tuple(Text(r.failed), r.renaming, r.status.err(), Text(r.status.message()));
          return nb::make_tuple(r.removed, failure);
        },
        "run_dir"_a, "names"_a,
        "Remove these entries of run_dir as prune does (the core's RemoveEntries, run_dir.h): each renamed to "
        ".deleting-*, RUN_DIR fsync'ed, then removed without following a symlink. Returns (indices of the names "
        "removed, None or (failed path, whether renaming failed, errno, message)).");

  nb::class_<PyLock>(m, "RunDirLock",
                     "The run directory's one writer lock (cpp/core/run_dir.h): taken at construction "
                     "(RunDirLockedError naming the holder when a live process has it; UsageError when the "
                     "lock's name is a symlink or not a regular file), released by release() or when collected.")
      .def(nb::init<const FsPath&, uint32_t, const std::string&>(), "run_dir"_a, "rank"_a, "owner_json"_a)
      .def("release", &PyLock::release, "Empty the owner record and drop the lock (idempotent).")
      .def_prop_ro("held", &PyLock::held)
      .def_prop_ro("path", &PyLock::path);
  m.def("probe_lock", [](const FsPath& run_dir, uint32_t rank) {
        bool held = false;
        std::string owner;
        Status s;
        {
          nb::gil_scoped_release nogil;
          s = RunDirLock::Probe(run_dir, rank, &held, &owner);
        }
        if (!s.ok()) RaiseStatus(s, false);
        return std::make_pair(held, Text(owner));
      }, "run_dir"_a, "rank"_a = 0,
      "(held, owner): whether a live process holds rank's writer lock, and the owner it recorded ('' if "
      "none). Never blocks, never follows a symlink; a lock name that is not a regular file raises UsageError.");

  m.def("parse_lock_owner", [](const std::string& owner) {
        const LockOwner o = ParseLockOwner(owner);
        nb::dict d;
        d["pid"] = o.pid;
        d["host"] = o.host;
        d["job_id"] = o.job_id;
        return d;
      }, "owner"_a,
      "The fields of a lock's owner record (probe_lock's owner), each '' when missing: {pid, host, job_id}. "
      "The core's one parser of the record; anything but a JSON object reads as no owner.");
}

}  // namespace alpsck::binding
