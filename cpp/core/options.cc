#include "options.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine_options.h"
#include "retention.h"

namespace alpsck {

namespace {

constexpr double kU32 = 4294967295.0;

double Default(const char* name) { return EngineOptionSpec(name).default_value; }

}  // namespace

EngineOptions::EngineOptions()
    : max_in_flight(static_cast<uint32_t>(Default("max_in_flight"))),
      threads(static_cast<uint32_t>(Default("threads"))),
      copy_threads(static_cast<uint32_t>(Default("copy_threads"))),
      chunk_bytes(static_cast<uint64_t>(Default("chunk_bytes"))),
      keep_last(static_cast<uint32_t>(Default("keep_last"))),
      keep_every_steps(static_cast<uint64_t>(Default("keep_every_steps"))),
      keep_every_seconds(Default("keep_every_seconds")),
      staging_bytes(static_cast<uint64_t>(Default("staging_bytes"))),
      direct_io(Default("direct_io") != 0),
      background_nice(static_cast<uint32_t>(Default("background_nice"))),
      crc_in_copy(Default("crc_in_copy") != 0),
      numa_node(static_cast<int32_t>(Default("numa_node"))),
      commit_timeout_s(Default("commit_timeout_s")) {}

const std::vector<OptionSpec>& EngineOptionSpecs() {
  static const std::vector<OptionSpec> specs = {
      {"max_in_flight", OptionType::kInt, 2, 1, 1024, nullptr,
       "checkpoints persisting at once before save() waits"},
      {"threads", OptionType::kInt, 8, 1, kMaxWriterThreads, nullptr,
       "writer threads on the shared chunk queue (I/O concurrency, not the CPU count, is what the storage "
       "needs: fio here peaks at queue depth 16)"},
      {"copy_threads", OptionType::kInt, 0, 0, kMaxWriterThreads, "auto: min(4, CPUs this process may use)",
       "threads taking the snapshot copy (the caller is one of them)"},
      {"chunk_bytes", OptionType::kInt, 8 << 20, 1, 1 << 30, nullptr,
       "unit of writing, CRC and pipelining (rounded up to the I/O alignment)"},
      {"keep_last", OptionType::kInt, 3, 0, kU32, "keep all",
       "the newest checkpoints kept (besides the newest healthy one, pinned ones and those the keep_every_* and "
       "keep_best rules keep: docs/retention.md); up to max_in_flight expired ones stay as free-* directories, "
       "overwritten in place by later saves"},
      {"keep_every_steps", OptionType::kInt, 0, 0, 4611686018427387904.0, "off",
       "also keep every checkpoint whose step is a multiple of this (milestones)"},
      {"keep_every_seconds", OptionType::kFloat, 0, 0, 31536000000.0, "off",
       "also keep the oldest checkpoint, then each one saved at least this many seconds after the last one this "
       "rule kept"},
      {"keep_best", OptionType::kText, 0, 0, 0, nullptr,
       "METRIC:min:K or METRIC:max:K: also keep the K checkpoints with the best value of that metric (a NaN, an "
       "infinity or no value never counts among the best); empty: off"},
      {"staging_bytes", OptionType::kInt, 0, 0, 4611686018427387904.0,
       "auto: max_in_flight x the state's chunks (+ one per writer), at the first save, grown by a larger one",
       "pre-faulted staging memory"},
      {"direct_io", OptionType::kBool, 1, 0, 1, nullptr,
       "O_DIRECT where the file system allows (a buffered, still fdatasync'ed fallback is reported)"},
      {"pin_cpus", OptionType::kCpuList, 0, 0, 1023, nullptr,
       "pin writer i to pin_cpus[i % n] (e.g. the cores of the GPU's NUMA node); empty: no pinning"},
      {"background_nice", OptionType::kInt, 0, 0, 19, nullptr,
       "nice value of the background threads (writers, committer, staging pool fault-in): above 0, on a node "
       "whose cores are all busy the kernel runs training threads first (it measured no gain on the reference "
       "training, whose cost is the copy and memory traffic, not CPU time: docs/benchmarks.md)"},
      {"crc_in_copy", OptionType::kBool, 1, 0, 1, nullptr,
       "each chunk's CRC32C computed inside the snapshot copy while the bytes are in cache (one pass over "
       "memory; a longer stall), or, false, by the writers afterwards, reading the staging memory again"},
      {"numa_node", OptionType::kInt, -1, -1, 1023, nullptr,
       "NUMA node the staging memory comes from (on a GH200 node: the Grace of the rank's GPU, "
       "alpsck.gpu_numa_node()); -1: wherever the thread that faults it in runs"},
      {"commit_timeout_s", OptionType::kFloat, 600, 0.001, 604800, nullptr,
       "how long a multi-rank commit waits for the other ranks before the attempt is aborted"},
      // Not EngineOptions fields: the Checkpointer's save (spike_factor), the readers' (read_threads:
      // restore, verify, export, the DCP reader).
      {"spike_factor", OptionType::kFloat, 0, 1, 1e6, "off",
       "a save whose metric 'loss' is above this many times the median of the last 8 finite ones saved is "
       "recorded unhealthy (a loss spike: no restore resumes from it unless asked); 0: off"},
      {"read_threads", OptionType::kInt, 16, 1, kMaxWriterThreads, nullptr,
       "threads reading and CRC-checking a shard in restore, verify and export"},
  };
  return specs;
}

const OptionSpec& EngineOptionSpec(const char* name) {
  for (const OptionSpec& s : EngineOptionSpecs())
    if (std::strcmp(s.name, name) == 0) return s;
  std::fprintf(stderr, "alpsck: no engine option named %s\n", name);
  std::abort();
}

namespace {

std::string Num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}

Status Check(const char* name, double value) {
  const OptionSpec& s = EngineOptionSpec(name);
  if ((value >= s.min && value <= s.max) || (value == 0 && s.zero_means)) return Status::Ok();
  std::string range = Num(s.min) + " and " + Num(s.max);
  if (s.zero_means) range += " (0: " + std::string(s.zero_means) + ")";
  return Status::Invalid(std::string(name) + " is " + Num(value) + ": it must be between " + range);
}

}  // namespace

