// Tests for core/json: parsing, writing, round trips, limits and hostile inputs.
#include "json.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "testing.h"

using alpsck::Code;
using alpsck::Json;
using alpsck::JsonEscape;
using alpsck::JsonLimits;
using alpsck::ParseJson;
using alpsck::Status;

namespace {

// Parses text that must be valid.
Json MustParse(const std::string& text, bool* ok) {
  Json j;
  Status s = ParseJson(text, &j);
  *ok = s.ok();
  if (!s.ok()) std::fprintf(stderr, "  unexpected parse error for %s: %s\n", text.c_str(), s.message().c_str());
  return j;
}

// True if text is rejected with a kCorrupt status whose message names an offset, and the output
// value is left untouched.
bool Rejected(const std::string& text, JsonLimits limits = {}) {
  Json j = Json::Str("sentinel");
  Status s = ParseJson(text, &j, limits);
  if (s.ok()) {
    std::fprintf(stderr, "  accepted but should not be: %s\n", text.c_str());
    return false;
  }
  const std::string* still = j.get_string();
  return s.code() == Code::kCorrupt && s.message().find("offset ") != std::string::npos &&
         s.message().rfind("json: ", 0) == 0 && still != nullptr && *still == "sentinel";
}

// parse -> dump -> parse -> dump must be stable; returns the first dump ("" on failure).
std::string RoundTrip(const std::string& text) {
  Json a;
  if (!ParseJson(text, &a).ok()) return "";
  std::string d1 = a.dump();
  Json b;
  if (!ParseJson(d1, &b).ok()) return "";
  if (b.dump() != d1) return "";
  return d1;
}

std::string Nested(size_t depth, const char* open, const char* close) {
  std::string s;
  for (size_t i = 0; i < depth; ++i) s += open;
  for (size_t i = 0; i < depth; ++i) s += close;
  return s;
}

// depth nested objects: {"a":{"a":...{}...}}
std::string NestedObjects(size_t depth) {
  std::string s;
  for (size_t i = 1; i < depth; ++i) s += "{\"a\":";
  s += "{}";
  for (size_t i = 1; i < depth; ++i) s += "}";
  return s;
}

}  // namespace

TEST(scalars) {
  bool ok = false;
  CHECK(MustParse("null", &ok).is_null() && ok);
  bool b = false;
  CHECK(MustParse("true", &ok).get_bool(&b) && b && ok);
  CHECK(MustParse(" false ", &ok).get_bool(&b) && !b && ok);
  int64_t i = 1;
  CHECK(MustParse("0", &ok).get_i64(&i) && i == 0 && ok);
  CHECK(MustParse("-0", &ok).get_i64(&i) && i == 0 && ok);
  CHECK(MustParse("-17", &ok).get_i64(&i) && i == -17 && ok);
  Json s = MustParse("\"hi\"", &ok);
  REQUIRE(ok && s.get_string() != nullptr);
  CHECK_EQ(*s.get_string(), std::string("hi"));
  CHECK(Json().type() == Json::Type::kNull);
  CHECK(Json::Bool(true).type() == Json::Type::kBool);
  CHECK(Json::Int(3).type() == Json::Type::kInt);
  CHECK(Json::UInt(3).type() == Json::Type::kInt);
  CHECK(Json::Double(3).type() == Json::Type::kDouble);
  CHECK(Json::Str("x").type() == Json::Type::kString);
  CHECK(Json::Array().type() == Json::Type::kArray);
  CHECK(Json::Object().type() == Json::Type::kObject);
}

TEST(whitespace) {
  bool ok = false;
  Json j = MustParse(" \t\r\n[ \t\r\n1 \t\r\n, {\n\"a\"\t:\r2 } ]\n", &ok);
  CHECK(ok);
  CHECK_EQ(j.dump(), std::string("[1,{\"a\":2}]"));
  CHECK(Rejected("\v1"));
  CHECK(Rejected("\f1"));
  CHECK(Rejected("1\v"));
  CHECK(Rejected("\xc2\xa0" "1"));       // NBSP
  CHECK(Rejected("\xef\xbb\xbf" "1"));   // UTF-8 BOM
}

