// alpsck._core: the nanobind binding of the C++ core.
//
// This file only converts types and errors. Every core Status that is not OK becomes an
// alpsck.errors exception in RaiseStatus (the one place that mapping lives). Long calls (the
// snapshot copy, waits, reads, scans) release the GIL. Zero-copy saves keep the caller's arrays
// alive in the Engine wrapper until the save is observed complete.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cctype>
#include <cerrno>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "build_info.h"
#include "commit_attempt.h"
#include "crc32c.h"
#include "engine.h"
#include "kv_store.h"
#include "options.h"
#include "env.h"
#include "env_fault.h"
#include "platform.h"
#include "recovery.h"
#include "retention.h"
#include "run_dir.h"
#include "run_dir_actions.h"
#include "run_dir_lock.h"

namespace nb = nanobind;
using namespace nb::literals;

// A file system path: the bytes the kernel sees. From Python it accepts str, bytes and
// os.PathLike, a str encoded as os.fsencode does (so a name that is not valid UTF-8, which Python
// holds with surrogate escapes, round-trips); to Python it is a str decoded as os.fsdecode does.
struct FsPath {
  std::string bytes;
  operator const std::string&() const { return bytes; }
};

namespace nanobind::detail {
template <>
struct type_caster<FsPath> {
  NB_TYPE_CASTER(FsPath, io_name("str | os.PathLike[str]", "str"))
  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    PyObject* fs = PyOS_FSPath(src.ptr());
    if (!fs) {
      PyErr_Clear();
      return false;
    }
    PyObject* b = PyUnicode_Check(fs) ? PyUnicode_EncodeFSDefault(fs) : PyBytes_Check(fs) ? (Py_INCREF(fs), fs) : nullptr;
    Py_DECREF(fs);
    if (!b) {
      PyErr_Clear();
      return false;
    }
    value.bytes.assign(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
    Py_DECREF(b);
    return value.bytes.find('\0') == std::string::npos;  // a NUL would cut the path short in C
  }
  static handle from_cpp(const FsPath& p, rv_policy, cleanup_list*) noexcept {
    return PyUnicode_DecodeFSDefaultAndSize(p.bytes.data(), static_cast<Py_ssize_t>(p.bytes.size()));
  }
};
}  // namespace nanobind::detail

namespace alpsck {
namespace {

using Bytes = nb::ndarray<nb::pytorch, nb::ro, nb::c_contig, nb::device::cpu>;
using MutBytes = nb::ndarray<nb::pytorch, nb::c_contig, nb::device::cpu>;

// Text from the core for Python: paths in it are bytes, maybe not UTF-8 (decoded as os.fsdecode
// does, so nothing fails and the name reads back as Python spells it).
nb::str Text(const std::string& s) {
  return nb::steal<nb::str>(PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size())));
}

// kIoError/kNoSpace during a save are write errors; elsewhere plain I/O errors.
[[noreturn]] void RaiseStatus(const Status& s, bool writing) {
  const char* name = "CheckpointError";
  switch (s.code()) {
    case Code::kNoSpace: name = "DiskFullError"; break;
    case Code::kIoError: name = writing ? "CheckpointWriteError" : "CheckpointIOError"; break;
    case Code::kNotFound: name = writing ? "CheckpointWriteError" : "CheckpointIOError"; break;
    case Code::kCorrupt: name = "CorruptCheckpointError"; break;
    case Code::kInvalidArgument: name = "UsageError"; break;
    case Code::kBusy: name = "RunDirLockedError"; break;
    case Code::kAborted:
    case Code::kOk: name = "CheckpointError"; break;
  }
  nb::object cls = nb::module_::import_("alpsck.errors").attr(name);
  // OSError subclasses get (errno, message): .errno is set and str() reads "[Errno N] message"
  // where the message names the file and the operation.
  const bool os_error = PyObject_IsSubclass(cls.ptr(), PyExc_OSError) == 1;
  nb::object exc = (s.err() && os_error) ? cls(s.err(), Text(s.message())) : cls(Text(s.message()));
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw nb::python_error();
}

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

