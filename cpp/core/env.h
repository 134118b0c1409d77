// Env: the one layer through which the core makes every file-system syscall.
//
// Each method is a thin wrapper of one syscall and returns its result or -errno (never throws,
// never retries: retry policy for EINTR and short transfers lives in file_io.h). Because nothing
// else in the core touches the file system directly, tests swap in a FaultEnv that injects
// EIO, ENOSPC, short writes or EINTR at chosen calls (env_fault.h), or a recording Env that
// replays the states a power loss could leave (env_record.h). Both are test doubles: they live in
// the alpsck_test_doubles library, not in the core's (CMakeLists.txt).
//
// Thread-safety: implementations must be callable from many threads at once.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace alpsck {

// What fstat says of an open file, the fields alpsck decides on.
struct FileStat {
  uint64_t size = 0;
  uint64_t nlink = 0;  // hard links: a file linked elsewhere too is never overwritten in place
  uint64_t uid = 0;
  uint32_t mode = 0;   // st_mode (type and permission bits)
  int64_t mtime_s = 0;  // last modification, seconds since the epoch
};

struct DirectIoInfo {
  uint64_t mem_align = 0;     // required buffer alignment (0: unknown)
  uint64_t offset_align = 0;  // required file offset / length alignment (0: unknown)
};

class Env {
 public:
  virtual ~Env() = default;
  virtual int Open(const std::string& path, int flags, mode_t mode) = 0;  // fd or -errno
  virtual int Close(int fd) = 0;
  virtual ssize_t PWrite(int fd, const void* buf, size_t n, uint64_t off) = 0;
  virtual ssize_t PRead(int fd, void* buf, size_t n, uint64_t off) = 0;
  virtual int FDataSync(int fd) = 0;
  virtual int FSync(int fd) = 0;
  virtual int FAllocate(int fd, uint64_t len) = 0;  // -EOPNOTSUPP where the FS cannot
  virtual int FTruncate(int fd, uint64_t len) = 0;
  virtual int FileSize(int fd, uint64_t* size) = 0;
  virtual int FStat(int fd, FileStat* st) = 0;
  virtual int DirectIo(int fd, DirectIoInfo* info) = 0;  // statx(STATX_DIOALIGN)
  virtual int Rename(const std::string& from, const std::string& to) = 0;
  // rename that fails with -EEXIST when `to` exists (renameat2 RENAME_NOREPLACE), also when it is
  // an empty directory, which a plain rename would replace. -EINVAL (or -ENOSYS) where the file
  // system or kernel cannot: the default, for an Env without it.
  virtual int RenameNoReplace(const std::string& from, const std::string& to) {
    (void)from;
    (void)to;
    return -22;  // EINVAL
  }
  virtual int Mkdir(const std::string& path) = 0;
  virtual int Unlink(const std::string& path) = 0;
  virtual int Rmdir(const std::string& path) = 0;
  // Names in a directory, without "." and "..".
  virtual int ListDir(const std::string& path, std::vector<std::string>* names) = 0;
  // 1 if path is a directory, 0 if something else exists there, -errno otherwise.
  virtual int IsDir(const std::string& path) = 0;
  // 1 only for a directory (not a symlink to one: lstat) owned by this process's effective user;
  // 0 if something else exists there. What alpsck checks before it writes into, recycles or
  // deletes in a directory of the run directory: another user's directory in a shared run
  // directory is never alpsck's to touch.
  virtual int IsOwnDir(const std::string& path) = 0;
  // lstat: what is at path itself (a symbolic link is itself, never followed).
  virtual int LStat(const std::string& path, FileStat* st) = 0;
  // flock(2) on an open file: LOCK_EX, LOCK_SH or LOCK_UN, with LOCK_NB -EWOULDBLOCK when held.
  virtual int Flock(int fd, int op) = 0;

  // Confinement (what keeps alpsck inside a run directory). Between Confine(root) and the matching
  // Unconfine(root) (calls nest and count), every path strictly below `root` is resolved one
  // component at a time from a descriptor of `root`, never following a symbolic link below it
  // (openat/renameat/unlinkat/mkdirat with O_NOFOLLOW, O_DIRECTORY for every directory on the
  // way): a symlink where alpsck expects its own entry fails with -ELOOP (or -ENOTDIR for another
  // kind of file on the way), also when it was swapped in after a check. `root` itself is the
  // user's path and may contain symlinks; it is opened once, at the first Confine, and that
  // directory is the root until the last Unconfine (a root renamed meanwhile is followed, not
  // looked up again). The default does nothing (an Env without the *at calls).
  virtual void Confine(const std::string& root) { (void)root; }
  virtual void Unconfine(const std::string& root) { (void)root; }

  // The process-wide POSIX implementation.
  static Env* Default();
};

// Confines `root` in `env` for its lifetime (Env::Confine/Unconfine). Every writer of a run
// directory holds one: the Engine, and each binding that changes a run directory on its own.
class ConfinedRoot {
 public:
  ConfinedRoot(Env* env, std::string root) : env_(env), root_(std::move(root)) { env_->Confine(root_); }
  ~ConfinedRoot() { env_->Unconfine(root_); }
  ConfinedRoot(const ConfinedRoot&) = delete;
  ConfinedRoot& operator=(const ConfinedRoot&) = delete;

 private:
  Env* env_;
  std::string root_;
};

}  // namespace alpsck
