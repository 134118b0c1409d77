// Engine: persistent concurrent checkpointing (PCcheck's idea, rebuilt).
//
// One save, top to bottom (the files in this order):
//   engine.cc          Save(): admission (max_in_flight, the attempt's number), the attempt's
//                      directory prepared (a recycled free-* claimed, or a fresh one), the layout
//   pipeline.cc        the snapshot into staging slots (or none: zero-copy, external fill), ONE
//                      shared chunk queue drained by T writer threads (no static split, so no
//                      stragglers): each pwrite()s a chunk at its aligned offset (O_DIRECT where
//                      the file system allows), after CRC32Cing it unless the snapshot copy did
//   engine_commit.cc   the writer of the last chunk seals the shard (commit.h); the committer
//                      thread runs the attempt's coordination with the other ranks
//                      (coordinate.h; one rank is N = 1), the commit (commit.h), LATEST,
//                      retention (run_dir.h), and completes the handle
//   history.cc         ContinueFrom/Supersede: an abandoned history retired before a save
// The protocol and its guarantees: docs/commit-protocol.md. Up to max_in_flight checkpoints
// persist at once; chunks of different checkpoints share the queue in submission order, and a
// checkpoint that finishes after a newer one never becomes the published latest.
//
// Three ways to hand over memory (SaveMode):
//  - kSnapshot (default): Save copies the bytes into pre-faulted staging slots on copy_threads
//    threads and returns once the copy is complete; the caller may change its buffers right
//    after. With crc_in_copy (default), each chunk's CRC32C is computed in the copy, piece by
//    piece while the piece is still in cache (GatherChunkCrc), not by a writer reading the chunk
//    back from memory later (measured on a 167 MB state: 34 -> 18 CPU-ms per save off the
//    caller's thread; every-iteration overhead 10 % against 14-16 %, docs/benchmarks.md).
//    Chunks are queued for the writers when the whole snapshot is taken: on a small
//    machine, writes running during the copy compete with it for memory bandwidth (measured:
//    stall 1.48x a plain copy with overlap, 1.06x without; time to durable +0.1 s for 2 GiB).
//  - kSnapshotOverlap: the same copy, but each chunk is queued as soon as it is copied: the
//    fastest time to durable (for a final checkpoint before preemption), a longer stall.
//  - kZeroCopy: Save returns at once; the caller keeps its buffers alive and unchanged until the
//    handle is done. Chunks inside one suitably aligned buffer go to disk without any copy.
//  - kExternal: the caller fills the staging slots itself (asynchronous GPU copies into the pool,
//    registered as pinned memory) through the ExternalFill that Save returns, and submits each
//    chunk once its bytes have landed. Extents need sizes only (their data may be null).
// Writers return staging slots as soon as their chunk is written, so a pool smaller than the
// state still streams (the snapshot modes then overlap by necessity).
//
// Several ranks: every rank runs its own Engine on the shared run directory and writes only its
// shard; a handle completes, on every rank, once the attempt is decided, and every rank reports
// the same verdict. Housekeeping at Open is rank 0's alone: the caller must let rank 0 open
// before the other ranks save (the Python layer uses a barrier). kDeferred saves (the DCP backend)
// stop after the DONE record: the handle completes when the shard is durable, and the caller
// commits the step (CommitStep in coordinate.h).
//
// Threading: Save, WaitAll and Close may be called from any thread; SaveHandle (save.h) is
// thread-safe.
// Close (or the destructor) waits for every in-flight save.
#pragma once

#include <atomic>
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
#include "coordinate.h"
#include "engine_options.h"
#include "env.h"
#include "format.h"
#include "history.h"
#include "published_step.h"
#include "save.h"
#include "staging_pool.h"
#include "status.h"

namespace alpsck {

class ExternalFill;

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
  // preallocation) are returned here; later ones through the handle. A step that is already
  // committed is not written again (the handle completes with skipped = true), unless it belongs
  // to an abandoned history and Supersede retired it first.
  // With kExternal, *fill receives the save's filler (required; otherwise ignored).
  Status Save(uint64_t step, const std::vector<SaveExtent>& extents, const std::string& meta, SaveMode mode,
              std::shared_ptr<SaveHandle>* handle, CommitMode commit = CommitMode::kAuto,
              std::shared_ptr<ExternalFill>* fill = nullptr);
  void WaitAll();
  void Close();

