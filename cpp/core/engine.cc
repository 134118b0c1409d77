#include "engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "commit.h"
#include "coordinate.h"
#include "crc32c.h"
#include "file_io.h"
#include "platform.h"

namespace alpsck {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
constexpr uint64_t kDefaultChunkBytes = 8ull << 20;

// 16 hex digits, unique per save across processes and hosts (with overwhelming probability):
// a random per-process seed, the pid and a counter, mixed.
std::string NewSaveId() {
  static const uint64_t seed = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  }();
  static std::atomic<uint64_t> counter{0};
  uint64_t x = seed ^ (static_cast<uint64_t>(::getpid()) << 40) ^ counter.fetch_add(1, std::memory_order_relaxed);
  x ^= x >> 33;  // splitmix64's finaliser: every input bit reaches every output bit
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}
}  // namespace

// ---------------------------------------------------------------- SaveHandle

bool SaveHandle::Done() const {
  std::lock_guard<std::mutex> l(mu_);
  return done_;
}

bool SaveHandle::Wait(double timeout_s) const {
  std::unique_lock<std::mutex> l(mu_);
  if (timeout_s < 0) {
    cv_.wait(l, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(l, std::chrono::duration<double>(timeout_s), [&] { return done_; });
}

Status SaveHandle::status() const {
  std::lock_guard<std::mutex> l(mu_);
  return status_;
}

SaveResult SaveHandle::result() const {
  std::lock_guard<std::mutex> l(mu_);
  return result_;
}

void SaveHandle::Complete(Status s, SaveResult r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    status_ = std::move(s);
    result_ = std::move(r);
    done_ = true;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------- Job

struct Engine::Job {
  std::shared_ptr<SaveHandle> handle;
  uint64_t step = 0;
  uint32_t attempt = 0;              // several ranks: the how-manieth save of this step (TmpDirName)
  CommitMode commit = CommitMode::kAuto;
  SaveResult result;                 // filled as the save goes (for the committer)
  std::string tmp_dir, final_dir, shard_path;
  int fd = -1;
  bool direct = false;
  ShardIndex index;                  // layout + crcs + meta
  ShardRecord record;                // this rank's sealed shard (several ranks: to find its commit)
  std::vector<const char*> srcs;     // zero-copy sources, per extent
  std::atomic<uint64_t> remaining{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status error;
  Clock::time_point t0, t_snap;

  void Fail(const Status& s) {
    std::lock_guard<std::mutex> l(err_mu);
    if (error.ok()) error = s;
    failed.store(true, std::memory_order_release);
  }
};

// ---------------------------------------------------------------- Engine

Engine::Engine(const EngineOptions& opts) : opts_(opts), env_(opts.env ? opts.env : Env::Default()) {}

Status Engine::Open(const EngineOptions& opts, std::unique_ptr<Engine>* out) {
  if (opts.run_dir.empty()) return Status::Invalid("run_dir is empty");
  if (opts.max_in_flight == 0) return Status::Invalid("max_in_flight must be at least 1");
  if (opts.threads > kMaxWriterThreads)
    return Status::Invalid("threads must be at most " + std::to_string(kMaxWriterThreads));
  if (opts.world_size == 0 || opts.rank >= opts.world_size)
    return Status::Invalid("rank " + std::to_string(opts.rank) + " is not below world_size " + std::to_string(opts.world_size));
  std::unique_ptr<Engine> e(new Engine(opts));
  ALPSCK_RETURN_IF_ERROR(e->Init());
  *out = std::move(e);
  return Status::Ok();
}

Status Engine::Init() {
  const std::string& dir = opts_.run_dir;
  int d = env_->IsDir(dir);
  if (d == -ENOENT) {
    int r = env_->Mkdir(dir);
    if (r < 0 && r != -EEXIST) return Status::FromErrno(-r, "create run directory " + dir);
    d = env_->IsDir(dir);
  }
  if (d < 0) return Status::FromErrno(-d, "run directory " + dir);
  if (d == 0) return Status::Invalid("run directory " + dir + " exists but is not a directory");

  // Probe: can this file system do O_DIRECT, and with which alignment? Also proves the
  // directory is writable before the first save.
  const std::string probe = JoinPath(dir, ".alpsck-probe-" + std::to_string(opts_.rank) + "-" + std::to_string(::getpid()));
  int fd = -1;
  bool direct = false;
  Status s = OpenMaybeDirect(env_, probe, O_WRONLY | O_CREAT | O_TRUNC, opts_.direct_io, &fd, &direct);
  if (!s.ok()) return Status::Error(s.code(), "run directory " + dir + " is not writable: " + s.message(), s.err());
  DirectIoInfo dio;
  if (direct && env_->DirectIo(fd, &dio) == 0 && dio.offset_align == 0) dio.offset_align = 4096;
  env_->Close(fd);
  env_->Unlink(probe);
  direct_io_ = direct;
  align_ = std::max<uint64_t>({PageSize(), dio.mem_align, dio.offset_align, 512});
  chunk_bytes_ = RoundUp(opts_.chunk_bytes ? opts_.chunk_bytes : kDefaultChunkBytes, align_);

  // What is already there: committed steps (a manifest exists; recovery does the deep checks),
  // abandoned step-N.tmp and expired free-K directories (both reused for new saves with one
  // rank, removed with several; either way by rank 0 only: other ranks may be writing).
  std::vector<std::string> names;
  int r = env_->ListDir(dir, &names);
  if (r < 0) return Status::FromErrno(-r, "list run directory " + dir);
  std::sort(names.begin(), names.end());
  std::vector<std::string> reusable;  // free-K directories for this process (one rank only)
  for (const std::string& n : names) {
    const std::string p = JoinPath(dir, n);
    uint64_t step = 0;
    if (ParseStepDirName(n, &step)) {
      if (env_->IsDir(JoinPath(p, kManifestName)) == 0) committed_.insert(step);
      if (env_->IsDir(p) == 1) foreign_.insert(step);
      continue;
    }
    const bool tmp = ParseTmpDirName(n, &step);
    const bool free_dir = n.rfind(kFreePrefix, 0) == 0;
    if ((tmp || free_dir) && opts_.rank == 0 && env_->IsDir(p) == 1) {
      if (opts_.world_size == 1 && reusable.size() < opts_.max_in_flight) {
        std::string f = JoinPath(dir, kFreePrefix + std::to_string(free_seq_++) + "-" + std::to_string(::getpid()));
        if (env_->Rename(p, f) == 0) reusable.push_back(f);
      } else {
        RemoveDirFiles(env_, p);
      }
    }
  }
  // The process that expired these may have died before its fsync of RUN_DIR: make every rename
  // that took a directory out of the checkpoints durable before its blocks are overwritten.
  if (!reusable.empty()) {
    if (SyncDir(env_, dir).ok()) free_dirs_ = std::move(reusable);
    else for (const std::string& f : reusable) RemoveDirFiles(env_, f);
  }
  std::string latest;
  if (ReadSmallFile(env_, JoinPath(dir, kLatestName), 64, &latest).ok()) published_ = std::strtoll(latest.c_str(), nullptr, 10);
  if (!committed_.empty()) published_ = std::max<int64_t>(published_, static_cast<int64_t>(*committed_.rbegin()));

  if (opts_.staging_bytes) {
    uint64_t slots = std::max<uint64_t>(1, opts_.staging_bytes / chunk_bytes_);
    ALPSCK_RETURN_IF_ERROR(pool_.Init(chunk_bytes_, slots));
  }

  copy_threads_ = opts_.copy_threads ? opts_.copy_threads
                                     : static_cast<uint32_t>(std::clamp<size_t>(AllowedCpus().size(), 1, 4));
  uint32_t t = opts_.threads;
  if (t == 0) t = 8;
  for (uint32_t i = 0; i < t; ++i) writers_.emplace_back([this, i] { WriterLoop(i); });
  if (opts_.world_size > 1) committer_ = std::thread([this] { CommitterLoop(); });
  return Status::Ok();
}

Engine::~Engine() { Close(); }

void Engine::Close() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    closed_ = true;
  }
  admit_cv_.notify_all();  // a Save waiting for an in-flight slot fails now (it re-checks closed_)
  WaitAll();
  {
    std::lock_guard<std::mutex> l(q_mu_);
    stopping_ = true;
  }
  q_cv_.notify_all();
  for (auto& w : writers_) w.join();
  writers_.clear();
  {
    std::lock_guard<std::mutex> l(c_mu_);
    c_stopping_ = true;
  }
  c_cv_.notify_all();
  if (committer_.joinable()) committer_.join();
  pool_.Close();
}

void Engine::WaitAll() {
  std::unique_lock<std::mutex> l(mu_);
  admit_cv_.wait(l, [&] { return in_flight_ == 0; });
}

int64_t Engine::published_step() const {
  std::lock_guard<std::mutex> l(mu_);
  return published_;
}

uint32_t Engine::in_flight() const {
  std::lock_guard<std::mutex> l(mu_);
  return in_flight_;
}

void Engine::ContinueFrom(int64_t step) {
  std::lock_guard<std::mutex> l(mu_);
  base_ = step < 0 ? -1 : step;
  for (uint64_t c : committed_)  // this process's own commits after S too (a rollback)
    if (static_cast<int64_t>(c) > base_) foreign_.insert(c);
  if (step >= 0) foreign_.erase(static_cast<uint64_t>(step));
}

std::vector<std::pair<uint64_t, std::string>> Engine::TakeRetired() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::pair<uint64_t, std::string>> out;
  out.swap(retired_log_);
  return out;
}

Status Engine::Supersede(uint64_t step, std::vector<std::pair<uint64_t, std::string>>* retired) {
  retired->clear();
  {
    // Every one_history save comes here: the common case (nothing of another history left) must
    // not wait behind a retention in progress (its renames and fsync) for retention_mu_.
    std::lock_guard<std::mutex> l(mu_);
    if (foreign_.empty()) return closed_ ? Status::Error(Code::kAborted, "engine is closed") : Status::Ok();
  }
  std::lock_guard<std::mutex> rl(retention_mu_);  // retention renames step directories too
  std::vector<uint64_t> victims;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return Status::Error(Code::kAborted, "engine is closed");
    for (auto it = foreign_.rbegin(); it != foreign_.rend(); ++it)
      if (*it >= step || (base_ != kNoBase && static_cast<int64_t>(*it) > base_)) victims.push_back(*it);
    for (uint64_t v : victims)
      if (v != step && in_flight_steps_.count(v))  // (step itself: Save calls this for it)
        return Status::Invalid("step " + std::to_string(v) + " of an earlier history is being saved; call Supersede "
                               "before saving it");
  }
  if (victims.empty()) return Status::Ok();
  if (opts_.rank == 0) {
    // LATEST (a hint) first: it must never name a step newer than every valid checkpoint, and a
    // power loss keeps the run directory's changes in order, so this one lands before the renames.
    int64_t remaining = -1;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (uint64_t c : committed_)
        if (std::find(victims.begin(), victims.end(), c) == victims.end()) remaining = static_cast<int64_t>(c);
    }
    std::lock_guard<std::mutex> pl(publish_mu_);
    if (remaining >= 0) PublishLatest(env_, opts_.run_dir, static_cast<uint64_t>(remaining));
    else env_->Unlink(JoinPath(opts_.run_dir, kLatestName));
  }
  Status failure;
  std::vector<uint64_t> gone;
  for (uint64_t v : victims) {
    std::string dest;
    if (opts_.rank == 0) {
      const std::string path = JoinPath(opts_.run_dir, StepDirName(v));
      int r;
      for (int tries = 0;; ++tries) {  // an earlier job (same pid, say) may have left the name taken
        {
          std::lock_guard<std::mutex> l(mu_);
          dest = JoinPath(opts_.run_dir, kSupersededPrefix + StepDirName(v) + "-" + std::to_string(::getpid()) +
                                             "-" + std::to_string(free_seq_++));
        }
        r = env_->Rename(path, dest);
        if ((r != -EEXIST && r != -ENOTEMPTY) || tries == 1000) break;
      }
      if (r == -ENOENT) {
        dest.clear();  // removed meanwhile (a prune): nothing left to retire
      } else if (r < 0) {
        failure = Status::FromErrno(-r, "retire " + path + " (a checkpoint of an abandoned history) to " + dest);
        break;
      }
    }
    gone.push_back(v);
    if (!dest.empty() || opts_.rank != 0) retired->emplace_back(v, dest);
  }
  // Durable before any later commit can be: a power loss must never leave the new history's
  // checkpoint beside an abandoned newer one (restore would pick the abandoned one).
  if (opts_.rank == 0 && !gone.empty()) {
    Status s = SyncDir(env_, opts_.run_dir);
    if (!s.ok() && failure.ok()) failure = s;
  }
  std::lock_guard<std::mutex> l(mu_);
  for (uint64_t v : gone) {
    foreign_.erase(v);
    committed_.erase(v);
  }
  retired_log_.insert(retired_log_.end(), retired->begin(), retired->end());
  published_ = committed_.empty() ? -1 : static_cast<int64_t>(*committed_.rbegin());
  return failure;  // on failure the renames done stay done, and the save must not proceed
}

