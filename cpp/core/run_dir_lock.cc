// RunDirLock (run_dir_lock.h): the run directory's one writer lock, every call through an Env.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <string>
#include <thread>

#include "file_io.h"
#include "json.h"
#include "platform.h"
#include "run_dir.h"
#include "run_dir_lock.h"

namespace alpsck {

namespace {

constexpr size_t kMaxOwnerBytes = 4096;

const char* KindOf(mode_t m) {
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// Opens RUN_DIR/<rank's lock> without following a symlink and without blocking; refuses
// anything but a regular file before opening it (and again after, against a swap in between).
Status OpenLockFile(Env* env, const std::string& run_dir, uint32_t rank, bool create, int* fd_out, std::string* path) {
  *fd_out = -1;
  *path = JoinPath(run_dir, LockFileName(rank));
  const int d = env->IsDir(run_dir);
  if (d <= 0) return Status::FromErrno(d < 0 ? -d : ENOTDIR, "open run directory " + run_dir);
  FileStat st;
  const int l = env->LStat(*path, &st);
  if (l == 0 && !S_ISREG(st.mode))
    return Status::Invalid(*path + " is " + KindOf(st.mode) + ", not alpsck's lock file: remove it (alpsck never "
                           "follows or opens it)");
  if (l < 0 && (l != -ENOENT || !create))
    return l == -ENOENT ? Status::FromErrno(ENOENT, *path) : Status::FromErrno(-l, "stat " + *path);
  const int flags = (create ? O_RDWR | O_CREAT : O_RDONLY) | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  const int fd = env->Open(*path, flags, 0644);
  if (fd < 0)
    return fd == -ELOOP ? Status::Invalid(*path + " is a symbolic link, not alpsck's lock file: remove it")
                        : Status::FromErrno(-fd, "open " + *path);
  if (env->FStat(fd, &st) != 0 || !S_ISREG(st.mode)) {
    env->Close(fd);
    return Status::Invalid(*path + " is not a regular file, not alpsck's lock file: remove it");
  }
  *fd_out = fd;
  return Status::Ok();
}

std::string ReadOwner(Env* env, int fd) {
  std::string text(kMaxOwnerBytes, '\0');
  const ssize_t n = env->PRead(fd, &text[0], text.size(), 0);
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return text;
}

// An owner record as a JSON object; an empty one when it is not one (a lock of another tool).
Json ParseOwner(const std::string& owner_json) {
  Json j;
  if (!ParseJson(owner_json, &j, JsonLimits{4, kMaxOwnerBytes}).ok() || !j.is_object()) j = Json::Object();
  return j;
}

// Whether an owner record names a process of this host that no longer exists.
bool OwnerGoneFromThisHost(const std::string& owner_json) {
  const Json j = ParseOwner(owner_json);
  const Json* host = j.find("host");
  const Json* pid = j.find("pid");
  const std::string* h = host ? host->get_string() : nullptr;
  uint64_t p = 0;
  if (!h || !pid || !pid->get_u64(&p) || p == 0 || p > static_cast<uint64_t>(INT32_MAX)) return false;
  const std::string here = HostName();
  if (here.empty() || *h != here) return false;
  return ::kill(static_cast<pid_t>(p), 0) != 0 && errno == ESRCH;
}

}  // namespace

LockOwner ParseLockOwner(const std::string& owner_json) {
  const Json j = ParseOwner(owner_json);
  auto field = [&](const char* key) -> std::string {
    const Json* v = j.find(key);
    if (!v) return "";
    if (const std::string* s = v->get_string()) return *s;
    uint64_t u = 0;
    return v->get_u64(&u) ? std::to_string(u) : "";
  };
  return LockOwner{field("pid"), field("host"), field("job_id")};
}

std::string DescribeLockOwner(const std::string& run_dir, const std::string& owner_json) {
  const LockOwner o = ParseLockOwner(owner_json);
  auto or_unknown = [](const std::string& s) { return s.empty() ? std::string("?") : s; };
  return run_dir + " is being written by job " + or_unknown(o.job_id) + " (pid " + or_unknown(o.pid) + ") on host " +
         or_unknown(o.host);
}

Status RunDirLock::Acquire(const std::string& run_dir, uint32_t rank, const std::string& owner_json,
                           std::unique_ptr<RunDirLock>* out, double orphan_wait_s, Env* env) {
  int fd = -1;
  std::string path;
  ALPSCK_RETURN_IF_ERROR(OpenLockFile(env, run_dir, rank, true, &fd, &path));
  const auto start = std::chrono::steady_clock::now();
  for (int r; (r = env->Flock(fd, LOCK_EX | LOCK_NB)) != 0;) {
    const int e = -r;
    const std::string owner = ReadOwner(env, fd);
    // The owner recorded may have died while a process it forked (a DataLoader worker) still has
    // the lock's file open, and so the lock: such a child exits soon after its parent. Waited for,
    // briefly, so that a restart on the same node is not refused by its predecessor's worker.
    const bool orphaned = e == EWOULDBLOCK && OwnerGoneFromThisHost(owner);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (orphaned && waited < orphan_wait_s) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    env->Close(fd);
    if (e != EWOULDBLOCK) return Status::FromErrno(e, "lock " + path);
    std::string why = DescribeLockOwner(run_dir, owner);
    if (orphaned)
      why += "; that process has exited, but one it forked (a DataLoader worker?) still held the lock after " +
             std::to_string(static_cast<int>(waited)) + " s, and frees it when it exits";
    return Status::Error(Code::kBusy, why + "; two writers in one run directory would corrupt each other's "
                                            "checkpoints and retention");
  }
  const std::string text = owner_json + "\n";
  int w = env->FTruncate(fd, 0);
  if (w == 0) {
    const ssize_t n = env->PWrite(fd, text.data(), text.size(), 0);
    w = n == static_cast<ssize_t>(text.size()) ? 0 : n < 0 ? static_cast<int>(n) : -EIO;
  }
  if (w != 0) {
    env->Close(fd);
    return Status::FromErrno(-w, "record the owner in " + path);
  }
  out->reset(new RunDirLock(env, fd, path));
  return Status::Ok();
}

Status RunDirLock::Probe(const std::string& run_dir, uint32_t rank, bool* held, std::string* owner, Env* env) {
  *held = false;
  owner->clear();
  int fd = -1;
  std::string path;
  Status s = OpenLockFile(env, run_dir, rank, false, &fd, &path);
  if (s.code() == Code::kNotFound) return Status::Ok();  // no lock file: nobody has written here
  ALPSCK_RETURN_IF_ERROR(s);
  *owner = ReadOwner(env, fd);
  const int r = env->Flock(fd, LOCK_SH | LOCK_NB);
  if (r == 0) {
    env->Flock(fd, LOCK_UN);
  } else if (r == -EWOULDBLOCK) {
    *held = true;
  }
  env->Close(fd);
  return Status::Ok();
}

void RunDirLock::Release() {
  if (fd_ < 0) return;
  if (::getpid() == owner_pid_) {
    env_->FTruncate(fd_, 0);  // a clean release leaves no owner behind (best effort)
    // Unlocked explicitly, not by the close: a forked child (a DataLoader worker) shares this
    // open file, and the flock would live on in it until it exits.
    env_->Flock(fd_, LOCK_UN);
  }
  // In a forked child: only its copy of the descriptor goes. The lock and its owner record are
  // the parent's, which still writes under them.
  env_->Close(fd_);
  fd_ = -1;
}

RunDirLock::~RunDirLock() { Release(); }

}  // namespace alpsck