TEST(round_trip_document) {
  const std::string doc =
      "{\"version\": 3, \"name\": \"ckpt-0001\", \"shards\": [\n"
      "  {\"path\": \"a/b.bin\", \"size\": 18446744073709551615, \"crc\": -1, \"ok\": true},\n"
      "  {\"path\": \"\\u00e9\\n\", \"size\": 0, \"ratio\": 0.25, \"meta\": null, \"t\": []},\n"
      "  {}, [], [[]], \"\", -9223372036854775808, 1e-3, 2.5E+10]}";
  const std::string want =
      "{\"version\":3,\"name\":\"ckpt-0001\",\"shards\":["
      "{\"path\":\"a/b.bin\",\"size\":18446744073709551615,\"crc\":-1,\"ok\":true},"
      "{\"path\":\"\xc3\xa9\\n\",\"size\":0,\"ratio\":0.25,\"meta\":null,\"t\":[]},"
      "{},[],[[]],\"\",-9223372036854775808,0.001,25000000000.0]}";
  CHECK_EQ(RoundTrip(doc), want);
  CHECK_EQ(RoundTrip(want), want);
  // Insertion order is kept, even when it is not sorted.
  CHECK_EQ(RoundTrip("{\"z\":1,\"a\":2,\"m\":3}"), std::string("{\"z\":1,\"a\":2,\"m\":3}"));
}

TEST(every_escape) {
  bool ok = false;
  Json j = MustParse("\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0041\\u00e9\\u20AC\\u0000\\u001f\\u007f\"", &ok);
  REQUIRE(ok && j.get_string() != nullptr);
  const std::string want("\"\\/\b\f\n\r\tA\xc3\xa9\xe2\x82\xac\0\x1f\x7f", 17);
  CHECK_EQ(*j.get_string(), want);
  // The writer escapes what it must and nothing else ('/' and 0x7f pass through).
  CHECK_EQ(j.dump(), std::string("\"\\\"\\\\/\\b\\f\\n\\r\\tA\xc3\xa9\xe2\x82\xac\\u0000\\u001f\x7f\""));
  CHECK_EQ(RoundTrip(j.dump()), j.dump());
  CHECK_EQ(JsonEscape("a\"b"), std::string("\"a\\\"b\""));
  CHECK_EQ(JsonEscape(""), std::string("\"\""));
  CHECK_EQ(JsonEscape(std::string("\x01\x02\x1e", 3)), std::string("\"\\u0001\\u0002\\u001e\""));
  // Every control character is escaped and comes back unchanged.
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  std::string lit = JsonEscape(all);
  for (size_t i = 1; i + 1 < lit.size(); ++i) {
    CHECK(static_cast<unsigned char>(lit[i]) >= 0x20);
  }
  Json back;
  REQUIRE(ParseJson(lit, &back).ok());
  REQUIRE(back.get_string() != nullptr);
  CHECK(*back.get_string() == all);
  // Raw bytes >= 0x80 (even invalid UTF-8) pass through unvalidated.
  Json raw;
  CHECK(ParseJson("\"\xff\xfe\x80\"", &raw).ok());
  CHECK(raw.get_string() != nullptr && *raw.get_string() == "\xff\xfe\x80");
}

TEST(surrogate_pairs) {
  bool ok = false;
  Json j = MustParse("\"\\ud83d\\ude00|\\uD800\\uDC00|\\uDBFF\\uDFFF\"", &ok);
  REQUIRE(ok && j.get_string() != nullptr);
  CHECK_EQ(*j.get_string(), std::string("\xf0\x9f\x98\x80|\xf0\x90\x80\x80|\xf4\x8f\xbf\xbf"));
  CHECK(Rejected("\"\\ud800\""));            // lone high
  CHECK(Rejected("\"\\udc00\""));            // lone low
  CHECK(Rejected("\"\\udfff\\ud800\""));     // reversed
  CHECK(Rejected("\"\\ud800\\u0041\""));     // high + non-surrogate
  CHECK(Rejected("\"\\ud800\\ud800\""));     // high + high
  CHECK(Rejected("\"\\ud800x\""));
  CHECK(Rejected("\"\\ud800\\n\""));
  CHECK(Rejected("\"\\ud800\\"));
  CHECK(Rejected("\"\\ud800\\u"));
  CHECK(Rejected("\"\\ud800\\udc0"));
  CHECK(Rejected("\"\\u12\""));
  CHECK(Rejected("\"\\u12g4\""));
  CHECK(Rejected("\"\\U0041\""));
}

