// alpsck._core.Engine: the engine (engine.h) with its save handles and external fills. Zero-copy
// saves keep the caller's arrays alive in the Engine wrapper until the save is observed complete.
#include "binding.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine.h"
#include "env.h"
#include "env_fault.h"
#include "py_kv_store.h"

namespace alpsck::binding {
namespace {

using namespace nb::literals;

nb::dict ResultDict(const SaveResult& r) {
  nb::dict d;
  d["step"] = r.step;
  d["bytes"] = r.bytes;
  d["snapshot_seconds"] = r.snapshot_seconds;
  d["durable_seconds"] = r.durable_seconds;
  d["direct_io"] = r.direct_io;
  d["skipped"] = r.skipped;
  d["path"] = Text(r.path);
  d["warning"] = Text(r.warning);
  nb::list ranks;  // the committing rank's: every rank's pace (save.h)
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    nb::dict p;
    p["rank"] = i;
    p["node"] = Text(r.ranks[i].node);
    p["arrived"] = r.ranks[i].arrived;
    p["work_seconds"] = r.ranks[i].work_seconds;
    ranks.append(p);
  }
  d["ranks"] = ranks;
  return d;
}

FaultRule::Op ParseOp(const std::string& op) {
  static const std::map<std::string, FaultRule::Op> ops = {
      {"any", FaultRule::Op::kAny},       {"open", FaultRule::Op::kOpen},
      {"pwrite", FaultRule::Op::kPWrite}, {"pread", FaultRule::Op::kPRead},
      {"fdatasync", FaultRule::Op::kFDataSync}, {"fsync", FaultRule::Op::kFSync},
      {"fallocate", FaultRule::Op::kFAllocate}, {"rename", FaultRule::Op::kRename},
      {"mkdir", FaultRule::Op::kMkdir}};
  auto it = ops.find(op);
  if (it == ops.end()) throw nb::value_error(("unknown fault op: " + op).c_str());
  return it->second;
}

class PyHandle {
 public:
  explicit PyHandle(std::shared_ptr<SaveHandle> h) : h_(std::move(h)) {}
  uint64_t step() const { return h_->step(); }
  bool done() const { return h_->Done(); }
  // True when done (raising the save's error if it failed), False on timeout.
  bool wait(std::optional<double> timeout) const {
    bool ok;
    {
      nb::gil_scoped_release nogil;
      ok = h_->Wait(timeout ? *timeout : -1.0);
    }
    if (ok && !h_->status().ok()) RaiseStatus(h_->status(), true);
    return ok;
  }
  nb::object error_message() const {
    if (!h_->Done() || h_->status().ok()) return nb::none();
    return Text(h_->status().message());
  }
  nb::dict result() const { return ResultDict(h_->result()); }

 private:
  std::shared_ptr<SaveHandle> h_;
};

CommitMode ParseCommit(const std::string& name) {
  if (name == "auto") return CommitMode::kAuto;
  if (name == "deferred") return CommitMode::kDeferred;
  throw nb::value_error(("unknown commit mode: " + name + " (auto, deferred)").c_str());
}

// The caller's side of an external-fill save: slots are named by their byte offset in the
// staging pool (staging_tensor()). Blocking calls release the GIL.
class PyFill {
 public:
  PyFill(std::shared_ptr<Engine> e, std::shared_ptr<ExternalFill> f) : engine_(std::move(e)), fill_(std::move(f)) {}
  ExternalFill& fill() {
    if (!fill_) throw nb::value_error("nothing to fill: the step was already committed");
    return *fill_;
  }
  bool needed() const { return fill_ != nullptr; }
  nb::object acquire(uint64_t chunk, bool block) {
    ExternalFill& f = fill();
    char* slot;
    {
      nb::gil_scoped_release nogil;
      slot = f.Acquire(chunk, block);
    }
    if (!slot) return nb::none();
    return nb::int_(static_cast<uint64_t>(slot - engine_->staging_base()));
  }
  void submit(uint64_t chunk, uint64_t offset) {
    Status s = fill().Submit(chunk, Slot(offset));
    if (!s.ok()) RaiseStatus(s, true);
  }
  void release(uint64_t offset) { fill().Release(Slot(offset)); }
  void fail(const std::string& why) { fill().Fail(why); }
  void finish() {
    if (!fill_) return;
    nb::gil_scoped_release nogil;
    fill_->Finish();
  }
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> extents() {
    std::vector<std::tuple<std::string, uint64_t, uint64_t>> v;
    for (const auto& e : fill().layout().extents) v.emplace_back(e.name, e.offset, e.size);
    return v;
  }
  uint64_t num_chunks() { return fill().num_chunks(); }
  uint64_t chunk_bytes() { return fill().layout().chunk_bytes; }
  uint64_t data_padded() { return fill().layout().data_padded; }
  uint64_t submitted() { return fill().submitted(); }