// A client of a torch.distributed (c10d) Store as the core's KvStore (kv_store.h, whose semantics
// are c10d's): each call takes the GIL and calls the store's method; c10d's bindings release the
// GIL while they wait on the network, so a rank blocked in wait() holds up no Python thread. A
// c10d timeout (DistStoreError saying "timeout") is KvTimeout; any other exception is the store
// failing (kIoError, with its text). The engine's threads call it; while the interpreter exits,
// every call fails and the object is leaked rather than released without the GIL.
class PyKvStore : public KvStore {
 public:
  explicit PyKvStore(nb::object store) : store_(std::move(store)) {}
  ~PyKvStore() override {
    if (Exiting()) {
      (void)store_.release();
      return;
    }
    nb::gil_scoped_acquire g;
    store_.reset();
  }
  Status Set(const std::string& key, const std::string& value) override {
    return Call("set", {key}, 0, [&] { store_.attr("set")(key, nb::bytes(value.data(), value.size())); });
  }
  Status Get(const std::string& key, double timeout_s, std::string* value) override {
    return Call("get", {key}, timeout_s, [&] {
      if (timeout_s <= 0) {
        if (!nb::cast<bool>(store_.attr("check")(std::vector<std::string>{key}))) throw Missing();
      } else {
        store_.attr("wait")(std::vector<std::string>{key}, Seconds(timeout_s));
      }
      nb::bytes b = nb::cast<nb::bytes>(store_.attr("get")(key));
      value->assign(b.c_str(), b.size());
    });
  }
  Status Add(const std::string& key, int64_t delta, int64_t* new_value) override {
    return Call("add", {key}, 0, [&] { *new_value = nb::cast<int64_t>(store_.attr("add")(key, delta)); });
  }
  Status Append(const std::string& key, const std::string& value) override {
    return Call("append", {key}, 0, [&] { store_.attr("append")(key, nb::bytes(value.data(), value.size())); });
  }
  Status CompareSet(const std::string& key, const std::string& expected, const std::string& desired,
                    std::string* current) override {
    return Call("compare_set", {key}, 0, [&] {
      nb::bytes b = nb::cast<nb::bytes>(store_.attr("compare_set")(key, expected, desired));
      current->assign(b.c_str(), b.size());
    });
  }
  Status Wait(const std::vector<std::string>& keys, double timeout_s) override {
    return Call("wait", keys, timeout_s, [&] { store_.attr("wait")(keys, Seconds(timeout_s)); });
  }
  Status DeleteKey(const std::string& key) override {
    return Call("delete_key", {key}, 0, [&] { store_.attr("delete_key")(key); });
  }
  Status Clone(std::unique_ptr<KvStore>* out) override {
    return Call("clone", {}, 0, [&] { *out = std::make_unique<PyKvStore>(store_.attr("clone")()); });
  }

 private:
  struct Missing {};  // Get with no waiting found no key
  static bool Exiting() {
#if PY_VERSION_HEX >= 0x030D0000
    return !Py_IsInitialized() || Py_IsFinalizing();
#else
    return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
  }
  static nb::object Seconds(double s) {
    return nb::module_::import_("datetime").attr("timedelta")(nb::arg("seconds") = s);
  }
  template <class F>
  Status Call(const char* what, const std::vector<std::string>& keys, double timeout_s, F&& f) {
    if (Exiting()) return Status::Error(Code::kIoError, std::string("store ") + what + ": the interpreter is exiting");
    nb::gil_scoped_acquire g;
    try {
      f();
      return Status::Ok();
    } catch (const Missing&) {
      return KvTimeout(keys, timeout_s);
    } catch (nb::python_error& e) {
      const std::string type = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
      std::string text = nb::cast<std::string>(nb::str(e.value()));
      std::string lower = text;
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (type == "DistStoreError" && lower.find("timeout") != std::string::npos) return KvTimeout(keys, timeout_s);
      return Status::Error(Code::kIoError, std::string("store ") + what + ": " + type + ": " + text);
    } catch (const std::exception& e) {
      return Status::Error(Code::kIoError, std::string("store ") + what + ": " + e.what());
    }
  }

