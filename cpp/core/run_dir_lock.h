// The run directory's writer lock (its file's name: run_dir.h, LockFileName).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "env.h"
#include "status.h"

namespace alpsck {

// One writer per run directory, whatever kind (the engine, the DCP backend, the torch.save
// baseline, prune): an exclusive flock on RUN_DIR/.lock (LockFileName: rank R > 0 has its own),
// a regular file holding its owner (JSON: pid, host, job_id, rank), emptied on release. The kernel
// drops the flock when its owner dies, so a lock left by a crash is taken over at once. The name
// is never followed if it is a symlink, and never opened if it is not a regular file (a FIFO
// would block the open; a device would be opened), so taking or probing a lock never hangs and
// never touches anything outside the run directory. Every call goes through the Env given
// (Env::Default() unless a test passes its own).
class RunDirLock {
 public:
  // kBusy naming the holder (job, pid, host) when a live process holds it; kInvalidArgument when
  // the name is a symlink or not a regular file (saying what it is); errno errors otherwise.
  // When the owner recorded is a process of this host that has exited, a process it forked (a
  // DataLoader worker) holds the lock until it exits too: that is waited for up to
  // orphan_wait_s, then refused saying so.
  static Status Acquire(const std::string& run_dir, uint32_t rank, const std::string& owner_json,
                        std::unique_ptr<RunDirLock>* out, double orphan_wait_s = kOrphanLockWaitS,
                        Env* env = Env::Default());
  static constexpr double kOrphanLockWaitS = 30;
  // Whether a live process holds rank's lock, and the owner it recorded ("" when none); the
  // same refusals as Acquire. Takes nothing and changes nothing.
  static Status Probe(const std::string& run_dir, uint32_t rank, bool* held, std::string* owner,
                      Env* env = Env::Default());
  ~RunDirLock();  // Release()
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  // Empties the owner record and drops the flock (idempotent). In a process forked from the one
  // that took it, only closes that process's copy of the descriptor: the lock stays the parent's.
  void Release();
  const std::string& path() const { return path_; }

 private:
  RunDirLock(Env* env, int fd, std::string path) : env_(env), fd_(fd), path_(std::move(path)) {}
  Env* const env_;
  int fd_;
  std::string path_;
  const pid_t owner_pid_ = ::getpid();  // the process that took it (Release)
};

// The fields of an owner record (JSON {"pid", "host", "job_id"}, as the holder wrote it); a field
// that is missing or neither a string nor a number is empty, and so is every field of a record that
// is not a JSON object within the record's limits. The one parser of the record: the lock's
// messages, its orphan check and Python's lock_holder (through the binding) read it here.
struct LockOwner {
  std::string pid, host, job_id;
};
LockOwner ParseLockOwner(const std::string& owner_json);

// "{run_dir} is being written by job J (pid P) on host H" from an owner record (fields missing: ?).
std::string DescribeLockOwner(const std::string& run_dir, const std::string& owner_json);

}  // namespace alpsck
