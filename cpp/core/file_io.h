// File helpers built on Env: full transfers (retrying EINTR and short transfers), O_DIRECT with
// a reported buffered fallback, directory fsync, and small durable files. Every error names the
// path.
#pragma once

#include <cstdint>
#include <string>

#include "env.h"
#include "status.h"

namespace alpsck {

// Closes the fd through its Env on destruction unless released.
class ScopedFd {
 public:
  ScopedFd(Env* env, int fd) : env_(env), fd_(fd) {}
  ~ScopedFd() { Reset(); }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int Release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void Reset() {
    if (fd_ >= 0) env_->Close(fd_);
    fd_ = -1;
  }

 private:
  Env* env_;
  int fd_;
};

std::string JoinPath(const std::string& dir, const std::string& name);
std::string ParentDir(const std::string& path);

// Opens path with flags; when want_direct, first with O_DIRECT and, if the file system refuses
// it (EINVAL, as tmpfs does), again without. *direct says which one succeeded. Opened for
// writing, a symlink at path is refused (kInvalidArgument), never written through.
Status OpenMaybeDirect(Env* env, const std::string& path, int flags, bool want_direct, int* fd, bool* direct);

Status WriteFull(Env* env, int fd, const void* buf, uint64_t n, uint64_t off, const std::string& path);
// Reads exactly n bytes; a file that ends early is kCorrupt ("truncated").
Status ReadFull(Env* env, int fd, void* buf, uint64_t n, uint64_t off, const std::string& path);
// fsync (data_only: fdatasync), retried while it fails with EINTR: an interrupted sync did not
// finish, and a signal (a SLURM stop signal delivered to a writer thread) is no I/O error.
// 0 or -errno.
int SyncFd(Env* env, int fd, bool data_only);
Status SyncDir(Env* env, const std::string& dir);
// Creates (or truncates) path, writes data, fsyncs and closes it. No rename: for files inside a
// directory that is not yet visible as committed. A symlink at path is refused, never followed.
// likely_new: the name is most likely free (a manifest in a new directory, LATEST.tmp): it is
// created with O_EXCL first, which needs no look at what it is (one metadata call); otherwise (or
// when the name is taken) it is opened and checked as OpenMaybeDirect does.
Status WriteFileSynced(Env* env, const std::string& path, const std::string& data, bool likely_new = true);
// WriteFileSynced without the fsync: for a file that must be whole when it is read (its writer renames it
// into place), never durable (coordinate.cc's records: a crash discards the directory they are in).
Status WriteFileUnsynced(Env* env, const std::string& path, const std::string& data);
// Written whole under tmp_path (the caller names it: run_dir.h's TempFileName), fsync, rename to path,
// fsync(parent): the file is either old or new after a crash.
Status WriteFileAtomic(Env* env, const std::string& path, const std::string& tmp_path, const std::string& data);
// Reads a whole file of at most max_bytes (larger is kCorrupt).
Status ReadSmallFile(Env* env, const std::string& path, uint64_t max_bytes, std::string* out);
// Removes a directory and the plain files in it (one level; checkpoints have no subdirectories).
// A symlink at dir is refused and left alone (never followed into); files inside that are
// symlinks are removed as links, their targets untouched.
Status RemoveDirFiles(Env* env, const std::string& dir);

}  // namespace alpsck
