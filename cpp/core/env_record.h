// RecordingEnv: an Env decorator that logs every call that changes the file system, in the
// order they took effect, so a test can replay the states a power loss could leave (see
// cpp/tests/power_loss.h). In the spirit of LevelDB's fault-injection Env and of ALICE.
//
// What is logged (only calls that succeeded; a failed call changed nothing):
//   Open (every one: it binds an fd to a file; `created` says O_CREAT made the file, O_TRUNC is
//   in `flags`), Close, PWrite (with its bytes), FTruncate, FAllocate, FDataSync, FSync, Mkdir,
//   Rename, Unlink, Rmdir; and Mark(), a caller's note such as "step 7 reported durable".
// Reads (PRead, FileSize, DirectIo, ListDir, IsDir) pass through unlogged.
//
// Order: each logged call runs under one mutex together with its log append, so the log is the
// exact order in which the calls happened, even from many threads (I/O through this Env is
// serialised; it is a test tool).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "env.h"

namespace alpsck {

struct RecordedOp {
  enum class Kind { kOpen, kClose, kPWrite, kFTruncate, kFAllocate, kFDataSync, kFSync, kMkdir, kRename, kUnlink,
                    kRmdir, kMark };
  Kind kind = Kind::kMark;
  std::string path;      // kOpen/kMkdir/kUnlink/kRmdir; kRename: from
  std::string path2;     // kRename: to
  int fd = -1;           // kOpen: the new fd; fd-based calls: their fd
  int flags = 0;         // kOpen
  bool created = false;  // kOpen: the file did not exist before (O_CREAT made it)
  uint64_t offset = 0;   // kPWrite
  uint64_t length = 0;   // kFTruncate / kFAllocate: the length; kPWrite: bytes written
  std::string data;      // kPWrite: the bytes written (the first `length` of the buffer)
  std::string label;     // kMark
  uint64_t value = 0;    // kMark
};

const char* RecordedOpName(RecordedOp::Kind k);

class RecordingEnv : public Env {
 public:
  explicit RecordingEnv(Env* base = Env::Default()) : base_(base) {}

  // A copy of the log so far.
  std::vector<RecordedOp> Ops() const;
  size_t size() const;
  // Appends a note (e.g. Mark("durable", step) once a save was reported durable).
  void Mark(const std::string& label, uint64_t value);

  int Open(const std::string& path, int flags, mode_t mode) override;
  int Close(int fd) override;
  ssize_t PWrite(int fd, const void* buf, size_t n, uint64_t off) override;
  ssize_t PRead(int fd, void* buf, size_t n, uint64_t off) override { return base_->PRead(fd, buf, n, off); }
  int FDataSync(int fd) override;
  int FSync(int fd) override;
  int FAllocate(int fd, uint64_t len) override;
  int FTruncate(int fd, uint64_t len) override;
  int FileSize(int fd, uint64_t* size) override { return base_->FileSize(fd, size); }
  int FStat(int fd, FileStat* st) override { return base_->FStat(fd, st); }
  void Confine(const std::string& root) override { base_->Confine(root); }
  void Unconfine(const std::string& root) override { base_->Unconfine(root); }
  int DirectIo(int fd, DirectIoInfo* info) override { return base_->DirectIo(fd, info); }
  int Rename(const std::string& from, const std::string& to) override;
  int RenameNoReplace(const std::string& from, const std::string& to) override;  // recorded as a rename
  int Mkdir(const std::string& path) override;
  int Unlink(const std::string& path) override;
  int Rmdir(const std::string& path) override;
  int ListDir(const std::string& path, std::vector<std::string>* names) override {
    return base_->ListDir(path, names);
  }
  int IsDir(const std::string& path) override { return base_->IsDir(path); }
  int IsOwnDir(const std::string& path) override { return base_->IsOwnDir(path); }
  int LStat(const std::string& path, FileStat* st) override { return base_->LStat(path, st); }
  int Flock(int fd, int op) override { return base_->Flock(fd, op); }  // no file-system change: not logged

 private:
  Env* base_;
  mutable std::mutex mu_;  // held across each logged call and its append
  std::vector<RecordedOp> ops_;
};

}  // namespace alpsck
