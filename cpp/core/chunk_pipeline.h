// ChunkPipeline: the chunks of every save in flight, from memory to their place in the shard file
// and on to the sealed shard: the snapshot into staging slots (or none: zero-copy, external fill),
// ONE shared chunk queue drained by T writer threads (no static split, so no stragglers): each
// pwrite()s a chunk at its aligned offset (O_DIRECT where the file system allows), after CRC32Cing
// it unless the snapshot copy did. The writer of a job's last chunk seals the shard (commit.h) and
// hands the job on (SealedFn). Up to max_in_flight saves share the queue in submission order.
//
// Three ways to hand over memory (SaveMode, save.h):
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
// Threading: Reserve, Feed, Prepare and WaitPrepared are called from the engine's callers' threads
// (Feed: Save's, which copies the snapshot there, with copy_threads - 1 helpers); ExternalFill
// pushes chunks from any thread; the writer threads run the queue and SealedFn. q_mu_ guards
// queue_ and stopping_ (q_cv_ wakes the writers). pool_init_mu_ serialises sizing the pool
// (FitPool). prepare_mu_ guards preparer_, preparing_, prepare_slots_ and closing_ (prepared_cv_
// wakes WaitPrepared). The pool is thread-safe itself. Shutdown, from the engine's Close, in this
// order: StopPreparing, then StopWriters once no save is in flight, then Close.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine_options.h"
#include "env.h"
#include "format.h"
#include "save.h"
#include "staging_pool.h"
#include "status.h"

namespace alpsck {

class ExternalFill;
struct SaveJob;

class ChunkPipeline {
 public:
  // Runs on the writer that finished a job's last chunk, with the job (its shard sealed and closed,
  // job->record filled) and what became of it: OK, or the first failure of its chunks or the seal.
  using SealedFn = std::function<void(std::unique_ptr<SaveJob> job, Status s)>;

  ChunkPipeline(const EngineOptions& opts, Env* env, uint64_t align, uint64_t chunk_bytes, SealedFn sealed);
  ~ChunkPipeline();  // StopPreparing, StopWriters, Close
  ChunkPipeline(const ChunkPipeline&) = delete;
  ChunkPipeline& operator=(const ChunkPipeline&) = delete;

  // The fixed pool (staging_bytes), if asked for, and the writer threads.
  Status Start();
  // Staging sized for a save of this layout (none for zero-copy).
  Status Reserve(const ShardLayout& layout, SaveMode mode);
  // Hands j's chunks to the writers as the mode says (or, kExternal, returns a filler in *fill),
  // and j with them: the pipeline owns it until SealedFn.
  void Feed(SaveJob* j, SaveMode mode, std::shared_ptr<ExternalFill>* fill);

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
  // up; at once when none runs, and once StopPreparing stopped it). For work that must follow the
  // faulting and stay off the training's path: registering the pool with a GPU runtime as pinned
  // memory pins pages that are already there.
  void WaitPrepared();

  // No Prepare starts from here on, and a preparer running stops after its current sizing.
  void StopPreparing();
  // Joins the writers, once every save is done (what is queued still runs).
  void StopWriters();
  // Closes the pool (which also ends a preparer still faulting it in) and joins the preparer.
  void Close();

  uint32_t threads() const { return opts_.threads; }  // at most; started as work comes (Push)
  // The writer threads started so far.
  uint32_t writers_started() const {
    std::lock_guard<std::mutex> l(q_mu_);
    return static_cast<uint32_t>(writers_.size());
  }
  uint32_t copy_threads() const { return copy_threads_; }
  const StagingPool& pool() const { return pool_; }

 private:
  friend class ExternalFill;
  struct Task {
    SaveJob* job;
    uint64_t chunk;          // kFinalize: seal the shard
    char* slot;              // staging slot (copy mode) or nullptr
    bool crc_done = false;   // the snapshot copy already stored the chunk's CRC (GatherChunkCrc)
  };
  static constexpr uint64_t kFinalize = ~0ull;

  void WriterLoop(uint32_t index);
  void WriteChunk(SaveJob* j, const Task& t, char* bounce);
  // On the writer that wrote j's last chunk: steps 2-4 of the commit protocol (SealShard, close),
  // then SealedFn.
  void Seal(SaveJob* j);
  void Push(Task t);
  void ChunkDone(SaveJob* j, uint64_t count = 1);
  // The pool slots a copy-mode save of `layout` wants: max_in_flight saves of it.
  uint64_t SlotsFor(const ShardLayout& layout) const;
  // The one place the pool is sized (pool_init_mu_ held through *l): made if there is none
  // (mapped under the lock, faulted after releasing it), else grown to `slots` (grow) or shrunk
  // to it (shrink). Only making it can fail.
  // prefault: a new pool faulted in before it is used (Prepare, in the background), or, false, each page when a
  // save first copies into it (a first save with no Prepare before it: it faults only the slots it fills).
  Status FitPool(uint64_t slots, bool grow, bool shrink, bool prefault, std::unique_lock<std::mutex>* l);
  // Copies every chunk of j into staging slots on copy_threads threads and queues them (each at
  // once with overlap, else all after the copy — unless the pool runs dry, which forces it).
  void SnapshotChunks(SaveJob* j, bool overlap);

  const EngineOptions opts_;
  Env* const env_;
  const uint64_t align_;
  const uint64_t chunk_bytes_;
  const SealedFn sealed_;
  uint32_t copy_threads_ = 1;
  StagingPool pool_;
  std::mutex pool_init_mu_;

  mutable std::mutex q_mu_;  // guards the five below
  std::condition_variable q_cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> writers_;  // started by Start, then Push; joined by StopWriters
  uint64_t idle_writers_ = 0;         // writers waiting for a task, started and not yet waiting, or back from one
  void StartWriterLocked();           // one more writer (q_mu_ held)

  std::mutex prepare_mu_;  // guards the four below
  std::thread preparer_;   // Prepare's background pool sizing (joined once done, and by Close)
  bool preparing_ = false;      // preparer_ runs and will take prepare_slots_ up
  uint64_t prepare_slots_ = 0;  // the newest Prepare's slots not taken up yet (0: none)
  bool closing_ = false;        // StopPreparing was called
  std::condition_variable prepared_cv_;  // with prepare_mu_: preparing_ became false (WaitPrepared)
};

}  // namespace alpsck
