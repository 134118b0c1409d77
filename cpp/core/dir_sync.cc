#include "dir_sync.h"

#include <fcntl.h>

#include "file_io.h"

namespace alpsck {

DeferredDirSync::~DeferredDirSync() {
  for (const auto& d : dirs_) env_->Close(d.second);
}

Status DeferredDirSync::Add(const std::string& dir) {
  const int fd = env_->Open(dir, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0) return Status::FromErrno(-fd, "open directory " + dir);
  std::lock_guard<std::mutex> l(mu_);
  dirs_.emplace_back(dir, fd);
  return Status::Ok();
}

Status DeferredDirSync::SyncLocked() {
  while (!dirs_.empty()) {
    const auto& d = dirs_.back();
    const int r = SyncFd(env_, d.second, false);
    if (r < 0) return Status::FromErrno(-r, "fsync directory " + d.first + " (to make the name of the new one in it durable)");
    env_->Close(d.second);
    dirs_.pop_back();
  }
  return Status::Ok();
}

void DeferredDirSync::Run() {
  {
    std::lock_guard<std::mutex> l(mu_);
    status_ = SyncLocked();
    ran_ = true;
  }
  cv_.notify_all();
}

Status DeferredDirSync::Wait() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return ran_; });
  if (!status_.ok()) status_ = SyncLocked();
  return status_;
}

}  // namespace alpsck