TEST(integers) {
  bool ok = false;
  uint64_t u = 0;
  int64_t i = 0;
  Json max = MustParse("18446744073709551615", &ok);
  CHECK(ok && max.is_int() && max.is_uint64_form() && max.is_number());
  CHECK(max.get_u64(&u) && u == UINT64_MAX);
  i = 42;
  CHECK(!max.get_i64(&i) && i == 42);
  CHECK_EQ(max.dump(), std::string("18446744073709551615"));

  Json imax = MustParse("9223372036854775807", &ok);
  CHECK(ok && !imax.is_uint64_form() && imax.get_i64(&i) && i == INT64_MAX);
  Json above = MustParse("9223372036854775808", &ok);
  CHECK(ok && above.is_uint64_form() && above.get_u64(&u) && u == 9223372036854775808ull);

  Json imin = MustParse("-9223372036854775808", &ok);
  CHECK(ok && imin.get_i64(&i) && i == INT64_MIN);
  u = 7;
  CHECK(!imin.get_u64(&u) && u == 7);
  CHECK_EQ(imin.dump(), std::string("-9223372036854775808"));

  // Beyond the integer forms: doubles.
  Json big = MustParse("18446744073709551616", &ok);
  double d = 0;
  CHECK(ok && big.is_double() && big.get_double(&d) && d == 18446744073709551616.0);
  Json small = MustParse("-9223372036854775809", &ok);
  CHECK(ok && small.is_double() && small.get_double(&d) && d == -9223372036854775808.0);
  CHECK(MustParse("123456789012345678901234567890", &ok).is_double() && ok);

  CHECK_EQ(Json::UInt(UINT64_MAX).dump(), std::string("18446744073709551615"));
  CHECK(!Json::UInt(5).is_uint64_form());
  CHECK(Json::UInt(5).get_i64(&i) && i == 5);
  CHECK_EQ(Json::Int(INT64_MIN).dump(), std::string("-9223372036854775808"));
  CHECK(Json::Int(-1).get_double(&d) && d == -1.0);
  CHECK(Json::UInt(UINT64_MAX).get_double(&d) && d == 18446744073709551616.0);
}

TEST(doubles) {
  const double values[] = {0.1, -0.0, 1.5, 1e300, -1e-300, 5e-324, 2.2250738585072014e-308,
                           1.7976931348623157e308, 3.0, 1e16, 1e17, 123456.789, -2.5e-7};
  for (double v : values) {
    std::string text = Json::Double(v).dump();
    Json back;
    REQUIRE(ParseJson(text, &back).ok());
    CHECK(back.is_double());
    double got = 0;
    CHECK(back.get_double(&got));
    CHECK(std::memcmp(&got, &v, sizeof(double)) == 0);  // bit exact, sign of zero included
    CHECK_EQ(back.dump(), text);
  }
  CHECK_EQ(Json::Double(3.0).dump(), std::string("3.0"));
  CHECK_EQ(Json::Double(-0.0).dump(), std::string("-0.0"));
  CHECK_EQ(Json::Double(0.5).dump(), std::string("0.5"));
  CHECK_EQ(Json::Double(1e300).dump(), std::string("1.0000000000000001e+300"));
  CHECK_EQ(Json::Double(std::nan("")).dump(), std::string("null"));
  CHECK_EQ(Json::Double(std::numeric_limits<double>::infinity()).dump(), std::string("null"));
  CHECK_EQ(Json::Double(-std::numeric_limits<double>::infinity()).dump(), std::string("null"));

  bool ok = false;
  double d = 1;
  CHECK(MustParse("1E2", &ok).get_double(&d) && ok && d == 100.0);
  CHECK(MustParse("1e+2", &ok).get_double(&d) && ok && d == 100.0);
  CHECK(MustParse("-1.25e-2", &ok).get_double(&d) && ok && d == -0.0125);
  CHECK(MustParse("0.0", &ok).is_double() && ok);
  CHECK(MustParse("0e0", &ok).is_double() && ok);
  // Underflow is kept (as zero), overflow is rejected.
  CHECK(MustParse("1e-400", &ok).get_double(&d) && ok && d == 0.0);
  CHECK(Rejected("1e400"));
  CHECK(Rejected("-1e400"));
  CHECK(Rejected("[1e309]"));
  int64_t i = 9;
  CHECK(!Json::Double(1.0).get_i64(&i) && i == 9);
}

