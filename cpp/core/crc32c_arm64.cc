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

void Extend3Armv8(uint32_t c[3], const uint8_t* p, size_t n) {
  uint32_t a = c[0], b = c[1], d = c[2];
  const uint8_t* p1 = p + n;
  const uint8_t* p2 = p + 2 * n;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x, y, z;
    std::memcpy(&x, p + i, 8);
    std::memcpy(&y, p1 + i, 8);
    std::memcpy(&z, p2 + i, 8);
    a = __crc32cd(a, x);
    b = __crc32cd(b, y);
    d = __crc32cd(d, z);
  }
  c[0] = a;
  c[1] = b;
  c[2] = d;
}

bool Supported() {
  static const bool ok = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
  return ok;
}

}  // namespace

ExtendFn HardwareBackend() { return Supported() ? &ExtendArmv8 : nullptr; }
Extend3Fn HardwareBackend3() { return Supported() ? &Extend3Armv8 : nullptr; }
const char* HardwareBackendName() { return "armv8-crc"; }

}  // namespace crc32c_internal
}  // namespace alpsck
