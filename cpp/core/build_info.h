// What this build of the core was compiled for: the CPU tuning CMake chose (ALPSCK_TUNE_GRACE),
// the compiler, the target architecture and the build type. Fixed at compile time; CMakeLists.txt
// passes the values to build_info.cc only, so a change of tuning recompiles that one file.
#pragma once

namespace alpsck {

struct BuildInfo {
  const char* tuning;           // "neoverse-v2" (tuned for NVIDIA Grace) or "portable"
  const char* arch_flags;       // what the core was compiled with for it: "-mcpu=neoverse-v2",
                                // "-march=armv8.2-a+crc" (a compiler without neoverse-v2), or ""
  const char* compiler;         // e.g. "GNU 12.2.0"
  const char* arch;             // the target processor, e.g. "x86_64", "aarch64"
  const char* build_type;       // e.g. "Release"
  const char* crc32c_hardware;  // the hardware CRC32C backend built in: "sse42", "armv8-crc" or
                                // "none" (whether this CPU has it: Crc32cBackendName())
};

const BuildInfo& GetBuildInfo();

}  // namespace alpsck
