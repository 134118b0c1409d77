// CRC32C with the SSE4.2 crc32 instruction (x86-64). Only this file is compiled with -msse4.2;
// HardwareBackend() checks cpuid before anything here runs.
#include "crc32c.h"

#include <cstring>
#include <nmmintrin.h>

namespace alpsck {
namespace crc32c_internal {
namespace {

uint32_t ExtendSse42(uint32_t crc, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  // One dependent stream of 8-byte steps (about 8 bytes per 3 cycles): long buffers go through
  // Extend3Sse42 instead, three streams at once.
  uint64_t c = crc;
  while (n >= 32) {
    uint64_t a, b, d, e;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + 8, 8);
    std::memcpy(&d, p + 16, 8);
    std::memcpy(&e, p + 24, 8);
    c = _mm_crc32_u64(c, a);
    c = _mm_crc32_u64(c, b);
    c = _mm_crc32_u64(c, d);
    c = _mm_crc32_u64(c, e);
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    uint64_t a;
    std::memcpy(&a, p, 8);
    c = _mm_crc32_u64(c, a);
    p += 8;
    n -= 8;
  }
  crc = static_cast<uint32_t>(c);
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

void Extend3Sse42(uint32_t c[3], const uint8_t* p, size_t n) {
  uint64_t a = c[0], b = c[1], d = c[2];
  const uint8_t* p1 = p + n;
  const uint8_t* p2 = p + 2 * n;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x, y, z;
    std::memcpy(&x, p + i, 8);
    std::memcpy(&y, p1 + i, 8);
    std::memcpy(&z, p2 + i, 8);
    a = _mm_crc32_u64(a, x);
    b = _mm_crc32_u64(b, y);
    d = _mm_crc32_u64(d, z);
  }
  c[0] = static_cast<uint32_t>(a);
  c[1] = static_cast<uint32_t>(b);
  c[2] = static_cast<uint32_t>(d);
}

bool Supported() {
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
}

}  // namespace

ExtendFn HardwareBackend() { return Supported() ? &ExtendSse42 : nullptr; }
Extend3Fn HardwareBackend3() { return Supported() ? &Extend3Sse42 : nullptr; }
const char* HardwareBackendName() { return "sse42"; }

}  // namespace crc32c_internal
}  // namespace alpsck
