// json: value type, strict iterative parser and compact writer. See json.h for the contract.
#include "json.h"

#include <cerrno>
#include <charconv>
#include <clocale>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <system_error>

namespace alpsck {

// ---------------------------------------------------------------------------------------------
// Json value

Json Json::Bool(bool b) {
  Json j;
  j.v_ = b;
  return j;
}

Json Json::Int(int64_t i) {
  Json j;
  j.v_ = i;
  return j;
}

Json Json::UInt(uint64_t u) {
  Json j;
  if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    j.v_ = static_cast<int64_t>(u);
  } else {
    j.v_ = u;
  }
  return j;
}

Json Json::Double(double d) {
  Json j;
  j.v_ = d;
  return j;
}

Json Json::Str(std::string s) {
  Json j;
  j.v_ = std::move(s);
  return j;
}

Json Json::Array() {
  Json j;
  j.v_ = ArrayRep();
  return j;
}

Json Json::Object() {
  Json j;
  j.v_ = ObjectRep();
  return j;
}

Json::Type Json::type() const {
  switch (v_.index()) {
    case 1: return Type::kBool;
    case 2:
    case 3: return Type::kInt;
    case 4: return Type::kDouble;
    case 5: return Type::kString;
    case 6: return Type::kArray;
    case 7: return Type::kObject;
    default: return Type::kNull;
  }
}

bool Json::is_uint64_form() const { return std::get_if<uint64_t>(&v_) != nullptr; }

bool Json::get_u64(uint64_t* out) const {
  if (const int64_t* i = std::get_if<int64_t>(&v_)) {
    if (*i < 0) return false;
    *out = static_cast<uint64_t>(*i);
    return true;
  }
  if (const uint64_t* u = std::get_if<uint64_t>(&v_)) {
    *out = *u;
    return true;
  }
  return false;
}

bool Json::get_i64(int64_t* out) const {
  // The uint64 form only holds values above INT64_MAX, so it never fits.
  if (const int64_t* i = std::get_if<int64_t>(&v_)) {
    *out = *i;
    return true;
  }
  return false;
}

bool Json::get_double(double* out) const {
  if (const double* d = std::get_if<double>(&v_)) {
    *out = *d;
    return true;
  }
  if (const int64_t* i = std::get_if<int64_t>(&v_)) {
    *out = static_cast<double>(*i);
    return true;
  }
  if (const uint64_t* u = std::get_if<uint64_t>(&v_)) {
    *out = static_cast<double>(*u);
    return true;
  }
  return false;
}

bool Json::get_bool(bool* out) const {
  if (const bool* b = std::get_if<bool>(&v_)) {
    *out = *b;
    return true;
  }
  return false;
}

const std::string* Json::get_string() const { return std::get_if<std::string>(&v_); }

const std::vector<Json>* Json::get_array() const { return std::get_if<ArrayRep>(&v_); }

const std::vector<std::pair<std::string, Json>>* Json::members() const {
  return std::get_if<ObjectRep>(&v_);
}

const Json* Json::find(std::string_view key) const {
  const ObjectRep* o = std::get_if<ObjectRep>(&v_);
  if (o == nullptr) return nullptr;
  for (const auto& m : *o) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

Json& Json::push(Json v) {
  ArrayRep* a = std::get_if<ArrayRep>(&v_);
  if (a == nullptr) a = &v_.emplace<ArrayRep>();
  a->push_back(std::move(v));
  return a->back();
}

Json& Json::set(std::string key, Json v) {
  ObjectRep* o = std::get_if<ObjectRep>(&v_);
  if (o == nullptr) o = &v_.emplace<ObjectRep>();
  o->emplace_back(std::move(key), std::move(v));
  return o->back().second;
}

// ---------------------------------------------------------------------------------------------
// Writer

namespace {

const char kHex[] = "0123456789abcdef";

void EscapeTo(std::string_view s, std::string* out) {
  out->push_back('"');
  size_t run = 0;  // start of the pending run of bytes that need no escaping
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out->append(s.data() + run, i - run);
    run = i + 1;
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default: {
        const char esc[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 0xf]};
        out->append(esc, sizeof(esc));
        break;
      }
    }
  }
  out->append(s.data() + run, s.size() - run);
  out->push_back('"');
}

template <typename T>
void AppendInteger(T v, std::string* out) {
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v);
  out->append(buf, static_cast<size_t>(r.ptr - buf));
}

