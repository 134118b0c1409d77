// The chunk pipeline of a save: the snapshot into staging slots, the writers that CRC and write
// each chunk, and the seal of the shard. See chunk_pipeline.h for the modes.
#include "chunk_pipeline.h"

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "commit.h"
#include "crc32c.h"
#include "external_fill.h"
#include "file_io.h"
#include "platform.h"
#include "run_dir.h"
#include "save_job.h"

namespace alpsck {

ChunkPipeline::ChunkPipeline(const EngineOptions& opts, Env* env, uint64_t align, uint64_t chunk_bytes,
                             SealedFn sealed)
    : opts_(opts), env_(env), align_(align), chunk_bytes_(chunk_bytes), sealed_(std::move(sealed)) {
  pool_.SetNumaNode(opts_.numa_node);
}

ChunkPipeline::~ChunkPipeline() {
  StopPreparing();
  StopWriters();
  Close();
}

Status ChunkPipeline::Start() {
  if (opts_.staging_bytes) {
    uint64_t slots = std::max<uint64_t>(1, opts_.staging_bytes / chunk_bytes_);
    ALPSCK_RETURN_IF_ERROR(pool_.Init(chunk_bytes_, slots, opts_.prefault_staging));
  }
  copy_threads_ = opts_.copy_threads ? opts_.copy_threads
                                     : static_cast<uint32_t>(std::clamp<size_t>(AllowedCpus().size(), 1, 4));
  // One writer now, the others (up to opts_.threads) as work comes (Push): an engine opened for one
  // small save (Lightning's CheckpointIO, the Trainer: one per checkpoint path) started and joined
  // 8 threads for its one chunk, 0.64 ms of its open and close against 0.25 with one.
  std::lock_guard<std::mutex> l(q_mu_);
  StartWriterLocked();
  return Status::Ok();
}

void ChunkPipeline::StopPreparing() {
  std::lock_guard<std::mutex> l(prepare_mu_);
  closing_ = true;
}

void ChunkPipeline::StartWriterLocked() {
  const uint32_t index = static_cast<uint32_t>(writers_.size());
  writers_.emplace_back([this, index] { WriterLoop(index); });
  ++idle_writers_;  // from now: a writer still starting takes the next task, as a waiting one does
}

void ChunkPipeline::StopWriters() {
  {
    std::lock_guard<std::mutex> l(q_mu_);
    stopping_ = true;  // no writer starts after this (Push): writers_ changes no more
  }
  q_cv_.notify_all();
  for (auto& w : writers_) w.join();
  writers_.clear();
}

void ChunkPipeline::Close() {
  pool_.Close();  // also ends a Prepare still faulting the pool in
  std::thread preparer;  // joined without prepare_mu_, which it takes before it ends
  {
    std::lock_guard<std::mutex> l(prepare_mu_);
    preparer = std::move(preparer_);
  }
  if (preparer.joinable()) preparer.join();
}

// ---------------------------------------------------------------- the save modes (chunk_pipeline.h)

uint64_t ChunkPipeline::SlotsFor(const ShardLayout& layout) const {
  // Never more than max_in_flight saves hold slots (admission waits for one to finish), each at most one
  // slot per chunk, so this many never makes a save wait for the pool. (It also added a slot per writer
  // thread until stop 68: for a state of one chunk that was 5x what saves could use, all faulted in.)
  return std::max<uint64_t>(opts_.max_in_flight * layout.num_chunks(), 1);
}

void ChunkPipeline::Prepare(const std::vector<uint64_t>& sizes) {
  if (opts_.staging_bytes) return;  // a fixed pool, made at Open (Start)
  std::vector<std::pair<std::string, uint64_t>> named;
  named.reserve(sizes.size());
  for (uint64_t n : sizes) named.emplace_back("x" + std::to_string(named.size()), n);  // names only index
  ShardLayout layout;
  if (!PlanLayout(named, align_, chunk_bytes_, kDefaultPackAlign, &layout).ok()) return;
  const uint64_t slots = SlotsFor(layout);
  std::lock_guard<std::mutex> l(prepare_mu_);
  if (closing_) return;  // under prepare_mu_: Close, once closing_ is set, joins what runs
  prepare_slots_ = slots;  // the newest wish wins: a preparer still faulting takes it up next
  if (preparing_) return;  // never waits for it: the caller is the training (chunk_pipeline.h)
  if (preparer_.joinable()) preparer_.join();  // a finished one (preparing_ is false), at once
  preparing_ = true;
  preparer_ = std::thread([this] {
    EnterBackground(opts_.pin_cpus, opts_.background_nice, 0);
    for (;;) {
      uint64_t want;
      {
        std::lock_guard<std::mutex> p(prepare_mu_);
        if (prepare_slots_ == 0 || closing_) {
          preparing_ = false;
          prepared_cv_.notify_all();
          return;
        }
        want = std::exchange(prepare_slots_, 0);
      }
      std::unique_lock<std::mutex> i(pool_init_mu_);
      FitPool(want, true, true, true, &i);  // failure only costs the head start: the first save tries again
    }
  });
}

void ChunkPipeline::WaitPrepared() {
  std::unique_lock<std::mutex> l(prepare_mu_);
  prepared_cv_.wait(l, [this] { return !preparing_; });
}

Status ChunkPipeline::FitPool(uint64_t slots, bool grow, bool shrink, bool prefault,
                              std::unique_lock<std::mutex>* l) {
  if (!pool_.initialized()) {
    // Mapped under the lock, faulted outside it: a save that starts meanwhile finds the pool
    // sized and copies into each slot as soon as it is faulted. A save that sizes it itself faults
    // only the slots it fills, as it fills them: faulting the whole pool first (max_in_flight x the
    // state's chunks, and then one slot per writer more) made a new engine's first save of 300 MiB stall
    // 454 ms here (672 MiB faulted, then copied into), where torch.save took 421 (benchmarks/framework_io.py).
    ALPSCK_RETURN_IF_ERROR(pool_.Reserve(chunk_bytes_, slots));
    l->unlock();
    if (prefault) {
      pool_.Fill();
    } else {
      pool_.MarkFree();
    }
  } else if (grow && slots > pool_.slots()) {
    // Faulted outside the lock, as Fill above: a save that fits the pool as it is (or an external
    // fill, which never grows it) does not wait for a Prepare growing it in the background.
    l->unlock();
    pool_.GrowTo(slots);  // failure only costs speed: the smaller pool still streams
  } else if (shrink) {
    pool_.Shrink(slots);
  }
  return Status::Ok();
}

Status ChunkPipeline::Reserve(const ShardLayout& layout, SaveMode mode) {
  if (mode == SaveMode::kZeroCopy) return Status::Ok();  // written from the caller's memory
  std::unique_lock<std::mutex> l(pool_init_mu_);
  // Grown for a save larger than the pool (a first save before the optimizer had state sized it
  // for a third of the state), so later ones are not throttled to the writers' pace; never for a
  // fixed pool (staging_bytes) or an external fill, which uses the first mapping only.
  return FitPool(SlotsFor(layout), !opts_.staging_bytes && mode != SaveMode::kExternal, false, false, &l);
}

void ChunkPipeline::Feed(SaveJob* j, SaveMode mode, std::shared_ptr<ExternalFill>* fill) {
  switch (mode) {
    case SaveMode::kExternal:  // the caller fills and submits; the filler holds the extra count
      j->srcs.clear();
      *fill = std::make_shared<ExternalFill>(this, j);
      return;
    case SaveMode::kZeroCopy:
      for (uint64_t i = 0; i < j->index.layout.num_chunks(); ++i) Push({j, i, nullptr});
      j->t_snap = Clock::now();
      break;
    case SaveMode::kSnapshot:
    case SaveMode::kSnapshotOverlap:
      SnapshotChunks(j, mode == SaveMode::kSnapshotOverlap);
      j->t_snap = Clock::now();
      j->srcs.clear();  // the caller's memory is no longer referenced
      break;
  }
  ChunkDone(j);  // this thread's extra count
}

void ChunkPipeline::SnapshotChunks(SaveJob* j, bool overlap) {
  const ShardLayout& layout = j->index.layout;
  const uint64_t n = layout.num_chunks();
  PoolCopyScope copying(&pool_);  // a pool still being prepared waits while this copy runs
  std::atomic<uint64_t> next{0};
  std::mutex held_mu;
  std::vector<Task> held;  // copied chunks not yet queued (without overlap)
  auto release_held = [&] {
    std::vector<Task> out;
    {
      std::lock_guard<std::mutex> l(held_mu);
      out.swap(held);
    }
    for (const Task& t : out) Push(t);
  };
  // Chunks are claimed through a shared counter, so a slow copier never holds others up.
  auto copier = [&] {
    for (uint64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      char* slot = nullptr;
      if (!j->failed.load(std::memory_order_acquire)) {
        slot = pool_.TryAcquire();
        if (!slot) {
          // Pool dry: queue what is held so writers can free slots, then wait. Invariant: a
          // copier never blocks, nor exits, while chunks it could release are held.
          release_held();
          slot = pool_.Acquire();
        }
        if (slot && opts_.crc_in_copy) j->index.crcs[i] = GatherChunkCrc(layout, j->srcs, i, slot);  // its own element
        else if (slot) GatherChunk(layout, j->srcs, i, slot);
        else j->Fail(Status::Error(Code::kAborted, "staging pool closed during save of step " + std::to_string(j->step)));
      }
      const Task t{j, i, slot, slot != nullptr && opts_.crc_in_copy};
      if (overlap || !slot) {
        Push(t);
      } else {
        std::lock_guard<std::mutex> l(held_mu);
        held.push_back(t);
      }
    }
    release_held();  // copiers finish within a chunk of each other, so this costs ~nothing
  };
  const uint64_t helpers = std::min<uint64_t>(copy_threads_, n) > 0 ? std::min<uint64_t>(copy_threads_, n) - 1 : 0;
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (uint64_t h = 0; h < helpers; ++h) pool.emplace_back(copier);
  copier();
  for (auto& t : pool) t.join();
  release_held();
}

void ChunkPipeline::Push(Task t) {
  {
    std::lock_guard<std::mutex> l(q_mu_);
    queue_.push_back(t);
    // A task no waiting writer will take starts a writer, up to opts_.threads (Start).
    if (queue_.size() > idle_writers_ && writers_.size() < opts_.threads && !stopping_) {
      try {
        StartWriterLocked();
      } catch (const std::system_error&) {  // no thread to be had: the writers there take it, only slower
      }
    }
  }
  q_cv_.notify_one();
}

void ChunkPipeline::ChunkDone(SaveJob* j, uint64_t count) {
  if (j->remaining.fetch_sub(count, std::memory_order_acq_rel) == count) Push({j, kFinalize, nullptr});
}

void ChunkPipeline::WriterLoop(uint32_t index) {
  EnterBackground(opts_.pin_cpus, opts_.background_nice, index);
  PrefaultedMemory bounce;  // for zero-copy chunks that need gathering; allocated on first use
  // counted: this writer is in idle_writers_ already. StartWriterLocked counts it before it runs; a
  // writer done with a chunk counts itself before ChunkDone, whose Push (the seal of the shard, when
  // the chunk was its last) then starts no writer for what this one takes next.
  for (bool counted = true;;) {
    Task t;
    {
      std::unique_lock<std::mutex> l(q_mu_);
      if (!counted) ++idle_writers_;
      q_cv_.wait(l, [&] { return stopping_ || !queue_.empty(); });
      --idle_writers_;
      if (queue_.empty()) return;
      t = queue_.front();
      queue_.pop_front();
    }
    counted = false;
    if (t.chunk == kFinalize) {
      Seal(t.job);
      continue;
    }
    if (!t.slot && !bounce.data() && !bounce.Allocate(chunk_bytes_))
      t.job->Fail(Status::FromErrno(errno, "allocate a writer buffer"));
    WriteChunk(t.job, t, bounce.data());
    if (t.slot) pool_.Release(t.slot);
    {
      std::lock_guard<std::mutex> l(q_mu_);
      ++idle_writers_;
    }
    counted = true;
    ChunkDone(t.job);
  }
}

void ChunkPipeline::WriteChunk(SaveJob* j, const Task& t, char* bounce) {
  if (j->failed.load(std::memory_order_acquire)) return;
  const ShardLayout& l = j->index.layout;
  const uint64_t i = t.chunk;
  const char* buf = t.slot;
  if (!buf) {
    buf = DirectSource(l, j->srcs, i, j->direct ? align_ : 1);
    if (!buf) {
      GatherChunk(l, j->srcs, i, bounce);
      buf = bounce;
    }
  }
  const uint64_t len = l.chunk_len(i);
  if (!t.crc_done) j->index.crcs[i] = Crc32c(buf, len);
  Status s = WriteFull(env_, j->fd, buf, len, l.chunk_begin(i), j->shard_path);
  if (!s.ok()) j->Fail(s);
}

void ChunkPipeline::Seal(SaveJob* j) {
  std::unique_ptr<SaveJob> owned(j);
  Status s;
  ShardRecord rec;
  rec.name = ShardFileName(j->index.rank);
  if (j->failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> l(j->err_mu);
    s = j->error;
  } else {
    s = SealShard(env_, j->fd, j->shard_path, j->index, j->direct, align_, &rec);
    if (s.ok()) {
      int c = env_->Close(j->fd);
      j->fd = -1;
      if (c < 0) s = Status::FromErrno(-c, "close " + j->shard_path);
    }
    j->record = rec;
  }
  if (j->fd >= 0) env_->Close(j->fd);
  j->fd = -1;
  sealed_(std::move(owned), s);
}

}  // namespace alpsck
