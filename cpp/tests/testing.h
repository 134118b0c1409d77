// Minimal test harness for the core's ctest executables: no dependency, so the same tests
// cross-compile for aarch64 and run under qemu and the sanitizers unchanged.
//
//   TEST(name) { CHECK(cond); CHECK_EQ(a, b); }
//   int main() { return alpsck_test::run_all(); }   // or ALPSCK_TEST_MAIN()
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace alpsck_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { registry().push_back({name, std::move(fn)}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  ++failures();
}

template <typename A, typename B>
std::string describe(const char* ea, const char* eb, const A& a, const B& b) {
  std::ostringstream os;
  os << ea << " == " << eb << " (" << a << " vs " << b << ")";
  return os.str();
}

inline int run_all() {
  int failed_cases = 0;
  for (auto& c : registry()) {
    int before = failures();
    std::fprintf(stderr, "[ RUN  ] %s\n", c.name);
    c.fn();
    bool ok = failures() == before;
    if (!ok) ++failed_cases;
    std::fprintf(stderr, "[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
  }
  std::fprintf(stderr, "%zu cases, %d failed\n", registry().size(), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}

}  // namespace alpsck_test

#define ALPSCK_CAT2(a, b) a##b
#define ALPSCK_CAT(a, b) ALPSCK_CAT2(a, b)
#define TEST(name)                                                                       \
  static void name();                                                                    \
  static alpsck_test::Register ALPSCK_CAT(reg_, name)(#name, name);                      \
  static void name()
#define CHECK(cond)                                                                      \
  do {                                                                                   \
    if (!(cond)) alpsck_test::fail(__FILE__, __LINE__, #cond);                           \
  } while (0)
#define CHECK_EQ(a, b)                                                                   \
  do {                                                                                   \
    auto&& va_ = (a);                                                                    \
    auto&& vb_ = (b);                                                                    \
    if (!(va_ == vb_)) alpsck_test::fail(__FILE__, __LINE__, alpsck_test::describe(#a, #b, va_, vb_)); \
  } while (0)
#define REQUIRE(cond)                                                                    \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      alpsck_test::fail(__FILE__, __LINE__, #cond);                                      \
      return;                                                                            \
    }                                                                                    \
  } while (0)
#define ALPSCK_TEST_MAIN() \
  int main() { return alpsck_test::run_all(); }
