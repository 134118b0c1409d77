// libFuzzer target: DecodeFooter on hostile bytes. Input: 8 bytes of file size (little endian),
// then the 64-byte footer (zero-padded if shorter). Whatever decodes must describe an index that
// lies inside the file, before the footer.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "format.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  const uint64_t file_size = alpsck_fuzz::LoadU64(data);
  char footer[alpsck::kFooterBytes] = {};
  std::memcpy(footer, data + 8, std::min<size_t>(size - 8, sizeof(footer)));
  alpsck::Footer f;
  if (!alpsck::DecodeFooter(footer, file_size, "fuzz", &f).ok()) return 0;
  const bool inside = f.file_bytes == file_size && f.index_offset == f.data_padded && f.index_offset <= file_size &&
                      f.index_bytes <= alpsck::kMaxIndexBytes && f.index_bytes <= file_size - f.index_offset &&
                      file_size - f.index_offset - f.index_bytes >= alpsck::kFooterBytes;
  if (!inside) {
    std::fprintf(stderr, "accepted a footer that points outside the file\n");
    std::abort();
  }
  return 0;
}