  // True in a process forked from the one that opened the engine (a DataLoader worker, a
  // multiprocessing child). The engine's threads and staging memory stayed with the parent, so
  // there Save and Supersede fail (kInvalidArgument, saying so), and Prepare, WaitAll and Close
  // do nothing: the child has no saves of its own, and the parent's are the parent's. Never
  // destroy an engine in a forked child (leak it): its mutexes and condition variables may be
  // held by parent threads that do not exist there, and its thread handles cannot be joined.
  bool Forked() const { return ::getpid() != owner_pid_; }
  Status ForkedError() const;  // what Save and Supersede return there

  // Sizes the staging pool for copy-mode saves of extents of these sizes and faults it in, on a
  // background thread, so that the first save stalls no longer than the ones after it (a pool
  // allocated and faulted on the critical path made the first save of a process 16-26x slower).
  // Returns at once, also while an earlier Prepare is still faulting (its thread then takes the
  // newest sizes up when done; a restore followed by another waited seconds for it before); a
  // save that starts meanwhile waits for the pool (never allocates twice).
  // Calling it again re-sizes: the pool grows, and shrinks when nothing larger is needed (a
  // mapping beyond the first goes once its slots are free). Failure only costs the head start:
  // the first save then sizes the pool itself. No effect with staging_bytes set.
  void Prepare(const std::vector<uint64_t>& sizes);
  // Blocks until no Prepare is sizing or faulting the pool any more (every size asked for taken
  // up; at once when none runs, in a forked child, and once Close stopped it). For work that must
  // follow the faulting and stay off the training's path: registering the pool with a GPU
  // runtime as pinned memory pins pages that are already there.
  void WaitPrepared();

  // Histories (history.h: what one is, and why an abandoned one is retired). ContinueFrom(S):
  // the run continues from step S (-1: from nothing); call it on every rank after restoring.
  // Supersede(step), before saving `step`: retires the step directories not of this history
  // (*retired: (step, new path; empty on ranks > 0), newest first); an error leaves the step
  // unsaveable. TakeRetired() hands out every retirement so far once. With
  // EngineOptions::one_history, Save(step) runs Supersede itself.
  void ContinueFrom(int64_t step);
  Status Supersede(uint64_t step, std::vector<std::pair<uint64_t, std::string>>* retired);
  std::vector<std::pair<uint64_t, std::string>> TakeRetired();