Status CheckEngineOptions(const EngineOptions& o) {
  ALPSCK_RETURN_IF_ERROR(Check("max_in_flight", o.max_in_flight));
  ALPSCK_RETURN_IF_ERROR(Check("threads", o.threads));
  ALPSCK_RETURN_IF_ERROR(Check("copy_threads", o.copy_threads));
  ALPSCK_RETURN_IF_ERROR(Check("chunk_bytes", static_cast<double>(o.chunk_bytes)));
  ALPSCK_RETURN_IF_ERROR(Check("keep_last", o.keep_last));
  ALPSCK_RETURN_IF_ERROR(Check("keep_every_steps", static_cast<double>(o.keep_every_steps)));
  if (!(o.keep_every_seconds == o.keep_every_seconds)) return Status::Invalid("keep_every_seconds is not a number");
  ALPSCK_RETURN_IF_ERROR(Check("keep_every_seconds", o.keep_every_seconds));
  RetentionPolicy policy;
  ALPSCK_RETURN_IF_ERROR(ParseKeepBest(o.keep_best, &policy));
  ALPSCK_RETURN_IF_ERROR(CheckRetention(RetentionOf(o)));
  ALPSCK_RETURN_IF_ERROR(Check("staging_bytes", static_cast<double>(o.staging_bytes)));
  ALPSCK_RETURN_IF_ERROR(Check("background_nice", o.background_nice));
  ALPSCK_RETURN_IF_ERROR(Check("numa_node", o.numa_node));
  if (!(o.commit_timeout_s == o.commit_timeout_s)) return Status::Invalid("commit_timeout_s is not a number");
  ALPSCK_RETURN_IF_ERROR(Check("commit_timeout_s", o.commit_timeout_s));
  for (int cpu : o.pin_cpus) {
    const OptionSpec& s = EngineOptionSpec("pin_cpus");
    if (cpu < s.min || cpu > s.max)
      return Status::Invalid("pin_cpus holds " + std::to_string(cpu) + ": CPU numbers must be between " + Num(s.min) +
                             " and " + Num(s.max));
  }
  return Status::Ok();
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