  nb::object store_;
};

class PyEngine {
 public:
  PyEngine(const FsPath& run_dir, uint32_t threads, uint64_t chunk_bytes, uint32_t max_in_flight,
           uint32_t keep_last, uint64_t staging_bytes, std::vector<int> pin_cpus, bool direct_io, uint32_t rank,
           std::vector<nb::dict> faults, uint32_t copy_threads, uint32_t world_size, double commit_timeout_s,
           bool one_history, uint32_t background_nice, bool crc_in_copy, int32_t numa_node, nb::object store,
           const std::string& store_ns, uint64_t keep_every_steps, double keep_every_seconds,
           const std::string& keep_best) {
    EngineOptions o;
    if (!store.is_none()) {
      o.store = std::make_shared<PyKvStore>(store);
      o.store_ns = store_ns;
    }
    o.run_dir = run_dir;
    o.threads = threads;
    o.chunk_bytes = chunk_bytes;
    o.max_in_flight = max_in_flight;
    o.keep_last = keep_last;
    o.keep_every_steps = keep_every_steps;
    o.keep_every_seconds = keep_every_seconds;
    o.keep_best = keep_best;
    o.staging_bytes = staging_bytes;
    o.pin_cpus = std::move(pin_cpus);
    o.direct_io = direct_io;
    o.rank = rank;
    o.copy_threads = copy_threads;
    o.world_size = world_size;
    o.commit_timeout_s = commit_timeout_s;
    o.one_history = one_history;
    o.background_nice = background_nice;
    o.crc_in_copy = crc_in_copy;
    o.numa_node = numa_node;
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

class PyReader {
 public:
  PyReader(const FsPath& path, bool direct) {
    Status s;
    {
      nb::gil_scoped_release nogil;
      s = ShardReader::Open(Env::Default(), path, direct, &r_);
    }
    if (!s.ok()) RaiseStatus(s, false);
  }
  std::string meta() const { return r_->index().meta; }
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> extents() const {
    std::vector<std::tuple<std::string, uint64_t, uint64_t>> v;
    for (const auto& e : r_->index().layout.extents) v.emplace_back(e.name, e.offset, e.size);
    return v;
  }
  // dsts: (extent name, writable contiguous CPU array of exactly the extent's size)
  void read_into(const std::vector<std::pair<std::string, MutBytes>>& dsts, uint32_t threads) {
    const auto& ex = r_->index().layout.extents;
    std::unordered_map<std::string, size_t> pos;
    for (size_t k = 0; k < ex.size(); ++k) pos.emplace(ex[k].name, k);
    std::vector<char*> ptrs(ex.size(), nullptr);
    for (const auto& [name, arr] : dsts) {
      auto it = pos.find(name);
      if (it == pos.end()) RaiseStatus(Status::Corrupt(r_->path() + ": has no extent named " + name), false);
      if (static_cast<uint64_t>(arr.nbytes()) != ex[it->second].size)
        RaiseStatus(Status::Invalid(name + ": checkpoint holds " + std::to_string(ex[it->second].size) +
                                    " bytes, destination has " + std::to_string(arr.nbytes())),
                    false);
      ptrs[it->second] = static_cast<char*>(arr.data());
    }
    Status s;
    {
      nb::gil_scoped_release nogil;
      s = r_->Read(ptrs, threads);
    }
    if (!s.ok()) RaiseStatus(s, false);
  }
  void verify(uint32_t threads) {
    Status s;
    {
      nb::gil_scoped_release nogil;
      s = r_->Verify(threads);
    }
    if (!s.ok()) RaiseStatus(s, false);
  }
  uint64_t file_bytes() const { return r_->file_bytes(); }
  uint64_t data_bytes() const { return r_->index().layout.data_bytes; }
  uint64_t align() const { return r_->index().layout.align; }
  uint64_t chunk_bytes() const { return r_->index().layout.chunk_bytes; }
  uint32_t rank() const { return r_->index().rank; }

 private:
  std::unique_ptr<ShardReader> r_;
};

nb::dict InfoDict(const CheckpointInfo& i) {
  nb::dict d;
  d["step"] = i.step;
  d["path"] = Text(i.path);
  d["status"] = CheckpointStateName(i.state);
  d["error"] = i.error.empty() ? nb::none() : nb::object(Text(i.error));
  d["bytes"] = i.bytes;
  d["data_bytes"] = i.data_bytes;
  d["created"] = i.created;
  d["ranks"] = i.ranks;
  d["tensors"] = i.extents;
  d["write_seconds"] = i.write_seconds;
  d["direct_io"] = i.direct_io;
  d["verified"] = i.verified;
  d["shards"] = i.shards;
  d["extra_files"] = i.extra_files;
  nb::dict metrics;
  for (const auto& [name, value] : i.metrics) metrics[Text(name)] = value;
  d["metrics"] = metrics;
  const std::string sick = Unhealthy(i.metrics, i.flagged);  // the health rule (retention.h), told once
  d["unhealthy"] = sick.empty() ? nb::none() : nb::object(Text(sick));
  d["pinned"] = i.pinned;
  return d;
}

// A Python progress callback as a ProgressFn: an exception in it (KeyboardInterrupt at the
// terminal) must not unwind through the reader threads (std::terminate): it is kept in `raised`,
// the work is cancelled, and the caller raises it.
ProgressFn PyProgress(nb::object& progress, std::optional<nb::python_error>& raised) {
  if (progress.is_none()) return nullptr;
  return [&progress, &raised](uint64_t done) {
    nb::gil_scoped_acquire gil;
    if (raised) return false;
    try {
      progress(done);
      return true;
    } catch (nb::python_error& e) {
      raised.emplace(std::move(e));
      return false;
    }
  };
}

CheckpointKind KindNamed(const std::string& kind) {
  if (kind == "any") return CheckpointKind::kAny;
  if (kind == "alpsck") return CheckpointKind::kAlpsck;
  if (kind == "dcp") return CheckpointKind::kDcp;
  throw nb::value_error(("kind must be 'any', 'alpsck' or 'dcp', not '" + kind + "'").c_str());
}

nb::dict PickDict(const Pick& p) {
  nb::dict d;
  d["step"] = p.step ? nb::object(nb::int_(*p.step)) : nb::none();
  d["path"] = p.step ? nb::object(Text(p.path)) : nb::none();
  d["info"] = p.step ? nb::object(InfoDict(p.info)) : nb::none();
  nb::list candidates, skipped, scanned;
  for (const auto& i : p.candidates) candidates.append(InfoDict(i));
  for (const auto& k : p.skipped) {
    nb::dict x;
    x["step"] = k.step;
    x["path"] = Text(k.path);
    x["reason"] = k.reason;
    x["message"] = Text(k.message);
    skipped.append(x);
  }
  for (const auto& i : p.scanned) scanned.append(InfoDict(i));
  d["candidates"] = candidates;
  d["skipped"] = skipped;
  d["scanned"] = scanned;
  return d;
}

nb::dict PickPy(const FsPath& run_dir, bool verify_data, bool verify_all, const std::string& kind,
                std::optional<uint64_t> step, std::optional<uint64_t> max_step, uint32_t world_size, uint32_t threads,
                nb::object progress, bool allow_unhealthy) {
  PickOptions o;
  o.allow_unhealthy = allow_unhealthy;
  o.verify_data = verify_data;
  o.verify_all = verify_all;
  o.kind = KindNamed(kind);
  o.step = step;
  o.max_step = max_step;
  o.world_size = world_size;
  o.threads = threads;
  Pick p;
  Status s;
  std::optional<nb::python_error> raised;
  ProgressFn fn = PyProgress(progress, raised);
  {
    nb::gil_scoped_release nogil;
    s = PickCheckpoint(Env::Default(), run_dir, o, &p, fn);
  }
  if (raised) {
    nb::python_error e = std::move(*raised);
    raised.reset();
    throw e;
  }
  if (!s.ok()) RaiseStatus(s, false);
  return PickDict(p);
}

std::vector<nb::dict> Scan(const FsPath& run_dir, bool verify, uint32_t threads, nb::object progress) {
  std::vector<CheckpointInfo> infos;
  Status s;
  std::optional<nb::python_error> raised;
  ProgressFn fn = PyProgress(progress, raised);
  {
    nb::gil_scoped_release nogil;
    s = ScanRunDir(Env::Default(), run_dir, verify, threads, &infos, fn);
  }
  if (raised) {
    nb::python_error e = std::move(*raised);
    raised.reset();
    throw e;
  }
  if (!s.ok()) RaiseStatus(s, false);
  std::vector<nb::dict> out;
  for (const auto& i : infos) out.push_back(InfoDict(i));
  return out;
}

}  // namespace
}  // namespace alpsck

