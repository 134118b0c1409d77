// Platform facts are read at run time; staging memory is aligned, pre-faulted and bounded.
#include <atomic>
#include <cerrno>
#include <fstream>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "build_info.h"
#include "platform.h"
#include "staging_pool.h"
#include "test_util.h"
#include "testing.h"

using namespace alpsck;

TEST(page_size_is_the_systems) {
  uint64_t ps = PageSize();
  CHECK_EQ(ps, static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  CHECK(ps >= 4096 && (ps & (ps - 1)) == 0);
  // Under qemu -p 65536 (the aarch64 ctest run) the build passes the expected size in.
  if (const char* want = std::getenv("ALPSCK_EXPECT_PAGE_SIZE")) CHECK_EQ(ps, std::strtoull(want, nullptr, 10));
  std::fprintf(stderr, "page size %llu, cache line %llu\n", static_cast<unsigned long long>(ps),
               static_cast<unsigned long long>(CacheLineSize()));
}

TEST(build_info_names_the_tuning) {
  const BuildInfo& b = GetBuildInfo();
  std::fprintf(stderr, "tuning %s (%s), %s, %s, %s, crc32c hardware %s\n", b.tuning, b.arch_flags, b.compiler,
               b.arch, b.build_type, b.crc32c_hardware);
  const std::string tuning = b.tuning;
  CHECK(tuning == "neoverse-v2" || tuning == "portable");
  CHECK_EQ(std::string(b.arch_flags).empty(), tuning == "portable");
#if defined(__aarch64__)
  CHECK_EQ(std::string(b.crc32c_hardware), std::string("armv8-crc"));
#elif defined(__x86_64__)
  CHECK_EQ(tuning, std::string("portable"));
  CHECK_EQ(std::string(b.crc32c_hardware), std::string("sse42"));
#endif
  // What the build was asked for (tests/run.sh: neoverse-v2 for the aarch64 cross build with
  // ALPSCK_TUNE_GRACE=ON, portable for the native x86 builds with the default AUTO).
  if (const char* want = std::getenv("ALPSCK_EXPECT_TUNING")) CHECK_EQ(tuning, std::string(want));
}

TEST(cache_line_is_sane) {
  uint64_t cl = CacheLineSize();
  CHECK(cl >= 16 && cl <= 1024 && (cl & (cl - 1)) == 0);
}

TEST(allowed_cpus_and_pinning) {
  std::vector<int> cpus = AllowedCpus();
  REQUIRE(!cpus.empty());
  bool pinned = false;
  std::thread t([&] { pinned = PinCurrentThread(cpus.back()); });
  t.join();
  CHECK(pinned);
  CHECK(!PinCurrentThread(-1));
}

TEST(prefaulted_memory_is_page_aligned_and_writable) {
  PrefaultedMemory m;
  REQUIRE(m.Allocate(3 * PageSize() + 1));
  CHECK_EQ(reinterpret_cast<uintptr_t>(m.data()) % PageSize(), uintptr_t{0});
  CHECK_EQ(m.size(), 4 * PageSize());
  for (uint64_t i = 0; i < m.size(); ++i) CHECK(m.data()[i] == 0);
  m.data()[m.size() - 1] = 7;
  PrefaultedMemory n = std::move(m);
  CHECK(m.data() == nullptr);
  CHECK_EQ(n.data()[n.size() - 1], 7);
}

TEST(cpu_numa_nodes_reads_the_kernels_list) {
  alpsck_test::TempDir d;
  REQUIRE(!d.path().empty());
  const std::string dir = d.path() + "/devices/system/node";
  REQUIRE(::mkdir((d.path() + "/devices").c_str(), 0700) == 0 && ::mkdir((d.path() + "/devices/system").c_str(), 0700) == 0 &&
          ::mkdir(dir.c_str(), 0700) == 0);
  CHECK(CpuNumaNodes(d.path()).empty());  // no file: unknown
  auto write = [&](const char* text) { std::ofstream(dir + "/has_cpu") << text; };
  write("0-3,8\n");
  CHECK(CpuNumaNodes(d.path()) == (std::vector<int>{0, 1, 2, 3, 8}));
  write("5\n");
  CHECK(CpuNumaNodes(d.path()) == (std::vector<int>{5}));
  write("\n");
  CHECK(CpuNumaNodes(d.path()).empty());
  // This machine's own list (under qemu-user, the host's): a Linux kernel built with NUMA names at least one.
  std::ifstream own("/sys/devices/system/node/has_cpu");
  if (own) CHECK(!CpuNumaNodes().empty());
}

TEST(transparent_huge_page_size_reads_the_kernels_settings) {
  alpsck_test::TempDir d;
  REQUIRE(!d.path().empty());
  const std::string dir = d.path() + "/kernel/mm/transparent_hugepage";
  REQUIRE(::mkdir((d.path() + "/kernel").c_str(), 0700) == 0 && ::mkdir((d.path() + "/kernel/mm").c_str(), 0700) == 0 &&
          ::mkdir(dir.c_str(), 0700) == 0);
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{0});  // no files: none
  auto write = [&](const char* name, const char* text) { std::ofstream(dir + "/" + name) << text; };
  write("enabled", "always [madvise] never\n");
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{0});  // no size
  write("hpage_pmd_size", "2097152\n");
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{2097152});
  write("hpage_pmd_size", "536870912\n");  // arm64 with 64 KiB pages
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{536870912});
  write("enabled", "[always] madvise never\n");
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{536870912});
  write("enabled", "always madvise [never]\n");
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{0});
  write("enabled", "always [madvise] never\n");
  write("hpage_pmd_size", "3000000\n");  // not a power of two
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{0});
  write("hpage_pmd_size", "1024\n");  // not above the page size
  CHECK_EQ(TransparentHugePageSize(d.path()), uint64_t{0});
}

