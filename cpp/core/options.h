// The engine's tunable options, defined once: name, default, limits and meaning. EngineOptions
// (engine_options.h) holds the values and takes its defaults from here; Engine::Open checks them against
// these limits; the binding exports the table (_core.engine_options()), from which the Python
// Checkpointer, the job config's `checkpoint` section and the docs' option tables take their
// defaults and limits (tests/unit/test_options.py holds the docs to it).
#pragma once

#include <cstdint>
#include <vector>

#include "status.h"

namespace alpsck {

struct EngineOptions;

enum class OptionType { kInt, kFloat, kBool, kCpuList, kText };

struct OptionSpec {
  const char* name;
  OptionType type;
  double default_value;    // kBool: 0 or 1; kCpuList, kText: unused (default: none, "")
  double min, max;         // inclusive (0 too, where zero_means says what it means); kCpuList: of each CPU number
  const char* zero_means;  // what 0 means where it is not a plain count ("auto: ..."), else nullptr
  const char* doc;
};

// Every option of EngineOptions a user may set (not run_dir, rank, world_size, env, one_history:
// those say where and who, not how), and the readers' read_threads.
const std::vector<OptionSpec>& EngineOptionSpecs();
const OptionSpec& EngineOptionSpec(const char* name);  // aborts on an unknown name (a programming error)

// OK when every option lies within its limits; else kInvalidArgument naming the option, its value
// and the allowed range.
Status CheckEngineOptions(const EngineOptions& o);

// The retention policy the options give (retention.h); CheckEngineOptions checked them.
struct RetentionPolicy;
RetentionPolicy RetentionOf(const EngineOptions& o);

}  // namespace alpsck
