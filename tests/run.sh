#!/usr/bin/env bash
# The whole test suite — the README's test command (through .ci/run) and what CI runs. Five lanes
# run side by side, each into its own log, printed in full at the end with its time and CPU time:
#   cpp     the core's C++ tests (ctest -j) built with -Wall -Wextra -Werror; the same tests under
#           ASan+UBSan (clang, the build that also holds the libFuzzer targets, which then fuzz the
#           parsers a few seconds each: tests/fuzz.sh), under TSan, and cross-built for aarch64 and
#           run under qemu with 64 KiB pages;
#   static  ruff and mypy (niced: throughput work, off the python lane's path);
#   python  pytest's tiers against the installed package: tests/unit (in-process, pytest-xdist),
#           tests/process (one process tree), tests/ranks (several ranks);
#   slurm   pytest's tests/slurm tier on a real one-node SLURM (slurm/local-cluster/start.sh, which
#           installs slurm-wlm and munge when missing) and submitit's local executor: the jobs are
#           paced and mostly wait for signals and requeues, so several tests run at once (-n), each
#           on its own CPUs of the node; a test that changes the whole node runs alone (conftest.py);
#   readme  the README's main command, verbatim, from a fresh clone in a fresh venv, once with no
#           SLURM and once on the local cluster (tests/readme_quickstart.sh).
# Every pytest run checks the durations budget (tests/budget.toml): a test over its tier's ceiling
# fails the run. Arguments are pytest options for every pytest run (-m slow, -k NAME, -x).
# Needs: cmake, ninja, g++, g++-aarch64-linux-gnu, qemu-user-static, clang-14 with
# libclang-rt-14-dev (libFuzzer and the sanitizer runtimes), pytest-xdist (CI installs them; a
# missing tool is an error, never a skip). ALPSCK_SKIP_CPP=1 leaves out the cpp lane (for quick
# local loops); ALPSCK_SKIP_README=1 the readme lane (it clones the committed HEAD).
# ALPSCK_CORE_BUILD=DIR: a build of the core with its tests already made (.ci/run's wheel build, with
# ALPSCK_BUILD_TESTS=ON): the cpp lane runs its ctest instead of building the native tests again.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
ncpu=$(nproc)
section() { printf '\n==== %s (at %s s) ====\n' "$*" "$(( $(date +%s) - t0 ))"; }
require() { command -v "$1" >/dev/null || { echo "tests/run.sh: required tool '$1' is missing (install it; nothing is skipped)" >&2; exit 1; }; }
python3 -c 'import xdist' 2>/dev/null || { echo "tests/run.sh: pytest-xdist is missing (pip install '.[test]')" >&2; exit 1; }
export ALPSCK_BUDGET=1  # the durations budget (tests/budget.toml), checked by every pytest run below
logs=$(mktemp -d)
t0=$(date +%s)

# pytest on one tier, from outside the source tree (so the installed package and its compiled _core
# are what is tested). Exit 5 (a -k/-m selection that leaves none of the tier) is not a failure.
tier() {  # tier NAME [pytest options...]
  local name=$1; shift
  local rc=0
  (cd "$(mktemp -d)" && python3 -m pytest -q "$root/tests/$name" -p no:cacheprovider --durations=10 "$@") || rc=$?
  [ "$rc" = 5 ] && rc=0
  return "$rc"
}

