#include "save.h"

#include <chrono>
#include <utility>

namespace alpsck {

bool SaveHandle::Done() const {
  std::lock_guard<std::mutex> l(mu_);
  return done_;
}

bool SaveHandle::Wait(double timeout_s) const {
  std::unique_lock<std::mutex> l(mu_);
  if (timeout_s < 0) {
    cv_.wait(l, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(l, std::chrono::duration<double>(timeout_s), [&] { return done_; });
}

Status SaveHandle::status() const {
  std::lock_guard<std::mutex> l(mu_);
  return status_;
}

SaveResult SaveHandle::result() const {
  std::lock_guard<std::mutex> l(mu_);
  return result_;
}

void SaveHandle::Complete(Status s, SaveResult r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    status_ = std::move(s);
    result_ = std::move(r);
    done_ = true;
  }
  cv_.notify_all();
}

}  // namespace alpsck
