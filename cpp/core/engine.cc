#include "engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "chunk_pipeline.h"
#include "commit_attempt.h"
#include "coordinate.h"
#include "file_io.h"
#include "options.h"
#include "platform.h"
#include "save_job.h"

namespace alpsck {

namespace {

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

// ---------------------------------------------------------------- Engine

Engine::Engine(const EngineOptions& opts)
    : opts_(opts),
      env_(opts.env ? opts.env : Env::Default()),
      history_(env_, opts_.run_dir, opts_.rank, RetentionOf(opts_)),
      published_(env_, opts_.run_dir, opts_.rank == 0),
      spares_(env_, opts_.run_dir, opts_.rank, opts_.keep_last != 0, opts_.max_in_flight),
      dir_sync_(env_) {}

Status Engine::Open(const EngineOptions& opts, std::unique_ptr<Engine>* out) {
  if (opts.run_dir.empty()) return Status::Invalid("run_dir is empty");
  ALPSCK_RETURN_IF_ERROR(CheckEngineOptions(opts));
  if (opts.world_size == 0 || opts.rank >= opts.world_size)
    return Status::Invalid("rank " + std::to_string(opts.rank) + " is not below world_size " + std::to_string(opts.world_size));
  std::unique_ptr<Engine> e(new Engine(opts));
  ALPSCK_RETURN_IF_ERROR(e->Init());
  *out = std::move(e);
  return Status::Ok();
}

Status Engine::Init() {
  ALPSCK_RETURN_IF_ERROR(CheckNumaNode(opts_.numa_node));  // before anything is created
  const std::string& dir = opts_.run_dir;
  for (const std::string& u : opts_.unsynced_dirs) ALPSCK_RETURN_IF_ERROR(dir_sync_.Add(u));
  int d = env_->IsDir(dir);
  if (d == -ENOENT) {
    int r = env_->Mkdir(dir);
    if (r < 0 && r != -EEXIST) return Status::FromErrno(-r, "create run directory " + dir);
    // Its name durable in its parent before any save inside is (dir_sync.h), or a power loss could
    // take every checkpoint committed there.
    if (r == 0) ALPSCK_RETURN_IF_ERROR(dir_sync_.Add(ParentDir(dir)));
    d = env_->IsDir(dir);
  }
  if (d < 0) return Status::FromErrno(-d, "run directory " + dir);
  if (d == 0) return Status::Invalid("run directory " + dir + " exists but is not a directory");
  // From here on, nothing below RUN_DIR is reached through a symlink (env.h).
  confined_ = std::make_unique<ConfinedRoot>(env_, dir);
  if (opts_.store) store_clients_ = std::make_unique<KvClientPool>(opts_.store);

  // Probe: can this file system do O_DIRECT, and with which alignment? Also proves the
  // directory is writable before the first save.
  const std::string probe = JoinPath(dir, ProbeFileName(opts_.rank, static_cast<uint64_t>(::getpid())));
  int fd = -1;
  bool direct = false;
  // A new name (this process's): made with O_EXCL, it needs no check of what it is (file_io.h), one metadata
  // call fewer, and no truncation; only a leftover of this pid (a process before it, killed) is opened as it is.
  Status s = OpenMaybeDirect(env_, probe, O_WRONLY | O_CREAT | O_EXCL, opts_.direct_io, &fd, &direct);
  if (!s.ok() && s.err() == EEXIST)
    s = OpenMaybeDirect(env_, probe, O_WRONLY | O_CREAT | O_TRUNC, opts_.direct_io, &fd, &direct);
  if (!s.ok()) return Status::Error(s.code(), "run directory " + dir + " is not writable: " + s.message(), s.err());
  DirectIoInfo dio;
  if (direct && env_->DirectIo(fd, &dio) == 0 && dio.offset_align == 0) dio.offset_align = 4096;
  env_->Close(fd);
  env_->Unlink(probe);
  direct_io_ = direct;
  align_ = std::max<uint64_t>({PageSize(), dio.mem_align, dio.offset_align, 512});
  chunk_bytes_ = RoundUp(opts_.chunk_bytes, align_);

  // What is already there: committed steps (a manifest exists; recovery does the deep checks).
  // Rank 0 tidies the rest (run_dir_actions.h: TidyRunDir); the other ranks may not: rank 0 opens
  // first, and the others may be writing by the time they open.
  // One listing for both: the tidying never touches a step-N directory, all the history reads.
  std::vector<std::string> names;
  if (int r = env_->ListDir(dir, &names); r < 0) return Status::FromErrno(-r, "list run directory " + dir);
  if (opts_.rank == 0) spares_.Tidy(opts_.world_size, &names);
  ALPSCK_RETURN_IF_ERROR(history_.Load(&names));
  published_.Load(history_.newest());

  pipeline_ = std::make_unique<ChunkPipeline>(opts_, env_, align_, chunk_bytes_,
                                              [this](std::unique_ptr<SaveJob> j, Status s) { Sealed(std::move(j), s); });
  ALPSCK_RETURN_IF_ERROR(pipeline_->Start());
  committer_ = std::thread([this] { CommitterLoop(); });
  return Status::Ok();
}

Status Engine::CheckNumaNode(int node) {
  if (node < 0) return Status::Ok();
  const std::vector<int> nodes = CpuNumaNodes();
  if (std::find(nodes.begin(), nodes.end(), node) == nodes.end()) {
    std::string have;
    for (int n : nodes) have += (have.empty() ? "" : ", ") + std::to_string(n);
    return Status::Invalid("numa_node " + std::to_string(node) + " is not a NUMA node with CPUs on this machine (" +
                           (have.empty() ? "none found in /sys/devices/system/node/has_cpu" : "those: " + have) + ")");
  }
  // A page placed there now, so that a kernel refusing placement fails here, not at the first save.
  PrefaultedMemory probe;
  if (!probe.Map(PageSize(), node))
    return Status::FromErrno(errno, "numa_node " + std::to_string(node) + ": place memory on that node (mbind)");
  return Status::Ok();
}

Engine::~Engine() { Close(); }

void Engine::Close() {
  if (Forked()) return;  // the threads to stop are the parent's (engine.h)
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    closed_ = true;
  }
  if (pipeline_) pipeline_->StopPreparing();
  admit_cv_.notify_all();  // a Save waiting for an in-flight slot fails now (it re-checks closed_)
  WaitAll();
  if (pipeline_) pipeline_->StopWriters();
  {
    std::lock_guard<std::mutex> l(c_mu_);
    c_stopping_ = true;
  }
  c_cv_.notify_all();
  if (committer_.joinable()) committer_.join();
  if (pipeline_) pipeline_->Close();  // also ends a Prepare still faulting the pool in
}

Status Engine::ForkedError() const {
  return Status::Invalid("this checkpointer was opened by process " + std::to_string(owner_pid_) + "; process " +
                         std::to_string(::getpid()) + " is a fork of it, where its writer threads and staging memory "
                         "do not exist: open a new checkpointer in the child to save from it");
}

void Engine::WaitAll() {
  if (Forked()) return;  // the saves in flight are the parent's (engine.h)
  std::unique_lock<std::mutex> l(mu_);
  admit_cv_.wait(l, [&] { return in_flight_ == 0; });
}

uint32_t Engine::in_flight() const {
  std::lock_guard<std::mutex> l(mu_);
  return in_flight_;
}

uint32_t Engine::threads() const { return pipeline_->threads(); }
uint32_t Engine::copy_threads() const { return pipeline_->copy_threads(); }
uint32_t Engine::writers_started() const { return pipeline_->writers_started(); }
uint64_t Engine::staging_bytes() const { return pipeline_->pool().size(); }
char* Engine::staging_base() const { return pipeline_->pool().base(); }
uint64_t Engine::staging_slots() const { return pipeline_->pool().slots(); }
uint64_t Engine::staging_free_slots() const { return pipeline_->pool().free_slots(); }

void Engine::Prepare(const std::vector<uint64_t>& sizes) {
  if (Forked()) return;  // the parent's pool (engine.h)
  pipeline_->Prepare(sizes);
}

void Engine::WaitPrepared() {
  if (Forked()) return;  // the preparer is the parent's (engine.h)
  pipeline_->WaitPrepared();
}

Status Engine::PrepareDir(SaveJob* j) {
  j->tmp_dir = j->commit_attempt->attempt().tmp_dir();
  j->final_dir = j->commit_attempt->attempt().final_dir();
  j->shard_path = JoinPath(j->tmp_dir, ShardFileName(opts_.rank));
  // The attempt's directory is shared: the first rank to come claims the expired checkpoint's
  // directory rank 0 named for this save (its shards are overwritten in place), or creates it.
  // No rank lists RUN_DIR: the name came with the last verdict, and the claim never replaces a
  // directory another rank made (ClaimDir). A rank that made or claimed the directory knows it is
  // ours; one that found it in place (another rank's, or anything else at the name) looks.
  const SpareDirs::Claim claim = spares_.ClaimFor(j->tmp_dir);
  const bool known_ours = claim == SpareDirs::Claim::kClaimed;
  const bool exists = claim == SpareDirs::Claim::kTakenByOther;  // most likely for this save
  bool recycled = claim != SpareDirs::Claim::kNone;
  int own = known_ours ? 1 : exists ? env_->IsOwnDir(j->tmp_dir) : -ENOENT;
  if (own == -ENOENT) {
    recycled = false;
    const int r = env_->Mkdir(j->tmp_dir);
    if (r < 0 && r != -EEXIST) return Status::FromErrno(-r, "create " + j->tmp_dir);
    own = r == 0 ? 1 : env_->IsOwnDir(j->tmp_dir);
  }
  if (own < 0)  // gone again: another rank aborted the attempt (Save reads the verdict), or worse
    return Status::FromErrno(-own, "inspect " + j->tmp_dir);
  if (own == 0)  // something else took the name: never write through it
    return Status::Invalid(j->tmp_dir + " is a symbolic link, not a directory, or not ours: alpsck will not write through it");
  // Refused: once the attempt's directory exists (the abort that tells every rank renames it),
  // before the shard takes a byte.
  if (!j->refusal.ok()) return j->refusal;
  // A shard that is new (O_EXCL) needs no look at what it is; one in a recycled directory is
  // overwritten in place, after OpenMaybeDirect's checks. A claim can no longer replace a
  // directory under a rank's new shard (ClaimDir never replaces), so O_EXCL is safe.
  Status s = Status::Error(Code::kIoError, "", EEXIST);
  if (!recycled) s = OpenMaybeDirect(env_, j->shard_path, O_WRONLY | O_CREAT | O_EXCL, direct_io_, &j->fd, &j->direct);
  if (!s.ok() && s.err() == EEXIST)
    s = OpenMaybeDirect(env_, j->shard_path, O_WRONLY | O_CREAT, direct_io_, &j->fd, &j->direct);
  ALPSCK_RETURN_IF_ERROR(s);
  j->recycled = recycled;
  const uint64_t want = j->index.layout.data_padded + align_;
  if (!opts_.preallocate) return Status::Ok();  // options.cc: why one would not
  int r = env_->FAllocate(j->fd, want);
  if (r == -ENOSPC || r == -EDQUOT)
    return Status::FromErrno(-r, "preallocate " + std::to_string(want) + " bytes for " + j->shard_path);
  return Status::Ok();  // other fallocate failures (EOPNOTSUPP) only cost the preallocation
}

Status Engine::Save(const SaveRequest& req, std::shared_ptr<SaveHandle>* handle, std::shared_ptr<ExternalFill>* fill) {
  if (Forked()) return ForkedError();
  const uint64_t step = req.step;
  const std::vector<SaveExtent>& extents = req.extents;
  const SaveMode mode = req.mode;
  const CommitMode commit = req.commit;
  ALPSCK_RETURN_IF_ERROR(CheckNotes(req.notes));
  const bool external = mode == SaveMode::kExternal;
  if (external && !fill) return Status::Invalid("an external-fill save needs somewhere to return its filler");
  const Clock::time_point t0 = Clock::now();
  auto job = std::make_unique<SaveJob>();
  job->step = step;
  job->commit = commit;
  job->refusal = req.refusal;
  job->notes = req.notes;
  job->t0 = t0;
  job->handle = std::make_shared<SaveHandle>(step);
  std::vector<std::pair<std::string, uint64_t>> sizes;
  sizes.reserve(extents.size());
  for (const auto& e : extents) {
    if (!e.data && e.size && !external) return Status::Invalid("extent " + e.name + " has no memory");
    sizes.emplace_back(e.name, e.size);
  }
  ALPSCK_RETURN_IF_ERROR(PlanLayout(sizes, align_, chunk_bytes_, kDefaultPackAlign, &job->index.layout));
  job->index.meta = req.meta;
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
    if (history_.Skips(step, opts_.one_history)) {
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
    job->attempt = attempts_[step]++;
  }
  job->t_admitted = Clock::now();
  // A save that never started gives its in-flight slot back. An abort another rank decided is the
  // handle's to report (Save returns OK), whether this rank came after it or the attempt's
  // directory was renamed away while this one started: every rank but the one that failed hears
  // it the same way, and saves the step again. This rank's own failure is Save's error.
  auto end_unstarted = [&](const Status& out, bool by_other) {
    if (by_other) {
      job->handle->Complete(out, SaveResult{});
      *handle = job->handle;
    }
    std::lock_guard<std::mutex> l(mu_);
    --in_flight_;
    in_flight_steps_.erase(step);
    admit_cv_.notify_all();
    return by_other ? Status::Ok() : out;
  };
  auto abandon = [&](const Status& s) {  // aborts the attempt
    if (job->fd >= 0) env_->Close(job->fd);
    bool by_other = false;
    const Status out = job->commit_attempt->Fail(s, &by_other);
    return end_unstarted(out, by_other);
  };
  const Attempt at{opts_.run_dir, step, job->attempt};
  std::unique_ptr<KvStore> client;  // with a store the ranks meet there: no rank polls the file system
  if (store_clients_) {
    Status cs = store_clients_->Acquire(&client);
    if (!cs.ok()) return end_unstarted(StoreClientError(cs), false);
  }
  job->commit_attempt = std::make_unique<CommitAttempt>(
      env_, at, opts_.rank, opts_.commit_timeout_s,
      MakeAgreement(env_, at, std::move(client), opts_.store_ns, opts_.world_size,
                    // rank 0 of an engine's own commit holds its record at hand (engine_commit.cc)
                    commit == CommitMode::kAuto ? opts_.world_size - 1 : opts_.world_size, opts_.world_size,
                    opts_.commit_timeout_s));
  Status verdict;
  if (job->commit_attempt->AbortedAlready(&verdict))  // this rank comes late to it
    return end_unstarted(verdict, true);
  Status s = PrepareDir(job.get());
  if (!s.ok()) return abandon(s);
  if (opts_.one_history) {
    // After PrepareDir (a failure aborts this step on every rank; nothing moves for a save that
    // cannot even start), before any chunk can reach the commit.
    std::vector<std::pair<uint64_t, std::string>> retired;
    s = Supersede(step, &retired);
    if (!s.ok()) return abandon(s);
  }
  s = pipeline_->Reserve(layout, mode);
  if (!s.ok()) return abandon(s);
  // One extra count held until every chunk is queued, so the commit can never start early (and an
  // empty state still commits, through a finalize task).
  job->remaining.store(layout.num_chunks() + 1);
  SaveJob* j = job.release();
  *handle = j->handle;
  pipeline_->Feed(j, mode, fill);
  return Status::Ok();
}

// ---------------------------------------------------------------- histories (history.h)

void Engine::ContinueFrom(int64_t step) { history_.ContinueFrom(step); }

std::vector<std::pair<uint64_t, std::string>> Engine::TakeRetired() { return history_.TakeRetired(); }

Status Engine::Supersede(uint64_t step, std::vector<std::pair<uint64_t, std::string>>* retired) {
  retired->clear();
  if (Forked()) return ForkedError();  // renames belong to the parent's history (engine.h)
  {
    // Every one_history save comes here: the common case (nothing of another history left) must
    // not wait behind a retention in progress (its renames and fsync) for retention_mu_.
    std::lock_guard<std::mutex> l(mu_);
    if (!history_.HasForeign()) return closed_ ? Status::Error(Code::kAborted, "engine is closed") : Status::Ok();
  }
  std::lock_guard<std::mutex> rl(retention_mu_);  // retention renames step directories too
  std::vector<uint64_t> victims;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return Status::Error(Code::kAborted, "engine is closed");
    victims = history_.Victims(step);
    for (uint64_t v : victims)
      if (v != step && in_flight_steps_.count(v))  // (step itself: Save calls this for it)
        return Status::Invalid("step " + std::to_string(v) + " of an earlier history is being saved; call Supersede "
                               "before saving it");
  }
  if (victims.empty()) return Status::Ok();
  return history_.Retire(victims, &published_, retired);
}

}  // namespace alpsck
