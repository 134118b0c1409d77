// EngineOptions: what an Engine is opened with. Below engine.h, so that options.cc (which gives
// these fields their defaults, from the option table in options.h) never includes the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "env.h"
#include "kv_store.h"

namespace alpsck {

constexpr uint32_t kMaxWriterThreads = 1024;  // the limit of EngineOptions::threads (options.h)

// Where and who (run_dir, rank, world_size, env, one_history), and the tunable options, whose
// defaults, limits and meaning are defined once, a row each, in options.cc's table (the constructor
// takes every default from there; SetEngineOption sets one by name; Engine::Open checks the
// limits). A new option: a member here, its row there (ENGINE(member, type)), the code using it.
struct EngineOptions {
  EngineOptions();
  std::string run_dir;            // must exist or its parent must (created then)
  uint32_t rank = 0;
  uint32_t world_size = 1;        // ranks writing this run dir (each with its own Engine)
  bool one_history = false;       // every Save first retires the abandoned history (Supersede)
  Env* env = nullptr;             // nullptr: Env::Default()
  // Where the ranks agree on each commit (agreement.h): a store shared by every rank (its clients
  // cloned from this one, KvClientPool), under keys starting with store_ns, which must be the same
  // on every rank and unique to this run directory and this incarnation of the job
  // (StoreAgreement). nullptr: through the attempt's directory (FileAgreement).
  std::shared_ptr<KvStore> store;
  std::string store_ns;
  // Directories in which the caller just created a name this engine depends on (the parent of a
  // new run directory, and its parent's when that was new too): fsync'ed in the background from
  // Open on, and no save counts as durable before (dir_sync.h). Open creates RUN_DIR itself when
  // it is missing, and defers its parent's fsync the same way.
  std::vector<std::string> unsynced_dirs;
  // The table's options (options.cc; their defaults are set by the constructor):
  uint32_t max_in_flight{};       // checkpoints persisting at once
  uint32_t threads{};             // writer threads
  uint32_t copy_threads{};        // 0: min(4, allowed CPUs)
  uint64_t chunk_bytes{};         // rounded up to the alignment
  uint32_t keep_last{};           // 0 keeps all
  uint64_t keep_every_steps{};    // retention.h: milestones; 0: off
  double keep_every_seconds{};    // retention.h; 0: off
  std::string keep_best;          // retention.h: "METRIC:min|max:K"; "": off
  uint64_t staging_bytes{};       // 0: sized at the first copy-mode save to max_in_flight x its chunks,
                                  // grown when a later save is larger
                                  // (external fills still use only the first mapping)
  bool prefault_staging{};        // fault a fixed pool (staging_bytes) in at open, not at its first use
  bool direct_io{};               // try O_DIRECT (a buffered fallback is reported)
  bool preallocate{};             // fallocate each new shard before its writes
  std::vector<int> pin_cpus;      // writer i pinned to pin_cpus[i % n]; empty: no pinning
  uint32_t background_nice{};     // nice value of the writer, committer and pool-faulting threads
  bool crc_in_copy{};             // snapshot modes: CRC32C each chunk in the copy (else: in the writer)
  int32_t numa_node{};            // staging memory from this NUMA node; -1: first touch
  double commit_timeout_s{};      // how long a multi-rank commit waits for the other ranks
};

}  // namespace alpsck