TEST(rejections) {
  const char* bad[] = {
      "", " ", "\n", "[1,]", "[,1]", "[,]", "{\"a\":1,}", "{,}", "01", "-01", "00", "[01]",
      "1.", ".5", "-", "+1", "1e", "1e+", "1.e5", "-.5", "0x10", "1_000", "\"abc", "\"abc\\\"",
      "NaN", "nan", "Infinity", "-Infinity", "inf", "[1 2]", "{\"a\" 1}", "{\"a\":}", "{a:1}",
      "{'a':1}", "'a'", "{\"a\"}", "{1:2}", "tru", "nul", "fals", "True", "NULL", "truex",
      "[1]x", "1 2", "[1]]", "{}}", "[", "]", "{", "}", "[[]", "{\"a\":{}", "\"\\x\"", "\"\\",
      "\"\\u", "//c\n1", "/*c*/1", "[1,2", "[1,2,", "{\"a\":1", "{\"a\":1,", "{\"a\"",
      "{\"a\":", "-a", "--1", "1e5.5", "1.5.5",
  };
  for (const char* b : bad) {
    if (!Rejected(b)) std::fprintf(stderr, "  not rejected properly: %s\n", b);
    CHECK(Rejected(b));
  }
  // Raw control characters inside strings.
  for (int c = 0; c < 0x20; ++c) {
    std::string s = "\"a";
    s.push_back(static_cast<char>(c));
    s += "b\"";
    CHECK(Rejected(s));
  }
  CHECK(Rejected(std::string("[1,\0]", 5)));
  CHECK(Rejected(std::string("1\0", 2)));

  // Messages name the offset and what was expected.
  Json j;
  Status s = ParseJson("[1,]", &j);
  CHECK_EQ(s.message(), std::string("json: expected a value, found ']' at offset 3"));
  s = ParseJson("[1 2]", &j);
  CHECK_EQ(s.message(), std::string("json: expected ',' or ']', found '2' at offset 3"));
  s = ParseJson("{\"k\":1 ", &j);
  CHECK_EQ(s.message(), std::string("json: expected ',' or '}', found end of input at offset 7"));
  s = ParseJson("[01]", &j);
  CHECK_EQ(s.message(), std::string("json: leading zero in number at offset 1"));
  s = ParseJson("  \"abc", &j);
  CHECK(s.message().find("offset 6") != std::string::npos);
  CHECK(s.message().find("opened at offset 2") != std::string::npos);
}

TEST(depth_limit) {
  Json j;
  CHECK(ParseJson(Nested(64, "[", "]"), &j).ok());
  CHECK(ParseJson(NestedObjects(64), &j).ok());
  Status s = ParseJson(Nested(65, "[", "]"), &j);
  CHECK(!s.ok());
  CHECK(s.code() == Code::kCorrupt);
  CHECK_EQ(s.message(), std::string("json: nesting deeper than 64 at offset 64"));
  CHECK(Rejected(NestedObjects(65)));
  // Mixed: 32 objects holding 32 arrays is 64 deep (fine); one more is not.
  CHECK(ParseJson(Nested(32, "{\"a\":", "}").insert(5 * 32, Nested(32, "[", "]")), &j).ok());
  CHECK(Rejected(Nested(32, "{\"a\":", "}").insert(5 * 32, Nested(33, "[", "]"))));
  // Deep but not too deep documents round-trip.
  std::string d64 = Nested(64, "[", "]");
  CHECK_EQ(RoundTrip(d64), d64);

  JsonLimits three;
  three.max_depth = 3;
  CHECK(ParseJson("[[[1]]]", &j, three).ok());
  CHECK(Rejected("[[[[1]]]]", three));
  JsonLimits zero;
  zero.max_depth = 0;
  CHECK(ParseJson("7", &j, zero).ok());
  CHECK(Rejected("[]", zero));
  CHECK(Rejected("{}", zero));
  // A huge max_depth is clamped to kJsonMaxDepthCap.
  JsonLimits huge;
  huge.max_depth = SIZE_MAX;
  CHECK(ParseJson(Nested(alpsck::kJsonMaxDepthCap, "[", "]"), &j, huge).ok());
  CHECK(Rejected(Nested(alpsck::kJsonMaxDepthCap + 1, "[", "]"), huge));
}

