// The POSIX Env: one syscall per method, -errno on failure; below a confined root (env.h), the
// *at form of that syscall on a descriptor of the parent reached without following symlinks.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__linux__) && __has_include(<linux/openat2.h>)
#include <linux/openat2.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string_view>
#include <utility>
#include <vector>

#include "env.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)  // linux/fs.h; glibc's stdio.h has it from 2.28
#endif

namespace alpsck {
namespace {

// A descriptor closed at scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Whether a relative path has a "." or ".." component (never walked: Resolve refuses them).
bool HasDotComponent(const std::string& rel) {
  size_t pos = 0;
  while (pos <= rel.size()) {
    size_t next = rel.find('/', pos);
    if (next == std::string::npos) next = rel.size();
    const std::string_view part(rel.data() + pos, next - pos);
    if (part == "." || part == "..") return true;
    pos = next + 1;
  }
  return false;
}

// openat for a directory below a confined root: a symlink there is -ELOOP (O_DIRECTORY alone
// would say -ENOTDIR), so every caller can name it for what it is.
int OpenDirNoFollow(int parent, const char* name, int flags) {
  int fd = ::openat(parent, name, flags | O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) return fd;
  int err = errno;
  struct stat st;
  if (err == ENOTDIR && ::fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) err = ELOOP;
  return -err;
}

// openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH): `rel` below `dir` resolved by the kernel in one
// call, never through a symlink (ELOOP) nor out of `dir`. -ENOSYS where the kernel (or qemu, or
// a seccomp filter) has no openat2: the caller walks the components instead.
int OpenBeneath(int dir, const std::string& rel, int flags, mode_t mode) {
#if defined(SYS_openat2) && defined(RESOLVE_NO_SYMLINKS)
  static std::atomic<bool> missing{false};
  if (missing.load(std::memory_order_relaxed)) return -ENOSYS;
  struct open_how how = {};
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH;
  for (int tries = 0; tries < 4; ++tries) {
    long fd = ::syscall(SYS_openat2, dir, rel.c_str(), &how, sizeof how);
    if (fd >= 0) return static_cast<int>(fd);
    if (errno == EAGAIN || errno == EINTR) continue;  // a rename raced the lookup: the kernel asks to retry
    if (errno == ENOSYS || errno == EPERM || errno == E2BIG) {
      missing.store(true, std::memory_order_relaxed);
      return -ENOSYS;
    }
    return -errno;
  }
  return -ENOSYS;  // still racing: the walk decides
#else
  (void)dir, (void)rel, (void)flags, (void)mode;
  return -ENOSYS;
#endif
}

// A path split at a confined root: `parent` is a descriptor of the directory that holds `leaf`,
// reached from the root without following a symlink. Unconfined paths keep parent AT_FDCWD and
// the whole path as leaf, so every method is one *at call either way.
struct Resolved {
  Fd held;
  int parent = AT_FDCWD;
  std::string leaf;
  bool confined = false;
};

class PosixEnv final : public Env {
 public:
  int Open(const std::string& path, int flags, mode_t mode) override {
    // Below a root, in one call where the kernel can (a shard: step-N.tmp/rank-R.bin), instead
    // of an openat per directory on the way; the root itself (an fsync of RUN_DIR) by its
    // descriptor: no lookup at all.
    int root_fd = -1;
    const std::string root = RootOf(path, &root_fd, /*or_equal=*/true);
    Fd held_root(root_fd);
    if (held_root.get() >= 0 && Trim(path) == root) {
      // The root itself, read-only as a directory (SyncDir): the held descriptor's duplicate.
      // Nothing reads entries through it (ListDir opens its own), so the shared offset is moot.
      if ((flags & O_DIRECTORY) && (flags & O_ACCMODE) == O_RDONLY && !(flags & O_CREAT)) return held_root.release();
    } else if (held_root.get() >= 0) {
      const std::string rel = path.substr(root == "/" ? 1 : root.size() + 1);
      if (rel.find('/') != std::string::npos && !HasDotComponent(rel)) {
        const int fd = OpenBeneath(held_root.get(), rel, flags | O_NOFOLLOW, mode);
        if (fd != -ENOSYS) return fd;
      }
    }
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    if (r.confined && (flags & O_DIRECTORY)) return OpenDirNoFollow(r.parent, r.leaf.c_str(), flags & ~O_ACCMODE);
    if (r.confined) flags |= O_NOFOLLOW;
    int fd = ::openat(r.parent, r.leaf.c_str(), flags | O_CLOEXEC, mode);
    return fd >= 0 ? fd : -errno;
  }
  int Close(int fd) override { return ::close(fd) == 0 ? 0 : -errno; }
  ssize_t PWrite(int fd, const void* buf, size_t n, uint64_t off) override {
    ssize_t r = ::pwrite(fd, buf, n, static_cast<off_t>(off));
    return r >= 0 ? r : -errno;
  }
  ssize_t PRead(int fd, void* buf, size_t n, uint64_t off) override {
    ssize_t r = ::pread(fd, buf, n, static_cast<off_t>(off));
    return r >= 0 ? r : -errno;
  }
  int FDataSync(int fd) override { return ::fdatasync(fd) == 0 ? 0 : -errno; }
  int FSync(int fd) override { return ::fsync(fd) == 0 ? 0 : -errno; }
  int FAllocate(int fd, uint64_t len) override {
    // Plain fallocate (mode 0) only: posix_fallocate's write-zeroes emulation would double the
    // I/O on file systems without support, so those report -EOPNOTSUPP and we skip it.
    return ::fallocate(fd, 0, 0, static_cast<off_t>(len)) == 0 ? 0 : -errno;
  }
  int FTruncate(int fd, uint64_t len) override {
    return ::ftruncate(fd, static_cast<off_t>(len)) == 0 ? 0 : -errno;
  }
  int FileSize(int fd, uint64_t* size) override {
    FileStat st;
    if (int e = FStat(fd, &st)) return e;
    *size = st.size;
    return 0;
  }
  int FStat(int fd, FileStat* out) override {
    struct stat st;
    if (::fstat(fd, &st) != 0) return -errno;
    out->size = static_cast<uint64_t>(st.st_size);
    out->nlink = static_cast<uint64_t>(st.st_nlink);
    out->uid = static_cast<uint64_t>(st.st_uid);
    out->mode = static_cast<uint32_t>(st.st_mode);
    out->mtime_s = static_cast<int64_t>(st.st_mtime);
    return 0;
  }
  int DirectIo(int fd, DirectIoInfo* info) override {
    *info = DirectIoInfo{};
#if defined(STATX_DIOALIGN)
    struct statx sx;
    std::memset(&sx, 0, sizeof(sx));
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0) return -errno;
    if (sx.stx_mask & STATX_DIOALIGN) {
      info->mem_align = sx.stx_dio_mem_align;
      info->offset_align = sx.stx_dio_offset_align;
    }
#else
    (void)fd;
#endif
    return 0;
  }
  int Rename(const std::string& from, const std::string& to) override {
    Resolved a, b;
    if (int e = Resolve(from, &a)) return e;
    if (int e = Resolve(to, &b)) return e;
    return ::renameat(a.parent, a.leaf.c_str(), b.parent, b.leaf.c_str()) == 0 ? 0 : -errno;
  }
  int RenameNoReplace(const std::string& from, const std::string& to) override {
#if defined(SYS_renameat2)
    Resolved a, b;
    if (int e = Resolve(from, &a)) return e;
    if (int e = Resolve(to, &b)) return e;
    return ::syscall(SYS_renameat2, a.parent, a.leaf.c_str(), b.parent, b.leaf.c_str(), RENAME_NOREPLACE) == 0 ? 0
                                                                                                            : -errno;
#else
    (void)from;
    (void)to;
    return -ENOSYS;
#endif
  }
  int Mkdir(const std::string& path) override {
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    return ::mkdirat(r.parent, r.leaf.c_str(), 0755) == 0 ? 0 : -errno;
  }
  int Unlink(const std::string& path) override {
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    return ::unlinkat(r.parent, r.leaf.c_str(), 0) == 0 ? 0 : -errno;
  }
  int Rmdir(const std::string& path) override {
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    return ::unlinkat(r.parent, r.leaf.c_str(), AT_REMOVEDIR) == 0 ? 0 : -errno;
  }
  int ListDir(const std::string& path, std::vector<std::string>* names) override {
    names->clear();
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    int fd = r.confined ? OpenDirNoFollow(r.parent, r.leaf.c_str(), 0)
                        : ::openat(r.parent, r.leaf.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return r.confined ? fd : -errno;
    DIR* d = ::fdopendir(fd);
    if (!d) {
      int err = errno;
      ::close(fd);
      return -err;
    }
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      names->emplace_back(e->d_name);
    }
    int err = errno;
    ::closedir(d);
    return err ? -err : 0;
  }
  int IsDir(const std::string& path) override {
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    struct stat st;
    if (::fstatat(r.parent, r.leaf.c_str(), &st, r.confined ? AT_SYMLINK_NOFOLLOW : 0) != 0) return -errno;
    return S_ISDIR(st.st_mode) ? 1 : 0;
  }
  int LStat(const std::string& path, FileStat* out) override {
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    struct stat st;
    if (::fstatat(r.parent, r.leaf.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return -errno;
    out->size = static_cast<uint64_t>(st.st_size);
    out->nlink = static_cast<uint64_t>(st.st_nlink);
    out->uid = static_cast<uint64_t>(st.st_uid);
    out->mode = static_cast<uint32_t>(st.st_mode);
    out->mtime_s = static_cast<int64_t>(st.st_mtime);
    return 0;
  }
  int Flock(int fd, int op) override { return ::flock(fd, op) == 0 ? 0 : -errno; }
  int IsOwnDir(const std::string& path) override {
    Resolved r;
    if (int e = Resolve(path, &r)) return e;
    struct stat st;
    if (::fstatat(r.parent, r.leaf.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return -errno;
    return S_ISDIR(st.st_mode) && st.st_uid == ::geteuid() ? 1 : 0;
  }

  // The root is opened once, at its first Confine (a run directory on Lustre is not looked up
  // again for every call below it); a root that cannot be opened yet is opened by each call.
  void Confine(const std::string& root) override {
    std::lock_guard<std::mutex> l(mu_);
    const std::string r = Trim(root);
    for (Root& have : roots_)
      if (have.path == r) {
        ++have.refs;
        return;
      }
    roots_.push_back({r, ::open(r.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC), 1});
  }
  void Unconfine(const std::string& root) override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = std::find_if(roots_.begin(), roots_.end(), [&](const Root& x) { return x.path == Trim(root); });
    if (it == roots_.end() || --it->refs > 0) return;
    if (it->fd >= 0) ::close(it->fd);
    roots_.erase(it);
  }

 private:
  static std::string Trim(std::string root) {
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    return root;
  }

  struct Root {
    std::string path;
    int fd;    // opened at the first Confine; -1 if that failed
    int refs;  // Confine calls not yet undone
  };

  // The longest confined root that `path` lies strictly below (or_equal: or is) ("" when none),
  // and a duplicate of its descriptor in *fd (-1: none held); dup, because an Unconfine may close
  // the held one.
  std::string RootOf(const std::string& path, int* fd, bool or_equal = false) {
    std::lock_guard<std::mutex> l(mu_);
    const Root* best = nullptr;
    const std::string trimmed = or_equal ? Trim(path) : std::string();
    for (const Root& root : roots_) {
      const std::string& r = root.path;
      const size_t n = r == "/" ? 0 : r.size();
      const bool below = path.size() > n + 1 && path.compare(0, n, r, 0, n) == 0 && path[n] == '/';
      if ((!best || r.size() > best->path.size()) && (below || (or_equal && trimmed == r))) best = &root;
    }
    *fd = best && best->fd >= 0 ? ::fcntl(best->fd, F_DUPFD_CLOEXEC, 0) : -1;
    return best ? best->path : std::string();
  }

  // Splits `path` (see Resolved). Below a root: walks every component but the last with
  // O_DIRECTORY|O_NOFOLLOW, refusing "." and ".." (alpsck never makes such paths; anything that
  // does is not walked past the root). 0 or -errno.
  int Resolve(const std::string& path, Resolved* r) {
    int root_fd = -1;
    const std::string root = RootOf(path, &root_fd);
    Fd held_root(root_fd);
    if (root.empty()) {
      r->leaf = path;
      return 0;
    }
    std::vector<std::string> parts;
    size_t pos = root == "/" ? 1 : root.size() + 1;
    while (pos <= path.size()) {
      size_t next = path.find('/', pos);
      if (next == std::string::npos) next = path.size();
      if (next > pos) parts.push_back(path.substr(pos, next - pos));
      pos = next + 1;
    }
    if (parts.empty()) {  // the root itself, written with trailing slashes
      r->leaf = path;
      return 0;
    }
    for (const std::string& p : parts)
      if (p == "." || p == "..") return -EINVAL;
    Fd dir = held_root.get() >= 0 ? std::move(held_root) : Fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC));
    if (dir.get() < 0) return -errno;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const int fd = OpenDirNoFollow(dir.get(), parts[i].c_str(), 0);
      if (fd < 0) return fd;
      Fd next(fd);
      dir = std::move(next);
    }
    r->parent = dir.get();
    r->held = std::move(dir);
    r->leaf = parts.back();
    r->confined = true;
    return 0;
  }

  std::mutex mu_;
  std::vector<Root> roots_;
};

}  // namespace

Env* Env::Default() {
  static PosixEnv env;
  return &env;
}

}  // namespace alpsck
