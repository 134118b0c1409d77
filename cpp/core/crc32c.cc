// Portable CRC32C (slicing-by-8) and the run-time backend choice.
#include "crc32c.h"

#include <array>
#include <cstring>

namespace alpsck {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : (c >> 1);
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables tb;
  return tb;
}

uint32_t ExtendPortableRaw(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& tb = tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = tb.t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    lo = __builtin_bswap32(lo);
    hi = __builtin_bswap32(hi);
#endif
    lo ^= crc;
    crc = tb.t[7][lo & 0xFF] ^ tb.t[6][(lo >> 8) & 0xFF] ^ tb.t[5][(lo >> 16) & 0xFF] ^
          tb.t[4][lo >> 24] ^ tb.t[3][hi & 0xFF] ^ tb.t[2][(hi >> 8) & 0xFF] ^
          tb.t[1][(hi >> 16) & 0xFF] ^ tb.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = tb.t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return crc;
}

// The raw-register map "append kStripe zero bytes", byte-sliced: Apply(r) is what r becomes
// after kStripe more zero bytes. CRC is linear, so for equal-length pieces B and C,
// raw(r, A|B|C) == Apply(Apply(raw(r, A)) ^ raw(0, B)) ^ raw(0, C): three streams computed
// independently join into one.
constexpr size_t kStripe = 4096;

struct ShiftTable {
  uint32_t t[4][256];
  ShiftTable() {
    const Tables& tb = tables();
    uint32_t col[32];
    for (int j = 0; j < 32; ++j) {
      uint32_t r = 1u << j;
      for (size_t k = 0; k < kStripe; ++k) r = (r >> 8) ^ tb.t[0][r & 0xFF];
      col[j] = r;
    }
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int i = 0; i < 8; ++i)
          if (b & (1u << i)) v ^= col[8 * k + i];
        t[k][b] = v;
      }
  }
  uint32_t Apply(uint32_t r) const { return t[0][r & 0xFF] ^ t[1][(r >> 8) & 0xFF] ^ t[2][(r >> 16) & 0xFF] ^ t[3][r >> 24]; }
};

// The hardware backend as used: three streams of kStripe bytes at a time, then one for the tail.
uint32_t ExtendHardwareRaw(uint32_t crc, const uint8_t* p, size_t n) {
  static const crc32c_internal::ExtendFn one = crc32c_internal::HardwareBackend();
  static const crc32c_internal::Extend3Fn three = crc32c_internal::HardwareBackend3();
  static const ShiftTable shift;
  if (three) {
    for (; n >= 3 * kStripe; p += 3 * kStripe, n -= 3 * kStripe) {
      uint32_t c[3] = {crc, 0, 0};
      three(c, p, kStripe);
      crc = shift.Apply(shift.Apply(c[0]) ^ c[1]) ^ c[2];
    }
  }
  return one(crc, p, n);
}

crc32c_internal::ExtendFn Chosen() {
  static const crc32c_internal::ExtendFn fn =
      crc32c_internal::HardwareBackend() ? &ExtendHardwareRaw : &ExtendPortableRaw;
  return fn;
}

}  // namespace

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n) {
  return ~ExtendPortableRaw(~crc, static_cast<const uint8_t*>(data), n);
}

bool Crc32cExtendHardware(uint32_t crc, const void* data, size_t n, uint32_t* out) {
  if (!crc32c_internal::HardwareBackend()) return false;
  *out = ~ExtendHardwareRaw(~crc, static_cast<const uint8_t*>(data), n);
  return true;
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  return ~Chosen()(~crc, static_cast<const uint8_t*>(data), n);
}

const char* Crc32cBackendName() {
  return crc32c_internal::HardwareBackend() ? crc32c_internal::HardwareBackendName() : "portable";
}

}  // namespace alpsck
