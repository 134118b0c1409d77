#!/usr/bin/env bash
# The whole test suite — the README's test command and what CI runs:
#   1. the core's C++ tests (ctest), built with -Wall -Wextra -Werror;
#   2. the same tests under ASan+UBSan and under TSan;
#   3. the same tests cross-built for aarch64 and run under qemu with 64 KiB pages;
#      then the parsers (footer, index, manifest, shard, DONE record, JSON) fuzzed with libFuzzer, a few
#      seconds each (tests/fuzz.sh);
#   4. ruff, mypy, then pytest against the installed package, with a real one-node SLURM
#      (slurm/local-cluster/start.sh, which installs slurm-wlm and munge when missing). The tests
#      that run jobs start first, in the background, and overlap steps 1-3 (see below).
# Arguments are pytest options for both pytest runs (-m slow, -k NAME, -x).
# Needs: cmake, ninja, g++, g++-aarch64-linux-gnu, qemu-user-static, clang-14 with
# libclang-rt-14-dev (libFuzzer and the sanitizer runtimes) (CI installs them; a missing
# tool is an error, never a skip). ALPSCK_SKIP_CPP=1 runs only step 4 (for quick local loops);
# ALPSCK_SKIP_README=1 leaves out the verbatim README runs (5.), which clone the committed HEAD.
#   5. the README's main command, verbatim, from a fresh clone in a fresh venv, once with no SLURM and
#      once on the local cluster (tests/readme_quickstart.sh), alongside everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
section() { printf '\n==== %s ====\n' "$*"; }
require() { command -v "$1" >/dev/null || { echo "tests/run.sh: required tool '$1' is missing (install it; nothing is skipped)" >&2; exit 1; }; }

# The tests that run jobs (on the local SLURM cluster, and through submitit's local executor) spend
# most of their ~10 minutes waiting for signals and requeues, with paced, light jobs: they run in
# the background while the C++ sections build and test, and the rest of pytest (CPU-bound, some of
# it timing-sensitive) starts once they are done. Both run against the installed package, from
# outside the source tree (so its compiled _core is what is tested).
root=$(pwd)
job_tests=("$root/tests/test_slurm_cluster.py" "$root/tests/test_slurm_local.py" "$root/tests/test_slurm_front_door.py")
section "local SLURM cluster"
if bash slurm/local-cluster/start.sh; then
  cluster=1
elif [ -n "${CI:-}" ]; then
  echo "tests/run.sh: the local SLURM cluster did not start; its tests cannot run" >&2
  exit 1
else
  cluster=0
  echo "tests/run.sh: no local SLURM (start.sh failed): the SLURM tests will skip outside CI" >&2
fi
jobs_dir=$(mktemp -d)
# The README's main command, verbatim, in a fresh clone and a fresh venv: with no SLURM and on the
# local cluster (tests/readme_quickstart.sh). Light, paced jobs: they run alongside everything.
readme_pids=()
if [ "${ALPSCK_SKIP_README:-0}" != 1 ]; then
  for mode in local slurm; do
    if [ "$mode" = slurm ] && [ "$cluster" != 1 ]; then continue; fi
    bash tests/readme_quickstart.sh "$mode" >"$jobs_dir/readme-$mode.log" 2>&1 &
    readme_pids+=("$mode:$!")
  done
fi
cd "$jobs_dir"
python3 -m pytest -q "${job_tests[@]}" -p no:cacheprovider --basetemp="$jobs_dir/tmp" --durations=10 "$@" \
  >"$jobs_dir/log" 2>&1 &
