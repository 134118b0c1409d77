// libFuzzer target for core/json: parse arbitrary bytes; whatever parses must dump to text that
// parses again and dumps identically. Build:
//   cmake -DALPSCK_BUILD_FUZZERS=ON (with clang; see tests/run.sh), or by hand:
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Icpp/core \
//       cpp/fuzz/fuzz_json.cc cpp/core/json.cc -o fuzz_json
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  alpsck::Json first;
  if (!alpsck::ParseJson(text, &first).ok()) return 0;
  const std::string dump1 = first.dump();
  alpsck::Json second;
  const alpsck::Status s = alpsck::ParseJson(dump1, &second);
  if (!s.ok()) {
    std::fprintf(stderr, "re-parse of dump failed: %s\n", s.message().c_str());
    std::abort();
  }
  const std::string dump2 = second.dump();
  if (dump1 != dump2) {
    std::fprintf(stderr, "dump mismatch:\n%s\n%s\n", dump1.c_str(), dump2.c_str());
    std::abort();
  }
  return 0;
}
