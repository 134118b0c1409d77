#include "platform.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/vfs.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

namespace alpsck {

std::string HostName() {
  char here[256] = {};
  if (::gethostname(here, sizeof(here) - 1) != 0) return "";
  return here;
}

uint64_t PageSize() {
  static const uint64_t ps = [] {
    long v = sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<uint64_t>(v) : uint64_t{4096};
  }();
  return ps;
}

uint64_t CacheLineSize() {
  static const uint64_t cl = [] {
    long v = -1;
#ifdef _SC_LEVEL1_DCACHE_LINESIZE
    v = sysconf(_SC_LEVEL1_DCACHE_LINESIZE);
#endif
    if (v <= 0) {
      if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index0/coherency_line_size", "r")) {
        long x = 0;
        if (std::fscanf(f, "%ld", &x) == 1) v = x;
        std::fclose(f);
      }
    }
    return v > 0 ? static_cast<uint64_t>(v) : uint64_t{64};
  }();
  return cl;
}

std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int i = 0; i < CPU_SETSIZE; ++i)
      if (CPU_ISSET(i, &set)) cpus.push_back(i);
  }
  if (cpus.empty()) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < (n > 0 ? n : 1); ++i) cpus.push_back(static_cast<int>(i));
  }
  return cpus;
}

bool PinCurrentThread(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

bool NiceCurrentThread(int nice) {
#ifdef __linux__
  return setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice) == 0;
#else
  (void)nice;
  return false;
#endif
}

void EnterBackground(const std::vector<int>& pin_cpus, uint32_t nice, uint32_t index) {
  if (!pin_cpus.empty()) PinCurrentThread(pin_cpus[index % pin_cpus.size()]);
  if (nice) NiceCurrentThread(static_cast<int>(nice));
}

namespace {

// The kernel's memory-policy ABI (linux/mempolicy.h), stable since 2.6: spelled out here so the
// core needs no kernel headers of the target.
constexpr int kMpolPreferred = 1;
constexpr unsigned long kMpolFNode = 1ul << 0;
constexpr unsigned long kMpolFAddr = 1ul << 1;
constexpr int kMaxNumaNodes = 1024;  // the mask's bits
// What the calls are told the mask holds: the kernel reads one bit fewer than maxnode says
// (mm/mempolicy.c get_nodes), so node 1023 needs 1025.
constexpr unsigned long kMaxNode = kMaxNumaNodes + 1;
constexpr size_t kWordBits = 8 * sizeof(unsigned long);
constexpr size_t kMaskWords = kMaxNumaNodes / kWordBits;

}  // namespace

namespace {

// The first bytes (up to 4 KiB) of a small file such as a sysfs attribute; empty if unreadable.
std::string ReadSmallSysFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return std::string();
  char buf[4096];
  const size_t n = std::fread(buf, 1, sizeof(buf), f);
  std::fclose(f);
  return std::string(buf, n);
}

}  // namespace

uint64_t TransparentHugePageSize(const std::string& sysfs) {
  const std::string thp = sysfs + "/kernel/mm/transparent_hugepage/";
  const std::string enabled = ReadSmallSysFile(thp + "enabled");
  if (enabled.find('[') == std::string::npos || enabled.find("[never]") != std::string::npos) return 0;
  const uint64_t size = std::strtoull(ReadSmallSysFile(thp + "hpage_pmd_size").c_str(), nullptr, 10);
  return size > PageSize() && (size & (size - 1)) == 0 ? size : 0;
}

std::vector<int> CpuNumaNodes(const std::string& sysfs) {
  std::vector<int> nodes;
  const std::string text = ReadSmallSysFile(sysfs + "/devices/system/node/has_cpu");
  const char* p = text.c_str();
  while (*p >= '0' && *p <= '9') {
    char* end = nullptr;
    const long lo = std::strtol(p, &end, 10);
    long hi = lo;
    p = end;
    if (*p == '-') {
      hi = std::strtol(p + 1, &end, 10);
      p = end;
    }
    for (long v = lo; v <= hi && v < kMaxNumaNodes; ++v) nodes.push_back(static_cast<int>(v));
    if (*p != ',') break;
    ++p;
  }
  return nodes;
}

int PreferNumaNode(void* addr, uint64_t len, int node) {
  if (node < 0 || node >= kMaxNumaNodes) return -EINVAL;
#if defined(__linux__) && defined(SYS_mbind)
  unsigned long mask[kMaskWords] = {};
  const size_t bit = static_cast<size_t>(node);
  mask[bit / kWordBits] |= 1ul << (bit % kWordBits);
  if (syscall(SYS_mbind, addr, len, kMpolPreferred, mask, kMaxNode, 0u) != 0)
    return -errno;
  return 0;
#else
  (void)addr;
  (void)len;
  return -ENOSYS;
#endif
}

int NumaPolicyOf(const void* addr, int* mode, int* node) {
#if defined(__linux__) && defined(SYS_get_mempolicy)
  unsigned long mask[kMaskWords] = {};
  int m = 0;
  if (syscall(SYS_get_mempolicy, &m, mask, kMaxNode, addr, kMpolFAddr) != 0)
    return -errno;
  *mode = m;
  *node = -1;
  for (size_t bit = 0; bit < static_cast<size_t>(kMaxNumaNodes) && *node < 0; ++bit)
    if ((mask[bit / kWordBits] >> (bit % kWordBits)) & 1ul) *node = static_cast<int>(bit);
  return 0;
#else
  (void)addr;
  (void)mode;
  (void)node;
  return -ENOSYS;
#endif
}