jobs_pid=$!
cd "$root"
cleanup() {
  kill "$jobs_pid" 2>/dev/null || true
  for entry in "${readme_pids[@]}"; do kill "${entry#*:}" 2>/dev/null || true; done
  if [ "$cluster" = 1 ]; then bash "$root/slurm/local-cluster/stop.sh" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
echo "pytest of the job tests started in the background (log: $jobs_dir/log)"

if [ "${ALPSCK_SKIP_CPP:-0}" != 1 ]; then
  require cmake; require ninja; require g++; require aarch64-linux-gnu-g++; require qemu-aarch64-static; require clang++-14
  build() {  # build DIR [cmake args...]
    local dir=$1; shift
    cmake -S . -B "$dir" -G Ninja -DALPSCK_BUILD_TESTS=ON -DALPSCK_BUILD_PYTHON=OFF "$@" >/dev/null
    cmake --build "$dir" -j "$jobs"
  }
  section "C++ core tests (native, -Werror)"
  build build/ci-native -DCMAKE_BUILD_TYPE=RelWithDebInfo
  # AUTO tuning: portable on x86-64 (only a native build on a Neoverse-V2 tunes for Grace)
  expect_tuning=""; [ "$(uname -m)" = x86_64 ] && expect_tuning=portable
  env ${expect_tuning:+ALPSCK_EXPECT_TUNING=$expect_tuning} ctest --test-dir build/ci-native --output-on-failure -j 2

  section "C++ core tests under ASan + UBSan"
  build build/ci-asan -DCMAKE_BUILD_TYPE=Debug -DALPSCK_SANITIZE=address,undefined
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir build/ci-asan --output-on-failure

  section "C++ core tests under TSan"
  build build/ci-tsan -DCMAKE_BUILD_TYPE=Debug -DALPSCK_SANITIZE=thread
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --test-dir build/ci-tsan --output-on-failure

  section "C++ core tests cross-built for aarch64, run under qemu with 64 KiB pages"
  build build/ci-arm64 -DCMAKE_TOOLCHAIN_FILE=cpp/cmake/aarch64-linux-gnu.cmake -DALPSCK_TUNE_GRACE=ON
  ALPSCK_EXPECT_TUNING=neoverse-v2 ctest --test-dir build/ci-arm64 --output-on-failure

  section "fuzzing the parsers (libFuzzer + ASan/UBSan, bounded time)"
  CC=clang-14 CXX=clang++-14 cmake -S . -B build/ci-fuzz -G Ninja -DALPSCK_BUILD_FUZZERS=ON -DALPSCK_BUILD_PYTHON=OFF \
    -DALPSCK_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DALPSCK_SANITIZE=address,undefined >/dev/null
  cmake --build build/ci-fuzz -j "$jobs"
  bash tests/fuzz.sh build/ci-fuzz
fi

section "ruff"
python3 -m ruff check alpsck tests benchmarks

section "mypy (the sources, with the installed extension's generated stub _core.pyi)"
pkg=$(cd / && python3 -c 'import alpsck, os; print(os.path.dirname(alpsck.__file__))')
typed=$(mktemp -d)
cp -r alpsck "$typed/" && cp "$pkg/_core.pyi" "$typed/alpsck/"
repo=$(pwd)
(cd "$typed" && python3 -m mypy --config-file "$repo/pyproject.toml" alpsck)

section "pytest: the job tests (SLURM cluster, local executor), run alongside the sections above"
jobs_rc=0
wait "$jobs_pid" || jobs_rc=$?
cat "$jobs_dir/log"
[ "$jobs_rc" = 5 ] && jobs_rc=0  # 5: a selection (-k, -m) that leaves none of them to run

section "pytest: the rest"
rest_rc=0
(cd "$(mktemp -d)" && python3 -m pytest -q "$root/tests" "${job_tests[@]/#/--ignore=}" -p no:cacheprovider \
   --durations=10 "$@") || rest_rc=$?
[ "$rest_rc" = 5 ] && rest_rc=0
section "the README's main command, verbatim (fresh clone, fresh venv): no SLURM, then the local SLURM"
readme_failed=()
for entry in "${readme_pids[@]}"; do
  mode=${entry%%:*}
  rc=0
  wait "${entry#*:}" || rc=$?
  echo "---- $mode ----"
  tail -n 40 "$jobs_dir/readme-$mode.log"
  [ "$rc" = 0 ] || readme_failed+=("$mode")
done
if [ "$jobs_rc" != 0 ] || [ "$rest_rc" != 0 ] || [ ${#readme_failed[@]} -gt 0 ]; then
  echo "tests/run.sh: failed (pytest job tests: exit $jobs_rc, the rest: exit $rest_rc;" \
       "README main command: ${readme_failed[*]:-ok})" >&2
  exit 1
fi