  uint64_t align() const { return align_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  bool direct_io() const { return direct_io_; }
  uint32_t threads() const { return static_cast<uint32_t>(writers_.size()); }
  uint32_t copy_threads() const { return copy_threads_; }
  // The staging pool's first mapping (what a caller may register with a GPU runtime): the slots
  // an ExternalFill hands out always lie there, even after the pool grew for copy-mode saves.
  uint64_t staging_bytes() const { return pool_.size(); }
  char* staging_base() const { return pool_.base(); }
  uint64_t staging_slots() const { return pool_.slots(); }
  uint64_t staging_free_slots() const { return pool_.free_slots(); }  // faulted in, not in use
  // Newest step published as latest; -1 if none.
  int64_t published_step() const;
  uint32_t in_flight() const;
  const std::string& run_dir() const { return opts_.run_dir; }

 private:
  friend class ExternalFill;
  struct Job;
  struct Task {
    Job* job;
    uint64_t chunk;          // kFinalize: run the commit
    char* slot;              // staging slot (copy mode) or nullptr
    bool crc_done = false;   // the snapshot copy already stored the chunk's CRC (GatherChunkCrc)
  };
  static constexpr uint64_t kFinalize = ~0ull;

  explicit Engine(const EngineOptions& opts);
  Status Init();
  // A background thread's start: pinned to pin_cpus[index % n] (if any), niced to background_nice.
  void EnterBackground(uint32_t index) const;
  void WriterLoop(uint32_t index);
  void WriteChunk(Job* j, const Task& t, char* bounce);
  void Push(Task t);
  void ChunkDone(Job* j, uint64_t count = 1);
  // On the writer that wrote j's last chunk: seal the shard, publish its DONE record (ranks > 0,
  // and every rank of a deferred commit), and hand j to the committer thread.
  void Finish(Job* j);
  void CommitterLoop();
  // The common end of every save: publish, retention, complete the handle, free the slot.
  void Complete(std::unique_ptr<Job> j, Status s, SaveResult r);
  Status PrepareDir(Job* j);
  // The save modes (pipeline.cc): staging sized for a save of this layout (none for zero-copy),
  // then the chunks handed to the writers as the mode says (or a filler returned for kExternal).
  Status ReserveStaging(const ShardLayout& layout, SaveMode mode);
  // The pool slots a copy-mode save of `layout` wants: max_in_flight saves of it, one per writer.
  uint64_t SlotsFor(const ShardLayout& layout) const;
  // The one place the pool is sized (pool_init_mu_ held through *l): made if there is none
  // (mapped under the lock, faulted after releasing it), else grown to `slots` (grow) or shrunk
  // to it (shrink). Only making it can fail.
  Status FitPool(uint64_t slots, bool grow, bool shrink, std::unique_lock<std::mutex>* l);
  void Feed(Job* j, SaveMode mode, std::shared_ptr<ExternalFill>* fill);
  // Copies every chunk of j into staging slots on copy_threads threads and queues them (each at
  // once with overlap, else all after the copy — unless the pool runs dry, which forces it).
  void SnapshotChunks(Job* j, bool overlap);
  void ApplyRetention(std::string* warning);

  EngineOptions opts_;
  const pid_t owner_pid_ = ::getpid();  // the process that opened it (Forked)
  Env* env_;
  std::unique_ptr<ConfinedRoot> confined_;  // from Init on: RUN_DIR is confined in env_
  uint64_t align_ = 4096;
  uint64_t chunk_bytes_ = 0;
  bool direct_io_ = true;
  uint32_t copy_threads_ = 1;
  StagingPool pool_;
  std::mutex pool_init_mu_;

  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> writers_;

  std::mutex c_mu_;                       // the committer's queue
  std::condition_variable c_cv_;
  std::deque<Job*> commit_queue_;
  bool c_stopping_ = false;
  std::thread committer_;
  std::mutex prepare_mu_;  // guards the three below
  std::thread preparer_;   // Prepare's background pool sizing (joined once done, and by Close)
  bool preparing_ = false;      // preparer_ runs and will take prepare_slots_ up
  uint64_t prepare_slots_ = 0;  // the newest Prepare's slots not taken up yet (0: none)
  std::condition_variable prepared_cv_;  // with prepare_mu_: preparing_ became false (WaitPrepared)

  mutable std::mutex mu_;                 // guards the fields below
  std::condition_variable admit_cv_;
  uint32_t in_flight_ = 0;
  std::set<uint64_t> in_flight_steps_;
  // Saves of a step so far (its next attempt), until the step commits. Every rank
  // calls Save the same number of times for a step, so the ranks agree without a collective.
  std::map<uint64_t, uint32_t> attempts_;
  bool closed_ = false;
  std::mutex retention_mu_;
  History history_;                       // which step directories are of this run's history
  PublishedStep published_;               // the newest step published (LATEST)
};

// The caller's side of a kExternal save. Per chunk: Acquire a staging slot, write the chunk's
// extent pieces into it (layout() says where), Submit it once the bytes are there. Finish() when
// done or on failure: chunks never submitted make the save fail, and the handle completes only
// after Finish (the destructor calls it). Thread-safe; Acquire may block (pool dry).
class ExternalFill {
 public:
  ExternalFill(Engine* e, Engine::Job* j);
  ~ExternalFill();
  ExternalFill(const ExternalFill&) = delete;
  ExternalFill& operator=(const ExternalFill&) = delete;

  const ShardLayout& layout() const { return layout_; }
  uint64_t num_chunks() const { return layout_.num_chunks(); }
  // A free slot for chunk i, with the bytes of chunk i that belong to no extent (padding)
  // zeroed; nullptr if the pool is closed, the save already failed or was finished. With
  // block=false, also nullptr at once when no slot is free.
  char* Acquire(uint64_t chunk, bool block);
  // Queues chunk i (its bytes are in slot) for writing. Invalid: a chunk out of range or
  // submitted twice, or a slot this filler does not hold.
  Status Submit(uint64_t chunk, char* slot);
  // Returns a slot acquired but not to be submitted.
  void Release(char* slot);
  // The save fails with this reason (the handle reports it); call Finish afterwards.
  void Fail(const std::string& why);
  // Nothing more will be submitted: the save commits once its chunks are written (or fails if
  // some were never submitted). Slots still held go back to the pool, so call it only when no
  // copy into them can still land. Idempotent.
  void Finish();
  uint64_t submitted() const;

 private:
  Engine* const engine_;
  const ShardLayout layout_;
  mutable std::mutex mu_;
  Engine::Job* job_;  // nullptr once finished
  std::vector<bool> submitted_;
  std::vector<char*> held_;  // acquired, not yet submitted or released
  uint64_t count_ = 0;
};

}  // namespace alpsck
