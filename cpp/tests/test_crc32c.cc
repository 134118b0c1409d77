// Every CRC32C backend against the same vectors (RFC 3720 B.4 and random buffers).
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "crc32c.h"
#include "testing.h"

using namespace alpsck;

namespace {
struct Vector {
  std::vector<uint8_t> data;
  uint32_t crc;
};
std::vector<Vector> Vectors() {
  std::vector<Vector> v;
  v.push_back({std::vector<uint8_t>{'1', '2', '3', '4', '5', '6', '7', '8', '9'}, 0xE3069283u});
  v.push_back({std::vector<uint8_t>(32, 0x00), 0x8A9136AAu});
  v.push_back({std::vector<uint8_t>(32, 0xFF), 0x62A8AB43u});
  std::vector<uint8_t> inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  v.push_back({inc, 0x46DD794Eu});
  v.push_back({dec, 0x113FDB5Cu});
  v.push_back({std::vector<uint8_t>{}, 0u});
  return v;
}
}  // namespace

TEST(portable_matches_rfc3720_vectors) {
  for (const auto& v : Vectors()) CHECK_EQ(Crc32cExtendPortable(0, v.data.data(), v.data.size()), v.crc);
}

TEST(dispatched_matches_rfc3720_vectors) {
  for (const auto& v : Vectors()) CHECK_EQ(Crc32c(v.data.data(), v.data.size()), v.crc);
}

TEST(hardware_backend_matches_vectors_when_present) {
  uint32_t out = 0;
  bool have = Crc32cExtendHardware(0, "x", 1, &out);
  std::fprintf(stderr, "backend: %s (hardware %s)\n", Crc32cBackendName(), have ? "present" : "absent");
#if defined(__x86_64__) || defined(__aarch64__)
  CHECK(have);  // every x86-64 CPU we run on has SSE4.2; every aarch64 one we target has CRC
#endif
  if (!have) return;
  for (const auto& v : Vectors()) {
    CHECK(Crc32cExtendHardware(0, v.data.data(), v.data.size(), &out));
    CHECK_EQ(out, v.crc);
  }
}

TEST(backends_agree_on_random_buffers_at_every_alignment) {
  std::mt19937_64 rng(42);
  std::vector<uint8_t> buf(1 << 16);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t off = 0; off < 16; ++off) {
    for (size_t len : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{31}, size_t{33}, size_t{4095}, size_t{65000}}) {
      uint32_t p = Crc32cExtendPortable(0, buf.data() + off, len);
      CHECK_EQ(Crc32c(buf.data() + off, len), p);
      uint32_t h = 0;
      if (Crc32cExtendHardware(0, buf.data() + off, len, &h)) CHECK_EQ(h, p);
    }
  }
}

TEST(three_stream_path_agrees_around_its_block_boundaries) {
  // Hardware backends cut buffers of 12 KiB and more into three 4 KiB streams joined by a shift
  // table: lengths around multiples of 12 KiB, at odd offsets and with a running CRC.
  std::mt19937_64 rng(7);
  std::vector<uint8_t> buf((1 << 20) + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const size_t block = 3 * 4096;
  for (size_t off : {size_t{0}, size_t{3}, size_t{8}}) {
    for (size_t len : {block - 1, block, block + 1, 2 * block - 8, 2 * block + 13, size_t{100000}, size_t{1} << 20}) {
      uint32_t p = Crc32cExtendPortable(0x12345678u, buf.data() + off, len);
      CHECK_EQ(Crc32cExtend(0x12345678u, buf.data() + off, len), p);
      uint32_t h = 0;
      if (Crc32cExtendHardware(0x12345678u, buf.data() + off, len, &h)) CHECK_EQ(h, p);
    }
  }
}

TEST(extend_equals_whole) {
  const std::string a = "hello, ", b = "checkpoint world";
  const std::string ab = a + b;
  CHECK_EQ(Crc32cExtend(Crc32c(a.data(), a.size()), b.data(), b.size()), Crc32c(ab.data(), ab.size()));
  CHECK_EQ(Crc32cExtendPortable(Crc32cExtendPortable(0, a.data(), a.size()), b.data(), b.size()),
           Crc32c(ab.data(), ab.size()));
}

ALPSCK_TEST_MAIN()
