// alpsck._core: CRC32C, what the core was built for, NUMA and file-system probes, constants.
#include "binding.h"

#include <map>
#include <string>

#include "build_info.h"
#include "commit.h"
#include "crc32c.h"
#include "engine.h"
#include "platform.h"
#include "staging_pool.h"

namespace alpsck::binding {

using namespace nb::literals;

void BindPlatform(nb::module_& m) {
  m.def("crc32c", [](Bytes data, uint32_t crc) {
        return Crc32cExtend(crc, data.data(), data.nbytes()); }, "data"_a, "crc"_a = 0,
        nb::sig("def crc32c(data: bytes | bytearray | memoryview | torch.Tensor, crc: int = 0) -> int"),
        "CRC32C of a contiguous buffer, continuing from crc.");
  m.def("crc32c_backend", &Crc32cBackendName, "The CRC32C implementation chosen for this CPU.");
  m.def("build_info", [] {
        const BuildInfo& b = GetBuildInfo();
        return std::map<std::string, std::string>{
            {"tuning", b.tuning}, {"arch_flags", b.arch_flags}, {"compiler", b.compiler}, {"arch", b.arch},
            {"build_type", b.build_type}, {"crc32c_hardware", b.crc32c_hardware}};
      },
      "What the core was built for: tuning ('neoverse-v2': tuned for NVIDIA Grace, or 'portable'), the "
      "arch_flags that tuning used, compiler, arch (target processor), build_type, crc32c_hardware (the "
      "hardware CRC32C backend built in: 'sse42', 'armv8-crc' or 'none'; crc32c_backend() says which runs).");
  m.def("page_size", &PageSize);
  m.def("check_numa_node", [](int node) {
        const Status s = Engine::CheckNumaNode(node);
        if (!s.ok()) RaiseStatus(s, false);
      }, "node"_a, "UsageError (or an OSError) unless the numa_node option's value works on this machine.");
  m.def("cpu_numa_nodes", &CpuNumaNodes, "sysfs"_a = "/sys",
        "The NUMA nodes that have CPUs, ascending (empty if unknown); sysfs: another root, for tests.");
  m.def("fs_magic", [](const FsPath& path) {
        uint64_t magic = 0;
        const int r = FileSystemMagic(path.bytes, &magic);
        if (r < 0) RaiseStatus(Status::FromErrno(-r, "statfs " + path.bytes), false);
        return magic;
      }, "path"_a, "The type of the file system holding path (statfs f_type).");
  m.def("numa_policy_of", [](uint64_t address) {
        int mode = 0, node = -1;
        const int r = NumaPolicyOf(reinterpret_cast<const void*>(static_cast<uintptr_t>(address)), &mode, &node);
        if (r < 0) RaiseStatus(Status::FromErrno(-r, "get_mempolicy"), false);
        return std::make_pair(mode, node);
      }, "address"_a,
      "The memory policy of the page at address: (mode, lowest node of its mask or -1); mode 0 is the "
      "default (first touch), 1 preferred, 2 bind.");
  m.def("spare_staging_bytes", &SpareStagingBytes,
        "The bytes of staging memory a closed engine left for this process's next one (0: none).");
  m.def("release_spare_staging", [] {
        nb::gil_scoped_release unlocked;  // munmap of gigabytes
        return ReleaseSpareStaging();
      }, "Unmaps the staging memory a closed engine left for the next one; returns its bytes.");
  m.attr("MAX_THREADS") = kMaxWriterThreads;  // the engine's limit on writer threads
  m.attr("checkpoint_format") = kManifestFormat;  // what this build writes (MANIFEST.json "format")
}

}  // namespace alpsck::binding
