// The engine's tunable options, defined once: name, default, limits, meaning, and (for the
// engine's own) the EngineOptions field that holds it. One row per option: EngineOptions
// (engine_options.h) takes its defaults from here, SetEngineOption fills it by name (the binding's
// Engine(run_dir, options) takes a mapping so), CheckEngineOptions checks every field against its
// row. The binding exports the table (_core.engine_options()), from which the Python Checkpointer,
// the job config's `checkpoint` section and the docs' option tables take their names, defaults and
// limits (tests/unit/test_options.py holds the docs to it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace alpsck {

struct EngineOptions;

enum class OptionType { kInt, kFloat, kBool, kCpuList, kText };

// Who reads an option: the engine (an EngineOptions field), the Python Checkpointer's save
// (spike_factor), or the readers (read_threads: restore, verify, export, the DCP reader).
enum class OptionScope { kEngine, kCheckpointer, kReaders };

// One option's value, given by name: the member its type names (kInt: integer, kFloat: number,
// kBool: flag, kCpuList: cpus, kText: text).
struct OptionValue {
  int64_t integer = 0;
  double number = 0;
  bool flag = false;
  std::vector<int> cpus;
  std::string text;
};

// Where an engine option lives in EngineOptions (options.cc: Field<&EngineOptions::x>()), with the
// type its C++ member has; both functions null for the options that are not the engine's.
struct OptionField {
  void (*set)(EngineOptions*, const OptionValue&);
  OptionValue (*get)(const EngineOptions&);
  OptionType type;
};

struct OptionSpec {
  const char* name;
  OptionType type;
  OptionScope scope;
  OptionField field;       // kEngine: the EngineOptions member; else {}
  double default_value;    // kBool: 0 or 1; kCpuList, kText: unused (default: none, "")
  double min, max;         // inclusive (0 too, where zero_means says what it means); kCpuList: of each CPU number
  const char* zero_means;  // what 0 means where it is not a plain count ("auto: ..."), else nullptr
  const char* doc;
};

// Every option of EngineOptions a user may set (not run_dir, rank, world_size, env, one_history:
// those say where and who, not how), and the readers' read_threads.
const std::vector<OptionSpec>& EngineOptionSpecs();
const OptionSpec& EngineOptionSpec(const char* name);  // aborts on an unknown name (a programming error)
const OptionSpec* FindEngineOption(const std::string& name);  // nullptr: no option of that name

// The option's default as a value.
OptionValue DefaultValue(const OptionSpec& s);

// Set engine option `name` of *o to v (the member of v that the option's type names), checked
// against its row: kInvalidArgument naming it when no engine option has that name (the others'
// options say whose they are) or the value is out of range. The combined rules (retention) are
// CheckEngineOptions's.
Status SetEngineOption(EngineOptions* o, const std::string& name, const OptionValue& v);

// kInvalidArgument: "NAME is VALUE: it must be between MIN and MAX (0: ...)", VALUE as given.
Status OptionOutOfRange(const OptionSpec& s, const std::string& value);

// OK when every option lies within its limits (each field checked against its row) and the
// retention rules together can take effect; else kInvalidArgument naming the option, its value
// and the allowed range.
Status CheckEngineOptions(const EngineOptions& o);

// The retention policy the options give (retention.h); CheckEngineOptions checked them.
struct RetentionPolicy;
RetentionPolicy RetentionOf(const EngineOptions& o);

}  // namespace alpsck