Status Engine::PrepareDir(Job* j) {
  const std::string& dir = opts_.run_dir;
  j->tmp_dir = JoinPath(dir, TmpDirName(j->step, j->attempt));
  j->final_dir = JoinPath(dir, StepDirName(j->step));
  j->shard_path = JoinPath(j->tmp_dir, ShardFileName(opts_.rank));
  if (opts_.world_size > 1) {
    // Shared directory: whoever comes first claims an expired checkpoint's directory for it (its
    // shards are overwritten in place), or creates it; remove only what is ours. Without
    // retention (keep_last 0, and the DCP backend's engines) no free-K directory ever appears,
    // so the listing of RUN_DIR is skipped.
    if (opts_.keep_last == 0 || !ClaimFreeDir(env_, opts_.run_dir, j->tmp_dir)) {
      int r = env_->Mkdir(j->tmp_dir);
      if (r < 0 && r != -EEXIST) return Status::FromErrno(-r, "create " + j->tmp_dir);
    }
    for (const std::string& n : {DoneRecordName(opts_.rank), FailedRecordName(opts_.rank)})
      env_->Unlink(JoinPath(j->tmp_dir, n));
  } else {
    ALPSCK_RETURN_IF_ERROR(PrepareOwnDir(j));
  }
  ALPSCK_RETURN_IF_ERROR(OpenMaybeDirect(env_, j->shard_path, O_WRONLY | O_CREAT, direct_io_, &j->fd, &j->direct));
  const uint64_t want = j->index.layout.data_padded + align_;
  int r = env_->FAllocate(j->fd, want);
  if (r == -ENOSPC || r == -EDQUOT)
    return Status::FromErrno(-r, "preallocate " + std::to_string(want) + " bytes for " + j->shard_path);
  return Status::Ok();  // other fallocate failures (EOPNOTSUPP) only cost the preallocation
}