// The VmFlags of the mapping holding addr in /proc/self/smaps ("" when it is not listed there).
std::string VmFlagsOf(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  const auto a = reinterpret_cast<uintptr_t>(addr);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = a >= lo && a < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line + " ";
    }
  }
  return "";
}

// Asked for huge pages, a mapping of at least one huge page starts on a huge-page boundary (the
// kernel backs only aligned ranges with huge pages), is advised MADV_HUGEPAGE, is usable to its
// last byte, and unmaps cleanly. Not asked (the staging pool: slower to fault in, platform.cc),
// the same size is plain memory, never advised.
TEST(prefaulted_memory_takes_huge_pages_only_when_asked_and_then_aligned_to_them) {
  const uint64_t huge = TransparentHugePageSize();
  std::fprintf(stderr, "transparent huge pages here: %llu bytes\n", static_cast<unsigned long long>(huge));
  if (huge == 0 || huge > (64ull << 20)) return;  // none here, or too big to map in a test (512 MiB)
  const bool emulated = std::getenv("ALPSCK_TEST_EMULATED") != nullptr;  // qemu-user (set by the build: CMakeLists.txt)
  for (int round = 0; round < 3; ++round) {
    PrefaultedMemory m;
    REQUIRE(m.Allocate(2 * huge + PageSize(), -1, /*huge_pages=*/true));
    CHECK_EQ(reinterpret_cast<uintptr_t>(m.data()) % huge, uintptr_t{0});
    CHECK_EQ(m.size(), 2 * huge + PageSize());
    m.data()[0] = 1;
    m.data()[m.size() - 1] = 2;
    CHECK(m.data()[0] == 1 && m.data()[m.size() - 1] == 2);
    if (!emulated) CHECK(VmFlagsOf(m.data()).find(" hg ") != std::string::npos);  // qemu-user drops advice
  }
  PrefaultedMemory plain;
  REQUIRE(plain.Allocate(2 * huge + PageSize()));
  CHECK_EQ(reinterpret_cast<uintptr_t>(plain.data()) % PageSize(), uintptr_t{0});
  const std::string flags = VmFlagsOf(plain.data());
  std::fprintf(stderr, "plain mapping's %s\n", flags.c_str());
  if (!emulated) CHECK(!flags.empty() && flags.find(" hg ") == std::string::npos);
  PrefaultedMemory small;
  REQUIRE(small.Allocate(huge / 2, -1, true));
  CHECK_EQ(reinterpret_cast<uintptr_t>(small.data()) % PageSize(), uintptr_t{0});
}

