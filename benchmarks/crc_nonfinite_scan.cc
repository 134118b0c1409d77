// Would flagging non-finite float tensors inside the save's CRC pass fit in 10 % of that pass
// (issue 43, item 2, the optional part)? CRC32C over 512 MiB of float32, 64 KiB blocks, alone and
// followed by a scan of each block (still in cache) for an all-ones exponent: float32 scalar and
// SSE2, bfloat16 scalar. Best of 5. Not built by CMake (an experiment, x86-64 only):
//   g++ -O2 -std=c++17 -msse4.2 -Icpp/core benchmarks/crc_nonfinite_scan.cc cpp/core/crc32c.cc cpp/core/crc32c_sse42.cc -o /tmp/s && /tmp/s
// Results: docs/benchmarks.md, "A non-finite scan in the CRC pass".
#include <emmintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "crc32c.h"

using alpsck::Crc32cExtend;

namespace {

bool AnyNonFiniteF32(const uint32_t* p, size_t n) {
  uint32_t acc = 0;
  for (size_t i = 0; i < n; ++i) acc |= ((p[i] & 0x7f800000u) == 0x7f800000u);
  return acc != 0;
}

bool AnyNonFiniteF32Sse2(const uint32_t* p, size_t n) {
  const __m128i m = _mm_set1_epi32(0x7f800000);
  __m128i a0 = _mm_setzero_si128(), a1 = _mm_setzero_si128();
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + 4));
    a0 = _mm_or_si128(a0, _mm_cmpeq_epi32(_mm_and_si128(x, m), m));
    a1 = _mm_or_si128(a1, _mm_cmpeq_epi32(_mm_and_si128(y, m), m));
  }
  return _mm_movemask_epi8(_mm_or_si128(a0, a1)) != 0;
}

bool AnyNonFiniteBf16(const uint16_t* p, size_t n) {
  uint32_t acc = 0;
  for (size_t i = 0; i < n; ++i) acc |= ((p[i] & 0x7f80u) == 0x7f80u);
  return acc != 0;
}

}  // namespace

int main() {
  const size_t n = 512ull << 20, block = 64 << 10;
  std::vector<float> v(n / 4);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000) * 0.001f;
  const char* b = reinterpret_cast<const char*>(v.data());
  const char* names[] = {"crc32c only", "crc32c + float32 scan", "crc32c + float32 scan (sse2)",
                         "crc32c + bfloat16 scan"};
  for (int mode = 0; mode < 4; ++mode) {
    double best = 1e9;
    uint32_t crc = 0;
    bool bad = false;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      crc = 0;
      for (size_t off = 0; off < n; off += block) {
        crc = Crc32cExtend(crc, b + off, block);
        if (mode == 1) bad |= AnyNonFiniteF32(reinterpret_cast<const uint32_t*>(b + off), block / 4);
        if (mode == 2) bad |= AnyNonFiniteF32Sse2(reinterpret_cast<const uint32_t*>(b + off), block / 4);
        if (mode == 3) bad |= AnyNonFiniteBf16(reinterpret_cast<const uint16_t*>(b + off), block / 2);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s < best) best = s;
    }
    std::printf("%-30s %6.2f GB/s (crc %08x, non-finite: %d)\n", names[mode], n / best / 1e9, crc, bad);
  }
}