cpp_lane() {
  require cmake; require ninja; require g++; require aarch64-linux-gnu-g++; require qemu-aarch64-static; require clang++-14
  # The lane runs niced (its compiles are throughput work), but its tests have time limits (ctest's 600 s,
  # libFuzzer's per input): they run at normal priority, or a starved test times out (CI: test_crash_states,
  # 51 s of CPU, got 600 s of wall at nice 10 beside the other lanes). As root; elsewhere nice warns and goes on.
  unniced() { nice -n "-$(nice_of cpp)" "$@"; }
  build() {  # build DIR [cmake args...]: not through ccache (no other build has these flags: every compile
    local dir=$1; shift  # would miss, and a miss preprocesses twice)
    env -u CMAKE_CXX_COMPILER_LAUNCHER -u CMAKE_C_COMPILER_LAUNCHER \
      cmake -S . -B "$dir" -G Ninja -DALPSCK_BUILD_TESTS=ON -DALPSCK_BUILD_PYTHON=OFF "$@" >/dev/null
    cmake --build "$dir" -j "$ncpu"
  }
  section "C++ core tests under ASan + UBSan (clang), then the parsers fuzzed (libFuzzer, bounded time)"
  CC=clang-14 CXX=clang++-14 build build/ci-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DALPSCK_SANITIZE=address,undefined \
    -DALPSCK_BUILD_FUZZERS=ON
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    unniced ctest --test-dir build/ci-asan --output-on-failure -j "$ncpu"
  unniced bash tests/fuzz.sh build/ci-asan

  section "C++ core tests under TSan"
  build build/ci-tsan -DCMAKE_BUILD_TYPE=Debug -DALPSCK_SANITIZE=thread
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 unniced ctest --test-dir build/ci-tsan --output-on-failure -j "$ncpu"

  section "C++ core tests cross-built for aarch64, run under qemu with 64 KiB pages"
  build build/ci-arm64 -DCMAKE_TOOLCHAIN_FILE=cpp/cmake/aarch64-linux-gnu.cmake -DALPSCK_TUNE_GRACE=ON
  ALPSCK_EXPECT_TUNING=neoverse-v2 unniced ctest --test-dir build/ci-arm64 --output-on-failure -j "$ncpu"

  # Last: with ALPSCK_CORE_BUILD there is nothing to compile, and by now the other lanes are ending.
  section "C++ core tests (native, -Werror)"
  local native=${ALPSCK_CORE_BUILD:-}
  if [ -z "$native" ]; then
    native=build/ci-native
    build "$native" -DCMAKE_BUILD_TYPE=RelWithDebInfo
  else
    # Built by pip (.ci/run), whose build env (its cmake, nanobind) is gone: ctest only, no rebuild.
    echo "reusing the core build in $native (ALPSCK_CORE_BUILD)"
  fi
  # AUTO tuning: portable on x86-64 (only a native build on a Neoverse-V2 tunes for Grace)
  local expect_tuning=""; [ "$(uname -m)" = x86_64 ] && expect_tuning=portable
  unniced env ${expect_tuning:+ALPSCK_EXPECT_TUNING=$expect_tuning} ctest --test-dir "$native" --output-on-failure -j "$ncpu"
}

static_lane() {
  section "ruff"
  python3 -m ruff check alpsck tests benchmarks
  section "mypy (the sources, with the installed extension's generated stub _core.pyi)"
  local pkg typed
  pkg=$(cd / && python3 -c 'import alpsck, os; print(os.path.dirname(alpsck.__file__))')
  typed=$(mktemp -d)
  cp -r alpsck "$typed/" && cp "$pkg/_core.pyi" "$typed/alpsck/"
  (cd "$typed" && python3 -m mypy --config-file "$root/pyproject.toml" alpsck)
}

python_lane() {
  local rc=0
  section "pytest: tests/unit (in-process, $ncpu workers)"
  tier unit -n "$ncpu" "$@" || rc=1
  section "pytest: tests/process (one process tree, $ncpu workers)"
  tier process -n "$ncpu" "$@" || rc=1
  section "pytest: tests/ranks (several ranks)"
  tier ranks "$@" || rc=1
  return "$rc"
}

slurm_lane() {
  section "pytest: tests/slurm (the local SLURM cluster and submitit's local executor, ${ALPSCK_SLURM_WORKERS:-3} at once)"
  tier slurm -n "${ALPSCK_SLURM_WORKERS:-3}" --dist loadgroup "$@"  # a module's xdist_group on one worker
}

readme_lane() {  # the README's main command, verbatim: no SLURM, then the local SLURM (side by side)
  local pids=() rc=0 mode
  for mode in local slurm; do
    if [ "$mode" = slurm ] && [ "$cluster" != 1 ]; then continue; fi
    # Its clones under build/ (TMPDIR), inside ccache's base dir (.ci/run): their `pip install .` finds the
    # core's objects that the suite's wheel compiled.
    mkdir -p "$root/build/readme"
    TMPDIR="$root/build/readme" bash tests/readme_quickstart.sh "$mode" >"$logs/readme-$mode.log" 2>&1 &
    pids+=("$mode:$!")
  done
  for entry in "${pids[@]}"; do
    mode=${entry%%:*}
    local mrc=0
    wait "${entry#*:}" || mrc=$?
    section "the README's main command, verbatim (fresh clone, fresh venv): $mode (exit $mrc)"
    tail -n 40 "$logs/readme-$mode.log"
    # A failure's last lines again at the log's very end (below): a CI log is read from its tail.
    [ "$mrc" = 0 ] || { rc=1; { echo "---- readme $mode: its log's last lines ----"; tail -n 30 "$logs/readme-$mode.log"; } >>"$logs/readme-failed.txt"; }
  done
  return "$rc"
}

