// Engine: persistent concurrent checkpointing (PCcheck's idea, rebuilt). A facade that wires the
// units of a save, each with its own header and threading rules.
//
// One save, top to bottom (the files in this order):
//   engine.cc          Save(): admission (max_in_flight, the attempt's number), the attempt's
//                      directory prepared (a recycled free-* claimed: spare_dirs.h, or a fresh
//                      one), the layout
//   chunk_pipeline.cc  the snapshot into staging slots (or none: zero-copy, external fill:
//   external_fill.cc)  external_fill.h), ONE shared chunk queue drained by T writer threads; the
//                      writer of the last chunk seals the shard (commit.h)
//   engine_commit.cc   the sealed shard's commit attempt (commit_attempt.h: with the other ranks
//                      through an Agreement, coordinate.h; one rank is N = 1): the committer
//                      thread commits (rank 0) or waits for the verdict; then the history, LATEST
//                      (run_dir_latest.h), retention (retention.h decides, SpareDirs expires),
//                      and the handle completed
//   history.cc         ContinueFrom/Supersede: an abandoned history retired before a save
// The protocol and its guarantees: docs/commit-protocol.md. Up to max_in_flight checkpoints
// persist at once; chunks of different checkpoints share the queue in submission order, and a
// checkpoint that finishes after a newer one never becomes the published latest. The save modes
// (SaveMode, save.h) and what each costs: chunk_pipeline.h.
//
// Several ranks: every rank runs its own Engine on the shared run directory and writes only its
// shard; a handle completes, on every rank, once the attempt is decided, and every rank reports
// the same verdict. Housekeeping at Open is rank 0's alone: the caller must let rank 0 open
// before the other ranks save (the Python layer uses a barrier). kDeferred saves (the DCP backend)
// stop after the DONE record: the handle completes when the shard is durable, and the caller
// commits the step (CommitStep in commit_attempt.h).
//
// Threading: Save, WaitAll, Close and the rest of the public methods may be called from any
// thread; SaveHandle and ExternalFill are thread-safe. Close (or the destructor) waits for every
// in-flight save. Threads: the callers', the pipeline's writers (chunk_pipeline.h; the writer that
// seals a shard runs Sealed, and Complete for a deferred or failed save), the committer thread
// (CommitterLoop, Complete) and the pipeline's preparer. mu_ guards admission (in_flight_,
// in_flight_steps_, attempts_, closed_); History is asked under it (lock order: mu_, then
// History's); c_mu_ guards the committer's queue; retention_mu_ serialises the renames of step
// directories (retention, Supersede); SpareDirs guards its own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "commit.h"
#include "dir_sync.h"
#include "engine_options.h"
#include "env.h"
#include "external_fill.h"
#include "history.h"
#include "kv_store.h"
#include "platform.h"
#include "run_dir_latest.h"
#include "save.h"
#include "spare_dirs.h"
#include "status.h"

namespace alpsck {

class ChunkPipeline;
struct SaveJob;

class Engine {
 public:
  static Status Open(const EngineOptions& opts, std::unique_ptr<Engine>* out);
  // OK for numa_node -1, or a NUMA node with CPUs on which the kernel places memory (Open checks
  // it before creating anything; the Python layer before it locks the run directory).
  static Status CheckNumaNode(int node);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Blocks while max_in_flight saves are in flight (nothing is dropped). Errors found before
  // anything is queued (bad names, a directory that cannot be created, no space for the
  // preallocation, the request's refusal: save.h) are returned here; later ones through the
  // handle. A step already committed is not written again (the handle completes with skipped =
  // true), unless it belongs to an abandoned history and Supersede retired it first. With
  // kExternal, *fill receives the save's filler (required; otherwise ignored).
  Status Save(const SaveRequest& req, std::shared_ptr<SaveHandle>* handle,
              std::shared_ptr<ExternalFill>* fill = nullptr);
  void WaitAll();
  void Close();

  // True in a process forked from the one that opened the engine (a DataLoader worker, a
  // multiprocessing child). The engine's threads and staging memory stayed with the parent, so
  // there Save and Supersede fail (kInvalidArgument, saying so), and Prepare, WaitAll and Close
  // do nothing. Never destroy an engine in a forked child (leak it): its mutexes may be held by
  // parent threads that do not exist there, and its thread handles cannot be joined.
  bool Forked() const { return ::getpid() != owner_pid_; }
  Status ForkedError() const;  // what Save and Supersede return there