TEST(megabyte_of_brackets) {
  const std::string opens(1u << 20, '[');
  CHECK(Rejected(opens));
  JsonLimits huge;
  huge.max_depth = SIZE_MAX;
  CHECK(Rejected(opens, huge));
  std::string objs;
  while (objs.size() < (1u << 20)) objs += "{\"a\":";
  CHECK(Rejected(objs, huge));
  // Wide (not deep) input is fine.
  std::string wide = "[";
  for (size_t i = 0; i < 100000; ++i) wide += i == 0 ? "[]" : ",[]";
  wide += "]";
  Json j;
  CHECK(ParseJson(wide, &j).ok());
  CHECK(j.get_array() != nullptr && j.get_array()->size() == 100000);
}

TEST(max_bytes) {
  JsonLimits lim;
  lim.max_bytes = 8;
  Json j;
  CHECK(ParseJson("[1,2,3]", &j, lim).ok());   // 7 bytes
  CHECK(ParseJson("[1,2,34]", &j, lim).ok());  // 8 bytes
  CHECK(Rejected("[1,2,345]", lim));           // 9 bytes
}

TEST(truncated_prefixes) {
  const std::string doc =
      "{\"a\": [1, -2.5e3, true, false, null, \"x\\u00e9\\ud83d\\ude00\\n\"], \"b\": {\"c\": {}},"
      " \"n\": 18446744073709551615, \"m\": -9223372036854775808, \"e\": [], \"s\": \"\"}";
  Json full;
  REQUIRE(ParseJson(doc, &full).ok());
  // A proper prefix of an object is never complete: every one must fail cleanly.
  for (size_t n = 0; n < doc.size(); ++n) {
    std::string prefix = doc.substr(0, n);  // own allocation: ASan catches reads past its end
    Json j;
    Status s = ParseJson(prefix, &j);
    CHECK(!s.ok());
    CHECK(s.code() == Code::kCorrupt);
  }
  // Scalars: some prefixes are valid documents; none may crash.
  for (const std::string top : {"-12.5e+7", "\"ab\\u0041\"", "true", "123"}) {
    for (size_t n = 0; n <= top.size(); ++n) {
      std::string prefix = top.substr(0, n);
      Json j;
      Status s = ParseJson(prefix, &j);
      if (s.ok()) CHECK_EQ(RoundTrip(prefix).empty(), false);
    }
  }
}

TEST(single_byte_mutations) {
  const std::string doc = "{\"k\":[1,-2.5e3,true,null,\"\\ud83d\\ude00\\t\"],\"o\":{\"p\":0}}";
  const char subst[] = {'\0', '"', '\\', '[', ']', '{', '}', ',', ':', '-', '0', '9', 'e', '.',
                        'u', 'd', ' ', '\x7f', '\x80', '\xff'};
  size_t accepted = 0;
  for (size_t pos = 0; pos < doc.size(); ++pos) {
    for (char c : subst) {
      std::string m = doc;
      m[pos] = c;
      Json j;
      if (ParseJson(m, &j).ok()) {
        ++accepted;
        CHECK(!RoundTrip(m).empty());
      }
    }
    std::string removed = doc;
    removed.erase(pos, 1);
    Json j;
    if (ParseJson(removed, &j).ok()) CHECK(!RoundTrip(removed).empty());
  }
  CHECK(accepted > 0);
}

TEST(random_inputs) {
  // Deterministic pseudo-random documents over a JSON-ish alphabet: never crash; whatever parses
  // must round-trip.
  const char alphabet[] = "[]{}\",:\\u0123456789abcdefDEn-+.eEtrulsfx \n\t";
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state]() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  size_t parsed = 0;
  for (size_t iter = 0; iter < 20000; ++iter) {
    const size_t len = next() % 24;
    std::string s;
    for (size_t i = 0; i < len; ++i) s.push_back(alphabet[next() % (sizeof(alphabet) - 1)]);
    Json j;
    if (ParseJson(s, &j).ok()) {
      ++parsed;
      CHECK(!RoundTrip(s).empty());
    }
  }
  CHECK(parsed > 0);
}

