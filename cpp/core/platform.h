// Facts about the machine read at run time (never hard-coded: GH200 kernels may use 64 KiB
// pages) and the few things the core does with CPUs and memory: the process's cpuset, pinning
// a thread, and pre-faulted aligned memory for staging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace alpsck {

uint64_t PageSize();
// This machine's host name (gethostname), "" if it cannot be read.
std::string HostName();
uint64_t CacheLineSize();
// CPUs this process may run on (sched_getaffinity): respects the SLURM job's cpuset.
std::vector<int> AllowedCpus();
// Pins the calling thread to one CPU; false if the kernel refuses (CPU not in the cpuset).
bool PinCurrentThread(int cpu);
// Gives the calling thread (not the process: Linux keeps a nice value per thread) the nice value
// `nice` (0 .. 19): under contention the kernel then hands the CPU to normal threads first.
// False where the kernel refuses or the platform has no per-thread nice.
bool NiceCurrentThread(int nice);
// A background thread's start (the engine's writers, committer and pool-faulting thread): pinned
// to pin_cpus[index % n] (if any), niced to `nice` (if above 0).
void EnterBackground(const std::vector<int>& pin_cpus, uint32_t nice, uint32_t index);

inline uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The size of a transparent huge page (SYSFS/kernel/mm/transparent_hugepage/hpage_pmd_size: 2 MiB
// on x86-64 and 4 KiB-page arm64, 512 MiB with 64 KiB pages), or 0 when the kernel has none or
// has them set to "never". sysfs: another root, for tests.
uint64_t TransparentHugePageSize(const std::string& sysfs = "/sys");

// NUMA placement (Linux system calls, no libnuma; elsewhere each reports ENOSYS). On a GH200 node
// each GPU has its own Grace CPU and memory: staging memory on another node crosses the
// inter-chip links on every device-to-host copy and every write.
//
// The NUMA nodes that have CPUs (SYSFS/devices/system/node/has_cpu, a list such as "0-3,8"),
// ascending; empty if unknown. sysfs: another root, for tests.
std::vector<int> CpuNumaNodes(const std::string& sysfs = "/sys");
// Asks the kernel to take the pages of [addr, addr + len) from `node` when they are first touched
// (mbind MPOL_PREFERRED: another node only once this one is full, never an out-of-memory kill).
// addr page-aligned. 0, or -errno.
int PreferNumaNode(void* addr, uint64_t len, int node);
// The policy of the page at addr (get_mempolicy MPOL_F_ADDR): *mode gets 0 (default: first touch),
// 1 (preferred), 2 (bind), ...; *node the lowest node of its mask, -1 if none. 0, or -errno.
int NumaPolicyOf(const void* addr, int* mode, int* node);
// The node holding the (faulted) page at addr, or -errno.
int NumaNodeOfPage(const void* addr);

// The type of the file system holding path (statfs f_type: 0x0BD00BD0 Lustre, 0x6969 NFS, ...),
// which alpsck asks before any Lustre-only call. 0, or -errno.
int FileSystemMagic(const std::string& path, uint64_t* magic);

// Page-aligned anonymous memory, pre-faulted (one write per page) so that first-touch page faults
// never land on the hot path, and not inherited by fork() (MADV_DONTFORK). With huge_pages, a
// mapping of at least one transparent huge page is aligned to it and advised MADV_HUGEPAGE (the
// restore's read buffers; not the staging pool: platform.cc says why). Move-only; unmaps on
// destruction.
class PrefaultedMemory {
 public:
  PrefaultedMemory() = default;
  ~PrefaultedMemory();
  PrefaultedMemory(PrefaultedMemory&& o) noexcept;
  PrefaultedMemory& operator=(PrefaultedMemory&& o) noexcept;
  PrefaultedMemory(const PrefaultedMemory&) = delete;
  PrefaultedMemory& operator=(const PrefaultedMemory&) = delete;

  // Maps and faults in `bytes` (rounded up to pages), on NUMA node `numa_node` if it is >= 0
  // (PreferNumaNode). Returns false (errno set) when the mapping or the placement fails.
  bool Allocate(uint64_t bytes, int numa_node = -1, bool huge_pages = false);
  // The two halves of Allocate: Map reserves the address range (and sets its placement), Fault
  // touches every page of [offset, offset + len) (a caller may hand out parts as they are faulted).
  bool Map(uint64_t bytes, int numa_node = -1, bool huge_pages = false);
  void Fault(uint64_t offset, uint64_t len);
  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Drops the mapping without unmapping it: in a forked child, where a MADV_DONTFORK mapping of
  // the parent is not mapped (and its address range may since hold another mapping).
  void Forget() {
    data_ = nullptr;
    size_ = 0;
  }

 private:
  void Release();
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace alpsck