 private:
  char* Slot(uint64_t offset) {
    if (offset >= engine_->staging_bytes()) throw nb::value_error("slot offset outside the staging pool");
    return engine_->staging_base() + offset;
  }
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<ExternalFill> fill_;
};

class PyEngine {
 public:
  // options: option name -> value, through the core's table (EngineOptionsFrom); the rest say
  // where and who.
  PyEngine(const FsPath& run_dir, const nb::dict& options, uint32_t rank, uint32_t world_size, bool one_history,
           nb::object store, const std::string& store_ns, std::vector<nb::dict> faults,
           std::vector<FsPath> unsynced_dirs) {
    EngineOptions o = EngineOptionsFrom(options);
    o.run_dir = run_dir;
    o.unsynced_dirs.assign(unsynced_dirs.begin(), unsynced_dirs.end());
    o.rank = rank;
    o.world_size = world_size;
    o.one_history = one_history;
    if (!store.is_none()) {
      o.store = KvStoreFrom(store);
      o.store_ns = store_ns;
    }
    if (!faults.empty()) {
      fault_env_ = std::make_unique<FaultEnv>();
      for (const nb::dict& f : faults) fault_env_->AddRule(ToRule(f));
      o.env = fault_env_.get();
    }
    Status s;
    std::unique_ptr<Engine> e;
    {
      nb::gil_scoped_release nogil;
      s = Engine::Open(o, &e);
    }
    if (!s.ok()) RaiseStatus(s, true);
    engine_ = std::move(e);
  }

  static FaultRule ToRule(const nb::dict& f) {
    FaultRule r;
    for (auto [k, v] : f) {
      std::string key = nb::cast<std::string>(k);
      if (key == "op") r.op = ParseOp(nb::cast<std::string>(v));
      else if (key == "path_contains") r.path_contains = nb::cast<std::string>(v);
      else if (key == "skip") r.skip = nb::cast<uint64_t>(v);
      else if (key == "count") r.count = nb::cast<uint64_t>(v);
      else if (key == "error") r.error = nb::cast<int>(v);
      else if (key == "short") r.short_transfer = nb::cast<bool>(v);
      else if (key == "delay_us") r.delay_us = nb::cast<uint64_t>(v);
      else throw nb::value_error(("unknown fault key: " + key).c_str());
    }
    return r;
  }

  // In a forked child (Engine::Forked) the engine is never destroyed: this leaks its last
  // reference rather than run a destructor that could wait on the parent's threads.
  ~PyEngine() { Abandon(); }

  Engine& engine() {
    if (!engine_) throw nb::value_error("engine is closed");
    if (engine_->Forked()) RaiseStatus(engine_->ForkedError(), true);
    return *engine_;
  }

  bool forked() const { return engine_ && engine_->Forked(); }

