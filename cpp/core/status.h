// Status: the result of every fallible operation in the core (no exceptions cross the core's
// API). A Status carries a code, the errno that caused it (0 if none) and a message that names
// the file or object involved. The Python binding turns it into an alpsck.errors exception in one
// place.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace alpsck {

enum class Code : int {
  kOk = 0,
  kIoError = 1,        // a syscall failed (errno says which)
  kNoSpace = 2,        // ENOSPC / EDQUOT
  kCorrupt = 3,        // a checkpoint failed verification
  kNotFound = 4,       // a file, directory or checkpoint does not exist
  kInvalidArgument = 5,
  kAborted = 6,        // the operation was cancelled (engine closing, an earlier error)
  kBusy = 7,           // a resource is held by someone else
};

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(Code code, std::string msg, int err = 0) { return Status(code, std::move(msg), err); }
  // From errno: ENOSPC/EDQUOT become kNoSpace, ENOENT kNotFound, everything else kIoError.
  static Status FromErrno(int err, const std::string& what) {
    Code c = Code::kIoError;
    if (err == ENOSPC || err == EDQUOT) c = Code::kNoSpace;
    else if (err == ENOENT) c = Code::kNotFound;
    return Status(c, what + ": " + std::strerror(err), err);
  }
  static Status Corrupt(std::string msg) { return Status(Code::kCorrupt, std::move(msg), 0); }
  static Status Invalid(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg), 0); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  int err() const { return errno_; }
  const std::string& message() const { return msg_; }
  std::string ToString() const { return ok() ? std::string("OK") : msg_; }

 private:
  Status(Code c, std::string m, int e) : code_(c), errno_(e), msg_(std::move(m)) {}
  Code code_ = Code::kOk;
  int errno_ = 0;
  std::string msg_;
};

#define ALPSCK_RETURN_IF_ERROR(expr)      \
  do {                                    \
    ::alpsck::Status s_ = (expr);         \
    if (!s_.ok()) return s_;              \
  } while (0)

}  // namespace alpsck