TEST(accessors_and_type_mismatch) {
  bool ok = false;
  Json doc = MustParse("{\"a\":1,\"b\":\"two\",\"a\":3,\"arr\":[true,-1],\"o\":{}}", &ok);
  REQUIRE(ok);
  CHECK(doc.is_object() && !doc.is_array());
  REQUIRE(doc.members() != nullptr);
  CHECK_EQ(doc.members()->size(), static_cast<size_t>(5));
  CHECK_EQ((*doc.members())[2].first, std::string("a"));

  const Json* a = doc.find("a");
  int64_t i = 0;
  REQUIRE(a != nullptr);
  CHECK(a->get_i64(&i) && i == 1);  // first match wins
  CHECK(doc.find("missing") == nullptr);
  CHECK(doc.find("") == nullptr);
  CHECK(doc.find(std::string_view("a\0", 2)) == nullptr);

  const Json* b = doc.find("b");
  REQUIRE(b != nullptr);
  uint64_t u = 5;
  double d = 5;
  bool flag = true;
  CHECK(!b->get_u64(&u) && u == 5);
  CHECK(!b->get_i64(&i));
  CHECK(!b->get_double(&d) && d == 5);
  CHECK(!b->get_bool(&flag) && flag);
  CHECK(b->get_array() == nullptr && b->members() == nullptr && b->find("x") == nullptr);
  CHECK(b->get_string() != nullptr && *b->get_string() == "two");

  const Json* arr = doc.find("arr");
  REQUIRE(arr != nullptr && arr->get_array() != nullptr);
  CHECK(arr->find("0") == nullptr);
  CHECK(arr->get_string() == nullptr);
  const std::vector<Json>& v = *arr->get_array();
  REQUIRE(v.size() == 2);
  CHECK(v[0].get_bool(&flag) && flag);
  CHECK(!v[0].get_i64(&i));
  u = 9;
  CHECK(!v[1].get_u64(&u) && u == 9);
  CHECK(v[1].get_i64(&i) && i == -1);

  Json null;
  CHECK(null.find("a") == nullptr && null.get_array() == nullptr && null.members() == nullptr);
  CHECK(!null.get_bool(&flag) && !null.get_double(&d) && null.get_string() == nullptr);
  CHECK(!Json::Bool(true).get_u64(&u) && !Json::Bool(false).get_double(&d));
  CHECK(!Json::Str("1").get_i64(&i));
}

TEST(builders) {
  Json root = Json::Object();
  root.set("name", Json::Str("ckpt"));
  Json& shards = root.set("shards", Json::Array());
  shards.push(Json::Int(1));
  Json& obj = shards.push(Json::Object());
  obj.set("size", Json::UInt(UINT64_MAX));
  obj.set("ratio", Json::Double(0.5));
  obj.set("q\"uote", Json::Str("line\nbreak"));
  shards.push(Json());
  root.set("ok", Json::Bool(false));
  const std::string want =
      "{\"name\":\"ckpt\",\"shards\":[1,{\"size\":18446744073709551615,\"ratio\":0.5,"
      "\"q\\\"uote\":\"line\\nbreak\"},null],\"ok\":false}";
  CHECK_EQ(root.dump(), want);
  CHECK_EQ(RoundTrip(want), want);
  // Copies are deep and independent.
  Json copy = root;
  copy.set("extra", Json::Int(1));
  CHECK_EQ(root.dump(), want);
  CHECK(copy.dump() != want);
  // push/set on a value of another kind replace it with an empty container.
  Json n;
  n.push(Json::Int(2));
  CHECK_EQ(n.dump(), std::string("[2]"));
  Json s = Json::Str("x");
  s.set("k", Json());
  CHECK_EQ(s.dump(), std::string("{\"k\":null}"));
  // set() appends, find() keeps returning the first.
  Json dup = Json::Object();
  dup.set("k", Json::Int(1));
  dup.set("k", Json::Int(2));
  CHECK_EQ(dup.dump(), std::string("{\"k\":1,\"k\":2}"));
  int64_t i = 0;
  CHECK(dup.find("k") != nullptr && dup.find("k")->get_i64(&i) && i == 1);
  CHECK_EQ(Json::Array().dump(), std::string("[]"));
  CHECK_EQ(Json::Object().dump(), std::string("{}"));
  CHECK_EQ(Json().dump(), std::string("null"));
}

TEST(output_untouched_on_error) {
  Json j = Json::Int(5);
  CHECK(!ParseJson("[1,2", &j).ok());
  int64_t i = 0;
  CHECK(j.get_i64(&i) && i == 5);
}

ALPSCK_TEST_MAIN()
