// json: a small, strict JSON value type with a parser and a writer, for checkpoint index and
// manifest files that may be hostile.
//
// Parser: RFC 8259 strict (no comments, no trailing commas, no leading zeros, no NaN/Infinity,
// no raw control characters in strings, nothing after the document). It is iterative: nesting
// is bounded by JsonLimits::max_depth (default 64, clamped to kJsonMaxDepthCap) with an explicit
// counter, so hostile input cannot exhaust the stack. Memory use is linear in the input size and
// the input is bounded by JsonLimits::max_bytes. Strings are byte strings: \uXXXX escapes
// (surrogate pairs included) are decoded to UTF-8 and lone surrogates rejected, but raw bytes are
// not validated as UTF-8. Numbers: integers that fit int64 are kInt; non-negative integers up to
// UINT64_MAX are kInt in their uint64 form; everything else is kDouble (a literal that overflows
// a double is rejected). Errors are Status::Corrupt naming the byte offset and what was expected.
//
// Writer: dump() is compact and deterministic (object members in insertion order). Doubles are
// written with %.17g (always with a '.' or exponent, so they re-read as doubles); NaN and
// infinities are not representable and are written as null.
//
// Nothing here throws (except std::bad_alloc from the standard containers). Destruction, copy
// and dump() recurse once per nesting level: a parsed value is at most kJsonMaxDepthCap deep;
// values built by code are the caller's responsibility.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "status.h"

namespace alpsck {

class Json {
 public:
  enum class Type { kNull, kBool, kInt, kDouble, kString, kArray, kObject };

  Json() = default;  // null
  static Json Bool(bool b);
  static Json Int(int64_t i);
  static Json UInt(uint64_t u);  // kInt; kept in the uint64 form only when > INT64_MAX
  static Json Double(double d);
  static Json Str(std::string s);
  static Json Array();
  static Json Object();

  Type type() const;
  bool is_null() const { return type() == Type::kNull; }
  bool is_bool() const { return type() == Type::kBool; }
  bool is_int() const { return type() == Type::kInt; }        // either integer form
  bool is_uint64_form() const;                                 // kInt greater than INT64_MAX
  bool is_double() const { return type() == Type::kDouble; }
  bool is_number() const { return is_int() || is_double(); }
  bool is_string() const { return type() == Type::kString; }
  bool is_array() const { return type() == Type::kArray; }
  bool is_object() const { return type() == Type::kObject; }

  // Accessors never throw: they return false / nullptr when the type does not match or the value
  // does not fit, and leave *out untouched then.
  bool get_u64(uint64_t* out) const;   // kInt that is non-negative
  bool get_i64(int64_t* out) const;    // kInt that fits int64
  bool get_double(double* out) const;  // kInt (converted) or kDouble
  bool get_bool(bool* out) const;
  const std::string* get_string() const;
  const std::vector<Json>* get_array() const;
  const std::vector<std::pair<std::string, Json>>* members() const;
  // The first object member named `key`, or nullptr (also when this is not an object).
  const Json* find(std::string_view key) const;

  // Builders. push() on a non-array and set() on a non-object first replace the value with an
  // empty array / object. set() always appends (it does not replace an existing key; find()
  // returns the first). The returned reference is valid until the container is next modified.
  Json& push(Json v);
  Json& set(std::string key, Json v);

  // Compact JSON text; deterministic; always parses back with ParseJson.
  std::string dump() const;
  void dump_to(std::string* out) const;

 private:
  using ArrayRep = std::vector<Json>;
  using ObjectRep = std::vector<std::pair<std::string, Json>>;
  // Index order matters: type() maps indexes 2 and 3 to kInt.
  std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string, ArrayRep, ObjectRep>
      v_;
};

// Hard ceiling on JsonLimits::max_depth: larger requests are treated as this.
constexpr size_t kJsonMaxDepthCap = 1024;

struct JsonLimits {
  size_t max_depth = 64;          // containers nested deeper than this are rejected
  size_t max_bytes = 256u << 20;  // longer documents are rejected before parsing
};

// Parses a whole document (any JSON value at top level). On error *out is left unchanged and a
// Status::Corrupt names the byte offset, e.g. "json: expected ',' or ']' at offset 17".
Status ParseJson(std::string_view text, Json* out, JsonLimits limits = {});

// The quoted JSON string literal for s: escapes '"', '\\' and control characters (< 0x20);
// other bytes pass through unchanged. JsonEscape("a\"b") == "\"a\\\"b\"".
std::string JsonEscape(std::string_view s);

}  // namespace alpsck
