#!/usr/bin/env bash
# Start a real one-node SLURM cluster on this machine: munged, slurmctld and slurmd, as root.
#
# Idempotent: when the cluster is already up and healthy with the same configuration it only
# says so; a missing or dead daemon is (re)started; a changed slurm.conf restarts slurmctld and
# slurmd. Installs slurm-wlm and munge with apt-get when they are missing. See README.md.
#
# Environment:
#   ALPSCK_SLURM_STATE  state directory (default /var/lib/alpsck-slurm): spool, state, logs, pids
#   ALPSCK_SLURM_CPUS   CPUs to declare for the node (default: the machine's count, at least 2)
#   ALPSCK_SLURM_GRACE  GraceTime of the 'debug' partition, seconds (default 30)
#   ALPSCK_SLURM_TIMEOUT  seconds to wait for the node to become idle (default 60)
#
#   start.sh --nodes N   (N >= 2) a multi-node cluster instead, beside the one-node one: slurmctld and N
#                        slurmd, each in its own network, UTS and mount namespaces (start_nodes.sh); its
#                        commands need SLURM_CONF=/var/lib/alpsck-slurm-nodes/etc/slurm.conf.
#   ALPSCK_SLURM_NODE_SHM  the size of each node's own /dev/shm with --nodes (default 2g)
set -euo pipefail

NODES=1
while (($#)); do
    case "$1" in
        --nodes) [[ "${2:-}" =~ ^[1-9][0-9]?$ ]] || { echo "start.sh: --nodes takes a count from 1 to 99" >&2; exit 2; }
                 NODES=$2; shift 2 ;;
        *) echo "start.sh: unknown argument '$1' (usage: start.sh [--nodes N])" >&2; exit 2 ;;
    esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

WAIT_TIMEOUT="${ALPSCK_SLURM_TIMEOUT:-60}"
GRACE="${ALPSCK_SLURM_GRACE:-30}"

log() { printf 'start.sh: %s\n' "$*" >&2; }

show_logs() {
    local f
    for f in "$SLURMCTLD_LOG" "$STATE_DIR/log/slurmctld.stderr" \
             "$SLURMD_LOG" "$STATE_DIR/log/slurmd.stderr" "$MUNGED_LOG"; do
        if [[ -s "$f" ]]; then
            printf -- '----- tail of %s -----\n' "$f" >&2
            tail -n 25 "$f" >&2 || true
        fi
    done
}

die() {
    printf 'start.sh: ERROR: %s\n' "$*" >&2
    show_logs
    exit 1
}

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.5 s until it succeeds.
wait_for() {
    local secs="$1" what="$2" deadline
    shift 2
    deadline=$((SECONDS + secs))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            die "timed out after ${secs}s waiting for $what"
        fi
        sleep 0.5
    done
}

