// alpsck._core: the option table (options.h) for Python, and EngineOptions from a mapping of
// option names to values through it (the Engine's `options`).
#include "binding.h"

#include <cstdint>
#include <string>
#include <vector>

#include "options.h"

namespace alpsck::binding {
namespace {

using namespace nb::literals;

std::string Repr(nb::handle v) { return nb::cast<std::string>(nb::repr(v)); }

[[noreturn]] void Refuse(const OptionSpec& s, nb::handle v, const char* must) {
  RaiseStatus(Status::Invalid(std::string(s.name) + " is " + Repr(v) + ": it must be " + must), false);
}

// A Python value as option s takes it (the member of OptionValue its type names). A value of
// another type raises UsageError naming the option; an integer too large for int64 is out of
// range (the table's message).
OptionValue ValueFrom(const OptionSpec& s, nb::handle v) {
  OptionValue out;
  const bool is_bool = PyBool_Check(v.ptr());
  switch (s.type) {
    case OptionType::kInt: {
      if (is_bool || !PyLong_Check(v.ptr())) Refuse(s, v, "an integer");
      int overflow = 0;
      out.integer = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
      if (overflow) RaiseStatus(OptionOutOfRange(s, Repr(v)), false);
      break;
    }
    case OptionType::kFloat:
      if (is_bool || !(PyLong_Check(v.ptr()) || PyFloat_Check(v.ptr()))) Refuse(s, v, "a number");
      out.number = PyFloat_AsDouble(v.ptr());
      if (out.number == -1.0 && PyErr_Occurred()) {  // an int beyond a double's range
        PyErr_Clear();
        RaiseStatus(OptionOutOfRange(s, Repr(v)), false);
      }
      break;
    case OptionType::kBool:
      if (!is_bool) Refuse(s, v, "True or False");
      out.flag = v.ptr() == Py_True;
      break;
    case OptionType::kCpuList:
      if (PyUnicode_Check(v.ptr()) || PyBytes_Check(v.ptr()) || !nb::try_cast(v, out.cpus))
        Refuse(s, v, "a list of CPU numbers");
      break;
    case OptionType::kText:
      if (!PyUnicode_Check(v.ptr())) Refuse(s, v, "a string");
      out.text = nb::cast<std::string>(v);
      break;
  }
  return out;
}

nb::object ValueTo(const OptionSpec& s, const OptionValue& v) {
  switch (s.type) {
    case OptionType::kInt: return nb::int_(v.integer);
    case OptionType::kFloat: return nb::float_(v.number);
    case OptionType::kBool: return nb::bool_(v.flag);
    case OptionType::kCpuList: return nb::cast(v.cpus);
    case OptionType::kText: return nb::str(v.text.c_str(), v.text.size());
  }
  return nb::none();
}

const char* ScopeName(OptionScope scope) {
  switch (scope) {
    case OptionScope::kEngine: return "engine";
    case OptionScope::kCheckpointer: return "checkpointer";
    case OptionScope::kReaders: return "readers";
  }
  return "";
}

nb::dict SpecDict(const OptionSpec& s) {
  nb::dict d;
  d["name"] = s.name;
  const bool integral = s.type == OptionType::kInt || s.type == OptionType::kCpuList;
  auto num = [&](double v) -> nb::object {
    if (integral) return nb::int_(static_cast<int64_t>(v));
    return nb::float_(v);
  };
  switch (s.type) {
    case OptionType::kInt: d["type"] = "int"; break;
    case OptionType::kFloat: d["type"] = "float"; break;
    case OptionType::kBool: d["type"] = "bool"; break;
    case OptionType::kCpuList: d["type"] = "cpus"; break;
    case OptionType::kText: d["type"] = "text"; break;
  }
  d["default"] = ValueTo(s, DefaultValue(s));
  if (s.type != OptionType::kBool && s.type != OptionType::kText) {
    d["min"] = num(s.min);
    d["max"] = num(s.max);
  }
  d["zero_means"] = s.zero_means ? nb::object(nb::str(s.zero_means)) : nb::none();
  d["scope"] = ScopeName(s.scope);
  d["doc"] = s.doc;
  return d;
}

}  // namespace

EngineOptions EngineOptionsFrom(const nb::dict& options) {
  EngineOptions o;
  for (auto [k, v] : options) {
    if (!PyUnicode_Check(k.ptr())) RaiseStatus(Status::Invalid("an option name must be a str, not " + Repr(k)), false);
    const std::string name = nb::cast<std::string>(k);
    const OptionSpec* s = FindEngineOption(name);
    const Status st = SetEngineOption(&o, name, s ? ValueFrom(*s, v) : OptionValue());
    if (!st.ok()) RaiseStatus(st, false);
  }
  return o;
}

void BindOptions(nb::module_& m) {
  m.def("engine_options", [] {
        std::vector<nb::dict> out;
        for (const OptionSpec& s : EngineOptionSpecs()) out.push_back(SpecDict(s));
        return out;
      },
      "The engine's options, defined once in the core (cpp/core/options.h): a list of {name, type "
      "('int', 'float', 'bool', 'cpus': a list of CPU numbers, or 'text'), default, min, max (inclusive; not for "
      "'bool' and 'text'), zero_means (what 0 means where it is not a plain count, else None), scope (who reads "
      "it: 'engine', 'checkpointer' or 'readers'), doc}.");
  m.def("check_engine_options", [](const nb::dict& options) {
        const EngineOptions o = EngineOptionsFrom(options);
        const Status s = CheckEngineOptions(o);
        if (!s.ok()) RaiseStatus(s, false);
        nb::dict out;
        for (const OptionSpec& spec : EngineOptionSpecs())
          if (spec.field.get) out[spec.name] = ValueTo(spec, spec.field.get(o));
        return out;
      },
      "options"_a,
      "Every engine option's value as Engine(run_dir, options) would open with them: the given ones (by name, "
      "each checked against its row of the table), the table's defaults for the rest, checked together as the "
      "engine checks them (the retention rules). An unknown name, a value of the wrong type or out of range "
      "raises UsageError naming the option.");
}

}  // namespace alpsck::binding
