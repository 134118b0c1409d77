// The chunk pipeline of a save: the snapshot into staging slots, the writers that CRC and write
// each chunk, and the caller-filled (external) snapshot. See engine.h for the modes.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine_job.h"
#include "file_io.h"
#include "crc32c.h"
#include "platform.h"

namespace alpsck {

// ---------------------------------------------------------------- the save modes (engine.h)

uint64_t Engine::SlotsFor(const ShardLayout& layout) const {
  return std::max<uint64_t>(opts_.max_in_flight * layout.num_chunks() + writers_.size(), 1);
}

void Engine::Prepare(const std::vector<uint64_t>& sizes) {
  if (opts_.staging_bytes || Forked()) return;  // a fixed pool, made at Open; or the parent's (engine.h)
  std::vector<std::pair<std::string, uint64_t>> named;
  named.reserve(sizes.size());
  for (uint64_t n : sizes) named.emplace_back("x" + std::to_string(named.size()), n);  // names only index
  ShardLayout layout;
  if (!PlanLayout(named, align_, chunk_bytes_, kDefaultPackAlign, &layout).ok()) return;
  const uint64_t slots = SlotsFor(layout);
  std::lock_guard<std::mutex> l(prepare_mu_);
  {
    std::lock_guard<std::mutex> c(mu_);  // under prepare_mu_: Close, once closed_ is set, joins what runs
    if (closed_) return;
  }
  prepare_slots_ = slots;  // the newest wish wins: a preparer still faulting takes it up next
  if (preparing_) return;  // never waits for it: the caller is the training (engine.h)
  if (preparer_.joinable()) preparer_.join();  // a finished one (preparing_ is false), at once
  preparing_ = true;
  preparer_ = std::thread([this] {
    EnterBackground(0);
    for (;;) {
      uint64_t want;
      {
        std::lock_guard<std::mutex> p(prepare_mu_);
        bool closed;
        {
          std::lock_guard<std::mutex> c(mu_);
          closed = closed_;
        }
        if (prepare_slots_ == 0 || closed) {
          preparing_ = false;
          prepared_cv_.notify_all();
          return;
        }
        want = std::exchange(prepare_slots_, 0);
      }
      std::unique_lock<std::mutex> i(pool_init_mu_);
      FitPool(want, true, true, &i);  // failure only costs the head start: the first save tries again
    }
  });
}

void Engine::WaitPrepared() {
  if (Forked()) return;  // the preparer is the parent's (engine.h)
  std::unique_lock<std::mutex> l(prepare_mu_);
  prepared_cv_.wait(l, [this] { return !preparing_; });
}

Status Engine::FitPool(uint64_t slots, bool grow, bool shrink, std::unique_lock<std::mutex>* l) {
  if (!pool_.initialized()) {
    // Mapped under the lock, faulted outside it: a save that starts meanwhile finds the pool
    // sized and copies into each slot as soon as it is faulted.
    ALPSCK_RETURN_IF_ERROR(pool_.Reserve(chunk_bytes_, slots));
    l->unlock();
    pool_.Fill();
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

Status Engine::ReserveStaging(const ShardLayout& layout, SaveMode mode) {
  if (mode == SaveMode::kZeroCopy) return Status::Ok();  // written from the caller's memory
  std::unique_lock<std::mutex> l(pool_init_mu_);
  // Grown for a save larger than the pool (a first save before the optimizer had state sized it
  // for a third of the state), so later ones are not throttled to the writers' pace; never for a
  // fixed pool (staging_bytes) or an external fill, which uses the first mapping only.
  return FitPool(SlotsFor(layout), !opts_.staging_bytes && mode != SaveMode::kExternal, false, &l);
}

void Engine::Feed(Job* j, SaveMode mode, std::shared_ptr<ExternalFill>* fill) {
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

void Engine::SnapshotChunks(Job* j, bool overlap) {
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

void Engine::Push(Task t) {
  {
    std::lock_guard<std::mutex> l(q_mu_);
    queue_.push_back(t);
  }
  q_cv_.notify_one();
}

void Engine::ChunkDone(Job* j, uint64_t count) {
  if (j->remaining.fetch_sub(count, std::memory_order_acq_rel) == count) Push({j, kFinalize, nullptr});
}

// ---------------------------------------------------------------- ExternalFill

ExternalFill::ExternalFill(Engine* e, Engine::Job* j)
    : engine_(e), layout_(j->index.layout), job_(j), submitted_(layout_.num_chunks(), false) {}

ExternalFill::~ExternalFill() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (job_ && count_ < submitted_.size())
      job_->Fail(Status::Error(Code::kAborted, "the snapshot of step " + std::to_string(job_->step) +
                                                   " was abandoned before all its chunks were filled"));
  }
  Finish();
}

char* ExternalFill::Acquire(uint64_t chunk, bool block) {
  if (chunk >= submitted_.size()) return nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!job_ || job_->failed.load(std::memory_order_acquire)) return nullptr;
  }
  // Not under mu_: blocking here waits for writers, which never need mu_.
  // Only slots of the first mapping: the caller names them by their offset from staging_base()
  // and may have registered just that mapping with CUDA (the pool may have grown since).
  char* slot = block ? engine_->pool_.Acquire(true) : engine_->pool_.TryAcquire(true);
  if (!slot) return nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!job_) {
      engine_->pool_.Release(slot);
      return nullptr;
    }
    held_.push_back(slot);
  }
  ZeroChunkGaps(layout_, chunk, slot);
  return slot;
}

