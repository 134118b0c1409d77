#include "options.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "engine_options.h"
#include "retention.h"

namespace alpsck {

namespace {

constexpr double kU32 = 4294967295.0;

// An EngineOptions member as an option value and back, by its C++ type (the row's type must agree:
// EngineOptionSpecs checks it once).
void Put(uint32_t* f, const OptionValue& v) { *f = static_cast<uint32_t>(v.integer); }
void Put(uint64_t* f, const OptionValue& v) { *f = static_cast<uint64_t>(v.integer); }
void Put(int32_t* f, const OptionValue& v) { *f = static_cast<int32_t>(v.integer); }
void Put(double* f, const OptionValue& v) { *f = v.number; }
void Put(bool* f, const OptionValue& v) { *f = v.flag; }
void Put(std::vector<int>* f, const OptionValue& v) { *f = v.cpus; }
void Put(std::string* f, const OptionValue& v) { *f = v.text; }

OptionValue Int(int64_t x) {
  OptionValue v;
  v.integer = x;
  return v;
}
OptionValue Take(uint32_t x) { return Int(x); }
OptionValue Take(int32_t x) { return Int(x); }
OptionValue Take(uint64_t x) { return Int(x > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(x)); }
OptionValue Take(double x) {
  OptionValue v;
  v.number = x;
  return v;
}
OptionValue Take(bool x) {
  OptionValue v;
  v.flag = x;
  return v;
}
OptionValue Take(const std::vector<int>& x) {
  OptionValue v;
  v.cpus = x;
  return v;
}
OptionValue Take(const std::string& x) {
  OptionValue v;
  v.text = x;
  return v;
}

template <class T>
constexpr OptionType TypeOf() {
  if constexpr (std::is_same_v<T, bool>) return OptionType::kBool;
  else if constexpr (std::is_same_v<T, double>) return OptionType::kFloat;
  else if constexpr (std::is_same_v<T, std::vector<int>>) return OptionType::kCpuList;
  else if constexpr (std::is_same_v<T, std::string>) return OptionType::kText;
  else return OptionType::kInt;
}

// The row's link to its EngineOptions member M.
template <auto M>
OptionField Field() {
  using T = std::remove_reference_t<decltype(std::declval<EngineOptions&>().*M)>;
  return {[](EngineOptions* o, const OptionValue& v) { Put(&(o->*M), v); },
          [](const EngineOptions& o) { return Take(o.*M); }, TypeOf<T>()};
}

}  // namespace

// A row of an engine option: its name is its EngineOptions member's.
#define ENGINE(member, type) #member, OptionType::type, OptionScope::kEngine, Field<&EngineOptions::member>()

EngineOptions::EngineOptions() {
  for (const OptionSpec& s : EngineOptionSpecs())
    if (s.field.set) s.field.set(this, DefaultValue(s));
}

const std::vector<OptionSpec>& EngineOptionSpecs() {
  static const std::vector<OptionSpec> specs = {
      {ENGINE(max_in_flight, kInt), 2, 1, 1024, nullptr,
       "checkpoints persisting at once before save() waits"},
      {ENGINE(threads, kInt), 8, 1, kMaxWriterThreads, nullptr,
       "writer threads on the shared chunk queue, at most: one starts with the engine, the others as chunks "
       "are queued (I/O concurrency, not the CPU count, is what the storage needs: fio here peaks at queue "
       "depth 16)"},
      {ENGINE(copy_threads, kInt), 0, 0, kMaxWriterThreads, "auto: min(4, CPUs this process may use)",
       "threads taking the snapshot copy (the caller is one of them)"},
      {ENGINE(chunk_bytes, kInt), 8 << 20, 1, 1 << 30, nullptr,
       "unit of writing, CRC and pipelining (rounded up to the I/O alignment)"},
      {ENGINE(keep_last, kInt), 3, 0, kU32, "keep all",
       "the newest checkpoints kept (besides the newest healthy one, pinned ones and those the keep_every_* and "
       "keep_best rules keep: docs/retention.md); up to max_in_flight expired ones stay as free-* directories, "
       "overwritten in place by later saves"},
      {ENGINE(keep_every_steps, kInt), 0, 0, 4611686018427387904.0, "off",
       "also keep every checkpoint whose step is a multiple of this (milestones)"},
      {ENGINE(keep_every_seconds, kFloat), 0, 0, 31536000000.0, "off",
       "also keep the oldest checkpoint, then each one saved at least this many seconds after the last one this "
       "rule kept"},
      {ENGINE(keep_best, kText), 0, 0, 0, nullptr,
       "METRIC:min:K or METRIC:max:K: also keep the K checkpoints with the best value of that metric (a NaN, an "
       "infinity or no value never counts among the best); empty: off"},
      {ENGINE(staging_bytes, kInt), 0, 0, 4611686018427387904.0,
       "auto: max_in_flight x the state's chunks, at the first save, grown by a larger one",
       "pre-faulted staging memory"},
      {ENGINE(prefault_staging, kBool), 1, 0, 1, nullptr,
       "fault a fixed staging pool (staging_bytes) in when the engine opens, so a first save copies into ready "
       "memory; false: each page faults when a save first copies into it (an engine whose saves are written in "
       "place, the DCP writer's for CPU tensors, then pays nothing: 40 ms per 80 MiB here)"},
      {ENGINE(direct_io, kBool), 1, 0, 1, nullptr,
       "O_DIRECT where the file system allows (a buffered, still fdatasync'ed fallback is reported)"},
      {ENGINE(preallocate, kBool), 1, 0, 1, nullptr,
       "fallocate each new shard before its writes, inside save(): a full file system fails the save before a "
       "byte is written; false: at the writes, through the handle (the memory tier: on a tmpfs preallocating "
       "zeroes every page on the caller's clock, 0.17 s per 512 MiB, pages the writes fill anyway)"},
      {ENGINE(pin_cpus, kCpuList), 0, 0, 1023, nullptr,
       "pin writer i to pin_cpus[i % n] (e.g. the cores of the GPU's NUMA node); empty: no pinning"},
      {ENGINE(background_nice, kInt), 0, 0, 19, nullptr,
       "nice value of the background threads (writers, committer, staging pool fault-in): above 0, on a node "
       "whose cores are all busy the kernel runs training threads first (it measured no gain on the reference "
       "training, whose cost is the copy and memory traffic, not CPU time: docs/benchmarks.md)"},
      {ENGINE(crc_in_copy, kBool), 1, 0, 1, nullptr,
       "each chunk's CRC32C computed inside the snapshot copy while the bytes are in cache (one pass over "
       "memory; a longer stall), or, false, by the writers afterwards, reading the staging memory again"},
      {ENGINE(numa_node, kInt), -1, -1, 1023, nullptr,
       "NUMA node the staging memory comes from (on a GH200 node: the Grace of the rank's GPU, "
       "alpsck.gpu_numa_node()); -1: wherever the thread that faults it in runs"},
      {ENGINE(commit_timeout_s, kFloat), 600, 0.001, 604800, nullptr,
       "how long a multi-rank commit waits for the other ranks before the attempt is aborted"},
      // Not EngineOptions fields: the Checkpointer's save (spike_factor), the readers' (read_threads:
      // restore, verify, export, the DCP reader).
      {"spike_factor", OptionType::kFloat, OptionScope::kCheckpointer, {}, 0, 1, 1e6, "off",
       "a save whose metric 'loss' is above this many times the median of the last 8 finite ones saved is "
       "recorded unhealthy (a loss spike: no restore resumes from it unless asked); 0: off"},
      {"read_threads", OptionType::kInt, OptionScope::kReaders, {}, 16, 1, kMaxWriterThreads, nullptr,
       "threads reading and CRC-checking a shard in restore, verify and export"},
  };
  static const bool consistent = [] {  // each engine row's type is its member's (a programming error)
    for (const OptionSpec& s : specs)
      if ((s.scope == OptionScope::kEngine) != (s.field.set != nullptr) || (s.field.set && s.field.type != s.type)) {
        std::fprintf(stderr, "alpsck: option %s: its row and its EngineOptions member disagree\n", s.name);
        std::abort();
      }
    return true;
  }();
  (void)consistent;
  return specs;
}
#undef ENGINE

const OptionSpec* FindEngineOption(const std::string& name) {
  for (const OptionSpec& s : EngineOptionSpecs())
    if (name == s.name) return &s;
  return nullptr;
}

const OptionSpec& EngineOptionSpec(const char* name) {
  if (const OptionSpec* s = FindEngineOption(name)) return *s;
  std::fprintf(stderr, "alpsck: no engine option named %s\n", name);
  std::abort();
}

OptionValue DefaultValue(const OptionSpec& s) {
  OptionValue v;
  v.integer = static_cast<int64_t>(s.default_value);
  v.number = s.default_value;
  v.flag = s.default_value != 0;
  return v;  // kCpuList: none; kText: ""
}

namespace {

std::string Num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}

// OK when v lies within s's limits; else kInvalidArgument naming s, the value and the range.
Status Check(const OptionSpec& s, const OptionValue& v) {
  switch (s.type) {
    case OptionType::kInt:
      if ((v.integer >= static_cast<int64_t>(s.min) && v.integer <= static_cast<int64_t>(s.max)) ||
          (v.integer == 0 && s.zero_means))
        return Status::Ok();
      return OptionOutOfRange(s, std::to_string(v.integer));
    case OptionType::kFloat:
      if (!(v.number == v.number)) return Status::Invalid(std::string(s.name) + " is not a number");
      if ((v.number >= s.min && v.number <= s.max) || (v.number == 0 && s.zero_means)) return Status::Ok();
      return OptionOutOfRange(s, Num(v.number));
    case OptionType::kCpuList:
      for (int cpu : v.cpus)
        if (cpu < s.min || cpu > s.max)
          return Status::Invalid(std::string(s.name) + " holds " + std::to_string(cpu) +
                                 ": CPU numbers must be between " + Num(s.min) + " and " + Num(s.max));
      return Status::Ok();
    case OptionType::kBool:
    case OptionType::kText:
      break;
  }
  return Status::Ok();
}

}  // namespace

