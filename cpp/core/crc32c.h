// CRC32C (Castagnoli), the checksum of every chunk, index and footer on disk.
//
// Backends: a portable slicing-by-8 table version (every CPU), SSE4.2 (x86-64) and the ARMv8
// CRC extension (aarch64). Each hardware backend lives in its own file compiled with its own ISA
// flags; the backend is chosen once at run time (cpuid / getauxval), so a binary built for a
// baseline CPU still runs everywhere. All backends give the same results (tested with the same
// vectors).
//
// Crc32cExtend(crc, data, n) continues a CRC: Crc32c(ab) == Crc32cExtend(Crc32c(a), b).
// Thread-safe: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace alpsck {

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// Name of the backend Crc32cExtend uses: "sse42", "armv8-crc" or "portable".
const char* Crc32cBackendName();

// Direct access for tests and benchmarks.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);
// Returns false (and leaves *out alone) when the CPU lacks the hardware backend of this build.
bool Crc32cExtendHardware(uint32_t crc, const void* data, size_t n, uint32_t* out);

namespace crc32c_internal {
// Implemented by the ISA-specific file that the build selects; nullptr when none applies. Both
// work on the raw CRC register (no pre/post inversion).
using ExtendFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);
// Three independent streams in lockstep, so the CRC instruction's latency is hidden (it has a
// throughput of one per cycle but a latency of 2-3): for i = 0, 1, 2, c[i] is extended over
// p[i*n, (i+1)*n). n is a multiple of 8. crc32c.cc joins the three results (ShiftTable).
using Extend3Fn = void (*)(uint32_t c[3], const uint8_t* p, size_t n);
ExtendFn HardwareBackend();       // nullptr when the CPU lacks the instructions
Extend3Fn HardwareBackend3();     // nullptr when the CPU lacks the instructions
const char* HardwareBackendName();
}  // namespace crc32c_internal

}  // namespace alpsck
