// alpsck._core: which checkpoints a run directory holds and which a restore uses (recovery.h:
// scan, pick), and reading a shard (ShardReader).
#include "binding.h"

#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "env.h"
#include "recovery.h"
#include "retention.h"
#include "run_dir.h"
#include "run_dir_actions.h"
#include "run_dir_latest.h"
#include "run_dir_lock.h"

namespace alpsck::binding {
namespace {

using namespace nb::literals;

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

void BindRecovery(nb::module_& m) {
  const uint32_t read_threads = ReadThreads();
  m.def("scan", &Scan, "run_dir"_a, "verify"_a = false, "threads"_a = read_threads, "progress"_a = nb::none(),
        "Classify every checkpoint directory of run_dir (ascending steps).");
  m.def("pick", &PickPy, "run_dir"_a, "verify_data"_a = false, "verify_all"_a = false, "kind"_a = "any",
        "step"_a = nb::none(), "max_step"_a = nb::none(), "world_size"_a = 0, "threads"_a = read_threads,
        "progress"_a = nb::none(), "allow_unhealthy"_a = false,
        "Which checkpoint of run_dir a restore uses, and why not the newer ones (the core's PickCheckpoint, "
        "cpp/core/recovery.h): {step, path, info, candidates, skipped: [{step, path, reason, message}], scanned}. "
        "Use alpsck.store.run_dir.pick.");

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

}  // namespace alpsck::binding
