#include "file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

namespace alpsck {

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string ParentDir(const std::string& path) {
  size_t p = path.find_last_of('/');
  if (p == std::string::npos) return ".";
  if (p == 0) return "/";
  return path.substr(0, p);
}

namespace {

std::string FileKind(uint32_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

int OpenOnce(Env* env, const std::string& path, int flags, bool want_direct, bool* direct) {
  if (want_direct) {
    int r = env->Open(path, flags | O_DIRECT, 0644);
    if (r != -EINVAL) {
      *direct = r >= 0;
      return r;
    }
  }
  *direct = false;
  return env->Open(path, flags, 0644);
}

}  // namespace

Status OpenMaybeDirect(Env* env, const std::string& path, int flags, bool want_direct, int* fd, bool* direct) {
  const bool write = flags & (O_WRONLY | O_RDWR);
  // A file opened for writing is alpsck's own: never written through a symlink, never a FIFO or
  // a device (O_NONBLOCK: opening one must not hang), and never a file that is also linked
  // somewhere else or belongs to someone else, since alpsck writes shards in place when it
  // recycles a directory: such a name is unlinked and made afresh. O_TRUNC is applied only after
  // those checks. (Reads may follow a symlink: a checkpoint copied elsewhere and linked back
  // still restores.)
  const bool trunc = flags & O_TRUNC;
  if (write) flags = (flags & ~O_TRUNC) | O_NOFOLLOW | O_NONBLOCK;
  auto fail = [&](int r) {
    return r == -ELOOP ? Status::Invalid(path + " is a symbolic link: alpsck never writes through one")
                       : Status::FromErrno(-r, "open " + path);
  };
  int r = OpenOnce(env, path, flags, want_direct, direct);
  if (r < 0) return fail(r);
  // O_CREAT|O_EXCL succeeded: a regular file this call made, linked once, ours: nothing to check
  // (one metadata call fewer per shard, where a caller knows the name is new).
  if (write && (flags & O_CREAT) && (flags & O_EXCL)) {
    *fd = r;
    return Status::Ok();
  }
  if (write) {
    FileStat st;
    int e = env->FStat(r, &st);
    if (e == 0 && !S_ISREG(st.mode)) {
      env->Close(r);
      return Status::Invalid(path + " is " + FileKind(st.mode) + ": alpsck writes only its own regular files");
    }
    if (e == 0 && (st.nlink > 1 || st.uid != static_cast<uint64_t>(::geteuid()))) {
      env->Close(r);
      e = env->Unlink(path);
      if (e < 0) return Status::FromErrno(-e, path + " is linked elsewhere or not ours, and cannot be replaced");
      r = OpenOnce(env, path, flags | O_CREAT | O_EXCL, want_direct, direct);
      if (r < 0) return fail(r);
      e = 0;
    }
    if (e < 0 || (trunc && (e = env->FTruncate(r, 0)) < 0)) {
      env->Close(r);
      return Status::FromErrno(-e, "open " + path);
    }
  }
  *fd = r;
  return Status::Ok();
}

Status WriteFull(Env* env, int fd, const void* buf, uint64_t n, uint64_t off, const std::string& path) {
  const char* p = static_cast<const char*>(buf);
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = env->PWrite(fd, p + done, static_cast<size_t>(n - done), off + done);
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) return Status::FromErrno(static_cast<int>(-r), "write " + path + " at offset " + std::to_string(off + done));
    if (r == 0) return Status::FromErrno(ENOSPC, "write " + path + " made no progress at offset " + std::to_string(off + done));
    done += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

Status ReadFull(Env* env, int fd, void* buf, uint64_t n, uint64_t off, const std::string& path) {
  char* p = static_cast<char*>(buf);
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = env->PRead(fd, p + done, static_cast<size_t>(n - done), off + done);
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) return Status::FromErrno(static_cast<int>(-r), "read " + path + " at offset " + std::to_string(off + done));
    if (r == 0)
      return Status::Corrupt(path + ": truncated (file ends before offset " + std::to_string(off + n) + ")");
    done += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

int SyncFd(Env* env, int fd, bool data_only) {
  int r;
  do {
    r = data_only ? env->FDataSync(fd) : env->FSync(fd);
  } while (r == -EINTR);
  return r;
}

Status SyncDir(Env* env, const std::string& dir) {
  int fd = env->Open(dir, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0) return Status::FromErrno(-fd, "open directory " + dir);
  ScopedFd g(env, fd);
  int r = SyncFd(env, fd, false);
  if (r < 0) return Status::FromErrno(-r, "fsync directory " + dir);
  return Status::Ok();
}

namespace {

Status WriteWholeFile(Env* env, const std::string& path, const std::string& data, bool likely_new, bool sync) {
  int fd = -1;
  bool direct = false;
  Status s = Status::Error(Code::kIoError, "", EEXIST);
  if (likely_new) s = OpenMaybeDirect(env, path, O_WRONLY | O_CREAT | O_EXCL, false, &fd, &direct);
  if (!s.ok() && s.err() == EEXIST) s = OpenMaybeDirect(env, path, O_WRONLY | O_CREAT | O_TRUNC, false, &fd, &direct);
  ALPSCK_RETURN_IF_ERROR(s);
  ScopedFd g(env, fd);
  ALPSCK_RETURN_IF_ERROR(WriteFull(env, fd, data.data(), data.size(), 0, path));
  int r = sync ? SyncFd(env, fd, false) : 0;
  if (r < 0) return Status::FromErrno(-r, "fsync " + path);
  r = env->Close(g.Release());
  if (r < 0) return Status::FromErrno(-r, "close " + path);
  return Status::Ok();
}

}  // namespace

Status WriteFileSynced(Env* env, const std::string& path, const std::string& data, bool likely_new) {
  return WriteWholeFile(env, path, data, likely_new, true);
}

Status WriteFileUnsynced(Env* env, const std::string& path, const std::string& data) {
  return WriteWholeFile(env, path, data, true, false);
}

Status WriteFileAtomic(Env* env, const std::string& path, const std::string& tmp, const std::string& data) {
  ALPSCK_RETURN_IF_ERROR(WriteFileSynced(env, tmp, data));
  int r = env->Rename(tmp, path);
  if (r < 0) {
    env->Unlink(tmp);
    return Status::FromErrno(-r, "rename " + tmp + " -> " + path);
  }
  return SyncDir(env, ParentDir(path));
}

Status ReadSmallFile(Env* env, const std::string& path, uint64_t max_bytes, std::string* out) {
  int fd = env->Open(path, O_RDONLY | O_NONBLOCK, 0);  // NONBLOCK: a FIFO in its place must not hang the reader
  if (fd < 0) return Status::FromErrno(-fd, "open " + path);
  ScopedFd g(env, fd);
  uint64_t size = 0;
  int r = env->FileSize(fd, &size);
  if (r < 0) return Status::FromErrno(-r, "stat " + path);
  if (size > max_bytes)
    return Status::Corrupt(path + ": " + std::to_string(size) + " bytes, more than the limit of " +
                           std::to_string(max_bytes));
  out->assign(static_cast<size_t>(size), '\0');
  return ReadFull(env, fd, out->data(), size, 0, path);
}

Status RemoveDirFiles(Env* env, const std::string& dir) {
  const int real = env->IsOwnDir(dir);
  if (real == -ENOENT) return Status::Ok();
  if (real == 0) return Status::Invalid(dir + " is a symbolic link, not a directory, or not ours: left alone");
  std::vector<std::string> names;
  int r = env->ListDir(dir, &names);
  if (r < 0) return Status::FromErrno(-r, "list " + dir);
  for (const auto& n : names) {
    int u = env->Unlink(JoinPath(dir, n));
    if (u < 0 && u != -ENOENT) return Status::FromErrno(-u, "remove " + JoinPath(dir, n));
  }
  r = env->Rmdir(dir);
  if (r < 0 && r != -ENOENT) return Status::FromErrno(-r, "remove directory " + dir);
  return Status::Ok();
}

}  // namespace alpsck
