// Facts about the machine read at run time (never hard-coded: GH200 kernels may use 64 KiB
// pages) and the few things the core does with CPUs and memory: the process's cpuset, pinning
// a thread, and pre-faulted aligned memory for staging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace alpsck {

uint64_t PageSize();
uint64_t CacheLineSize();
// CPUs this process may run on (sched_getaffinity): respects the SLURM job's cpuset.
std::vector<int> AllowedCpus();
// Pins the calling thread to one CPU; false if the kernel refuses (CPU not in the cpuset).
bool PinCurrentThread(int cpu);
// Gives the calling thread (not the process: Linux keeps a nice value per thread) the nice value
// `nice` (0 .. 19): under contention the kernel then hands the CPU to normal threads first.
// False where the kernel refuses or the platform has no per-thread nice.
bool NiceCurrentThread(int nice);

inline uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Page-aligned anonymous memory, pre-faulted (MAP_POPULATE, then one write per page) so that
// first-touch page faults never land on the hot path. Move-only; unmaps on destruction.
class PrefaultedMemory {
 public:
  PrefaultedMemory() = default;
  ~PrefaultedMemory();
  PrefaultedMemory(PrefaultedMemory&& o) noexcept;
  PrefaultedMemory& operator=(PrefaultedMemory&& o) noexcept;
  PrefaultedMemory(const PrefaultedMemory&) = delete;
  PrefaultedMemory& operator=(const PrefaultedMemory&) = delete;

  // Maps and faults in `bytes` (rounded up to pages). Returns false (errno set) when the mapping fails.
  bool Allocate(uint64_t bytes);
  // The two halves of Allocate: Map reserves the address range, Fault touches every page of
  // [offset, offset + len) (a caller may hand out parts as they are faulted).
  bool Map(uint64_t bytes);
  void Fault(uint64_t offset, uint64_t len);
  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void Release();
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace alpsck
