#!/usr/bin/env bash
# The README's main command, as a new user runs it: taken from the README's "Set-up" section (the
# first ```bash block under that heading, never a copy), pasted into a shell from the root of a
# fresh clone of this repository, in a fresh venv. Then checked: the quickstart ended `finished`
# after at least 2 requeues, within 15 minutes of its submission, with one loss for every step.
#
#   tests/readme_quickstart.sh local   # no SLURM: submitit's local executor (the embedded default)
#   tests/readme_quickstart.sh slurm   # the local one-node SLURM (slurm/local-cluster/start.sh first)
#
# "local" runs on a machine without SLURM: in a private mount namespace (unshare -m, as root) where
# SLURM's commands are covered by /dev/null, which is not executable, so they are not on the PATH (a
# machine with SLURM installed but its controller down must not run the job locally: `alpsck submit`
# refuses there). The clone is of the committed HEAD: uncommitted changes are not in it.
set -euo pipefail
mode=${1:?usage: tests/readme_quickstart.sh local|slurm}
if [ "$mode" = local ] && [ -z "${ALPSCK_NO_SLURM_NS:-}" ]; then
  command -v unshare >/dev/null || { echo "readme_quickstart: unshare (util-linux) is missing" >&2; exit 1; }
  exec env ALPSCK_NO_SLURM_NS=1 unshare -m --propagation private bash "$0" "$@"
fi
root=$(cd "$(dirname "$0")/.." && pwd)
# 15 minutes from submission to finished: alone the quickstart takes 5-8; in CI, beside the other lanes on 2
# cores, a step took up to 0.6 s instead of 0.12 and the run needed 12 starts (about 690 s, stop 61's CI).
limit_s=900

cmd=$(awk '/^## Set-up/ {inside=1; next} inside && /^## / {exit} inside && /^```bash$/ {grab=1; next}
           grab && /^```$/ {exit} grab {print}' "$root/README.md")
[ -n "$cmd" ] || { echo "readme_quickstart: no \`\`\`bash block under '## Set-up' in README.md" >&2; exit 1; }
echo "README main command: $cmd"

work=$(mktemp -d "${TMPDIR:-/tmp}/alpsck-readme-$mode.XXXXXX")
git clone -q "$root" "$work/clone"
python3 -m venv "$work/venv"
if [ "$mode" = local ]; then
  IFS=: read -r -a path_dirs <<<"$PATH"
  for tool in sinfo sbatch srun squeue scontrol scancel sacct salloc; do
    for dir in "${path_dirs[@]}"; do
      if [ -f "$dir/$tool" ] && [ -x "$dir/$tool" ]; then mount --bind /dev/null "$dir/$tool"; fi
    done
  done
  if python3 -c 'import shutil, sys; sys.exit(shutil.which("sbatch") is None)'; then
    echo "readme_quickstart: could not hide sbatch" >&2; exit 1
  fi
elif [ "$mode" != slurm ]; then
  echo "readme_quickstart: mode must be local or slurm, not '$mode'" >&2; exit 2
fi

cd "$work/clone"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
unset PYTHONPATH
if [ "$mode" = slurm ]; then
  # The job shares the local cluster with the slurm tier's tests, which take turns through a lock
  # (tests/slurm/conftest.py): a test that changes the whole node (a preempting --exclusive job, a
  # maintenance reservation) holds it alone. The quickstart's job holds it shared from its submission
  # to this script's end (fd 9 stays open here), so such a test neither preempts it nor keeps its
  # requeue pending behind a reservation: `alpsck`, as the command calls it, takes the lock first.
  exec 9>>"${ALPSCK_CLUSTER_LOCK:-/tmp/alpsck-cluster-tests.lock}"
  alpsck() { flock -s 9 && command alpsck "$@"; }
  export -f alpsck
fi
set +e
# A hang guard only (the check below holds the run to limit_s from its submission): the install before it
# compiles at nice 10 beside CI's other lanes and once took 23 minutes.
timeout $((limit_s + 1800)) bash -c "$cmd" 2>&1 | grep --line-buffered -v "^WARNING: Location" | tee "$work/out.log"
rc=${PIPESTATUS[0]}
set -e
run=runs/quickstart
[ "$rc" = 0 ] || { echo "readme_quickstart ($mode): the README's command exited $rc" >&2; exit 1; }

if [ "$mode" = slurm ]; then  # sbatch returned: wait for the job as a user would, with alpsck status
  start=$(date +%s)  # from the submission (the install before it took 21 min once, beside CI's other lanes)
  while :; do
    state=$(alpsck status "$run" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
    case "$state" in finished|failed|cancelled|gave_up) break;; esac
    [ $(( $(date +%s) - start )) -lt $((limit_s + 600)) ] || break
    sleep 5
  done
fi

alpsck status "$run" --events 1000000  # the whole timeline: a failure below is read from it
python3 - "$run" "$limit_s" "$mode" <<'EOF'
import json, subprocess, sys, yaml
run, limit, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
# Every event (--events): the default shows the newest 50, and a run of 12 starts has more (stop 61's CI:
# its "submitted" event was not among them).
doc = json.loads(subprocess.run(["alpsck", "status", run, "--json", "--events", "1000000"],
                                capture_output=True, text=True, check=True).stdout)
args = yaml.safe_load(open("slurm/examples/quickstart.yaml"))["entry"]["args"]
steps = int(args[args.index("--training-steps") + 1])
ev = doc["events"]
submitted = [e["time"] for e in ev if e["event"] == "submitted"]
if not submitted or doc["earlier_events"]:
    sys.exit(f"readme_quickstart ({mode}): the timeline has no 'submitted' event ({len(ev)} shown, "
             f"{doc['earlier_events']} not shown)")
submitted = submitted[-1]
ended = [e["time"] for e in ev if e["event"] == "finished"]
rows = [line.split(",")[0] for line in open(f"{run}/loss.csv").read().split("\n")[1:] if line]
problems = []
if doc["state"] != "finished":
    problems.append(f"state {doc['state']}, not finished")
if doc["requeues"] < 2:
    problems.append(f"{doc['requeues']} requeues, fewer than 2")
if sorted(map(int, rows)) != list(range(1, steps + 1)):
    problems.append(f"loss.csv holds {len(rows)} rows, not one for each of steps 1..{steps}")
took = (ended[-1] - submitted) if ended else float("inf")
if took > limit:
    problems.append(f"took {took:.0f} s from submission to finished, over {limit:.0f} s")
if problems:
    sys.exit(f"readme_quickstart ({mode}): " + "; ".join(problems))
print(f"readme_quickstart ({mode}): README main command verbatim: finished after {doc['requeues']} requeues, "
      f"{doc['starts']} starts, {len(rows)} losses, {took:.0f} s from submission to finished")
EOF
rm -rf "$work"