[[ "$(id -u)" -eq 0 ]] || { echo "start.sh: must run as root (as another user: sudo $0)" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# 1. Packages.
install_packages() {
    local missing=0 cmd
    for cmd in slurmctld slurmd sinfo sbatch scontrol munged munge unmunge; do
        command -v "$cmd" >/dev/null 2>&1 || missing=1
    done
    ((missing)) || return 0
    log "installing slurm-wlm and munge with apt-get"
    command -v apt-get >/dev/null 2>&1 || die "slurm/munge missing and no apt-get to install them"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2 || die "apt-get update failed"
    # policy-rc.d-less machines may try to start the packaged services; that is harmless:
    # we stop packaged slurm daemons below and reuse a working munged.
    apt-get install -y -q -o Dpkg::Options::=--force-confold slurm-wlm munge >&2 \
        || die "apt-get install slurm-wlm munge failed"
    for cmd in slurmctld slurmd sinfo sbatch scontrol munged munge unmunge; do
        command -v "$cmd" >/dev/null 2>&1 || die "$cmd still missing after apt-get install"
    done
}
install_packages

mkdir -p "$STATE_DIR"/{ctld,spool,log,run}
chmod 0755 "$STATE_DIR"
# One start.sh at a time.
exec 9>"$STATE_DIR/run/start.lock"
flock -w 120 9 || die "another start.sh holds $STATE_DIR/run/start.lock"

# If systemd runs this machine, the packaged units may hold the slurm ports; stop them.
if systemd_is_init; then
    for unit in slurmctld slurmd; do
        if systemctl is-active --quiet "$unit" 2>/dev/null; then
            log "stopping systemd unit $unit (this cluster runs its own daemons)"
            systemctl stop "$unit" || true
        fi
    done
fi

# ---------------------------------------------------------------------------------------------
# 2. munge.
MUNGE_USER=munge
id -u munge >/dev/null 2>&1 || MUNGE_USER=root

start_munged() {
    install -d -m 0700 -o "$MUNGE_USER" -g "$MUNGE_USER" /etc/munge /var/log/munge
    install -d -m 0711 -o "$MUNGE_USER" -g "$MUNGE_USER" /var/lib/munge
    install -d -m 0755 -o "$MUNGE_USER" -g "$MUNGE_USER" /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --force --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    chown "$MUNGE_USER:$MUNGE_USER" /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    if pid_alive "$MUNGED_PID" munged; then
        # A munged that does not answer (wrong key, stale socket): replace it.
        log "munged (pid $(cat "$MUNGED_PID")) does not answer; restarting it"
        kill "$(cat "$MUNGED_PID")" || true
        sleep 1
    fi
    log "starting munged as $MUNGE_USER"
    if [[ "$MUNGE_USER" == munge ]]; then
        runuser -u munge -- munged 9>&- || die "munged failed to start"
    else
        # munged refuses root unless forced.
        munged --force 9>&- || die "munged failed to start"
    fi
    touch "$MUNGED_OURS"
    wait_for 15 "munged to answer" munge_works
}

if munge_works; then
    log "munge: already working"
else
    start_munged
fi

if ((NODES > 1)); then
    # shellcheck source=start_nodes.sh
    source "$HERE/start_nodes.sh"
    exit 0
fi

# A slurmctld/slurmd not started by us (another state dir, an init script) holds the ports;
# check before touching slurm.conf.
for d in slurmctld slurmd; do
    pf="$SLURMCTLD_PID"
    [[ "$d" == slurmd ]] && pf="$SLURMD_PID"
    if ! pid_alive "$pf" "$d"; then
        other="$(pids_named "$d")"
        [[ -z "$other" ]] || die "a $d not started by this script runs (pid $(echo "$other" | tr '\n' ' ')); stop it first"
    fi
done

# ---------------------------------------------------------------------------------------------
# 3. slurm.conf.
SHORT="$(short_hostname)"
NODE="$(node_name)"
# slurmctld decides it is the controller by comparing SlurmctldHost with its short host name;
# "localhost" is slurm's alias for that name, so use it when the name is unusable.
CTL_HOST="$SHORT"
[[ "$CTL_HOST" =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]] || CTL_HOST=localhost

hw="$(slurmd -C 2>/dev/null | head -n 1 || true)"
hw_cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
hw_mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
[[ -n "$hw_cpus" ]] || hw_cpus="$(nproc)"
[[ -n "$hw_mem" ]] || hw_mem="$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)"
CPUS="${ALPSCK_SLURM_CPUS:-$hw_cpus}"
# Two 1-CPU test jobs must be able to run side by side; without task binding (task/none) a
# declared CPU is only a scheduling token, so a 1-CPU machine declares 2.
if [[ -z "${ALPSCK_SLURM_CPUS:-}" ]] && ((CPUS < 2)); then CPUS=2; fi
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "bad CPU count: '$CPUS'"
# Leave headroom so a slightly smaller reading at registration never invalidates the node.
[[ "$GRACE" =~ ^[0-9]+$ ]] || die "bad ALPSCK_SLURM_GRACE: '$GRACE'"
MEM=$((hw_mem * 95 / 100))
((MEM >= 256)) || MEM=256

new_conf="$(mktemp)"
trap 'rm -f "$new_conf"' EXIT
cat >"$new_conf" <<EOF
# Written by alpsck slurm/local-cluster/start.sh; rewritten on every start. See its README.md.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$CTL_HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Requeued jobs are held until the job credential expires (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$SLURMCTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$SLURMCTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups needed (containers / VMs without a delegated cgroup tree).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/log/jobcomp.log
MpiDefault=none
MailProg=/bin/true
# Jobs share the node per CPU.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A requeued/preempted job becomes eligible again while nothing else happens; only a timed
# scheduler pass starts it: backfill every 5 s instead of 30 s.
SchedulerParameters=bf_interval=5,sched_interval=5
# Preemption by partition: a job in 'urgent' requeues jobs in 'debug'.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
# Seconds between SIGTERM and SIGKILL at time limit / cancel.
KillWait=10
# Finished jobs stay visible to scontrol/squeue this long (seconds).
MinJobAge=120
# A node that was DOWN comes back as soon as its slurmd registers.
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
# Trust the node line below instead of draining the node on hardware differences.
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES PriorityTier=1 MaxTime=INFINITE State=UP PreemptMode=REQUEUE GraceTime=$GRACE
PartitionName=urgent Nodes=ALL Default=NO PriorityTier=10 MaxTime=INFINITE State=UP PreemptMode=OFF
EOF

mkdir -p "$SLURM_CONF_DIR"
conf_changed=0
if ! cmp -s "$new_conf" "$SLURM_CONF"; then
    conf_changed=1
    install -m 0644 "$new_conf" "$SLURM_CONF"
    log "wrote $SLURM_CONF (node $NODE: $CPUS CPUs, ${MEM} MB)"
fi
# slurmd reads cgroup.conf when present; make one that can never ask for cgroup enforcement.
if [[ ! -f "$CGROUP_CONF" ]] || ! grep -q 'alpsck' "$CGROUP_CONF"; then write_cgroup_conf "$CGROUP_CONF"; fi
printf '%s\n' "$NODE" >"$NODE_NAME_FILE"

# ---------------------------------------------------------------------------------------------
# 4. Daemons.
node_ready() {
    local st
    st="$(node_state "$NODE")"
    [[ "$st" == idle || "$st" == mix || "$st" == alloc ]]
}

healthy() {
    pid_alive "$SLURMCTLD_PID" slurmctld && pid_alive "$SLURMD_PID" slurmd && ctld_up \
        && node_ready
}

summary() {
    printf 'alpsck-local SLURM cluster %s: node %s (%s CPUs, %s MB), partitions debug (default) + urgent, ctld %s, state %s\n' \
        "$1" "$NODE" "$CPUS" "$MEM" "$CTL_HOST" "$STATE_DIR"
}

if ((conf_changed == 0)) && healthy; then
    summary "already up"
    exit 0
fi

stop_daemon() { # PIDFILE NAME
    local pid i
    pid_alive "$1" "$2" || return 0
    pid="$(cat "$1")"
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do
        proc_running "$pid" || return 0
        sleep 0.5
    done
    kill -9 "$pid" 2>/dev/null || true
}

if ((conf_changed)); then
    # New node/partition definitions need fresh daemons.
    stop_daemon "$SLURMD_PID" slurmd
    stop_daemon "$SLURMCTLD_PID" slurmctld
fi

if ! pid_alive "$SLURMCTLD_PID" slurmctld; then
    log "starting slurmctld"
    slurmctld -f "$SLURM_CONF" 9>&- >>"$STATE_DIR/log/slurmctld.stderr" 2>&1 \
        || die "slurmctld failed to start"
    wait_for 30 "slurmctld to write its pid file" pid_alive "$SLURMCTLD_PID" slurmctld
fi
# Fails at once when slurmctld died (bad config, port in use) instead of waiting it out.
ctld_up_or_dead() {
    pid_alive "$SLURMCTLD_PID" slurmctld || die "slurmctld exited right after starting"
    ctld_up
}
wait_for 30 "slurmctld to answer (scontrol ping)" ctld_up_or_dead

if ! pid_alive "$SLURMD_PID" slurmd; then
    log "starting slurmd"
    slurmd_args=(-f "$SLURM_CONF")
    [[ "$NODE" == "$SHORT" ]] || slurmd_args+=(-N "$NODE")
    slurmd "${slurmd_args[@]}" 9>&- >>"$STATE_DIR/log/slurmd.stderr" 2>&1 || die "slurmd failed to start"
    wait_for 30 "slurmd to write its pid file" pid_alive "$SLURMD_PID" slurmd
fi

deadline=$((SECONDS + WAIT_TIMEOUT))
resumed=0
while :; do
    pid_alive "$SLURMD_PID" slurmd || die "slurmd exited right after starting"
    st="$(node_state "$NODE")"
    case "$st" in
        idle | mix | alloc) break ;;
        down | drain | drng | drained | fail | failg)
            # DOWN/DRAIN without '*' means slurmd answers but the node was set unavailable
            # (earlier run, unexpected reboot): put it back.
            if ((resumed < 3)); then
                log "node $NODE is '$st'; resuming it"
                scontrol update nodename="$NODE" state=resume || true
                resumed=$((resumed + 1))
            fi
            ;;
    esac
    if ((SECONDS >= deadline)); then
        scontrol show node "$NODE" >&2 || true
        die "node $NODE not idle after ${WAIT_TIMEOUT}s (state '${st:-unknown}')"
    fi
    sleep 1
done

summary "up"