  // mode: "snapshot" (copy, then write), "overlap" (copy and write at once), "zerocopy".
  // commit: "auto" (the engine commits; coordinated across ranks), "deferred" (seal the shard
  // only; the caller commits with commit_step).
  PyHandle save(uint64_t step, const std::vector<std::pair<std::string, Bytes>>& extents, const std::string& meta,
                const std::string& mode_name, nb::object keepalive, const std::string& commit_name,
                const std::string& refuse, const Metrics& metrics, const std::string& unhealthy, bool pin) {
    CommitMode commit = ParseCommit(commit_name);
    SaveMode mode;
    if (mode_name == "snapshot") mode = SaveMode::kSnapshot;
    else if (mode_name == "overlap") mode = SaveMode::kSnapshotOverlap;
    else if (mode_name == "zerocopy") mode = SaveMode::kZeroCopy;
    else throw nb::value_error(("unknown save mode: " + mode_name + " (snapshot, overlap, zerocopy)").c_str());
    const bool copy = mode != SaveMode::kZeroCopy;
    Reap();
    std::vector<SaveExtent> ex;
    ex.reserve(extents.size());
    for (const auto& [name, arr] : extents) ex.push_back({name, arr.data(), static_cast<uint64_t>(arr.nbytes())});
    std::shared_ptr<SaveHandle> h;
    Status s;
    Engine& e = engine();
    {
      nb::gil_scoped_release nogil;
      s = e.Save({step, std::move(ex), meta, mode, commit,
                  refuse.empty() ? Status::Ok() : Status::Error(Code::kNoSpace, refuse), SaveNotes{metrics, unhealthy, pin}},
                 &h);
    }
    if (!s.ok()) RaiseStatus(s, true);
    if (!copy && !h->Done()) pending_.push_back({h, keepalive.is_none() ? nb::cast(extents) : keepalive});
    return PyHandle(h);
  }

  void continue_from(int64_t step) { engine().ContinueFrom(step); }

  // Engine::Prepare: size and fault in the staging pool in the background.
  void prepare(const std::vector<uint64_t>& sizes) {
    nb::gil_scoped_release nogil;
    engine().Prepare(sizes);
  }

  // Engine::WaitPrepared. Holds the engine itself while it waits: close() on another thread
  // may drop engine_ meanwhile, and then ends the wait (Close stops the preparer).
  void wait_prepared() {
    if (!engine_ || engine_->Forked()) return;
    std::shared_ptr<Engine> e = engine_;
    nb::gil_scoped_release nogil;
    e->WaitPrepared();
  }

  // What the saves so far retired (EngineOptions::one_history: Save runs Supersede itself).
  std::vector<std::pair<uint64_t, FsPath>> take_retired() {
    std::vector<std::pair<uint64_t, FsPath>> out;
    for (auto& [st, path] : engine().TakeRetired()) out.push_back({st, FsPath{std::move(path)}});
    return out;
  }

  void wait_all() {
    if (forked()) return;  // the child has no saves of its own (Engine::Forked)
    if (engine_) {
      nb::gil_scoped_release nogil;
      engine_->WaitAll();
    }
    Reap();
  }

  // An external-fill save: the caller fills staging slots itself (see PyFill).
  std::pair<PyHandle, PyFill> save_external(uint64_t step, const std::vector<std::pair<std::string, uint64_t>>& sizes,
                                            const std::string& meta, const std::string& commit_name,
                                            const Metrics& metrics, const std::string& unhealthy, bool pin) {
    CommitMode commit = ParseCommit(commit_name);
    std::vector<SaveExtent> ex;
    ex.reserve(sizes.size());
    for (const auto& [name, size] : sizes) ex.push_back({name, nullptr, size});
    std::shared_ptr<SaveHandle> h;
    std::shared_ptr<ExternalFill> fill;
    Status s;
    Engine& e = engine();
    {
      nb::gil_scoped_release nogil;
      s = e.Save({step, std::move(ex), meta, SaveMode::kExternal, commit, Status::Ok(), SaveNotes{metrics, unhealthy, pin}},
                 &h, &fill);
    }
    if (!s.ok()) RaiseStatus(s, true);
    if (fill) {
      std::vector<std::weak_ptr<ExternalFill>> live;
      for (auto& w : fills_)
        if (!w.expired()) live.push_back(w);
      live.push_back(fill);
      fills_.swap(live);
    }
    return {PyHandle(h), PyFill(engine_, fill)};
  }