int NumaNodeOfPage(const void* addr) {
#if defined(__linux__) && defined(SYS_get_mempolicy)
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, addr, kMpolFNode | kMpolFAddr) != 0) return -errno;
  return node;
#else
  (void)addr;
  return -ENOSYS;
#endif
}

PrefaultedMemory::~PrefaultedMemory() { Release(); }

PrefaultedMemory::PrefaultedMemory(PrefaultedMemory&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

PrefaultedMemory& PrefaultedMemory::operator=(PrefaultedMemory&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

bool PrefaultedMemory::Allocate(uint64_t bytes, int numa_node, bool huge_pages) {
  if (!Map(bytes, numa_node, huge_pages)) return false;
  Fault(0, size_);
  return true;
}

bool PrefaultedMemory::Map(uint64_t bytes, int numa_node, bool huge_pages) {
  Release();
  if (bytes == 0) return true;
  const uint64_t len = RoundUp(bytes, PageSize());
  // huge_pages, at least one huge page's worth: aligned to the huge page size (the kernel backs
  // only aligned ranges with huge pages) and advised MADV_HUGEPAGE, for far fewer pages for
  // O_DIRECT to pin. The restore's read buffers ask for it (restore of 2 GiB 1.00-1.05 s against
  // 1.15-1.36, system CPU 0.08-0.11 s against 0.25-0.33; they are reused memory, quick to fault).
  // The staging pool does not: on this project's VM huge pages took 3x longer to fault in (fresh
  // guest memory the hypervisor must back; 2.1 GiB in 0.27-5.2 s against 0.88-0.95 s on base
  // pages), so a pool prepared during 5 s of training was often not ready for the first save
  // (first stall over the rest, 1 GiB: over 1.5 in 13 of 18 rounds, against 2 of 21 on base
  // pages) and the faulting took CPU from the training. What they saved a steady save (system CPU 0.01-0.02 s against 0.06-0.13,
  // stall 187-209 ms against 198-262 at 2 GiB) is less than that; on Grace the base pages are
  // 64 KiB already, and its huge pages 512 MiB. docs/benchmarks.md has both measurements.
  // The extra reservation (one huge page of address space) is unmapped at once.
  static const uint64_t huge = TransparentHugePageSize();
  void* p = MAP_FAILED;
  if (huge_pages && huge && len >= huge) {
    void* r = mmap(nullptr, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r != MAP_FAILED) {
      char* raw = static_cast<char*>(r);
      char* a = raw + (RoundUp(reinterpret_cast<uintptr_t>(raw), huge) - reinterpret_cast<uintptr_t>(raw));
      if (a > raw) munmap(raw, static_cast<size_t>(a - raw));
      munmap(a + len, static_cast<size_t>(raw + len + huge - (a + len)));
      madvise(a, len, MADV_HUGEPAGE);  // advice: a kernel that ignores it costs only the speed
      p = a;
    }
  } else {
    p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (p == MAP_FAILED) return false;
  // Not inherited by fork(): a forked child (a DataLoader worker) would otherwise share every page
  // copy-on-write, and the next save's copy would take one page fault and a page copy per page
  // while the child lives (measured: 0.61 s against 0.03 s for a 256 MB state). Nothing in a
  // child may use this memory: its engine's threads stayed with the parent (Engine::Forked). A
  // kernel or emulator that ignores the advice loses only the speed.
  madvise(p, len, MADV_DONTFORK);
  if (numa_node >= 0) {
    const int r = PreferNumaNode(p, len, numa_node);
    if (r < 0) {
      munmap(p, len);
      errno = -r;
      return false;
    }
  }
  data_ = static_cast<char*>(p);
  size_ = len;
  return true;
}

void PrefaultedMemory::Fault(uint64_t offset, uint64_t len) {
  // One page at a time, not MAP_POPULATE: populating holds the process's mmap lock for the whole
  // range, and a training thread that allocates meanwhile (a new tensor) waits on it. Measured
  // with Engine::Prepare faulting 2 GiB in the background on a 2-vCPU VM: with MAP_POPULATE the
  // training ran 1-5,600 matrix products in 5 s, touching pages 2,700-5,300, without the
  // faulting 9,200-17,000 (benchmarks/first_save.py).
  const uint64_t ps = PageSize();
  const uint64_t end = std::min(size_, offset + len);
  for (uint64_t off = offset - offset % ps; off < end; off += ps) data_[off] = 0;
}

void PrefaultedMemory::Release() {
  if (data_) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

int FileSystemMagic(const std::string& path, uint64_t* magic) {
  struct statfs st;
  if (::statfs(path.c_str(), &st) != 0) return -errno;
  *magic = static_cast<uint64_t>(static_cast<uint32_t>(st.f_type));  // f_type's width varies by ISA
  return 0;
}

}  // namespace alpsck