Status Engine::PrepareOwnDir(Job* j) {
  std::string reuse;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!free_dirs_.empty()) {
      reuse = free_dirs_.back();
      free_dirs_.pop_back();
    }
  }
  if (env_->IsDir(j->tmp_dir) == 1) RemoveDirFiles(env_, j->tmp_dir);  // left by a failed save
  if (!reuse.empty() && env_->Rename(reuse, j->tmp_dir) == 0) {
    // Keep only our shard file: its blocks are overwritten in place (no new allocation).
    std::vector<std::string> names;
    if (env_->ListDir(j->tmp_dir, &names) == 0)
      for (const auto& n : names)
        if (n != ShardFileName(opts_.rank)) env_->Unlink(JoinPath(j->tmp_dir, n));
  } else {
    if (!reuse.empty()) RemoveDirFiles(env_, reuse);
    int r = env_->Mkdir(j->tmp_dir);
    if (r < 0) return Status::FromErrno(-r, "create " + j->tmp_dir);
  }
  return Status::Ok();
}

Status Engine::Save(uint64_t step, const std::vector<SaveExtent>& extents, const std::string& meta, SaveMode mode,
                    std::shared_ptr<SaveHandle>* handle, CommitMode commit, std::shared_ptr<ExternalFill>* fill) {
  const bool copy = mode != SaveMode::kZeroCopy;  // the bytes go through staging slots
  const bool external = mode == SaveMode::kExternal;
  if (external && !fill) return Status::Invalid("an external-fill save needs somewhere to return its filler");
  const Clock::time_point t0 = Clock::now();
  auto job = std::make_unique<Job>();
  job->step = step;
  job->commit = commit;
  job->t0 = t0;
  job->handle = std::make_shared<SaveHandle>(step);
  std::vector<std::pair<std::string, uint64_t>> sizes;
  sizes.reserve(extents.size());
  for (const auto& e : extents) {
    if (!e.data && e.size && !external) return Status::Invalid("extent " + e.name + " has no memory");
    sizes.emplace_back(e.name, e.size);
  }
  ALPSCK_RETURN_IF_ERROR(PlanLayout(sizes, align_, chunk_bytes_, kDefaultPackAlign, &job->index.layout));
  job->index.meta = meta;
  job->index.rank = opts_.rank;
  job->index.save_id = NewSaveId();
  const ShardLayout& layout = job->index.layout;
  job->index.crcs.assign(layout.num_chunks(), 0);
  // PlanLayout keeps the input order, so srcs[k] belongs to layout.extents[k].
  for (const auto& e : extents) job->srcs.push_back(static_cast<const char*>(e.data));

  {
    std::unique_lock<std::mutex> l(mu_);
    if (closed_) return Status::Error(Code::kAborted, "engine is closed");
    // A step of another history is saved anew (Supersede retires the old one below).
    if (committed_.count(step) && !(opts_.one_history && foreign_.count(step))) {
      SaveResult r;
      r.step = step;
      r.skipped = true;
      r.path = JoinPath(opts_.run_dir, StepDirName(step));
      job->handle->Complete(Status::Ok(), r);
      *handle = job->handle;
      return Status::Ok();
    }
    if (in_flight_steps_.count(step)) return Status::Invalid("step " + std::to_string(step) + " is already being saved");
    admit_cv_.wait(l, [&] { return closed_ || in_flight_ < opts_.max_in_flight; });
    // Close() during the wait: WaitAll may already have seen nothing in flight, and the writers
    // stop next, so this save must not start.
    if (closed_) return Status::Error(Code::kAborted, "engine is closed");
    ++in_flight_;
    in_flight_steps_.insert(step);
    if (opts_.world_size > 1) job->attempt = attempts_[step]++;
  }
  auto abandon = [&](const Status& s) {
    if (job->fd >= 0) env_->Close(job->fd);
    if (opts_.world_size == 1) RemoveDirFiles(env_, job->tmp_dir);
    else FailShared(job.get(), s.message());
    std::lock_guard<std::mutex> l(mu_);
    --in_flight_;
    in_flight_steps_.erase(step);
    admit_cv_.notify_all();
    return s;
  };
  Status s = PrepareDir(job.get());
  if (!s.ok()) return abandon(s);
  if (opts_.one_history) {
    // After PrepareDir (a failure aborts this step on every rank; nothing moves for a save that
    // cannot even start), before any chunk can reach the commit.
    std::vector<std::pair<uint64_t, std::string>> retired;
    s = Supersede(step, &retired);
    if (!s.ok()) return abandon(s);
  }
  if (copy) {
    std::lock_guard<std::mutex> l(pool_init_mu_);
    const uint64_t slots = std::max<uint64_t>(opts_.max_in_flight * layout.num_chunks() + writers_.size(), 1);
    if (!pool_.initialized()) {
      s = pool_.Init(chunk_bytes_, slots);
      if (!s.ok()) return abandon(s);
    } else if (!opts_.staging_bytes && !external && slots > pool_.slots()) {
      // A first save before the optimizer had state sized the pool for a third of the state:
      // follow the largest save, so later ones are not throttled to the writers' pace. Failure
      // only costs that: the smaller pool still streams.
      pool_.Grow(slots - pool_.slots());
    }
  }

  // One extra count held by this thread until every chunk is queued, so the commit can never
  // start early (and an empty state still commits, through a finalize task).
  const uint64_t n = layout.num_chunks();
  job->remaining.store(n + 1);
  Job* j = job.release();
  *handle = j->handle;
  if (external) {
    j->srcs.clear();
    *fill = std::make_shared<ExternalFill>(this, j);  // holds the extra count until Finish
    return Status::Ok();
  }
  if (copy) {
    SnapshotChunks(j, mode == SaveMode::kSnapshotOverlap);
  } else {
    for (uint64_t i = 0; i < n; ++i) Push({j, i, nullptr});
  }
  j->t_snap = Clock::now();
  if (copy) j->srcs.clear();  // the caller's memory is no longer referenced
  ChunkDone(j);
  return Status::Ok();
}

