// Build for a CPU family without a hardware CRC32C backend: the portable code is used.
#include "crc32c.h"

namespace alpsck {
namespace crc32c_internal {
ExtendFn HardwareBackend() { return nullptr; }
Extend3Fn HardwareBackend3() { return nullptr; }
const char* HardwareBackendName() { return "portable"; }
}  // namespace crc32c_internal
}  // namespace alpsck
