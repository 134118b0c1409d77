// alpsck._core: the DCP backend's commit of a step (commit_attempt.h) and its retention.
#include "binding.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commit_attempt.h"
#include "kv_store_memory.h"
#include "py_kv_store.h"
#include "retention.h"
#include "run_dir.h"
#include "run_dir_actions.h"
#include "run_dir_latest.h"
#include "run_dir_lock.h"

namespace alpsck::binding {

using namespace nb::literals;

void BindCommit(nb::module_& m) {
  nb::class_<StoreClients>(m, "StoreClients",
                           "A torch.distributed store's client connections, shared by every Engine and commit_step "
                           "given this object as store= (a new one each, and its connections, otherwise): "
                           "alpsck.ranks.store_clients() keeps one per process.")
      .def("__init__",
           [](StoreClients* self, nb::object store) {
             new (self) StoreClients{std::make_shared<PooledKvStore>(std::make_shared<PyKvStore>(std::move(store)))};
           },
           "store"_a)
      .def_static("in_memory",
                  []() { return StoreClients{std::make_shared<PooledKvStore>(std::make_shared<MemoryKvStore>())}; },
                  "Clients of a new store in this process's memory, for an agreement of one process with itself (a DCP "
                  "save at world size 1: its engine and its commit_step meet there instead of through a DONE record "
                  "in the attempt's directory).")
      .def_prop_ro("clients_made",
                   [](const StoreClients& c) {
                     // The pool's lock is held while it clones, which takes the GIL: never wait for it holding the GIL.
                     nb::gil_scoped_release nogil;
                     return c.kv->clients_made();
                   },
                   "How many connections (store.clone()) it has made so far.");
  m.def("commit_step",
        [](const FsPath& run_dir, uint64_t step, uint32_t world_size,
           const std::vector<std::pair<std::string, nb::bytes>>& extra_files, double timeout_s, double elapsed_s,
           nb::object store, const std::string& store_ns, const Metrics& metrics) {
          std::vector<std::pair<std::string, std::string>> extra;
          for (const auto& [name, data] : extra_files) extra.emplace_back(name, std::string(data.c_str(), data.size()));
          std::shared_ptr<KvStore> kv = KvStoreFrom(store);
          Status s;
          {
            nb::gil_scoped_release nogil;
            ConfinedRoot confined(Env::Default(), run_dir);
            s = CommitStep(Env::Default(), run_dir, step, world_size, extra, timeout_s, elapsed_s, kv, store_ns,
                           SaveNotes{metrics, "", false});
          }
          if (!s.ok()) RaiseStatus(s, true);
        },
        "run_dir"_a, "step"_a, "world_size"_a, "extra_files"_a = std::vector<std::pair<std::string, nb::bytes>>{},
        "timeout_s"_a = 600.0, "elapsed_s"_a = 0.0, "store"_a = nb::none(), "store_ns"_a = "", "metrics"_a = Metrics{},
        "Commit step-N.tmp once every rank's deferred shard is durable, with small extra files; elapsed_s: how "
        "long the save ran before this call (the manifest's write_seconds counts from the save's start). store, "
        "store_ns: where the ranks' engines agreed (Engine(store=, store_ns=)): their records are read there, not "
        "from DONE records. metrics: [(name, value)] recorded in the manifest (retention's keep_best, the health rule).");
  m.def("retain_newest",
        [](const FsPath& run_dir, uint32_t keep_last, uint64_t keep_every_steps, double keep_every_seconds,
           const std::string& keep_best) {
          RetentionPolicy policy;
          policy.keep_last = keep_last;
          policy.keep_every_steps = keep_every_steps;
          policy.keep_every_seconds = keep_every_seconds;
          Status s = ParseKeepBest(keep_best, &policy);
          if (s.ok()) s = CheckRetention(policy);
          if (!s.ok()) RaiseStatus(s, false);
          std::string warning;
          {
            nb::gil_scoped_release nogil;
            ConfinedRoot confined(Env::Default(), run_dir);
            warning = RetainNewest(Env::Default(), run_dir, policy);
          }
          return Text(warning);
        },
        "run_dir"_a, "keep_last"_a, "keep_every_steps"_a = 0, "keep_every_seconds"_a = 0.0, "keep_best"_a = "",
        "Apply the retention rules (retention.h; keep_last 0 keeps all) to run_dir's committed checkpoints; returns "
        "a warning or ''.");
}

}  // namespace alpsck::binding