void Engine::SnapshotChunks(Job* j, bool overlap) {
  const ShardLayout& layout = j->index.layout;
  const uint64_t n = layout.num_chunks();
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
        if (slot) GatherChunk(layout, j->srcs, i, slot);
        else j->Fail(Status::Error(Code::kAborted, "staging pool closed during save of step " + std::to_string(j->step)));
      }
      if (overlap || !slot) {
        Push({j, i, slot});
      } else {
        std::lock_guard<std::mutex> l(held_mu);
        held.push_back({j, i, slot});
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

void Engine::WriterLoop(uint32_t index) {
  if (!opts_.pin_cpus.empty()) PinCurrentThread(opts_.pin_cpus[index % opts_.pin_cpus.size()]);
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
    WriteChunk(t.job, t.chunk, t.slot, bounce.data());
    if (t.slot) pool_.Release(t.slot);
    ChunkDone(t.job);
  }
}

void Engine::WriteChunk(Job* j, uint64_t i, const char* slot, char* bounce) {
  if (j->failed.load(std::memory_order_acquire)) return;
  const ShardLayout& l = j->index.layout;
  const char* buf = slot;
  if (!buf) {
    buf = DirectSource(l, j->srcs, i, j->direct ? align_ : 1);
    if (!buf) {
      GatherChunk(l, j->srcs, i, bounce);
      buf = bounce;
    }
  }
  const uint64_t len = l.chunk_len(i);
  j->index.crcs[i] = Crc32c(buf, len);
  Status s = WriteFull(env_, j->fd, buf, len, l.chunk_begin(i), j->shard_path);
  if (!s.ok()) j->Fail(s);
}