# The lanes that only need throughput run at a lower priority (nice): the jobs of the slurm and
# readme lanes, and the python lane's timing-sensitive tests, get the cores when they need them (a
# job's start-up, a signal handled within its grace time), the compiles take the rest.
nice_of() { case $1 in cpp|static) echo 10;; *) echo 0;; esac; }
lanes=(slurm python static)
[ "${ALPSCK_SKIP_README:-0}" = 1 ] || lanes+=(readme)
[ "${ALPSCK_SKIP_CPP:-0}" = 1 ] || lanes+=(cpp)
declare -A pid
start_lane() {  # start_lane NAME [pytest options...]: NAME_lane in the background, into its log
  local lane=$1; shift
  # The lane in a subshell of its own, outside any `||`: there errexit holds, so its first failing
  # command ends it (a function called as `f || ...` would run on past every failure).
  ( set +e; s=$(date +%s)
    ( set -euo pipefail; renice -n "$(nice_of "$lane")" -p "$BASHPID" >/dev/null; "${lane}_lane" "$@" ); rc=$?
    times >"$logs/$lane.times"  # its second line: the CPU time of every process the lane waited for
    printf '\n---- lane %s: exit %s after %s s, %s ----\n' "$lane" "$rc" "$(( $(date +%s) - s ))" \
      "$(awk 'NR == 2 { print "CPU user " $1 ", system " $2 }' "$logs/$lane.times")"; exit "$rc" ) \
    >"$logs/$lane.log" 2>&1 &
  pid[$lane]=$!
}

cluster=0
cleanup() {
  for lane in "${!pid[@]}"; do kill "${pid[$lane]}" 2>/dev/null || true; done
  if [ "$cluster" = 1 ]; then bash "$root/slurm/local-cluster/stop.sh" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# The local cluster declares more CPUs than the machine has (the test jobs mostly wait), so that the
# slurm tier's tests can each have their jobs running at once.
section "local SLURM cluster"
if ALPSCK_SLURM_CPUS=${ALPSCK_SLURM_CPUS:-12} bash slurm/local-cluster/start.sh; then
  cluster=1
elif [ -n "${CI:-}" ]; then
  echo "tests/run.sh: the local SLURM cluster did not start; its tests cannot run" >&2
  exit 1
else
  echo "tests/run.sh: no local SLURM (start.sh failed): the SLURM tests will skip outside CI" >&2
fi

for lane in "${lanes[@]}"; do start_lane "$lane" "$@"; done
echo "lanes started side by side: ${lanes[*]} (logs: $logs)"

failed=()
for lane in "${lanes[@]}"; do
  rc=0
  wait "${pid[$lane]}" || rc=$?
  printf '\n######## lane %s (finished %s s after the start) ########\n' "$lane" "$(( $(date +%s) - t0 ))"
  cat "$logs/$lane.log"
  [ "$rc" = 0 ] || failed+=("$lane")
done
printf '\ntests/run.sh: %s s in all\n' "$(( $(date +%s) - t0 ))"
if [ ${#failed[@]} -gt 0 ]; then
  # What failed, once more at the very end (where a CI log's tail is read): pytest's FAILED/ERROR lines,
  # the budget's OVER lines, ctest's failed tests, a lane's own error lines and the section they came in.
  for lane in "${failed[@]}"; do
    printf '\n---- what failed in lane %s ----\n' "$lane"
    grep -E '^==== |^(FAILED|ERROR) |OVER BUDGET|^ +[0-9.]+ +[0-9.]+ +[a-z]+ +tests/|tests failed out of|^[ 0-9]+- .*\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)|^(tests/|readme_quickstart|\.ci/)[a-z_./]*( \([a-z]+\))?: ' \
      "$logs/$lane.log" | grep -v -E '^==== .*\(exit 0\)' | cut -c1-400 || true
    if [ "$lane" = readme ] && [ -f "$logs/readme-failed.txt" ]; then cut -c1-400 "$logs/readme-failed.txt"; fi
  done
  echo "tests/run.sh: failed: ${failed[*]} (their logs above)" >&2
  exit 1
fi
