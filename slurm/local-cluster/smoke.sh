#!/usr/bin/env bash
# Self-check of the local cluster (start.sh must have run): verifies, with real jobs, the SLURM
# behaviour alpsck relies on and prints PASS/FAIL per item plus the measured timings.
# Exits 0 when everything passed, 1 on any FAIL, 2 when the cluster is not usable at all.
# Bounded: every wait has a timeout and the whole run stops at ALPSCK_SMOKE_DEADLINE seconds
# (default 230); it normally takes 2.5-3 minutes.
#
#   (a)  sbatch --wrap runs and writes its output
#   (b1) --signal=B:USR2@60 with --time=2: the batch shell's trap sees USR2 before the limit
#   (b2) --signal=USR2@60 (no B:, as submitit does): an srun step's trap sees USR2
#   (c)  scontrol requeue of a running job: it runs again with SLURM_RESTART_COUNT=1
#   (d1) preemption: a debug job is preempted by an --exclusive urgent job; its srun step gets
#        SIGTERM at once, SLURM requeues it when GraceTime ends, it runs again after the
#        urgent job
#   (d2) preemption, self-requeue: the step exits on SIGTERM and the batch script runs
#        `scontrol requeue` itself (a job that merely exits during GraceTime is COMPLETED,
#        not requeued); it runs again after the urgent job
#   (e)  a Flags=MAINT reservation starting in 60 s is visible in `scontrol show reservation`,
#        holds back a job whose time limit overlaps it, and can be deleted
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

DEADLINE=$((SECONDS + ${ALPSCK_SMOKE_DEADLINE:-230}))
WORK="$(mktemp -d /tmp/alpsck-smoke.XXXXXX)"
chmod 0755 "$WORK"
RESV="alpsck_smoke_maint_$$"
JOBS=()
FAILS=0
TIMINGS=()