// Whether this platform places memory by node: not under qemu-user, which has no mbind
// (ENOSYS); there the placement must fail loudly instead.
bool NumaPlacementWorks() {
  PrefaultedMemory probe;
  const bool mapped = probe.Map(PageSize());
  CHECK(mapped);
  if (!mapped) return false;
  const int r = PreferNumaNode(probe.data(), probe.size(), 0);
  if (r == -ENOSYS) std::fprintf(stderr, "mbind: ENOSYS here (qemu-user?): checking that placement fails loudly\n");
  else CHECK_EQ(r, 0);
  return r == 0;
}

// Staging memory is not inherited by fork() (a DataLoader worker): otherwise every page is shared
// copy-on-write while the child lives, and the parent's next save takes a fault per page. The
// child asks the kernel whether the range is mapped (mincore: ENOMEM where it is not) rather
// than touching it, so no sanitizer's SIGSEGV handler stands between the test and the answer.
// qemu-user ignores the advice (the child still sees the memory); the test accepts that only
// where qemu-user's other signature, no mbind, is seen too.
TEST(prefaulted_memory_is_not_inherited_by_a_forked_child) {
  PrefaultedMemory m;
  REQUIRE(m.Allocate(4 * PageSize()));
  m.data()[PageSize()] = 42;
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    unsigned char resident[4] = {};
    if (mincore(m.data(), 4 * PageSize(), resident) == 0) _exit(0);  // still mapped here
    _exit(errno == ENOMEM ? 3 : 4);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) != 3) {
    CHECK_EQ(WEXITSTATUS(status), 0);
    std::fprintf(stderr, "the forked child still saw the memory (MADV_DONTFORK ignored: qemu-user?)\n");
    CHECK(!NumaPlacementWorks());
  }
  CHECK_EQ(m.data()[PageSize()], 42);  // the parent's copy is untouched
}

TEST(staging_memory_comes_from_the_numa_node_asked_for) {
  const std::vector<int> nodes = CpuNumaNodes();
  REQUIRE(!nodes.empty());
  const int node = nodes.back();
  if (!NumaPlacementWorks()) {
    PrefaultedMemory m;
    errno = 0;
    CHECK(!m.Allocate(PageSize(), node));
    CHECK_EQ(errno, ENOSYS);
    CHECK(m.data() == nullptr);
    StagingPool pool;
    pool.SetNumaNode(node);
    const Status s = pool.Init(64 << 10, 2);
    CHECK(!s.ok());
    CHECK(s.message().find("staging memory") != std::string::npos);
    return;
  }
  PrefaultedMemory m;
  REQUIRE(m.Allocate(4 * PageSize(), node));
  int mode = -1, got = -2;
  REQUIRE(NumaPolicyOf(m.data() + PageSize(), &mode, &got) == 0);
  CHECK_EQ(mode, 1);  // MPOL_PREFERRED
  CHECK_EQ(got, node);
  CHECK_EQ(NumaNodeOfPage(m.data() + 3 * PageSize()), node);
  PrefaultedMemory plain;  // no node asked for: the default policy (first touch)
  REQUIRE(plain.Allocate(PageSize()));
  REQUIRE(NumaPolicyOf(plain.data(), &mode, &got) == 0);
  CHECK_EQ(mode, 0);
  // A node beyond the mask: refused, nothing left mapped. (A node within the mask that the machine
  // lacks is not refused by the kernel, which then allocates locally: Engine::CheckNumaNode is
  // what refuses it, tested in test_engine.)
  PrefaultedMemory bad;
  errno = 0;
  CHECK(!bad.Map(PageSize(), 1024));
  CHECK_EQ(errno, EINVAL);
  CHECK(bad.data() == nullptr);
  StagingPool pool;  // the pool's first mapping and a grown one
  pool.SetNumaNode(node);
  REQUIRE(pool.Init(64 << 10, 2).ok());
  REQUIRE(pool.GrowTo(3).ok());
  char* slots[3] = {pool.Acquire(), pool.Acquire(), pool.Acquire()};
  for (char* s : slots) {
    REQUIRE(s != nullptr);
    REQUIRE(NumaPolicyOf(s, &mode, &got) == 0);
    CHECK_EQ(mode, 1);
    CHECK_EQ(got, node);
  }
}