void Engine::FailShared(Job* j, const std::string& why) {
  if (j->tmp_dir.empty()) return;
  if (opts_.rank == 0) AbortStep(env_, j->tmp_dir, why);  // the coordinator decides at once
  else WriteFailedRecord(env_, j->tmp_dir, opts_.rank, why);
}

void Engine::Finish(Job* j) {
  std::unique_ptr<Job> owned(j);
  SaveResult& r = j->result;
  r.step = j->step;
  r.direct_io = j->direct;
  r.snapshot_seconds = Seconds(j->t0, j->t_snap);
  Status s;
  ShardRecord rec;
  rec.name = ShardFileName(opts_.rank);
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
    r.bytes = rec.bytes;
    j->record = rec;
  }
  if (j->fd >= 0) env_->Close(j->fd);
  j->fd = -1;

  if (opts_.world_size == 1 && j->commit == CommitMode::kAuto) {
    if (s.ok()) s = Commit(j, {rec});
    if (!s.ok()) {
      // Nothing of a failed save is ever published: its directory never lost the .tmp suffix
      // (or, if only the final fsync failed, it is removed again, best effort).
      RemoveDirFiles(env_, env_->IsDir(j->tmp_dir) == 1 ? j->tmp_dir : j->final_dir);
    }
    Complete(std::move(owned), s, r);
    return;
  }

  // Several ranks, or a deferred commit: the shard is durable; say so with a DONE record.
  if (s.ok()) {
    s = WriteDoneRecord(env_, j->tmp_dir, opts_.rank, rec);
    // The coordinator may have aborted the step meanwhile, removing the record half-published:
    // its verdict, not the failed rename, is what this save's caller needs to hear.
    if (!s.ok()) AbortVerdict(env_, j->tmp_dir, j->step, &s);
  }
  if (!s.ok()) {
    FailShared(j, s.message());
    Complete(std::move(owned), s, r);
    return;
  }
  if (j->commit == CommitMode::kDeferred) {
    r.path = j->tmp_dir;  // sealed, not committed
    Complete(std::move(owned), s, r);
    return;
  }
  {
    std::lock_guard<std::mutex> l(c_mu_);
    commit_queue_.push_back(owned.release());
  }
  c_cv_.notify_one();
}

