#!/usr/bin/env bash
# Runs every libFuzzer target of the parsers for a bounded time (tests/run.sh calls this):
#   tests/fuzz.sh BUILD_DIR [SECONDS_PER_TARGET]     (default 3 s, or $ALPSCK_FUZZ_SECONDS)
# BUILD_DIR is a build with -DALPSCK_BUILD_FUZZERS=ON (clang, ASan+UBSan). Seeds are written
# fresh from real checkpoints by fuzz_seeds; any crash, sanitizer report, leak, timeout (10 s
# per input) or memory blow-up (2 GiB) fails, with the log tail and the input that did it.
set -euo pipefail
build=${1:?usage: tests/fuzz.sh BUILD_DIR [SECONDS]}
secs=${2:-${ALPSCK_FUZZ_SECONDS:-3}}
corpus=$build/fuzz-corpus
rm -rf "$corpus" "$build"/fuzz-crash-* && mkdir -p "$corpus"
# Scratch files on a tmpfs where there is one: on a disk, verification's O_DIRECT reads would
# flush every freshly written input to the device first.
scratch=$(mktemp -d -p "$([ -w /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}")")
trap 'rm -rf "$scratch"' EXIT
export ALPSCK_FUZZ_TMP=$scratch
"$build/fuzz_seeds" "$corpus" >/dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
for t in json footer index shard manifest record; do
  log=$build/fuzz-$t.log
  if ! "$build/fuzz_$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$build/fuzz-crash-$t-" "$corpus/$t" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "tests/fuzz.sh: fuzz_$t failed; the input is $(ls "$build"/fuzz-crash-"$t"-* 2>/dev/null | head -1)" >&2
    exit 1
  fi
  printf 'fuzz_%-9s %s\n' "$t" "$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$') inputs, no failure"
done
