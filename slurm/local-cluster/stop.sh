#!/usr/bin/env bash
# Stop the clusters that start.sh started (the one-node one, and the multi-node one of --nodes N):
# cancel leftover jobs, then stop slurmd, slurmctld, and munged if start.sh started it. Idempotent:
# stopping a stopped cluster is fine. `stop.sh --nodes` stops the multi-node cluster only.
#
# Environment: ALPSCK_SLURM_STATE (default /var/lib/alpsck-slurm), as for start.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"

log() { printf 'stop.sh: %s\n' "$*" >&2; }

only_nodes=0  # stop.sh --nodes: the multi-node cluster only, the one-node one left running
case "${1:-}" in
    "") ;;
    --nodes) only_nodes=1 ;;
    *) echo "stop.sh: unknown argument '$1' (usage: stop.sh [--nodes])" >&2; exit 2 ;;
esac

[[ "$(id -u)" -eq 0 ]] || { echo "stop.sh: must run as root (as another user: sudo $0)" >&2; exit 1; }

# stop_daemon PIDFILE NAME: SIGTERM, wait up to 20 s, then SIGKILL.
stop_daemon() {
    local pidfile="$1" name="$2" pid i
    if ! pid_alive "$pidfile" "$name"; then
        rm -f "$pidfile"
        return 0
    fi
    pid="$(tr -dc '0-9' <"$pidfile")"
    log "stopping $name (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do
        if ! proc_running "$pid"; then
            rm -f "$pidfile"
            return 0
        fi
        sleep 0.5
    done
    log "$name (pid $pid) ignored SIGTERM for 20 s; killing it"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stopped=()

# 0. The multi-node cluster (start.sh --nodes N), when there is one: its jobs, every process in its
# namespaces, the namespaces, the bridge and the /etc/hosts lines.
if [[ -e "/run/netns/$MULTI_CTL" ]] || ip link show "$MULTI_BRIDGE" >/dev/null 2>&1; then
    if pid_alive "$(multi_pidfile "$MULTI_CTL")" slurmctld; then
        SLURM_CONF="$MULTI_CONF" timeout 10 squeue -h -o '%i' 2>/dev/null \
            | SLURM_CONF="$MULTI_CONF" xargs -r timeout 10 scancel --full 2>/dev/null || true
    fi
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^($MULTI_CTL|alpsck-n[0-9]+)\$" || true); do
        netns_kill_all "$ns" || log "processes of $ns survive SIGKILL"
        ip link del "ack-${ns#alpsck-}" 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$MULTI_BRIDGE" 2>/dev/null || true
    if grep -qxF "$MULTI_HOSTS_BEGIN" /etc/hosts; then
        hosts="$(mktemp)"
        hosts_without_multi >"$hosts" && cat "$hosts" >/etc/hosts
        rm -f "$hosts"
    fi
    # Its jobs are gone with its processes: a controller started later must not recover them.
    rm -rf "${MULTI_STATE:?}/ctld" "$MULTI_STATE"/run/*.pid "$MULTI_STATE/run/nodes"
    stopped+=("multi-node cluster")
fi

if ((only_nodes)); then
    if ((${#stopped[@]})); then echo "alpsck-nodes SLURM cluster stopped"; else echo "alpsck-nodes SLURM cluster was not running"; fi
    exit 0
fi

# 1. Jobs: cancel everything while the controller still answers, so no job survives into the
# next start (slurmctld keeps jobs in its state directory across restarts).
if pid_alive "$SLURMCTLD_PID" slurmctld && ctld_up; then
    jobs_left="$(timeout 10 squeue -h -o '%i' 2>/dev/null | wc -l || true)"
    if [[ "${jobs_left:-0}" -gt 0 ]]; then
        log "cancelling $jobs_left job(s)"
        timeout 10 squeue -h -o '%i' 2>/dev/null | xargs -r timeout 10 scancel --full || true
        # Give slurmd a moment to kill the job processes.
        for ((i = 0; i < 20; i++)); do
            [[ "$(timeout 10 squeue -h -t RUNNING,COMPLETING -o '%i' 2>/dev/null | wc -l)" -eq 0 ]] && break
            sleep 0.5
        done
    fi
    # Reservations left behind by tests would block jobs after the next start.
    for resv in $(timeout 10 scontrol show reservation -o 2>/dev/null \
                  | sed -n 's/^ReservationName=\([^ ]*\).*/\1/p'); do
        timeout 10 scontrol delete reservation="$resv" 2>/dev/null || true
    done
fi

# 2. Daemons: slurmd first (it kills what is left of the jobs), then the controller.
if pid_alive "$SLURMD_PID" slurmd; then stopped+=(slurmd); fi
stop_daemon "$SLURMD_PID" slurmd
if pid_alive "$SLURMCTLD_PID" slurmctld; then stopped+=(slurmctld); fi
stop_daemon "$SLURMCTLD_PID" slurmctld

# 3. munged, only when start.sh started it.
if [[ -e "$MUNGED_OURS" ]]; then
    if pid_alive "$MUNGED_PID" munged; then stopped+=(munged); fi
    stop_daemon "$MUNGED_PID" munged
    rm -f "$MUNGED_OURS"
elif pid_alive "$MUNGED_PID" munged; then
    log "leaving munged running (not started by start.sh)"
fi

if ((${#stopped[@]})); then
    echo "alpsck-local SLURM cluster stopped (${stopped[*]})"
else
    echo "alpsck-local SLURM cluster was not running"
fi
