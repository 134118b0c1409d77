# shellcheck shell=bash disable=SC2034
# Shared settings and helpers for start.sh, stop.sh and smoke.sh. Sourced, never run.
#
# Everything the local cluster writes lives under one state directory (override with
# ALPSCK_SLURM_STATE); only slurm.conf/cgroup.conf go to /etc/slurm and munge keeps its usual
# Debian paths (/etc/munge, /run/munge, /var/log/munge, /var/lib/munge).

# sbin is not on PATH for every root shell (su without -, CI runners).
export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"

ALPSCK_SLURM_STATE="${ALPSCK_SLURM_STATE:-/var/lib/alpsck-slurm}"
STATE_DIR="$ALPSCK_SLURM_STATE"
SLURM_CONF_DIR=/etc/slurm
SLURM_CONF="$SLURM_CONF_DIR/slurm.conf"
CGROUP_CONF="$SLURM_CONF_DIR/cgroup.conf"
CLUSTER_NAME=alpsck-local

SLURMCTLD_PID="$STATE_DIR/run/slurmctld.pid"
SLURMD_PID="$STATE_DIR/run/slurmd.pid"
SLURMCTLD_LOG="$STATE_DIR/log/slurmctld.log"
SLURMD_LOG="$STATE_DIR/log/slurmd.log"
# Written by start.sh only when it started munged itself (stop.sh stops only that one).
MUNGED_OURS="$STATE_DIR/run/munged.started-by-alpsck"
MUNGED_PID=/run/munge/munged.pid
MUNGED_LOG=/var/log/munge/munged.log
# Node name chosen by start.sh (see node_name below); stop.sh / smoke.sh read it back.
NODE_NAME_FILE="$STATE_DIR/run/nodename"

# The name slurmctld/slurmd compare against SlurmctldHost / NodeName is gethostname() cut at
# the first dot (slurm's gethostname_short). `uname -n` is gethostname(); `hostname -s` can fail
# or try DNS on machines whose name does not resolve, so it is not used.
short_hostname() {
    local name
    name="$(uname -n)"
    printf '%s\n' "${name%%.*}"
}

# NodeName for the single node: the short host name when slurm can use it as a node name,
# otherwise a fixed name (slurmd is then started with -N so it still finds its record).
node_name() {
    local short
    short="$(short_hostname)"
    if [[ "$short" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$ && "$short" != localhost ]]; then
        printf '%s\n' "$short"
    else
        printf '%s\n' alpsck-node
    fi
}

# proc_running PID: PID exists and is not a zombie. (Daemons are reparented to PID 1, which on
# container-like machines may not reap them: kill -0 alone would call a dead daemon alive.)
proc_running() {
    local stat rest
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    rest="${stat##*) }"
    [[ -n "$rest" && "${rest:0:1}" != Z && "${rest:0:1}" != X ]]
}

# pid_alive PIDFILE [NAME]: the pid in PIDFILE runs (and, if NAME is given, is that program).
pid_alive() {
    local pidfile="$1" name="${2:-}" pid comm
    [[ -r "$pidfile" ]] || return 1
    pid="$(tr -dc '0-9' <"$pidfile")"
    [[ -n "$pid" ]] || return 1
    proc_running "$pid" || return 1
    if [[ -n "$name" ]]; then
        comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
        [[ "$comm" == "$name" ]] || return 1
    fi
    return 0
}

# pids_named NAME: pids of running processes whose command name is NAME (no procps needed), in this
# network namespace only: a daemon of the multi-node cluster (start.sh --nodes) holds no port of ours.
pids_named() {
    local f pid here
    here="$(readlink /proc/self/ns/net 2>/dev/null || true)"
    for f in /proc/[0-9]*/comm; do
        [[ "$(cat "$f" 2>/dev/null || true)" == "$1" ]] || continue
        pid="${f#/proc/}"
        pid="${pid%/comm}"
        [[ "$(readlink "/proc/$pid/ns/net" 2>/dev/null || true)" == "$here" ]] || continue
        proc_running "$pid" && printf '%s\n' "$pid"
    done
    return 0
}

# munge_works: a credential made here decodes here (munged up, key readable, socket reachable).
munge_works() {
    command -v munge >/dev/null 2>&1 && command -v unmunge >/dev/null 2>&1 || return 1
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

# node_state NODE: sinfo's compact state of NODE ("idle", "mix", "down*", "drain", ...).
node_state() {
    timeout 10 sinfo -h -n "$1" -o '%t' 2>/dev/null | head -n 1
}

# ctld_up: slurmctld answers.
ctld_up() {
    timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'
}

systemd_is_init() {
    [[ "$(cat /proc/1/comm 2>/dev/null || true)" == systemd ]]
}

# ---- the multi-node cluster (start.sh --nodes N, N >= 2; start_nodes.sh): a controller and N nodes, each in
# its own network, UTS and mount namespaces, on one bridge. It has its own state directory and slurm.conf
# (SLURM_CONF points the commands at it) and runs beside the one-node cluster (other namespaces, other ports).
MULTI_STATE="${ALPSCK_SLURM_MULTI_STATE:-/var/lib/alpsck-slurm-nodes}"
MULTI_CONF="$MULTI_STATE/etc/slurm.conf"
MULTI_CLUSTER=alpsck-nodes
MULTI_BRIDGE=alpsckbr0
MULTI_NET=10.77.0             # /24: the host .254, the controller .1, node i .(10 + i)
MULTI_CTL=alpsck-ctl          # the controller's host name and network namespace
MULTI_HOSTS_BEGIN="# alpsck-nodes begin: written by start.sh --nodes, removed by stop.sh"
MULTI_HOSTS_END="# alpsck-nodes end"

multi_node_name() { printf 'alpsck-n%s\n' "$1"; }           # node i's host name and namespace
multi_node_addr() { printf '%s.%s\n' "$MULTI_NET" $((10 + $1)); }
multi_pidfile() { printf '%s/run/%s.pid\n' "$MULTI_STATE" "$1"; }  # NAME: alpsck-ctl or a node's
# multi_nodes: the node names of the configured multi-node cluster (none when it was never started).
multi_nodes() {
    [[ -r "$MULTI_STATE/run/nodes" ]] && cat "$MULTI_STATE/run/nodes"
    return 0
}

# netns_kill_all NAME: SIGKILL every process in the network namespace NAME until none is left (10 s);
# fails when some survive. (A node's mount namespace, and its /dev/shm, goes with the last of them.)
netns_kill_all() {
    local pids i
    for ((i = 0; i < 40; i++)); do
        pids="$(ip netns pids "$1" 2>/dev/null || true)"
        [[ -n "$pids" ]] || return 0
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
        sleep 0.25
    done
    [[ -z "$(ip netns pids "$1" 2>/dev/null || true)" ]]
}

# write_cgroup_conf FILE: the cgroup.conf slurmd reads beside slurm.conf, with no cgroup enforcement.
write_cgroup_conf() {
    cat >"$1" <<'EOF'
# Written by alpsck slurm/local-cluster/start.sh: no cgroup enforcement (task/none, linuxproc).
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
}

# hosts_without_multi: /etc/hosts without the multi-node cluster's block.
hosts_without_multi() {
    sed "/^$MULTI_HOSTS_BEGIN\$/,/^$MULTI_HOSTS_END\$/d" /etc/hosts
}
