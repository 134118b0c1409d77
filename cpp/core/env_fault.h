// FaultEnv: an Env decorator that injects faults by rule (EIO, ENOSPC, short transfers, delays)
// at chosen calls. A test double: in the alpsck_test_doubles library (CMakeLists.txt), which the
// C++ tests link, and the Python extension too, for the `faults` its Engine takes (the Python
// tests' fault injection); never in the core library.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "env.h"

namespace alpsck {

// What a FaultEnv does to the matching call.
struct FaultRule {
  enum class Op { kAny, kOpen, kPWrite, kPRead, kFDataSync, kFSync, kFAllocate, kRename, kMkdir };
  Op op = Op::kAny;
  std::string path_contains;  // empty: any path (for fd-based ops, the path the fd was opened with)
  uint64_t skip = 0;          // let this many matching calls through first
  uint64_t count = 1;         // then fault this many (UINT64_MAX: forever)
  int error = 5;              // errno to return (EIO); 0: no error (only the delay/short transfer)
  bool short_transfer = false;
  uint64_t delay_us = 0;      // sleep this long before the call (with error 0: slow, not failing)
  uint64_t hits = 0;          // matching calls seen so far (updated by FaultEnv)
};

// Wraps another Env and injects faults by rule. Rules are checked in order; the first that
// fires decides. Thread-safe (one mutex around rule bookkeeping; the syscalls run outside it).
class FaultEnv : public Env {
 public:
  explicit FaultEnv(Env* base = Env::Default()) : base_(base) {}
  void AddRule(const FaultRule& r);
  void ClearRules();
  uint64_t FaultsInjected() const;

  int Open(const std::string& path, int flags, mode_t mode) override;
  int Close(int fd) override;
  ssize_t PWrite(int fd, const void* buf, size_t n, uint64_t off) override;
  ssize_t PRead(int fd, void* buf, size_t n, uint64_t off) override;
  int FDataSync(int fd) override;
  int FSync(int fd) override;
  int FAllocate(int fd, uint64_t len) override;
  int FTruncate(int fd, uint64_t len) override { return base_->FTruncate(fd, len); }
  int FileSize(int fd, uint64_t* size) override { return base_->FileSize(fd, size); }
  int FStat(int fd, FileStat* st) override { return base_->FStat(fd, st); }
  int DirectIo(int fd, DirectIoInfo* info) override { return base_->DirectIo(fd, info); }
  int Rename(const std::string& from, const std::string& to) override;
  int RenameNoReplace(const std::string& from, const std::string& to) override;
  int Mkdir(const std::string& path) override;
  void Confine(const std::string& root) override { base_->Confine(root); }
  void Unconfine(const std::string& root) override { base_->Unconfine(root); }
  int Unlink(const std::string& path) override { return base_->Unlink(path); }
  int Rmdir(const std::string& path) override { return base_->Rmdir(path); }
  int ListDir(const std::string& path, std::vector<std::string>* names) override {
    return base_->ListDir(path, names);
  }
  int IsDir(const std::string& path) override { return base_->IsDir(path); }
  int IsOwnDir(const std::string& path) override { return base_->IsOwnDir(path); }
  int LStat(const std::string& path, FileStat* st) override { return base_->LStat(path, st); }
  int Flock(int fd, int op) override { return base_->Flock(fd, op); }

 protected:
  std::string PathOf(int fd);  // the path `fd` was opened with ("" for one not opened here)

 private:
  // 0: no fault; >0: errno to return; -1: short transfer.
  int Check(FaultRule::Op op, const std::string& path);

  Env* base_;
  mutable std::mutex mu_;
  std::vector<FaultRule> rules_;
  std::vector<std::pair<int, std::string>> fd_paths_;
  uint64_t injected_ = 0;
};

}  // namespace alpsck