void AppendDouble(double d, std::string* out) {
  if (!std::isfinite(d)) {
    out->append("null");
    return;
  }
  char buf[64];
  const int n = std::snprintf(buf, sizeof(buf), "%.17g", d);
  if (n <= 0 || static_cast<size_t>(n) >= sizeof(buf)) {  // cannot happen for a finite double
    out->append("null");
    return;
  }
  // Copy, turning the locale's decimal point (whatever bytes it is) into '.', and make sure the
  // text reads back as a double rather than an integer (e.g. 3.0 prints "3" -> "3.0").
  bool looks_double = false;
  bool last_was_point = false;
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    const char c = buf[i];
    if ((c >= '0' && c <= '9') || c == '-' || c == '+') {
      out->push_back(c);
      last_was_point = false;
    } else if (c == 'e' || c == 'E') {
      out->push_back('e');
      looks_double = true;
      last_was_point = false;
    } else if (!last_was_point) {
      out->push_back('.');
      looks_double = true;
      last_was_point = true;
    }
  }
  if (!looks_double) out->append(".0");
}

}  // namespace

void Json::dump_to(std::string* out) const {
  switch (v_.index()) {
    case 1: out->append(*std::get_if<bool>(&v_) ? "true" : "false"); return;
    case 2: AppendInteger(*std::get_if<int64_t>(&v_), out); return;
    case 3: AppendInteger(*std::get_if<uint64_t>(&v_), out); return;
    case 4: AppendDouble(*std::get_if<double>(&v_), out); return;
    case 5: EscapeTo(*std::get_if<std::string>(&v_), out); return;
    case 6: {
      out->push_back('[');
      bool first = true;
      for (const Json& e : *std::get_if<ArrayRep>(&v_)) {
        if (!first) out->push_back(',');
        first = false;
        e.dump_to(out);
      }
      out->push_back(']');
      return;
    }
    case 7: {
      out->push_back('{');
      bool first = true;
      for (const auto& m : *std::get_if<ObjectRep>(&v_)) {
        if (!first) out->push_back(',');
        first = false;
        EscapeTo(m.first, out);
        out->push_back(':');
        m.second.dump_to(out);
      }
      out->push_back('}');
      return;
    }
    default: out->append("null"); return;
  }
}