Status Engine::Commit(Job* j, std::vector<ShardRecord> shards) {
  CommitRequest req;
  req.run_dir = opts_.run_dir;
  req.tmp_dir = j->tmp_dir;
  req.final_dir = j->final_dir;
  req.step = j->step;
  req.shards = std::move(shards);
  req.write_seconds = Seconds(j->t0, Clock::now());
  return CommitCheckpoint(env_, req);
}

void Engine::CommitterLoop() {
  for (;;) {
    std::unique_ptr<Job> j;
    {
      std::unique_lock<std::mutex> l(c_mu_);
      c_cv_.wait(l, [&] { return c_stopping_ || !commit_queue_.empty(); });
      if (commit_queue_.empty()) return;
      j.reset(commit_queue_.front());
      commit_queue_.pop_front();
    }
    Status s;
    if (opts_.rank == 0) {
      std::vector<ShardRecord> shards;
      s = WaitForShards(env_, j->tmp_dir, opts_.world_size, opts_.commit_timeout_s, &shards);
      if (s.ok()) s = Commit(j.get(), std::move(shards));
      if (!s.ok()) AbortStep(env_, j->tmp_dir, s.message());
      // The directories of this step's aborted attempts: every rank's DONE record for this
      // attempt says it finished the earlier ones, so nothing writes there any more.
      for (uint32_t a = 0; s.ok() && a < j->attempt; ++a) {
        const std::string old = JoinPath(opts_.run_dir, TmpDirName(j->step, a));
        if (env_->IsDir(old) == 1) RemoveDirFiles(env_, old);
      }
    } else {
      s = WaitForCommit(env_, opts_.run_dir, j->step, j->tmp_dir, opts_.commit_timeout_s, &j->record);
    }
    SaveResult r = j->result;
    Complete(std::move(j), s, r);
  }
}

