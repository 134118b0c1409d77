// Helpers shared by the core's tests: scratch directories, file pokes, save requests.
#pragma once

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "save.h"

namespace alpsck_test {

// A fresh directory under $ALPSCK_TEST_TMP (or /tmp), or under `base` when given, removed with
// its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& base_dir = std::string()) {
    const char* base = std::getenv("ALPSCK_TEST_TMP");
    std::string tmpl = (!base_dir.empty() ? base_dir : std::string(base && *base ? base : "/tmp")) + "/alpsck-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    path_ = mkdtemp(buf.data()) ? std::string(buf.data()) : std::string();
  }
  ~TempDir() {
    if (!path_.empty())
      nftw(path_.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// n pseudo-random bytes, reproducible from seed.
inline std::vector<char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

inline bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

inline long long FileSizeOf(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 ? static_cast<long long>(st.st_size) : -1;
}

// Flips one bit of the byte at offset (buffered I/O).
inline bool FlipBit(const std::string& p, long long offset) {
  int fd = ::open(p.c_str(), O_RDWR);
  if (fd < 0) return false;
  unsigned char b = 0;
  bool ok = ::pread(fd, &b, 1, offset) == 1;
  b ^= 0x10;
  ok = ok && ::pwrite(fd, &b, 1, offset) == 1;
  ::close(fd);
  return ok;
}

inline bool Truncate(const std::string& p, long long size) { return ::truncate(p.c_str(), size) == 0; }

inline bool WriteText(const std::string& p, const std::string& text) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return false;
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

// An Engine::Save request (save.h) from its fields in order, as the tests spell them.
inline alpsck::SaveRequest SaveReq(uint64_t step, std::vector<alpsck::SaveExtent> extents, std::string meta,
                                   alpsck::SaveMode mode, alpsck::CommitMode commit = alpsck::CommitMode::kAuto,
                                   alpsck::Status refusal = alpsck::Status::Ok(), alpsck::SaveNotes notes = {}) {
  alpsck::SaveRequest r;
  r.step = step;
  r.extents = std::move(extents);
  r.meta = std::move(meta);
  r.mode = mode;
  r.commit = commit;
  r.refusal = std::move(refusal);
  r.notes = std::move(notes);
  return r;
}

}  // namespace alpsck_test