  // The staging pool as a uint8 CPU tensor (no copy); None before the first copy-mode save. The
  // view keeps the pool's memory alive after close().
  nb::object staging_tensor() {
    Engine& e = engine();
    if (!e.staging_base()) return nb::none();
    auto* keep = new std::shared_ptr<Engine>(engine_);
    nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<Engine>*>(p); });
    size_t shape[1] = {static_cast<size_t>(e.staging_bytes())};
    return nb::cast(nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>>(e.staging_base(), 1, shape, owner));
  }

  void close() {
    if (Abandon()) return;
    // Fillers the caller abandoned would keep their saves in flight forever: fail them.
    for (auto& w : fills_)
      if (auto f = w.lock()) {
        f->Fail("the checkpointer was closed before the snapshot was filled");
        f->Finish();
      }
    fills_.clear();
    if (engine_) {
      nb::gil_scoped_release nogil;
      engine_->Close();
    }
    engine_.reset();
    pending_.clear();
  }

  // Drops keep-alive references of zero-copy saves that have finished.
  void Reap() {
    std::vector<std::pair<std::shared_ptr<SaveHandle>, nb::object>> still;
    for (auto& p : pending_)
      if (!p.first->Done()) still.push_back(std::move(p));
    pending_.swap(still);
  }

  // In a forked child: drops this object's hold on the parent's engine, its fillers and its
  // pending saves without running any of their destructors (Engine::Forked). True if it did.
  bool Abandon() {
    if (!forked()) return false;
    new std::shared_ptr<Engine>(std::move(engine_));
    new std::vector<std::weak_ptr<ExternalFill>>(std::move(fills_));
    new std::vector<std::pair<std::shared_ptr<SaveHandle>, nb::object>>(std::move(pending_));
    return true;
  }

  size_t pending_keepalive() const { return pending_.size(); }
  uint64_t faults_injected() const { return fault_env_ ? fault_env_->FaultsInjected() : 0; }

 private:
  std::unique_ptr<FaultEnv> fault_env_;
  std::shared_ptr<Engine> engine_;  // shared with fillers and staging views
  std::vector<std::weak_ptr<ExternalFill>> fills_;
  std::vector<std::pair<std::shared_ptr<SaveHandle>, nb::object>> pending_;
};

}  // namespace