void Engine::Complete(std::unique_ptr<Job> j, Status s, SaveResult r) {
  const bool committed = s.ok() && j->commit == CommitMode::kAuto;
  if (committed) r.path = j->final_dir;
  if (!s.ok()) r.path.clear();
  bool publish = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    // Before the handle completes: a caller that saw it fail may save the same step again at
    // once (nothing below touches this step's files).
    in_flight_steps_.erase(j->step);
    if (committed) {
      committed_.insert(j->step);
      attempts_.erase(j->step);
      publish = static_cast<int64_t>(j->step) > published_;
      // Several ranks: rank 0 expires old steps on disk (RetainNewest); forget them here too.
      while (opts_.world_size > 1 && opts_.keep_last && committed_.size() > opts_.keep_last)
        committed_.erase(committed_.begin());
    }
  }
  if (publish) {
    // Serialised so that two commits racing here cannot leave an older step in LATEST.
    std::lock_guard<std::mutex> pl(publish_mu_);
    bool still_newest;
    {
      std::lock_guard<std::mutex> l(mu_);
      still_newest = static_cast<int64_t>(j->step) > published_;
      if (still_newest) published_ = static_cast<int64_t>(j->step);
    }
    if (still_newest && opts_.rank == 0) {
      Status p = PublishLatest(env_, opts_.run_dir, j->step);
      if (!p.ok()) r.warning = "LATEST not updated: " + p.message();
    }
  }
  if (committed && opts_.rank == 0) ApplyRetention(&r.warning);
  r.durable_seconds = Seconds(j->t0, Clock::now());
  // Complete the handle before releasing the in-flight slot, so that WaitAll() returning
  // implies every handle is done.
  j->handle->Complete(s, r);
  {
    std::lock_guard<std::mutex> l(mu_);
    --in_flight_;
  }
  admit_cv_.notify_all();
}