Status OptionOutOfRange(const OptionSpec& s, const std::string& value) {
  std::string range = Num(s.min) + " and " + Num(s.max);
  if (s.zero_means) range += " (0: " + std::string(s.zero_means) + ")";
  return Status::Invalid(std::string(s.name) + " is " + value + ": it must be between " + range);
}

Status SetEngineOption(EngineOptions* o, const std::string& name, const OptionValue& v) {
  const OptionSpec* s = FindEngineOption(name);
  if (!s) return Status::Invalid("no engine option is named '" + name + "'");
  if (s->scope == OptionScope::kCheckpointer)
    return Status::Invalid(name + " is not an engine option: the Checkpointer's save takes it");
  if (s->scope == OptionScope::kReaders)
    return Status::Invalid(name + " is not an engine option: the readers take it (restore, verify, export)");
  ALPSCK_RETURN_IF_ERROR(Check(*s, v));
  s->field.set(o, v);
  return Status::Ok();
}

Status CheckEngineOptions(const EngineOptions& o) {
  for (const OptionSpec& s : EngineOptionSpecs())
    if (s.field.get) ALPSCK_RETURN_IF_ERROR(Check(s, s.field.get(o)));
  RetentionPolicy policy;  // keep_best's text, then the retention rules together (retention.h)
  ALPSCK_RETURN_IF_ERROR(ParseKeepBest(o.keep_best, &policy));
  return CheckRetention(RetentionOf(o));
}

RetentionPolicy RetentionOf(const EngineOptions& o) {
  RetentionPolicy p;
  (void)ParseKeepBest(o.keep_best, &p);  // checked by CheckEngineOptions; unparsable: off
  p.keep_last = o.keep_last;
  p.keep_every_steps = o.keep_every_steps;
  p.keep_every_seconds = o.keep_every_seconds;
  return p;
}

}  // namespace alpsck
