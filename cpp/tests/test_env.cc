// The I/O layer: full transfers survive short writes and EINTR, errors name the path, O_DIRECT
// falls back visibly, 64-bit offsets work past 4 GiB, atomic small files.
#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "env.h"
#include "file_io.h"
#include "platform.h"
#include "testing.h"
#include "test_util.h"

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
  REQUIRE(WriteFileAtomic(Env::Default(), p, "1\n").ok());
  REQUIRE(WriteFileAtomic(Env::Default(), p, "22\n").ok());
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

ALPSCK_TEST_MAIN()