void Engine::ApplyRetention(std::string* warning) {
  if (opts_.keep_last == 0) return;
  std::lock_guard<std::mutex> rl(retention_mu_);
  if (opts_.world_size > 1) {  // through the file system: any rank may claim a free directory
    std::string w = RetainNewest(env_, opts_.run_dir, opts_.keep_last, opts_.max_in_flight);
    if (!w.empty() && warning->empty()) *warning = w;
    return;
  }
  std::vector<uint64_t> victims;
  {
    std::lock_guard<std::mutex> l(mu_);
    while (committed_.size() > opts_.keep_last) {
      victims.push_back(*committed_.begin());
      committed_.erase(committed_.begin());
    }
  }
  if (victims.empty()) return;
  std::vector<std::string> expired;  // renamed to free-K, reusable once that rename is durable
  for (uint64_t v : victims) {
    const std::string path = JoinPath(opts_.run_dir, StepDirName(v));
    std::string free_path;
    bool keep;
    {
      std::lock_guard<std::mutex> l(mu_);
      keep = free_dirs_.size() + expired.size() < opts_.max_in_flight;
      free_path = JoinPath(opts_.run_dir, kFreePrefix + std::to_string(free_seq_++) + "-" + std::to_string(::getpid()));
    }
    // Renaming first makes the expiry atomic: the directory stops being a checkpoint at once.
    int r = env_->Rename(path, free_path);
    if (r < 0) {
      if (warning->empty()) *warning = Status::FromErrno(-r, "retention: rename " + path).message();
      continue;
    }
    env_->Unlink(JoinPath(free_path, kManifestName));
    if (keep) {
      expired.push_back(free_path);
    } else {
      Status s = RemoveDirFiles(env_, free_path);
      if (!s.ok() && warning->empty()) *warning = "retention: " + s.message();
    }
  }
  Status s = SyncDir(env_, opts_.run_dir);
  if (!s.ok()) {
    // Not reused (a later Open reclaims them): see below.
    if (warning->empty()) *warning = "retention: " + s.message();
    return;
  }
  // Only now may a save reuse the expired directories and overwrite their shards in place.
  // Before this fsync the renames were not durable: a power loss could bring back step-N over a
  // half-overwritten shard, a corrupt checkpoint (found by test_crash_states: recycling_...).
  std::lock_guard<std::mutex> l(mu_);
  for (std::string& f : expired) free_dirs_.push_back(std::move(f));
}

}  // namespace alpsck
