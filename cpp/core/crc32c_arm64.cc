// CRC32C with the ARMv8 CRC extension (aarch64; Neoverse-V2 has it). Only this file is compiled
// with +crc; HardwareBackend() checks HWCAP_CRC32 before anything here runs.
#include "crc32c.h"

#include <arm_acle.h>
#include <cstring>
#include <sys/auxv.h>

#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif

namespace alpsck {
namespace crc32c_internal {
namespace {

uint32_t ExtendArmv8(uint32_t crc, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = __crc32cb(crc, *p++);
    --n;
  }
  while (n >= 32) {
    uint64_t a, b, d, e;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + 8, 8);
    std::memcpy(&d, p + 16, 8);
    std::memcpy(&e, p + 24, 8);
    crc = __crc32cd(crc, a);
    crc = __crc32cd(crc, b);
    crc = __crc32cd(crc, d);
    crc = __crc32cd(crc, e);
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    uint64_t a;
    std::memcpy(&a, p, 8);
    crc = __crc32cd(crc, a);
    p += 8;
    n -= 8;
  }
  while (n--) crc = __crc32cb(crc, *p++);
  return crc;
}

}  // namespace

ExtendFn HardwareBackend() {
  static const bool ok = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
  return ok ? &ExtendArmv8 : nullptr;
}
const char* HardwareBackendName() { return "armv8-crc"; }

}  // namespace crc32c_internal
}  // namespace alpsck
