// DeferredDirSync: the fsync of directories in which a caller just created names (a new run
// directory's parent), taken off the path of opening an engine. The directories are opened at
// once (Add), fsync'ed later on a background thread (Run: the engine's committer, while the first
// save is copied and written), and every save waits for that before its shard counts as durable
// (Wait), so no checkpoint is reported durable while the name of the directory holding it is not.
//
// A failed fsync is kept and tried again by the next Wait (the caller's save fails with it,
// naming the directory); one that succeeded closes the descriptors.
//
// Thread-safety: every method may be called from any thread; Run is meant for one.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "env.h"
#include "status.h"

namespace alpsck {

class DeferredDirSync {
 public:
  explicit DeferredDirSync(Env* env) : env_(env) {}
  ~DeferredDirSync();
  DeferredDirSync(const DeferredDirSync&) = delete;
  DeferredDirSync& operator=(const DeferredDirSync&) = delete;

  // Opens dir (before the Env is confined below it: a parent lies outside). Before Run only.
  Status Add(const std::string& dir);
  void Run();     // fsyncs what was added; every Wait until then blocks
  Status Wait();  // OK once every directory added is synced; a failure is retried here once

 private:
  Status SyncLocked();  // mu_ held

  Env* env_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::string, int>> dirs_;  // (name, fd) not yet synced
  bool ran_ = false;
  Status status_;  // of the last attempt
};

}  // namespace alpsck
