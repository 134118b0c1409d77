// RecordingEnv: logs the calls that change the file system, in the order they took effect.
#include "env_record.h"

#include <fcntl.h>

namespace alpsck {

const char* RecordedOpName(RecordedOp::Kind k) {
  switch (k) {
    case RecordedOp::Kind::kOpen: return "open";
    case RecordedOp::Kind::kClose: return "close";
    case RecordedOp::Kind::kPWrite: return "pwrite";
    case RecordedOp::Kind::kFTruncate: return "ftruncate";
    case RecordedOp::Kind::kFAllocate: return "fallocate";
    case RecordedOp::Kind::kFDataSync: return "fdatasync";
    case RecordedOp::Kind::kFSync: return "fsync";
    case RecordedOp::Kind::kMkdir: return "mkdir";
    case RecordedOp::Kind::kRename: return "rename";
    case RecordedOp::Kind::kUnlink: return "unlink";
    case RecordedOp::Kind::kRmdir: return "rmdir";
    case RecordedOp::Kind::kMark: return "mark";
  }
  return "?";
}

std::vector<RecordedOp> RecordingEnv::Ops() const {
  std::lock_guard<std::mutex> l(mu_);
  return ops_;
}

size_t RecordingEnv::size() const {
  std::lock_guard<std::mutex> l(mu_);
  return ops_.size();
}

void RecordingEnv::Mark(const std::string& label, uint64_t value) {
  std::lock_guard<std::mutex> l(mu_);
  RecordedOp op;
  op.kind = RecordedOp::Kind::kMark;
  op.label = label;
  op.value = value;
  ops_.push_back(std::move(op));
}

int RecordingEnv::Open(const std::string& path, int flags, mode_t mode) {
  std::lock_guard<std::mutex> l(mu_);
  // Whether O_CREAT creates the file: looked up under the same lock as the open, so no other
  // call through this Env can come in between.
  const bool existed = base_->IsDir(path) >= 0;
  int fd = base_->Open(path, flags, mode);
  if (fd >= 0) {
    RecordedOp op;
    op.kind = RecordedOp::Kind::kOpen;
    op.path = path;
    op.fd = fd;
    op.flags = flags;
    op.created = !existed && (flags & O_CREAT);
    ops_.push_back(std::move(op));
  }
  return fd;
}

int RecordingEnv::Close(int fd) {
  std::lock_guard<std::mutex> l(mu_);
  // Logged before the close: once closed, another thread may get the same fd number.
  RecordedOp op;
  op.kind = RecordedOp::Kind::kClose;
  op.fd = fd;
  ops_.push_back(std::move(op));
  return base_->Close(fd);
}

ssize_t RecordingEnv::PWrite(int fd, const void* buf, size_t n, uint64_t off) {
  std::lock_guard<std::mutex> l(mu_);
  ssize_t r = base_->PWrite(fd, buf, n, off);
  if (r > 0) {
    RecordedOp op;
    op.kind = RecordedOp::Kind::kPWrite;
    op.fd = fd;
    op.offset = off;
    op.length = static_cast<uint64_t>(r);
    op.data.assign(static_cast<const char*>(buf), static_cast<size_t>(r));
    ops_.push_back(std::move(op));
  }
  return r;
}

namespace {
RecordedOp FdOp(RecordedOp::Kind k, int fd, uint64_t len = 0) {
  RecordedOp op;
  op.kind = k;
  op.fd = fd;
  op.length = len;
  return op;
}
RecordedOp PathOp(RecordedOp::Kind k, const std::string& path, const std::string& path2 = std::string()) {
  RecordedOp op;
  op.kind = k;
  op.path = path;
  op.path2 = path2;
  return op;
}
}  // namespace

int RecordingEnv::FDataSync(int fd) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->FDataSync(fd);
  if (r == 0) ops_.push_back(FdOp(RecordedOp::Kind::kFDataSync, fd));
  return r;
}

int RecordingEnv::FSync(int fd) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->FSync(fd);
  if (r == 0) ops_.push_back(FdOp(RecordedOp::Kind::kFSync, fd));
  return r;
}

int RecordingEnv::FAllocate(int fd, uint64_t len) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->FAllocate(fd, len);
  if (r == 0) ops_.push_back(FdOp(RecordedOp::Kind::kFAllocate, fd, len));
  return r;
}

int RecordingEnv::FTruncate(int fd, uint64_t len) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->FTruncate(fd, len);
  if (r == 0) ops_.push_back(FdOp(RecordedOp::Kind::kFTruncate, fd, len));
  return r;
}

int RecordingEnv::Rename(const std::string& from, const std::string& to) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->Rename(from, to);
  if (r == 0) ops_.push_back(PathOp(RecordedOp::Kind::kRename, from, to));
  return r;
}

int RecordingEnv::RenameNoReplace(const std::string& from, const std::string& to) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->RenameNoReplace(from, to);
  if (r == 0) ops_.push_back(PathOp(RecordedOp::Kind::kRename, from, to));
  return r;
}

int RecordingEnv::Mkdir(const std::string& path) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->Mkdir(path);
  if (r == 0) ops_.push_back(PathOp(RecordedOp::Kind::kMkdir, path));
  return r;
}

int RecordingEnv::Unlink(const std::string& path) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->Unlink(path);
  if (r == 0) ops_.push_back(PathOp(RecordedOp::Kind::kUnlink, path));
  return r;
}

int RecordingEnv::Rmdir(const std::string& path) {
  std::lock_guard<std::mutex> l(mu_);
  int r = base_->Rmdir(path);
  if (r == 0) ops_.push_back(PathOp(RecordedOp::Kind::kRmdir, path));
  return r;
}

}  // namespace alpsck
