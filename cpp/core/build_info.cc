// The values come from CMakeLists.txt as compile definitions of this file alone.
#include "build_info.h"

#include <cstring>

#include "crc32c.h"

#if !defined(ALPSCK_BUILD_TUNING) || !defined(ALPSCK_BUILD_ARCH_FLAGS) || !defined(ALPSCK_BUILD_COMPILER) || \
    !defined(ALPSCK_BUILD_ARCH) || !defined(ALPSCK_BUILD_TYPE)
#error "build_info.cc is compiled by CMakeLists.txt, which defines ALPSCK_BUILD_*"
#endif

// This file is part of the core, so it gets the core's tuning flags: a build that says it is
// tuned for Grace but whose flags did not reach the core fails here instead of reporting it.
#if defined(ALPSCK_TUNED_NEOVERSE_V2) && !(defined(__aarch64__) && defined(__ARM_FEATURE_CRC32))
#error "ALPSCK_TUNED_NEOVERSE_V2 but the core is not compiled for aarch64 with the CRC extension"
#endif

namespace alpsck {

const BuildInfo& GetBuildInfo() {
  static const BuildInfo info = [] {
    const char* hw = crc32c_internal::HardwareBackendName();
    return BuildInfo{ALPSCK_BUILD_TUNING, ALPSCK_BUILD_ARCH_FLAGS, ALPSCK_BUILD_COMPILER, ALPSCK_BUILD_ARCH,
                     ALPSCK_BUILD_TYPE, std::strcmp(hw, "portable") == 0 ? "none" : hw};
  }();
  return info;
}

}  // namespace alpsck