TEST(staging_pool_bounds_and_blocks) {
  StagingPool pool;
  REQUIRE(pool.Init(PageSize(), 2).ok());
  char* a = pool.Acquire();
  char* b = pool.Acquire();
  CHECK(a && b && a != b);
  CHECK_EQ(pool.free_slots(), uint64_t{0});
  std::atomic<bool> got{false};
  std::thread t([&] {
    char* c = pool.Acquire();  // blocks until a slot is released
    got = c == a;
    pool.Release(c);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!got.load());
  pool.Release(a);
  t.join();
  CHECK(got.load());
  pool.Release(b);
  CHECK_EQ(pool.free_slots(), uint64_t{2});
  pool.Close();
  CHECK(pool.Acquire() == nullptr);
  CHECK(!pool.Init(0, 1).ok());
}

// Without prefault every slot is free at once and no page is resident until a save copies into it:
// an engine whose saves are written in place (the DCP writer's, for CPU tensors) pays nothing for
// its pool (faulting 80 MiB at every open cost its saves 40-50 ms).
TEST(a_pool_not_prefaulted_has_every_slot_free_and_faults_each_page_at_its_first_write) {
  ReleaseSpareStaging();  // an earlier test's pool, whose pages are resident, is not taken
  StagingPool pool;
  const uint64_t ps = PageSize();
  REQUIRE(pool.Init(ps, 4, /*prefault=*/false).ok());
  CHECK_EQ(pool.free_slots(), uint64_t{4});
  unsigned char resident[4] = {1, 1, 1, 1};
  REQUIRE(mincore(pool.base(), 4 * ps, resident) == 0);
  for (unsigned char r : resident) CHECK_EQ(r & 1, 0);
  char* a = pool.Acquire();
  REQUIRE(a != nullptr);
  std::memset(a, 7, ps);
  REQUIRE(mincore(a, ps, resident) == 0);
  CHECK_EQ(resident[0] & 1, 1);
  pool.Release(a);
  CHECK_EQ(pool.free_slots(), uint64_t{4});
}

// Fill (a pool prepared in the background) pauses while a snapshot copy runs, so the two do not
// share the CPU during the save's stall; it faults on for a copy that waits for a slot, and once
// the copy ends. Before, the first save of a 2 GiB bench stalled 1.6-1.8x the rest here.
TEST(filling_pauses_during_a_copy_unless_the_copy_waits_for_a_slot) {
  StagingPool pool;
  const uint64_t n = 64;
  REQUIRE(pool.Reserve(PageSize(), n).ok());
  pool.BeginCopy();
  std::thread filler([&] { pool.Fill(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_EQ(pool.free_slots(), uint64_t{0});  // held: nothing faulted while the copy has all it asked for
  char* a = pool.Acquire();  // waits: Fill faults a slot for it
  REQUIRE(a != nullptr);
  char* b = pool.Acquire();  // and another
  REQUIRE(b != nullptr && b != a);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_EQ(pool.free_slots(), uint64_t{0});  // paused again once each waiter was served
  pool.EndCopy();
  filler.join();  // faults the rest now
  CHECK_EQ(pool.free_slots(), n - 2);
  pool.Release(a);
  pool.Release(b);
  // Close ends a paused Fill.
  StagingPool other;
  REQUIRE(other.Reserve(PageSize(), n).ok());
  other.BeginCopy();
  std::thread paused([&] { other.Fill(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  other.Close();
  paused.join();
  CHECK_EQ(other.free_slots(), uint64_t{0});
  other.EndCopy();
}

// A destroyed pool's first mapping is the process's spare: the next pool that fits takes it, pages
// already faulted, instead of mapping fresh memory (an engine per checkpoint path faulted a new pool
// for every save: Lightning's CheckpointIO at 2 MiB stalled 2.5 ms against 0.9 with one engine).
TEST(a_destroyed_pools_memory_serves_the_next_pool_that_fits_it) {
  const uint64_t ps = PageSize();
  ReleaseSpareStaging();
  CHECK_EQ(SpareStagingBytes(), uint64_t{0});
  char* first = nullptr;
  {
    StagingPool a;
    REQUIRE(a.Init(ps, 4, /*prefault=*/false).ok());
    first = a.base();
    for (uint64_t i = 0; i < 4; ++i) std::memset(a.Acquire(), 1, ps);  // faulted by "saves"
  }
  CHECK_EQ(SpareStagingBytes(), 4 * ps);
  {
    StagingPool b;  // needs 3 slots: the spare's 4 are enough, and not twice too many
    REQUIRE(b.Init(ps, 3, /*prefault=*/false).ok());
    CHECK(b.base() == first);
    CHECK_EQ(b.slots(), uint64_t{3});  // the pool asked for, the rest of the spare unused
    CHECK_EQ(b.free_slots(), uint64_t{3});
    CHECK_EQ(SpareStagingBytes(), uint64_t{0});
    unsigned char resident[4] = {};
    REQUIRE(mincore(b.base(), 4 * ps, resident) == 0);
    for (unsigned char r : resident) CHECK_EQ(r & 1, 1);  // no page to fault
    StagingPool c;  // the spare is taken: fresh memory
    REQUIRE(c.Init(ps, 4, false).ok());
    CHECK(c.base() != first);
    for (uint64_t i = 0; i < 3; ++i) CHECK(b.Acquire() != nullptr);
    CHECK(b.TryAcquire() == nullptr);  // the spare's fourth slot is not the pool's
  }  // c goes, then b: b's mapping, the first, is the spare again
  CHECK_EQ(SpareStagingBytes(), 4 * ps);
  {
    StagingPool tiny;  // one slot: a spare of four is more than twice that, so it stays the spare
    REQUIRE(tiny.Init(ps, 1, false).ok());
    StagingPool big;  // nine: too small
    REQUIRE(big.Init(ps, 9, false).ok());
    CHECK_EQ(SpareStagingBytes(), 4 * ps);
    StagingPool elsewhere;  // another NUMA placement: not taken (memory already placed)
    elsewhere.SetNumaNode(0);
    if (elsewhere.Init(ps, 4, false).ok()) CHECK_EQ(SpareStagingBytes(), 4 * ps);
    CHECK_EQ(ReleaseSpareStaging(), 4 * ps);
  }  // elsewhere's, then big's, then tiny's: the newest, tiny's, stays
  CHECK_EQ(SpareStagingBytes(), ps);
  // A forked child has no spare: the parent's mapping is not inherited (MADV_DONTFORK).
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (SpareStagingBytes() != 0) _exit(3);
    StagingPool child;
    if (!child.Init(ps, 1, false).ok()) _exit(4);
    std::memset(child.Acquire(), 2, ps);
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK_EQ(WEXITSTATUS(status), 0);
  CHECK_EQ(ReleaseSpareStaging(), ps);
  CHECK_EQ(SpareStagingBytes(), uint64_t{0});
}

ALPSCK_TEST_MAIN()