void BindEngine(nb::module_& m) {
  nb::class_<PyHandle>(m, "SaveHandle")
      .def_prop_ro("step", &PyHandle::step)
      .def("done", &PyHandle::done)
      .def("wait", &PyHandle::wait, "timeout"_a = nb::none(),
           "Wait until durable; raises the save's error; False on timeout.")
      .def("error_message", &PyHandle::error_message)
      .def("result", &PyHandle::result);

  nb::class_<PyFill>(m, "ExternalFill")
      .def_prop_ro("needed", &PyFill::needed)
      .def_prop_ro("extents", &PyFill::extents)
      .def_prop_ro("num_chunks", &PyFill::num_chunks)
      .def_prop_ro("chunk_bytes", &PyFill::chunk_bytes)
      .def_prop_ro("data_padded", &PyFill::data_padded)
      .def_prop_ro("submitted", &PyFill::submitted)
      .def("acquire", &PyFill::acquire, "chunk"_a, "block"_a = true,
           "A staging slot's offset for chunk, its padding zeroed; None if the save failed or ended.")
      .def("submit", &PyFill::submit, "chunk"_a, "offset"_a)
      .def("release", &PyFill::release, "offset"_a)
      .def("fail", &PyFill::fail, "why"_a)
      .def("finish", &PyFill::finish);

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<const FsPath&, const nb::dict&, uint32_t, uint32_t, bool, nb::object, const std::string&,
                    std::vector<nb::dict>, std::vector<FsPath>>(),
           "run_dir"_a, "options"_a = nb::dict(), nb::kw_only(), "rank"_a = 0, "world_size"_a = 1,
           "one_history"_a = false, "store"_a = nb::none(), "store_ns"_a = "", "faults"_a = std::vector<nb::dict>{},
           "unsynced_dirs"_a = std::vector<FsPath>{},
           "An engine on run_dir. options: the engine's options by name ({'threads': 4, 'keep_last': 0}; "
           "engine_options() lists them), each checked against the core's table (an unknown name or a value out of "
           "range raises UsageError naming it), the table's defaults for the rest. rank of world_size ranks "
           "writing run_dir; one_history: each save first retires the abandoned history (Engine::Supersede); "
           "faults: test hook, I/O errors to inject (cpp/core/env.h). store: a torch.distributed Store (c10d: "
           "TCPStore, PrefixStore, ...), or a StoreClients of one, through which the ranks agree on each commit, under keys starting with store_ns (the same on every rank, "
           "unique to this run directory and job); None: through the attempt's directory. unsynced_dirs: directories in which "
           "the caller just created run_dir (or a directory above it), fsync'ed in the background from now on; no save "
           "counts as durable before they are (cpp/core/dir_sync.h).")
      .def("save", &PyEngine::save, "step"_a, "extents"_a, "meta"_a = "", "mode"_a = "snapshot",
           "keepalive"_a = nb::none(), "commit"_a = "auto", "refuse"_a = "", "metrics"_a = Metrics{},
           "unhealthy"_a = "", "pin"_a = false,
           "Save a shard; refuse (not empty): a pre-flight check failed: abort the attempt on every rank with this "
           "reason (DiskFullError here) before the shard takes a byte. metrics: [(name, value)] for the manifest "
           "(rank 0's are recorded); unhealthy: why the caller judged it unhealthy besides its metrics (a loss "
           "spike), '' for none; pin: commit it pinned (retention never expires it).")
      .def("save_external", &PyEngine::save_external, "step"_a, "sizes"_a, "meta"_a = "", "commit"_a = "auto",
           "metrics"_a = Metrics{}, "unhealthy"_a = "", "pin"_a = false,
           "Start a save whose staging slots the caller fills (returns (handle, fill)); metrics, unhealthy and pin "
           "as for save.")
      .def("staging_tensor", &PyEngine::staging_tensor, nb::sig("def staging_tensor(self) -> torch.Tensor"),
           "The whole staging pool as one uint8 CPU tensor (zero-copy; keeps the memory alive past close).")
      .def_prop_ro("staging_address", [](PyEngine& e) {
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(e.engine().staging_base())); })
      .def("prepare", &PyEngine::prepare, "sizes"_a,
           "Size the staging pool for saves of extents of these byte sizes and fault it in on a background "
           "thread (returns at once); see Engine::Prepare.")
      .def("wait_prepared", &PyEngine::wait_prepared,
           "Block until no prepare() is sizing or faulting the staging pool any more (at once when closed); "
           "see Engine::WaitPrepared.")
      .def_prop_ro("staging_slots", [](PyEngine& e) { return e.engine().staging_slots(); })
      .def("continue_from", &PyEngine::continue_from, "step"_a,
           "The run continues from this restored step (-1: from nothing); see Engine::ContinueFrom.")
      .def("take_retired", &PyEngine::take_retired,
           "Every (step, new path) the saves retired so far (one_history=True), each once; paths are empty "
           "on ranks > 0. See Engine::Supersede.")
      .def("wait_all", &PyEngine::wait_all, "Block until every save of this process is durable (none in a fork).")
      .def("close", &PyEngine::close,
           "Finish the saves and stop the threads; in a forked child, let go of the parent's engine untouched.")
      .def("check_owner", [](PyEngine& e) { e.engine(); },
           "Raise UsageError in a process forked from the one that opened the engine (ValueError once closed).")
      .def_prop_ro("forked", &PyEngine::forked,
                   "True in a process forked from the one that opened the engine: there every call but close, "
                   "wait_all and forked raises UsageError (see Engine::Forked).")
      .def_prop_ro("align", [](PyEngine& e) { return e.engine().align(); })
      .def_prop_ro("chunk_bytes", [](PyEngine& e) { return e.engine().chunk_bytes(); })
      .def_prop_ro("direct_io", [](PyEngine& e) { return e.engine().direct_io(); })
      .def_prop_ro("threads", [](PyEngine& e) { return e.engine().threads(); })
      .def_prop_ro("copy_threads", [](PyEngine& e) { return e.engine().copy_threads(); })
      .def_prop_ro("staging_bytes", [](PyEngine& e) { return e.engine().staging_bytes(); })
      .def_prop_ro("published_step", [](PyEngine& e) { return e.engine().published_step(); })
      .def_prop_ro("in_flight", [](PyEngine& e) { return e.engine().in_flight(); })
      .def_prop_ro("pending_keepalive", &PyEngine::pending_keepalive)
      .def_prop_ro("faults_injected", &PyEngine::faults_injected);
}

}  // namespace alpsck::binding
