// The I/O layer: full transfers survive short writes and EINTR, errors name the path, O_DIRECT
// falls back visibly, 64-bit offsets work past 4 GiB, atomic small files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "env.h"
#include "env_fault.h"
#include "file_io.h"
#include "platform.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;
using alpsck_test::TempDir;

TEST(write_full_survives_short_writes_and_eintr) {
  TempDir d;
  FaultEnv env;
  FaultRule shortw;
  shortw.op = FaultRule::Op::kPWrite;
  shortw.short_transfer = true;
  shortw.count = 5;
  env.AddRule(shortw);
  FaultRule intr;
  intr.op = FaultRule::Op::kPWrite;
  intr.error = EINTR;
  intr.count = 3;
  env.AddRule(intr);
  const std::string p = d.sub("f");
  int fd = env.Open(p, O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  std::string data(100000, 'x');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  CHECK(WriteFull(&env, fd, data.data(), data.size(), 0, p).ok());
  CHECK(env.FaultsInjected() >= 8);
  std::string back(data.size(), '\0');
  CHECK(ReadFull(&env, fd, back.data(), back.size(), 0, p).ok());
  CHECK(back == data);
  env.Close(fd);
}

TEST(errors_are_classified_and_name_the_path) {
  TempDir d;
  FaultEnv env;
  FaultRule full;
  full.op = FaultRule::Op::kPWrite;
  full.error = ENOSPC;
  env.AddRule(full);
  const std::string p = d.sub("full");
  int fd = env.Open(p, O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  Status s = WriteFull(&env, fd, "abc", 3, 0, p);
  CHECK(s.code() == Code::kNoSpace);
  CHECK_EQ(s.err(), ENOSPC);
  CHECK(s.message().find(p) != std::string::npos);
  env.Close(fd);
  Status r = ReadSmallFile(Env::Default(), d.sub("missing"), 100, nullptr);
  CHECK(r.code() == Code::kNotFound);
}

TEST(read_full_reports_truncation_as_corruption) {
  TempDir d;
  REQUIRE(alpsck_test::WriteText(d.sub("short"), "12345"));
  int fd = Env::Default()->Open(d.sub("short"), O_RDONLY, 0);
  char buf[10];
  Status s = ReadFull(Env::Default(), fd, buf, 10, 0, d.sub("short"));
  CHECK(s.code() == Code::kCorrupt);
  CHECK(s.message().find("truncated") != std::string::npos);
  Env::Default()->Close(fd);
}

TEST(direct_io_falls_back_visibly_when_refused) {
  TempDir d;
  FaultEnv env;
  FaultRule refuse;  // what tmpfs on older kernels answers to O_DIRECT
  refuse.op = FaultRule::Op::kOpen;
  refuse.error = EINVAL;
  refuse.count = 1;
  env.AddRule(refuse);
  int fd = -1;
  bool direct = true;
  REQUIRE(OpenMaybeDirect(&env, d.sub("f"), O_WRONLY | O_CREAT, true, &fd, &direct).ok());
  CHECK(!direct);
  env.Close(fd);
  // Other open errors are not swallowed.
  FaultRule deny;
  deny.op = FaultRule::Op::kOpen;
  deny.error = EACCES;
  env.AddRule(deny);
  Status s = OpenMaybeDirect(&env, d.sub("g"), O_WRONLY | O_CREAT, true, &fd, &direct);
  CHECK(!s.ok());
  CHECK_EQ(s.err(), EACCES);
}

TEST(offsets_past_4gib_in_a_sparse_file) {
  TempDir d;
  Env* env = Env::Default();
  const std::string p = d.sub("sparse");
  int fd = env->Open(p, O_RDWR | O_CREAT, 0644);
  REQUIRE(fd >= 0);
  const uint64_t off = (5ull << 30) + 4096;
  const std::string data = "beyond four gibibytes";
  REQUIRE(WriteFull(env, fd, data.data(), data.size(), off, p).ok());
  uint64_t size = 0;
  CHECK_EQ(env->FileSize(fd, &size), 0);
  CHECK_EQ(size, off + data.size());
  std::string back(data.size(), '\0');
  CHECK(ReadFull(env, fd, back.data(), back.size(), off, p).ok());
  CHECK_EQ(back, data);
  env->Close(fd);
}

TEST(atomic_file_replaces_and_leaves_no_tmp) {
  TempDir d;
  const std::string p = d.sub("LATEST");
  REQUIRE(WriteFileAtomic(Env::Default(), p, p + ".tmp", "1\n").ok());
  REQUIRE(WriteFileAtomic(Env::Default(), p, p + ".tmp", "22\n").ok());
  std::string s;
  REQUIRE(ReadSmallFile(Env::Default(), p, 100, &s).ok());
  CHECK_EQ(s, std::string("22\n"));
  CHECK(!alpsck_test::Exists(p + ".tmp"));
  CHECK(ReadSmallFile(Env::Default(), p, 2, &s).code() == Code::kCorrupt);  // over the limit
}

TEST(direct_io_alignment_is_reported) {
  TempDir d;
  int fd = -1;
  bool direct = false;
  REQUIRE(OpenMaybeDirect(Env::Default(), d.sub("f"), O_WRONLY | O_CREAT, true, &fd, &direct).ok());
  DirectIoInfo info;
  CHECK_EQ(Env::Default()->DirectIo(fd, &info), 0);
  std::fprintf(stderr, "direct=%d mem_align=%llu offset_align=%llu\n", direct,
               static_cast<unsigned long long>(info.mem_align), static_cast<unsigned long long>(info.offset_align));
  if (direct && info.offset_align) CHECK(info.offset_align <= PageSize() * 16);
  Env::Default()->Close(fd);
}

namespace {

std::string Slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void Spit(const std::string& p, const std::string& data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << data;
}

}  // namespace

// Below a confined root no syscall goes through a symlink, whichever entry it is and whenever it
// was swapped in; outside the root (and on the root's own path) symlinks are followed as before.
TEST(confined_root_never_follows_a_symlink_below_it) {
  TempDir d;
  const std::string run = d.sub("run"), out = d.sub("outside");
  REQUIRE(::mkdir(run.c_str(), 0755) == 0);
  REQUIRE(::mkdir(out.c_str(), 0755) == 0);
  Spit(out + "/f", "keep");
  REQUIRE(::symlink(out.c_str(), (run + "/step-1.tmp").c_str()) == 0);
  Env* env = Env::Default();
  // Not confined: the symlinked directory is followed (what the kernel does).
  CHECK_EQ(env->IsDir(run + "/step-1.tmp/f"), 0);
  {
    ConfinedRoot confined(env, run + "/");  // a trailing slash names the same root
    std::vector<std::string> names;
    CHECK_EQ(env->Open(run + "/step-1.tmp/f", O_WRONLY | O_TRUNC, 0), -ELOOP);
    CHECK_EQ(env->Open(run + "/step-1.tmp/new", O_WRONLY | O_CREAT, 0644), -ELOOP);
    CHECK_EQ(env->Open(run + "/step-1.tmp", O_RDONLY | O_DIRECTORY, 0), -ELOOP);
    CHECK_EQ(env->Unlink(run + "/step-1.tmp/f"), -ELOOP);
    CHECK_EQ(env->Rename(run + "/step-1.tmp/f", run + "/g"), -ELOOP);
    CHECK_EQ(env->Mkdir(run + "/step-1.tmp/d"), -ELOOP);
    CHECK_EQ(env->Rmdir(run + "/step-1.tmp/d"), -ELOOP);
    CHECK_EQ(env->ListDir(run + "/step-1.tmp", &names), -ELOOP);
    CHECK_EQ(env->IsDir(run + "/step-1.tmp/f"), -ELOOP);
    CHECK_EQ(env->IsOwnDir(run + "/step-1.tmp"), 0);
    CHECK_EQ(env->IsDir(run + "/step-1.tmp"), 0);  // the link itself, not its target
    CHECK_EQ(env->Open(run + "/../outside/f", O_RDONLY, 0), -EINVAL);  // never walks up past the root
    // The root's own entries are still reachable, and the root itself may be named.
    int fd = env->Open(run + "/LATEST", O_WRONLY | O_CREAT, 0644);
    CHECK(fd >= 0);
    env->Close(fd);
    CHECK_EQ(env->IsDir(run), 1);
    CHECK_EQ(env->ListDir(run, &names), 0);
    CHECK_EQ(names.size(), size_t{2});
    // Unlinking the symlink removes the link, never the target.
    CHECK_EQ(env->Unlink(run + "/step-1.tmp"), 0);
  }
  CHECK_EQ(Slurp(out + "/f"), std::string("keep"));
  // Unconfined again: the same path is followed.
  REQUIRE(::symlink(out.c_str(), (run + "/step-1.tmp").c_str()) == 0);
  CHECK_EQ(env->IsDir(run + "/step-1.tmp/f"), 0);
}

// The check-then-use race: a directory checked as real and swapped for a symlink before the file
// inside it is opened is caught at the open, not written through.
TEST(confined_root_catches_a_directory_swapped_after_the_check) {
  TempDir d;
  const std::string run = d.sub("run"), out = d.sub("outside");
  REQUIRE(::mkdir(run.c_str(), 0755) == 0);
  REQUIRE(::mkdir(out.c_str(), 0755) == 0);
  Spit(out + "/rank-00000.bin", "keep");
  ConfinedRoot outer(Env::Default(), run);
  ConfinedRoot inner(Env::Default(), run);  // nested: both must go before the root is free again
  const std::string tmp = run + "/step-2.tmp";
  REQUIRE(::mkdir(tmp.c_str(), 0755) == 0);
  CHECK_EQ(Env::Default()->IsOwnDir(tmp), 1);
  REQUIRE(::rmdir(tmp.c_str()) == 0);
  REQUIRE(::symlink(out.c_str(), tmp.c_str()) == 0);
  int fd = -1;
  bool direct = false;
  Status s = OpenMaybeDirect(Env::Default(), tmp + "/rank-00000.bin", O_WRONLY | O_CREAT, false, &fd, &direct);
  CHECK(!s.ok());
  CHECK(s.message().find("symbolic link") != std::string::npos);
  CHECK(!WriteFileSynced(Env::Default(), tmp + "/rank-00000.bin", "x").ok());
  CHECK_EQ(Slurp(out + "/rank-00000.bin"), std::string("keep"));
}

// A file alpsck writes is its own regular file: a hard link to a file elsewhere is replaced by a
// new file (the other name keeps its bytes), a FIFO or a device is refused without hanging.
TEST(files_written_are_never_shared_or_special) {
  TempDir d;
  const std::string outside = d.sub("outside.bin"), mine = d.sub("rank-00000.bin");
  Spit(outside, "outside bytes");
  REQUIRE(::link(outside.c_str(), mine.c_str()) == 0);
  int fd = -1;
  bool direct = false;
  REQUIRE(OpenMaybeDirect(Env::Default(), mine, O_WRONLY | O_CREAT, false, &fd, &direct).ok());
  CHECK(WriteFull(Env::Default(), fd, "new", 3, 0, mine).ok());
  Env::Default()->Close(fd);
  CHECK_EQ(Slurp(outside), std::string("outside bytes"));
  CHECK_EQ(Slurp(mine), std::string("new"));
  // The same through WriteFileSynced (which truncates: only after the check).
  REQUIRE(::unlink(mine.c_str()) == 0);
  REQUIRE(::link(outside.c_str(), mine.c_str()) == 0);
  REQUIRE(WriteFileSynced(Env::Default(), mine, "x").ok());
  CHECK_EQ(Slurp(outside), std::string("outside bytes"));
  CHECK_EQ(Slurp(mine), std::string("x"));
  const std::string fifo = d.sub("MANIFEST.json");
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  Status s = WriteFileSynced(Env::Default(), fifo, "{}");
  CHECK(!s.ok());
  CHECK(s.message().find("FIFO") != std::string::npos || s.err() == ENXIO);
  s = OpenMaybeDirect(Env::Default(), fifo, O_RDWR, false, &fd, &direct);  // O_RDWR opens a FIFO at once
  CHECK(!s.ok());
  CHECK(s.message().find("a FIFO") != std::string::npos);
  s = OpenMaybeDirect(Env::Default(), "/dev/null", O_WRONLY, false, &fd, &direct);
  CHECK(!s.ok());
  CHECK(s.message().find("a device") != std::string::npos);
}

ALPSCK_TEST_MAIN()