std::string Json::dump() const {
  std::string out;
  dump_to(&out);
  return out;
}

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  EscapeTo(s, &out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Parser

namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Converts a literal already checked against the JSON number grammar. False if it overflows a
// double (underflow to a subnormal or zero is accepted).
bool ToDouble(const char* p, size_t len, double* out) {
// ALPSCK_JSON_USE_STRTOD forces the strtod path (the only one where the library lacks
// floating-point from_chars) so that it can be tested anywhere.
#if !defined(ALPSCK_JSON_USE_STRTOD) && defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L
  {
    double v = 0;
    const std::from_chars_result r = std::from_chars(p, p + len, v);
    if (r.ec == std::errc() && r.ptr == p + len) {
      if (!std::isfinite(v)) return false;
      *out = v;
      return true;
    }
    if (r.ec != std::errc::result_out_of_range) return false;
    // Out of range: strtod below tells overflow (reject) from underflow (keep).
  }
#endif
  std::string buf(p, len);
  // strtod honours the locale's decimal point; the grammar allows at most one '.'.
  const struct lconv* lc = std::localeconv();
  if (lc != nullptr && lc->decimal_point != nullptr && std::string_view(lc->decimal_point) != ".") {
    const size_t dot = buf.find('.');
    if (dot != std::string::npos) buf.replace(dot, 1, lc->decimal_point);
  }
  const int saved_errno = errno;
  char* end = nullptr;
  const double v = std::strtod(buf.c_str(), &end);
  errno = saved_errno;
  if (end != buf.c_str() + buf.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

class Parser {
 public:
  Parser(std::string_view text, size_t max_depth) : t_(text), max_depth_(max_depth) {}

  Status Parse(Json* out);

 private:
  struct Frame {
    Json v;           // the array or object being filled
    std::string key;  // objects: the key of the member whose value is being parsed
  };

  bool AtEnd() const { return pos_ >= t_.size(); }
  void SkipWs() {
    while (pos_ < t_.size()) {
      const char c = t_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }
  // What sits at pos_, for error messages.
  std::string Found() const {
    if (AtEnd()) return "end of input";
    const unsigned char c = static_cast<unsigned char>(t_[pos_]);
    if (c >= 0x21 && c < 0x7F) return std::string("'") + static_cast<char>(c) + "'";
    return std::string("byte 0x") + kHex[c >> 4] + kHex[c & 0xf];
  }
  Status Err(const std::string& what, size_t offset) const {
    return Status::Corrupt("json: " + what + " at offset " + std::to_string(offset));
  }
  Status Expected(const std::string& what) const {
    return Err("expected " + what + ", found " + Found(), pos_);
  }

  Status ParseString(std::string* out);
  Status ParseHex4(size_t escape_at, uint32_t* out);
  Status ParseKeyColon(std::string* key);
  Status ParseNumber(Json* out);
  Status ParseLiteral(Json* out);

  std::string_view t_;
  size_t pos_ = 0;
  size_t max_depth_;
};

Status Parser::ParseHex4(size_t escape_at, uint32_t* out) {
  if (t_.size() - pos_ < 4) return Err("truncated \\u escape", escape_at);
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) {
    const char c = t_[pos_ + i];
    uint32_t d;
    if (c >= '0' && c <= '9') d = static_cast<uint32_t>(c - '0');
    else if (c >= 'a' && c <= 'f') d = static_cast<uint32_t>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') d = static_cast<uint32_t>(c - 'A' + 10);
    else return Err("expected 4 hex digits after \\u", pos_ + i);
    v = (v << 4) | d;
  }
  pos_ += 4;
  *out = v;
  return Status::Ok();
}

Status Parser::ParseString(std::string* out) {
  const size_t open = pos_;  // at the opening quote
  ++pos_;
  for (;;) {
    const size_t run = pos_;
    while (pos_ < t_.size()) {
      const unsigned char c = static_cast<unsigned char>(t_[pos_]);
      if (c == '"' || c == '\\' || c < 0x20) break;
      ++pos_;
    }
    out->append(t_.data() + run, pos_ - run);
    if (AtEnd()) {
      return Err("expected '\"' to close the string opened at offset " + std::to_string(open) +
                     ", found end of input",
                 pos_);
    }
    const char c = t_[pos_];
    if (c == '"') {
      ++pos_;
      return Status::Ok();
    }
    if (c != '\\') return Err("unescaped control character in string", pos_);
    const size_t esc = pos_;
    ++pos_;
    if (AtEnd()) return Err("truncated escape in string", esc);
    const char e = t_[pos_++];
    switch (e) {
      case '"': out->push_back('"'); break;
      case '\\': out->push_back('\\'); break;
      case '/': out->push_back('/'); break;
      case 'b': out->push_back('\b'); break;
      case 'f': out->push_back('\f'); break;
      case 'n': out->push_back('\n'); break;
      case 'r': out->push_back('\r'); break;
      case 't': out->push_back('\t'); break;
      case 'u': {
        uint32_t cp = 0;
        ALPSCK_RETURN_IF_ERROR(ParseHex4(esc, &cp));
        if (cp >= 0xDC00 && cp <= 0xDFFF) return Err("lone low surrogate \\u escape", esc);
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          const size_t esc2 = pos_;
          if (t_.size() - pos_ < 2 || t_[pos_] != '\\' || t_[pos_ + 1] != 'u') {
            return Err("lone high surrogate \\u escape (expected a \\u low surrogate next)", esc);
          }
          pos_ += 2;
          uint32_t lo = 0;
          ALPSCK_RETURN_IF_ERROR(ParseHex4(esc2, &lo));
          if (lo < 0xDC00 || lo > 0xDFFF) {
            return Err("high surrogate \\u escape not followed by a low surrogate", esc);
          }
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        AppendUtf8(cp, out);
        break;
      }
      default: return Err("invalid escape in string", esc);
    }
  }
}

Status Parser::ParseKeyColon(std::string* key) {
  SkipWs();
  if (AtEnd() || t_[pos_] != '"') return Expected("a string key");
  key->clear();
  ALPSCK_RETURN_IF_ERROR(ParseString(key));
  SkipWs();
  if (AtEnd() || t_[pos_] != ':') return Expected("':' after object key");
  ++pos_;
  return Status::Ok();
}

Status Parser::ParseNumber(Json* out) {
  const size_t start = pos_;
  const bool negative = t_[pos_] == '-';
  if (negative) ++pos_;
  if (AtEnd() || !IsDigit(t_[pos_])) return Expected("a digit in number");
  if (t_[pos_] == '0') {
    ++pos_;
    if (!AtEnd() && IsDigit(t_[pos_])) return Err("leading zero in number", start);
  } else {
    while (!AtEnd() && IsDigit(t_[pos_])) ++pos_;
  }
  bool integral = true;
  if (!AtEnd() && t_[pos_] == '.') {
    integral = false;
    ++pos_;
    if (AtEnd() || !IsDigit(t_[pos_])) return Expected("a digit after '.'");
    while (!AtEnd() && IsDigit(t_[pos_])) ++pos_;
  }
  if (!AtEnd() && (t_[pos_] == 'e' || t_[pos_] == 'E')) {
    integral = false;
    ++pos_;
    if (!AtEnd() && (t_[pos_] == '+' || t_[pos_] == '-')) ++pos_;
    if (AtEnd() || !IsDigit(t_[pos_])) return Expected("a digit in exponent");
    while (!AtEnd() && IsDigit(t_[pos_])) ++pos_;
  }
  const char* b = t_.data() + start;
  const char* e = t_.data() + pos_;
  if (integral) {
    if (negative) {
      int64_t v = 0;
      const std::from_chars_result r = std::from_chars(b, e, v);
      if (r.ec == std::errc() && r.ptr == e) {
        *out = Json::Int(v);
        return Status::Ok();
      }
    } else {
      uint64_t v = 0;
      const std::from_chars_result r = std::from_chars(b, e, v);
      if (r.ec == std::errc() && r.ptr == e) {
        *out = Json::UInt(v);
        return Status::Ok();
      }
    }
    // Too large for the integer forms: fall through to a double.
  }
  double d = 0;
  if (!ToDouble(b, pos_ - start, &d)) return Err("number out of range", start);
  *out = Json::Double(d);
  return Status::Ok();
}

Status Parser::ParseLiteral(Json* out) {
  const std::string_view rest = t_.substr(pos_);
  if (rest.substr(0, 4) == "true") {
    *out = Json::Bool(true);
    pos_ += 4;
  } else if (rest.substr(0, 5) == "false") {
    *out = Json::Bool(false);
    pos_ += 5;
  } else if (rest.substr(0, 4) == "null") {
    *out = Json();
    pos_ += 4;
  } else {
    return Expected("a value");
  }
  return Status::Ok();
}

Status Parser::Parse(Json* out) {
  std::vector<Frame> stack;  // open containers, innermost last; size() is the nesting depth
  Json val;
  for (;;) {
    // A value starts here: parse a scalar, or open a container (possibly empty).
    SkipWs();
    bool complete = true;
    const char c = AtEnd() ? '\0' : t_[pos_];
    if (c == '[' || c == '{') {
      if (stack.size() >= max_depth_) {
        return Err("nesting deeper than " + std::to_string(max_depth_), pos_);
      }
      ++pos_;
      stack.emplace_back();
      Frame& f = stack.back();
      f.v = c == '[' ? Json::Array() : Json::Object();
      SkipWs();
      if (!AtEnd() && t_[pos_] == (c == '[' ? ']' : '}')) {
        ++pos_;
        val = std::move(f.v);
        stack.pop_back();
      } else {
        if (c == '{') ALPSCK_RETURN_IF_ERROR(ParseKeyColon(&f.key));
        complete = false;
      }
    } else if (c == '"') {
      std::string s;
      ALPSCK_RETURN_IF_ERROR(ParseString(&s));
      val = Json::Str(std::move(s));
    } else if (c == '-' || IsDigit(c)) {
      ALPSCK_RETURN_IF_ERROR(ParseNumber(&val));
    } else {
      ALPSCK_RETURN_IF_ERROR(ParseLiteral(&val));  // reports "expected a value" on anything else
    }
    if (!complete) continue;

    // Hand the finished value to its container; close containers that end here.
    for (;;) {
      if (stack.empty()) {
        SkipWs();
        if (!AtEnd()) return Expected("end of input after the document");
        *out = std::move(val);
        return Status::Ok();
      }
      Frame& f = stack.back();
      const bool is_array = f.v.is_array();
      if (is_array) {
        f.v.push(std::move(val));
      } else {
        f.v.set(std::move(f.key), std::move(val));
      }
      SkipWs();
      if (!AtEnd() && t_[pos_] == ',') {
        ++pos_;
        if (!is_array) ALPSCK_RETURN_IF_ERROR(ParseKeyColon(&f.key));
        break;  // the next element's value follows
      }
      if (!AtEnd() && t_[pos_] == (is_array ? ']' : '}')) {
        ++pos_;
        val = std::move(f.v);
        stack.pop_back();
        continue;
      }
      return Expected(is_array ? "',' or ']'" : "',' or '}'");
    }
  }
}

}  // namespace

Status ParseJson(std::string_view text, Json* out, JsonLimits limits) {
  if (text.size() > limits.max_bytes) {
    return Status::Corrupt("json: document longer than the limit of " +
                           std::to_string(limits.max_bytes) + " bytes at offset " +
                           std::to_string(limits.max_bytes) + " (it is " +
                           std::to_string(text.size()) + " bytes)");
  }
  const size_t depth = limits.max_depth < kJsonMaxDepthCap ? limits.max_depth : kJsonMaxDepthCap;
  Parser p(text, depth);
  return p.Parse(out);
}

}  // namespace alpsck
