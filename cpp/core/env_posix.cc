// The POSIX Env: one syscall per method, -errno on failure.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "env.h"

namespace alpsck {
namespace {

class PosixEnv final : public Env {
 public:
  int Open(const std::string& path, int flags, mode_t mode) override {
    int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
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
    struct stat st;
    if (::fstat(fd, &st) != 0) return -errno;
    *size = static_cast<uint64_t>(st.st_size);
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
    return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : -errno;
  }
  int Mkdir(const std::string& path) override { return ::mkdir(path.c_str(), 0755) == 0 ? 0 : -errno; }
  int Unlink(const std::string& path) override { return ::unlink(path.c_str()) == 0 ? 0 : -errno; }
  int Rmdir(const std::string& path) override { return ::rmdir(path.c_str()) == 0 ? 0 : -errno; }
  int ListDir(const std::string& path, std::vector<std::string>* names) override {
    names->clear();
    DIR* d = ::opendir(path.c_str());
    if (!d) return -errno;
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
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return -errno;
    return S_ISDIR(st.st_mode) ? 1 : 0;
  }
  int IsRealDir(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return -errno;
    return S_ISDIR(st.st_mode) ? 1 : 0;
  }
};

}  // namespace

Env* Env::Default() {
  static PosixEnv env;
  return &env;
}

}  // namespace alpsck