Status ExternalFill::Submit(uint64_t chunk, char* slot) {
  std::lock_guard<std::mutex> l(mu_);
  if (!job_) return Status::Invalid("the snapshot is already finished");
  if (chunk >= submitted_.size())
    return Status::Invalid("chunk " + std::to_string(chunk) + " out of range (" + std::to_string(submitted_.size()) +
                           " chunks)");
  if (submitted_[chunk]) return Status::Invalid("chunk " + std::to_string(chunk) + " submitted twice");
  auto it = std::find(held_.begin(), held_.end(), slot);
  if (it == held_.end()) return Status::Invalid("submitted memory is not a staging slot this filler holds");
  held_.erase(it);
  submitted_[chunk] = true;
  ++count_;
  engine_->Push({job_, chunk, slot});
  return Status::Ok();
}

void ExternalFill::Release(char* slot) {
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = std::find(held_.begin(), held_.end(), slot);
    if (it == held_.end()) return;  // not ours (or already returned): never double-free a slot
    held_.erase(it);
  }
  engine_->pool_.Release(slot);
}

void ExternalFill::Fail(const std::string& why) {
  std::lock_guard<std::mutex> l(mu_);
  if (job_) job_->Fail(Status::Error(Code::kAborted, why));
}

void ExternalFill::Finish() {
  Engine::Job* j;
  uint64_t missing;
  std::vector<char*> held;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!job_) return;
    j = job_;
    job_ = nullptr;
    held.swap(held_);
    missing = submitted_.size() - count_;
    if (missing && !j->failed.load(std::memory_order_acquire))
      j->Fail(Status::Error(Code::kAborted, std::to_string(missing) + " chunk(s) of step " + std::to_string(j->step) +
                                                " were never filled"));
    j->t_snap = Clock::now();
  }
  for (char* slot : held) engine_->pool_.Release(slot);
  engine_->ChunkDone(j, missing + 1);  // the unsubmitted chunks and the filler's own count
}

uint64_t ExternalFill::submitted() const {
  std::lock_guard<std::mutex> l(mu_);
  return count_;
}

void Engine::EnterBackground(uint32_t index) const {
  if (!opts_.pin_cpus.empty()) PinCurrentThread(opts_.pin_cpus[index % opts_.pin_cpus.size()]);
  if (opts_.background_nice) NiceCurrentThread(static_cast<int>(opts_.background_nice));
}

void Engine::WriterLoop(uint32_t index) {
  EnterBackground(index);
  PrefaultedMemory bounce;  // for zero-copy chunks that need gathering; allocated on first use
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> l(q_mu_);
      q_cv_.wait(l, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      t = queue_.front();
      queue_.pop_front();
    }
    if (t.chunk == kFinalize) {
      Finish(t.job);
      continue;
    }
    if (!t.slot && !bounce.data() && !bounce.Allocate(chunk_bytes_))
      t.job->Fail(Status::FromErrno(errno, "allocate a writer buffer"));
    WriteChunk(t.job, t, bounce.data());
    if (t.slot) pool_.Release(t.slot);
    ChunkDone(t.job);
  }
}

void Engine::WriteChunk(Job* j, const Task& t, char* bounce) {
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

}  // namespace alpsck
