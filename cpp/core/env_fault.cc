// FaultEnv: injects errors into chosen calls of another Env (for tests of every failure path).
#include <cerrno>
#include <chrono>
#include <thread>

#include "env_fault.h"

namespace alpsck {

void FaultEnv::AddRule(const FaultRule& r) {
  std::lock_guard<std::mutex> l(mu_);
  rules_.push_back(r);
}

void FaultEnv::ClearRules() {
  std::lock_guard<std::mutex> l(mu_);
  rules_.clear();
}

uint64_t FaultEnv::FaultsInjected() const {
  std::lock_guard<std::mutex> l(mu_);
  return injected_;
}

int FaultEnv::Check(FaultRule::Op op, const std::string& path) {
  uint64_t delay_us = 0;
  int result = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (FaultRule& r : rules_) {
      if (r.op != FaultRule::Op::kAny && r.op != op) continue;
      if (!r.path_contains.empty() && path.find(r.path_contains) == std::string::npos) continue;
      uint64_t n = r.hits++;
      if (n < r.skip || n - r.skip >= r.count) continue;
      ++injected_;
      delay_us = r.delay_us;
      result = r.short_transfer ? -1 : r.error;
      break;
    }
  }
  if (delay_us) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
  return result;
}

std::string FaultEnv::PathOf(int fd) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& p : fd_paths_)
    if (p.first == fd) return p.second;
  return std::string();
}

int FaultEnv::Open(const std::string& path, int flags, mode_t mode) {
  if (int e = Check(FaultRule::Op::kOpen, path); e > 0) return -e;
  int fd = base_->Open(path, flags, mode);
  if (fd >= 0) {
    std::lock_guard<std::mutex> l(mu_);
    fd_paths_.emplace_back(fd, path);
  }
  return fd;
}

int FaultEnv::Close(int fd) {
  {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < fd_paths_.size(); ++i)
      if (fd_paths_[i].first == fd) {
        fd_paths_.erase(fd_paths_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
  }
  return base_->Close(fd);
}

ssize_t FaultEnv::PWrite(int fd, const void* buf, size_t n, uint64_t off) {
  int e = Check(FaultRule::Op::kPWrite, PathOf(fd));
  if (e > 0) return -e;
  if (e < 0 && n > 1) return base_->PWrite(fd, buf, n / 2, off);
  return base_->PWrite(fd, buf, n, off);
}

ssize_t FaultEnv::PRead(int fd, void* buf, size_t n, uint64_t off) {
  int e = Check(FaultRule::Op::kPRead, PathOf(fd));
  if (e > 0) return -e;
  if (e < 0 && n > 1) return base_->PRead(fd, buf, n / 2, off);
  return base_->PRead(fd, buf, n, off);
}

int FaultEnv::FDataSync(int fd) {
  if (int e = Check(FaultRule::Op::kFDataSync, PathOf(fd)); e > 0) return -e;
  return base_->FDataSync(fd);
}

int FaultEnv::FSync(int fd) {
  if (int e = Check(FaultRule::Op::kFSync, PathOf(fd)); e > 0) return -e;
  return base_->FSync(fd);
}

int FaultEnv::FAllocate(int fd, uint64_t len) {
  if (int e = Check(FaultRule::Op::kFAllocate, PathOf(fd)); e > 0) return -e;
  return base_->FAllocate(fd, len);
}

int FaultEnv::Rename(const std::string& from, const std::string& to) {
  if (int e = Check(FaultRule::Op::kRename, from); e > 0) return -e;
  return base_->Rename(from, to);
}

int FaultEnv::RenameNoReplace(const std::string& from, const std::string& to) {
  if (int e = Check(FaultRule::Op::kRename, from); e > 0) return -e;
  return base_->RenameNoReplace(from, to);
}

int FaultEnv::Mkdir(const std::string& path) {
  if (int e = Check(FaultRule::Op::kMkdir, path); e > 0) return -e;
  return base_->Mkdir(path);
}

}  // namespace alpsck