NB_MODULE(_core, m) {
  using namespace alpsck;
  m.doc() = "alpsck's C++ checkpoint core (persistent concurrent checkpointing).";
  const uint32_t read_threads = static_cast<uint32_t>(EngineOptionSpec("read_threads").default_value);

  m.def("crc32c", [](Bytes data, uint32_t crc) {
        return Crc32cExtend(crc, data.data(), data.nbytes()); }, "data"_a, "crc"_a = 0,
        nb::sig("def crc32c(data: bytes | bytearray | memoryview | torch.Tensor, crc: int = 0) -> int"),
        "CRC32C of a contiguous buffer, continuing from crc.");
  m.def("crc32c_backend", &Crc32cBackendName, "The CRC32C implementation chosen for this CPU.");
  m.def("build_info", [] {
        const BuildInfo& b = GetBuildInfo();
        return std::map<std::string, std::string>{
            {"tuning", b.tuning}, {"arch_flags", b.arch_flags}, {"compiler", b.compiler}, {"arch", b.arch},
            {"build_type", b.build_type}, {"crc32c_hardware", b.crc32c_hardware}};
      },
      "What the core was built for: tuning ('neoverse-v2': tuned for NVIDIA Grace, or 'portable'), the "
      "arch_flags that tuning used, compiler, arch (target processor), build_type, crc32c_hardware (the "
      "hardware CRC32C backend built in: 'sse42', 'armv8-crc' or 'none'; crc32c_backend() says which runs).");
  m.def("page_size", &PageSize);
  m.def("check_numa_node", [](int node) {
        const Status s = Engine::CheckNumaNode(node);
        if (!s.ok()) RaiseStatus(s, false);
      }, "node"_a, "UsageError (or an OSError) unless the numa_node option's value works on this machine.");
  m.def("cpu_numa_nodes", &CpuNumaNodes, "sysfs"_a = "/sys",
        "The NUMA nodes that have CPUs, ascending (empty if unknown); sysfs: another root, for tests.");
  m.def("fs_magic", [](const FsPath& path) {
        uint64_t magic = 0;
        const int r = FileSystemMagic(path.bytes, &magic);
        if (r < 0) RaiseStatus(Status::FromErrno(-r, "statfs " + path.bytes), false);
        return magic;
      }, "path"_a, "The type of the file system holding path (statfs f_type).");
  m.def("numa_policy_of", [](uint64_t address) {
        int mode = 0, node = -1;
        const int r = NumaPolicyOf(reinterpret_cast<const void*>(static_cast<uintptr_t>(address)), &mode, &node);
        if (r < 0) RaiseStatus(Status::FromErrno(-r, "get_mempolicy"), false);
        return std::make_pair(mode, node);
      }, "address"_a,
      "The memory policy of the page at address: (mode, lowest node of its mask or -1); mode 0 is the "
      "default (first touch), 1 preferred, 2 bind.");
  m.attr("MAX_THREADS") = kMaxWriterThreads;  // the engine's limit on writer threads
  m.attr("checkpoint_format") = kManifestFormat;  // what this build writes (MANIFEST.json "format")
  // The run directory's names (run_dir.h owns them; Python spells none of its own).
  m.def("step_dir_name", &StepDirName, "step"_a, "step-N, as a committed checkpoint's directory is named.");
  m.def("tmp_dir_name", &TmpDirName, "step"_a, "attempt"_a = 0, "Where attempt K of a save of step N is written.");
  m.def("lock_file_name", &LockFileName, "rank"_a, "The writer lock of rank R in a run directory.");
  m.def("shard_file_name", &ShardFileName, "rank"_a, "rank-RRRRR.bin, rank R's shard in a checkpoint directory.");
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
  m.def("scan", &Scan, "run_dir"_a, "verify"_a = false, "threads"_a = read_threads, "progress"_a = nb::none(),
        "Classify every checkpoint directory of run_dir (ascending steps).");
  m.def("pick", &PickPy, "run_dir"_a, "verify_data"_a = false, "verify_all"_a = false, "kind"_a = "any",
        "step"_a = nb::none(), "max_step"_a = nb::none(), "world_size"_a = 0, "threads"_a = read_threads,
        "progress"_a = nb::none(), "allow_unhealthy"_a = false,
        "Which checkpoint of run_dir a restore uses, and why not the newer ones (the core's PickCheckpoint, "
        "cpp/core/recovery.h): {step, path, info, candidates, skipped: [{step, path, reason, message}], scanned}. "
        "Use alpsck.store.run_dir.pick.");

  m.def("commit_step",
        [](const FsPath& run_dir, uint64_t step, uint32_t world_size,
           const std::vector<std::pair<std::string, nb::bytes>>& extra_files, double timeout_s, double elapsed_s,
           nb::object store, const std::string& store_ns) {
          std::vector<std::pair<std::string, std::string>> extra;
          for (const auto& [name, data] : extra_files) extra.emplace_back(name, std::string(data.c_str(), data.size()));
          std::shared_ptr<KvStore> kv;
          if (!store.is_none()) kv = std::make_shared<PyKvStore>(store);
          Status s;
          {
            nb::gil_scoped_release nogil;
            ConfinedRoot confined(Env::Default(), run_dir);
            s = CommitStep(Env::Default(), run_dir, step, world_size, extra, timeout_s, elapsed_s, kv, store_ns);
          }
          if (!s.ok()) RaiseStatus(s, true);
        },
        "run_dir"_a, "step"_a, "world_size"_a, "extra_files"_a = std::vector<std::pair<std::string, nb::bytes>>{},
        "timeout_s"_a = 600.0, "elapsed_s"_a = 0.0, "store"_a = nb::none(), "store_ns"_a = "",
        "Commit step-N.tmp once every rank's deferred shard is durable, with small extra files; elapsed_s: how "
        "long the save ran before this call (the manifest's write_seconds counts from the save's start). store, "
        "store_ns: where the ranks' engines agreed (Engine(store=, store_ns=)): their records are read there, not "
        "from DONE records.");
  m.def("retain_newest",
        [](const FsPath& run_dir, uint32_t keep_last) {
          std::string warning;
          {
            nb::gil_scoped_release nogil;
            ConfinedRoot confined(Env::Default(), run_dir);
            RetentionPolicy policy;
            policy.keep_last = keep_last;
            warning = RetainNewest(Env::Default(), run_dir, policy);
          }
          return Text(warning);
        },
        "run_dir"_a, "keep_last"_a, "Keep the newest keep_last committed checkpoints; returns a warning or ''.");

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

  m.def("engine_options", [] {
        std::vector<nb::dict> out;
        for (const OptionSpec& s : EngineOptionSpecs()) {
          nb::dict d;
          d["name"] = s.name;
          const bool integral = s.type == OptionType::kInt || s.type == OptionType::kCpuList;
          auto num = [&](double v) -> nb::object {
            if (integral) return nb::int_(static_cast<int64_t>(v));
            return nb::float_(v);
          };
          switch (s.type) {
            case OptionType::kInt: d["type"] = "int"; d["default"] = num(s.default_value); break;
            case OptionType::kFloat: d["type"] = "float"; d["default"] = num(s.default_value); break;
            case OptionType::kBool: d["type"] = "bool"; d["default"] = nb::bool_(s.default_value != 0); break;
            case OptionType::kCpuList: d["type"] = "cpus"; d["default"] = nb::list(); break;
            case OptionType::kText: d["type"] = "text"; d["default"] = ""; break;
          }
          if (s.type != OptionType::kBool && s.type != OptionType::kText) {
            d["min"] = num(s.min);
            d["max"] = num(s.max);
          }
          d["zero_means"] = s.zero_means ? nb::object(nb::str(s.zero_means)) : nb::none();
          d["doc"] = s.doc;
          out.push_back(d);
        }
        return out;
      },
      "The engine's options, defined once in the core (cpp/core/options.h): a list of {name, type "
      "('int', 'float', 'bool' or 'cpus': a list of CPU numbers), default, min, max (inclusive), "
      "zero_means (what 0 means where it is not a plain count, else None), doc}.");

  const EngineOptions defaults;
  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<const FsPath&, uint32_t, uint64_t, uint32_t, uint32_t, uint64_t, std::vector<int>, bool,
                    uint32_t, std::vector<nb::dict>, uint32_t, uint32_t, double, bool, uint32_t, bool, int32_t,
                    nb::object, const std::string&, uint64_t, double, const std::string&>(),
           "run_dir"_a, "threads"_a = defaults.threads, "chunk_bytes"_a = defaults.chunk_bytes,
           "max_in_flight"_a = defaults.max_in_flight, "keep_last"_a = defaults.keep_last,
           "staging_bytes"_a = defaults.staging_bytes, "pin_cpus"_a = defaults.pin_cpus,
           "direct_io"_a = defaults.direct_io, "rank"_a = 0, "faults"_a = std::vector<nb::dict>{},
           "copy_threads"_a = defaults.copy_threads, "world_size"_a = 1,
           "commit_timeout_s"_a = defaults.commit_timeout_s, "one_history"_a = false,
           "background_nice"_a = defaults.background_nice, "crc_in_copy"_a = defaults.crc_in_copy,
           "numa_node"_a = defaults.numa_node, "store"_a = nb::none(), "store_ns"_a = "",
           "keep_every_steps"_a = defaults.keep_every_steps, "keep_every_seconds"_a = defaults.keep_every_seconds,
           "keep_best"_a = defaults.keep_best,
           "An engine on run_dir. store: a torch.distributed Store (c10d: TCPStore, PrefixStore, ...) through "
           "which the ranks agree on each commit, under keys starting with store_ns (the same on every rank, "
           "unique to this run directory and job); None: through the attempt's directory.")
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

  nb::class_<PyReader>(m, "ShardReader")
      .def(nb::init<const FsPath&, bool>(), "path"_a, "direct"_a = true)
      .def_prop_ro("meta", &PyReader::meta)
      .def_prop_ro("extents", &PyReader::extents)
      .def_prop_ro("file_bytes", &PyReader::file_bytes)
      .def_prop_ro("data_bytes", &PyReader::data_bytes)
      .def_prop_ro("align", &PyReader::align)
      .def_prop_ro("chunk_bytes", &PyReader::chunk_bytes)
      .def_prop_ro("rank", &PyReader::rank)
      .def("read_into", &PyReader::read_into, "dsts"_a, "threads"_a = read_threads)
      .def("verify", &PyReader::verify, "threads"_a = read_threads);
}