cleanup() {
    local rc=$?
    if ((${#JOBS[@]})); then
        scancel "${JOBS[@]}" 2>/dev/null || true
    fi
    scontrol delete reservation="$RESV" >/dev/null 2>&1 || true
    if ((FAILS == 0 && rc == 0)); then
        rm -rf "$WORK"
    else
        echo "smoke.sh: job scripts and outputs kept in $WORK" >&2
    fi
}
trap cleanup EXIT

pass() { printf 'PASS %s\n' "$*"; }
fail() { printf 'FAIL %s\n' "$*"; FAILS=$((FAILS + 1)); }
note() { printf '     %s\n' "$*"; }
timing() { TIMINGS+=("$*"); note "timing: $*"; }

now() { date +%s.%N; }
# secs A B: B - A, one decimal.
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# first_ts FILE WORDS: the timestamp (last field) of the first line starting with WORDS.
first_ts() { awk -v p="$2" 'index($0, p) == 1 { print $NF; exit }' "$1" 2>/dev/null || true; }

# wait_for SECS COMMAND...: poll every 0.5 s; false on timeout or when the overall deadline
# passes.
wait_for() {
    local limit=$((SECONDS + $1))
    shift
    ((limit <= DEADLINE)) || limit=$DEADLINE
    until "$@"; do
        ((SECONDS < limit)) || return 1
        sleep 0.5
    done
}

has_line() { grep -q -- "$2" "$1" 2>/dev/null; }
job_gone() { [[ -z "$(squeue -h -j "$1" -o '%i' 2>/dev/null)" ]]; }
job_running() { [[ "$(squeue -h -j "$1" -o '%T' 2>/dev/null)" == RUNNING ]]; }
node_idle() { [[ "$(node_state "$NODE")" == idle ]]; }

# submit ARGS...: sbatch --parsable, remembering the job for cleanup.
submit() {
    local id
    id="$(sbatch --parsable "$@")" || return 1
    id="${id%%;*}"
    JOBS+=("$id")
    printf '%s\n' "$id"
}

out_of_time() { ((SECONDS >= DEADLINE)); }

# ------------------------------------------------------------------------------ preconditions
NODE="$(cat "$NODE_NAME_FILE" 2>/dev/null || node_name)"
if ! ctld_up; then
    echo "FAIL cluster: slurmctld does not answer; run start.sh first"
    exit 2
fi
st="$(node_state "$NODE")"
if [[ "$st" != idle && "$st" != mix && "$st" != alloc && "$st" != comp ]]; then
    echo "FAIL cluster: node $NODE is '${st:-unknown}'; run start.sh first"
    exit 2
fi
queued="$(squeue -h -o '%i' | wc -l)"
if ((queued > 0)); then
    echo "FAIL cluster: $queued job(s) already queued; smoke.sh needs an idle cluster"
    exit 2
fi
if [[ -n "$(scontrol show reservation -o 2>/dev/null | grep '^ReservationName=' || true)" ]]; then
    echo "FAIL cluster: a reservation exists; smoke.sh needs a cluster without reservations"
    exit 2
fi
CPUS="$(sinfo -h -n "$NODE" -o '%c' | head -n 1)"
echo "smoke.sh: node $NODE, $CPUS CPUs, work dir $WORK"

# Job script pieces. Every marker line ends with an epoch timestamp.
cat >"$WORK/signal_batch.sh" <<'EOF'
#!/bin/bash
echo "start $(date +%s.%N)"
got=0
trap 'echo "batch USR2 $(date +%s.%N)"; got=1' USR2
end=$((SECONDS + 170))
while ((got == 0 && SECONDS < end)); do sleep 0.2; done
echo "exit $(date +%s.%N)"
EOF
cat >"$WORK/signal_step.sh" <<'EOF'
#!/bin/bash
echo "start $(date +%s.%N)"
srun --ntasks=1 bash -c 'got=0
trap "echo step USR2 \$(date +%s.%N); got=1" USR2
end=$((SECONDS + 170))
while ((got == 0 && SECONDS < end)); do sleep 0.2; done'
echo "exit $(date +%s.%N)"
EOF
cat >"$WORK/requeue.sh" <<'EOF'
#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0} $(date +%s.%N)"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then exit 0; fi
for ((i = 0; i < 1500; i++)); do sleep 0.2; done
EOF
# Preempted job, SLURM requeues it: the step notes SIGTERM and keeps running; the batch shell
# is signalled only when GraceTime is over (SLURM has requeued the job by then).
cat >"$WORK/preempt_slurm.sh" <<'EOF'
#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0} $(date +%s.%N)"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then exit 0; fi
trap 'echo "batch TERM $(date +%s.%N)"; exit 143' TERM
srun --ntasks=1 bash -c 'trap "echo step TERM \$(date +%s.%N)" TERM
echo "step start $(date +%s.%N)"
for ((i = 0; i < 1500; i++)); do sleep 0.2; done' &
wait
EOF
# Preempted job that requeues itself: the step exits on SIGTERM, the batch script requeues.
cat >"$WORK/preempt_self.sh" <<'EOF'
#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0} $(date +%s.%N)"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then exit 0; fi
srun --ntasks=1 bash -c 'trap "echo step TERM \$(date +%s.%N); exit 0" TERM
echo "step start $(date +%s.%N)"
for ((i = 0; i < 1500; i++)); do sleep 0.2; done'
echo "requeue self $(date +%s.%N)"
scontrol requeue "$SLURM_JOB_ID"
sleep 60
echo "still here after requeue $(date +%s.%N)"
EOF
# shellcheck disable=SC2016 # expanded by the job's shell
URGENT_CMD='echo "urgent start $(date +%s.%N)"; sleep 3; echo "urgent end $(date +%s.%N)"'

# ----------------------------------------------------------- (b1, b2) time-limit signals
# Started first because they take longest; 1 CPU each.
b1="$(submit -J smoke-b1 -c 1 --time=2 --signal=B:USR2@60 -o "$WORK/b1.out" "$WORK/signal_batch.sh")"
b2="$(submit -J smoke-b2 -c 1 --time=2 --signal=USR2@60 -o "$WORK/b2.out" "$WORK/signal_step.sh")"
wait_for 110 job_gone "$b1" || true
wait_for 10 job_gone "$b2" || true
for t in b1 b2; do
    f="$WORK/$t.out"
    if [[ "$t" == b1 ]]; then what="batch USR2"; label="(b1) --signal=B:USR2@60: batch trap"; else
        what="step USR2"; label="(b2) --signal=USR2@60: srun step trap"; fi
    t_start="$(first_ts "$f" start)"
    t_sig="$(first_ts "$f" "$what")"
    if [[ -n "$t_sig" && -n "$t_start" ]] && has_line "$f" '^exit ' && ! has_line "$f" 'DUE TO TIME LIMIT'; then
        pass "$label got USR2 $(secs "$t_start" "$t_sig") s after start (limit 120 s)"
        timing "$t: USR2@60 arrived $(secs "$t_start" "$t_sig") s after start"
    else
        fail "$label: no USR2 before the time limit (output: $(tr '\n' '|' <"$f" 2>/dev/null))"
    fi
done

# ------------------------------------------------------------------------ (a) sbatch --wrap
wait_for 30 node_idle || true
# shellcheck disable=SC2016 # expanded by the job's shell
a="$(submit -J smoke-a -c 1 -o "$WORK/a.out" --wrap 'echo "hello from job $SLURM_JOB_ID on $(hostname)"')"

# --------------------------------------------------------------------- (c) scontrol requeue
c="$(submit -J smoke-c -c 1 --open-mode=append -o "$WORK/c.out" "$WORK/requeue.sh")"

if wait_for 30 job_gone "$a" && has_line "$WORK/a.out" "hello from job $a"; then
    pass "(a) sbatch --wrap ran and wrote its output"
else
    fail "(a) sbatch --wrap: no output (state $(squeue -h -j "$a" -o '%T %r' 2>/dev/null))"
fi

if wait_for 30 has_line "$WORK/c.out" '^start restart=0'; then
    sleep 1
    t_rq="$(now)"
    scontrol requeue "$c" || true
    if wait_for 60 has_line "$WORK/c.out" '^start restart=1'; then
        t_again="$(first_ts "$WORK/c.out" 'start restart=1')"
        pass "(c) scontrol requeue: job ran again with SLURM_RESTART_COUNT=1 ($(grep -c '^start' "$WORK/c.out") starts in the appended log)"
        timing "requeue -> running again: $(secs "$t_rq" "$t_again") s"
    else
        fail "(c) scontrol requeue: no second start within 60 s (state $(squeue -h -j "$c" -o '%T %r' 2>/dev/null))"
    fi
else
    fail "(c) scontrol requeue: job did not start"
fi
wait_for 20 job_gone "$c" || true

# ---------------------------------------------- (d1) preemption, SLURM requeues after grace
wait_for 30 node_idle || true
grace="$(scontrol show partition debug | sed -n 's/.*GraceTime=\([0-9]*\).*/\1/p')"
d1="$(submit -J smoke-d1 -p debug -c 1 --open-mode=append -o "$WORK/d1.out" "$WORK/preempt_slurm.sh")"
if wait_for 30 has_line "$WORK/d1.out" '^step start'; then
    t_sub="$(now)"
    u1="$(submit -J smoke-u1 -p urgent --exclusive -o "$WORK/u1.out" --wrap "$URGENT_CMD")"
    wait_for $((grace + 90)) has_line "$WORK/d1.out" '^start restart=1' || true
    f="$WORK/d1.out"
    t_step="$(first_ts "$f" 'step TERM')"
    t_batch="$(first_ts "$f" 'batch TERM')"
    t_again="$(first_ts "$f" 'start restart=1')"
    t_ustart="$(first_ts "$WORK/u1.out" 'urgent start')"
    t_uend="$(first_ts "$WORK/u1.out" 'urgent end')"
    if [[ -n "$t_step" && -n "$t_again" && -n "$t_uend" ]] \
        && awk -v a="$t_again" -v b="$t_uend" 'BEGIN { exit !(a >= b) }'; then
        pass "(d1) preempted by urgent: step SIGTERM, requeued by SLURM after GraceTime=${grace}s, ran again after the urgent job"
        timing "d1: urgent submitted -> step SIGTERM $(secs "$t_sub" "$t_step") s"
        [[ -n "$t_batch" ]] && timing "d1: urgent submitted -> batch-shell SIGTERM (grace over) $(secs "$t_sub" "$t_batch") s"
        timing "d1: urgent submitted -> urgent running $(secs "$t_sub" "$t_ustart") s"
        timing "d1: urgent end -> preempted job running again $(secs "$t_uend" "$t_again") s"
    else
        fail "(d1) preemption: step TERM='${t_step}' restart='${t_again}' urgent end='${t_uend}' (d1: $(tr '\n' '|' <"$f"))"
    fi
    wait_for 20 job_gone "$d1" || true
    wait_for 10 job_gone "$u1" || true
else
    fail "(d1) preemption: debug job did not start its step"
fi

# ------------------------------------------------- (d2) preemption, the job requeues itself
wait_for 30 node_idle || true
d2="$(submit -J smoke-d2 -p debug -c 1 --open-mode=append -o "$WORK/d2.out" "$WORK/preempt_self.sh")"
if wait_for 30 has_line "$WORK/d2.out" '^step start'; then
    t_sub="$(now)"
    u2="$(submit -J smoke-u2 -p urgent --exclusive -o "$WORK/u2.out" --wrap "$URGENT_CMD")"
    wait_for 60 has_line "$WORK/d2.out" '^start restart=1' || true
    f="$WORK/d2.out"
    t_step="$(first_ts "$f" 'step TERM')"
    t_again="$(first_ts "$f" 'start restart=1')"
    t_ustart="$(first_ts "$WORK/u2.out" 'urgent start')"
    t_uend="$(first_ts "$WORK/u2.out" 'urgent end')"
    if [[ -n "$t_step" && -n "$t_again" && -n "$t_uend" ]] && ! has_line "$f" '^still here' \
        && awk -v a="$t_again" -v b="$t_uend" 'BEGIN { exit !(a >= b) }'; then
        pass "(d2) preempted, step exited on SIGTERM, batch script requeued itself, ran again after the urgent job"
        timing "d2: urgent submitted -> step SIGTERM $(secs "$t_sub" "$t_step") s"
        timing "d2: urgent submitted -> urgent running $(secs "$t_sub" "$t_ustart") s"
        timing "d2: urgent end -> preempted job running again $(secs "$t_uend" "$t_again") s"
    else
        fail "(d2) self-requeue on preemption: step TERM='${t_step}' restart='${t_again}' urgent end='${t_uend}' (d2: $(tr '\n' '|' <"$f"))"
    fi
    wait_for 20 job_gone "$d2" || true
    wait_for 10 job_gone "$u2" || true
else
    fail "(d2) preemption: debug job did not start its step"
fi

# ------------------------------------------------------------- (e) maintenance reservation
if scontrol create reservation reservationname="$RESV" flags=maint starttime=now+60 \
    duration=5 nodes=ALL users=root >/dev/null; then
    shown="$(scontrol show reservation "$RESV" 2>/dev/null || true)"
    if grep -q 'Flags=.*MAINT' <<<"$shown"; then
        pass "(e) MAINT reservation created and visible in scontrol show reservation"
    else
        fail "(e) reservation $RESV created but not shown with Flags=MAINT: $shown"
    fi
    e="$(submit -J smoke-e -c 1 --time=5 -o /dev/null --wrap 'true')"
    reason_is_maint() { squeue -h -j "$e" -o '%r' 2>/dev/null | grep -qi 'maint'; }
    if wait_for 20 reason_is_maint; then
        pass "(e) a --time=5 job waits for the reservation (reason: $(squeue -h -j "$e" -o '%r'))"
    else
        fail "(e) a --time=5 job is not held back by the reservation (state: $(squeue -h -j "$e" -o '%T %r' 2>/dev/null))"
    fi
    scancel "$e" 2>/dev/null || true
    if scontrol delete reservation="$RESV" && ! scontrol show reservation 2>/dev/null | grep -q "$RESV"; then
        pass "(e) reservation deleted"
    else
        fail "(e) reservation $RESV could not be deleted"
    fi
else
    fail "(e) scontrol create reservation flags=maint failed"
fi

if out_of_time; then fail "overall deadline reached; later checks may have been cut short"; fi
if ((${#TIMINGS[@]})); then
    echo "timings:"
    printf '  %s\n' "${TIMINGS[@]}"
fi
echo "smoke.sh: $FAILS failure(s), ${SECONDS}s"
((FAILS == 0))
