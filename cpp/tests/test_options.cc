// The option table (options.h): one row per option, and EngineOptions built from it by name.
#include <cmath>
#include <cstdio>
#include <string>

#include "engine_options.h"
#include "options.h"
#include "testing.h"

using namespace alpsck;

namespace {

bool Says(const Status& s, const std::string& text) {
  if (s.message().find(text) != std::string::npos) return true;
  std::fprintf(stderr, "got: %s (want: %s)\n", s.message().c_str(), text.c_str());
  return false;
}

OptionValue Int(int64_t x) {
  OptionValue v;
  v.integer = x;
  return v;
}

}  // namespace

TEST(every_engine_row_sets_and_reads_back_its_own_member_and_defaults_come_from_the_rows) {
  const EngineOptions defaults;
  for (const OptionSpec& s : EngineOptionSpecs()) {
    if (s.scope != OptionScope::kEngine) {
      CHECK(s.field.set == nullptr && s.field.get == nullptr);
      continue;
    }
    REQUIRE(s.field.set && s.field.get);
    const OptionValue d = s.field.get(defaults);  // the default is the row's
    const OptionValue want = DefaultValue(s);
    switch (s.type) {
      case OptionType::kInt: CHECK_EQ(d.integer, want.integer); break;
      case OptionType::kFloat: CHECK_EQ(d.number, want.number); break;
      case OptionType::kBool: CHECK_EQ(d.flag, want.flag); break;
      case OptionType::kCpuList: CHECK(d.cpus.empty()); break;
      case OptionType::kText: CHECK(d.text.empty()); break;
    }
    // A value within the limits, set by name, lands in this member and no other.
    OptionValue v;
    v.integer = static_cast<int64_t>(s.max);
    v.number = s.max;
    v.flag = !want.flag;
    if (s.type == OptionType::kCpuList) v.cpus = {static_cast<int>(s.min), static_cast<int>(s.max)};  // (other rows' limits may not fit an int)
    v.text = s.type == OptionType::kText ? "loss:min:1" : "";
    EngineOptions o;
    REQUIRE(SetEngineOption(&o, s.name, v).ok());
    const OptionValue got = s.field.get(o);
    CHECK(got.integer == v.integer || s.type != OptionType::kInt);
    CHECK(got.number == v.number || s.type != OptionType::kFloat);
    CHECK(got.flag == v.flag || s.type != OptionType::kBool);
    CHECK(got.cpus == v.cpus || s.type != OptionType::kCpuList);
    CHECK(got.text == v.text || s.type != OptionType::kText);
    for (const OptionSpec& other : EngineOptionSpecs()) {  // the others kept their defaults
      if (other.field.get == nullptr || &other == &s) continue;
      const OptionValue a = other.field.get(o), b = other.field.get(defaults);
      CHECK(a.integer == b.integer && a.flag == b.flag && a.cpus == b.cpus && a.text == b.text &&
            (a.number == b.number || (std::isnan(a.number) && std::isnan(b.number))));
    }
  }
}

TEST(set_by_name_refuses_an_unknown_name_another_scopes_option_and_a_value_out_of_range_naming_it) {
  EngineOptions o;
  Status s = SetEngineOption(&o, "thread", Int(4));
  CHECK(s.code() == Code::kInvalidArgument && Says(s, "no engine option is named 'thread'"));
  s = SetEngineOption(&o, "spike_factor", Int(4));
  CHECK(s.code() == Code::kInvalidArgument && Says(s, "spike_factor is not an engine option"));
  s = SetEngineOption(&o, "read_threads", Int(4));
  CHECK(s.code() == Code::kInvalidArgument && Says(s, "read_threads is not an engine option"));
  s = SetEngineOption(&o, "threads", Int(0));
  CHECK(Says(s, "threads is 0: it must be between 1 and 1024"));
  s = SetEngineOption(&o, "keep_last", Int(-1));
  CHECK(Says(s, "keep_last is -1: it must be between 0 and 4294967295 (0: keep all)"));
  s = SetEngineOption(&o, "numa_node", Int(-2));
  CHECK(Says(s, "numa_node is -2"));
  OptionValue nan;
  nan.number = std::nan("");
  CHECK(Says(SetEngineOption(&o, "keep_every_seconds", nan), "keep_every_seconds is not a number"));
  OptionValue cpus;
  cpus.cpus = {0, 1024};
  CHECK(Says(SetEngineOption(&o, "pin_cpus", cpus), "pin_cpus holds 1024: CPU numbers must be between 0 and 1023"));
  CHECK_EQ(o.threads, EngineOptions().threads);  // nothing refused was set
  CHECK(o.pin_cpus.empty());
  REQUIRE(SetEngineOption(&o, "copy_threads", Int(0)).ok());  // 0 means auto
  REQUIRE(SetEngineOption(&o, "threads", Int(3)).ok());
  CHECK_EQ(o.threads, 3u);
  CHECK(CheckEngineOptions(o).ok());
}

TEST(check_engine_options_checks_every_member_against_its_row_and_the_retention_rules_together) {
  EngineOptions o;
  CHECK(CheckEngineOptions(o).ok());
  o.staging_bytes = (1ull << 62) + 1;
  CHECK(Says(CheckEngineOptions(o), "staging_bytes is 4611686018427387905"));
  o = EngineOptions();
  o.background_nice = 20;
  CHECK(Says(CheckEngineOptions(o), "background_nice is 20: it must be between 0 and 19"));
  o = EngineOptions();
  o.keep_best = "loss:sideways:2";
  CHECK(Says(CheckEngineOptions(o), "keep_best"));
  o = EngineOptions();
  o.keep_last = 0;  // keeps all: a milestone rule beside it could never take effect
  o.keep_every_steps = 10;
  CHECK(CheckEngineOptions(o).code() == Code::kInvalidArgument);
}

ALPSCK_TEST_MAIN()