  // Size and fault in the staging pool in the background, and wait for that (at once in a forked
  // child): ChunkPipeline::Prepare and WaitPrepared (chunk_pipeline.h).
  void Prepare(const std::vector<uint64_t>& sizes);
  void WaitPrepared();

  // Histories (history.h). ContinueFrom(S): the run continues from step S (-1: from nothing);
  // every rank calls it after restoring. Supersede(step), before saving `step`: retires the step
  // directories not of this history (*retired: (step, new path; empty on ranks > 0), newest
  // first); an error leaves the step unsaveable. TakeRetired() hands out every retirement so far
  // once. With EngineOptions::one_history, Save(step) runs Supersede itself.
  void ContinueFrom(int64_t step);
  Status Supersede(uint64_t step, std::vector<std::pair<uint64_t, std::string>>* retired);
  std::vector<std::pair<uint64_t, std::string>> TakeRetired();

  uint64_t align() const { return align_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  bool direct_io() const { return direct_io_; }
  uint32_t threads() const;          // writer threads, at most (the option)
  uint32_t writers_started() const;  // those started so far: one at Open, more as saves queue chunks
  uint32_t copy_threads() const;
  // The staging pool's first mapping (what a caller may register with a GPU runtime): the slots
  // an ExternalFill hands out always lie there, even after the pool grew for copy-mode saves.
  uint64_t staging_bytes() const;
  char* staging_base() const;
  uint64_t staging_slots() const;
  uint64_t staging_free_slots() const;  // faulted in, not in use
  int64_t published_step() const { return published_.step(); }  // newest published as LATEST; -1: none
  uint32_t in_flight() const;
  const std::string& run_dir() const { return opts_.run_dir; }

 private:
  explicit Engine(const EngineOptions& opts);
  Status Init();
  Status PrepareDir(SaveJob* j);  // the attempt's directory: a spare claimed, or made
  // On the writer that sealed j's shard (or found it failed): its DONE record (ranks > 0, and
  // every rank of a deferred commit), then j to the committer thread, or completed.
  void Sealed(std::unique_ptr<SaveJob> j, Status s);
  void CommitterLoop();
  // The common end of every save: history, LATEST, retention, the handle, the in-flight slot.
  void Complete(std::unique_ptr<SaveJob> j, Status s, SaveResult r);

  EngineOptions opts_;
  const std::string host_ = HostName();    // this rank's node, in its records (ShardRecord::node)
  const pid_t owner_pid_ = ::getpid();  // the process that opened it (Forked)
  Env* env_;
  std::unique_ptr<ConfinedRoot> confined_;  // from Init on: RUN_DIR is confined in env_
  uint64_t align_ = 4096, chunk_bytes_ = 0;  // from Init's probe of RUN_DIR
  bool direct_io_ = true;
  History history_;                       // which step directories are of this run's history
  PublishedStep published_;               // the newest step published (LATEST)
  SpareDirs spares_;                      // the expired directories saves recycle (spare_dirs.h)
  std::unique_ptr<ChunkPipeline> pipeline_;  // from Init on
  std::unique_ptr<KvClientPool> store_clients_;  // with EngineOptions::store: each attempt's client
  DeferredDirSync dir_sync_;              // unsynced_dirs and a new RUN_DIR's parent: the committer
                                          // syncs them from Open on, every shard waits (Sealed)

  std::mutex c_mu_;                       // guards the committer's queue and c_stopping_
  std::condition_variable c_cv_;
  std::deque<SaveJob*> commit_queue_;
  bool c_stopping_ = false;
  std::thread committer_;

  mutable std::mutex mu_;                 // guards admission: the fields below
  std::condition_variable admit_cv_;
  uint32_t in_flight_ = 0;
  std::set<uint64_t> in_flight_steps_;
  // Saves of a step so far (its next attempt), until the step commits. Every rank calls Save the
  // same number of times for a step, so the ranks agree without a collective.
  std::map<uint64_t, uint32_t> attempts_;
  bool closed_ = false;
  std::mutex retention_mu_;               // serialises retention and Supersede's renames
};

}  // namespace alpsck
