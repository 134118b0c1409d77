# shellcheck shell=bash
# The multi-node cluster, sourced by `start.sh --nodes N` (N >= 2) once munge answers: slurmctld and N
# slurmd, each in its own network, UTS and mount namespaces (its own address on the bridge alpsckbr0, its
# own host name, its own /dev/shm), one munged for all (its Unix socket crosses network namespaces). Its
# slurm.conf is $MULTI_CONF: point the commands at it with SLURM_CONF. It runs beside the one-node cluster.
# Idempotent: a healthy cluster of the same shape is left alone; a node whose processes were killed
# (kill-node.sh) is started again, with an empty /dev/shm; a changed shape restarts every daemon.
# Uses start.sh's log, die, wait_for and lib.sh's names.

show_logs() {  # what die() prints: this cluster's logs
    local f
    for f in "$MULTI_STATE"/log/*.log "$MULTI_STATE"/log/*.stderr; do
        [[ -s "$f" && "$f" != */jobcomp.log ]] || continue
        printf -- '----- tail of %s -----\n' "$f" >&2
        tail -n 15 "$f" >&2 || true
    done
}

NODES_CPUS="${ALPSCK_SLURM_CPUS:-4}"     # CPUs each node declares (scheduling tokens: task/none)
NODES_SHM="${ALPSCK_SLURM_NODE_SHM:-2g}"  # the size of each node's /dev/shm (tmpfs)
[[ "$NODES_CPUS" =~ ^[1-9][0-9]*$ ]] || die "bad ALPSCK_SLURM_CPUS: '$NODES_CPUS'"
[[ "$NODES_SHM" =~ ^[1-9][0-9]*[kmg]?$ ]] || die "bad ALPSCK_SLURM_NODE_SHM: '$NODES_SHM' (a tmpfs size: 512m, 2g)"
for tool in ip unshare nsenter; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (iproute2, util-linux): the nodes need namespaces"
done

mkdir -p "$MULTI_STATE"/{etc,ctld,spool,log,run}
exec 8>"$MULTI_STATE/run/start.lock"
flock -w 120 8 || die "another start.sh holds $MULTI_STATE/run/start.lock"

# ---- the network: a bridge with the host on .254, a veth pair into each namespace.
if ! ip link show "$MULTI_BRIDGE" >/dev/null 2>&1; then
    ip link add "$MULTI_BRIDGE" type bridge || die "cannot create the bridge $MULTI_BRIDGE"
    ip addr add "$MULTI_NET.254/24" dev "$MULTI_BRIDGE"
fi
ip link set "$MULTI_BRIDGE" up
# Bridged frames must not meet the host's iptables FORWARD rules (a DROP policy, as Docker sets).
if [[ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]]; then echo 0 >/proc/sys/net/bridge/bridge-nf-call-iptables; fi

ns_up() {  # ns_up NAME ADDR: the namespace, its veth on the bridge, its address; idempotent
    local name="$1" addr="$2" veth="ack-${1#alpsck-}"
    [[ -e "/run/netns/$name" ]] || ip netns add "$name" || die "ip netns add $name failed"
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip link add "$veth" type veth peer name eth0 netns "$name" || die "cannot create the veth pair of $name"
    fi
    ip link set "$veth" master "$MULTI_BRIDGE" up
    ip -n "$name" link set lo up
    ip -n "$name" addr replace "$addr/24" dev eth0
    ip -n "$name" link set eth0 up
}

names=()
for ((i = 1; i <= NODES; i++)); do names+=("$(multi_node_name "$i")"); done
ns_up "$MULTI_CTL" "$MULTI_NET.1"
for ((i = 1; i <= NODES; i++)); do ns_up "${names[i - 1]}" "$(multi_node_addr "$i")"; done

# ---- names: every namespace shares /etc/hosts; srun and gloo reach a node by its host name.
hosts_block() {
    echo "$MULTI_HOSTS_BEGIN"
    echo "$MULTI_NET.1 $MULTI_CTL"
    for ((i = 1; i <= NODES; i++)); do echo "$(multi_node_addr "$i") ${names[i - 1]}"; done
    echo "$MULTI_HOSTS_END"
}
new_hosts="$(mktemp)"
hosts_without_multi >"$new_hosts"
hosts_block >>"$new_hosts"
cmp -s "$new_hosts" /etc/hosts || cat "$new_hosts" >/etc/hosts  # in place: /etc/hosts may be a bind mount
rm -f "$new_hosts"

# ---- slurm.conf
hw_mem="$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)"
NODE_MEM=$((hw_mem * 95 / 100 / NODES))
((NODE_MEM >= 256)) || NODE_MEM=256
new_conf="$(mktemp)"
{
    cat <<EOF
# Written by alpsck slurm/local-cluster/start.sh --nodes $NODES; rewritten on every start. See its README.md.
ClusterName=$MULTI_CLUSTER
SlurmctldHost=$MULTI_CTL($MULTI_NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=$MULTI_STATE/ctld
SlurmdSpoolDir=$MULTI_STATE/spool/%n
SlurmctldPidFile=$(multi_pidfile "$MULTI_CTL")
SlurmdPidFile=$MULTI_STATE/run/%n.pid
SlurmctldLogFile=$MULTI_STATE/log/slurmctld.log
SlurmdLogFile=$MULTI_STATE/log/%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$MULTI_STATE/log/jobcomp.log
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
JobRequeue=1
KillWait=10
MinJobAge=120
# A node whose slurmd stops answering is DOWN after this many seconds (kill-node.sh).
SlurmdTimeout=10
ReturnToService=2
InactiveLimit=0
SlurmdParameters=config_overrides
EOF
    for ((i = 1; i <= NODES; i++)); do
        echo "NodeName=${names[i - 1]} NodeAddr=$(multi_node_addr "$i") CPUs=$NODES_CPUS RealMemory=$NODE_MEM State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} >"$new_conf"
conf_changed=0
if ! cmp -s "$new_conf" "$MULTI_CONF"; then
    conf_changed=1
    install -m 0644 "$new_conf" "$MULTI_CONF"
    log "wrote $MULTI_CONF ($NODES nodes: $NODES_CPUS CPUs, ${NODE_MEM} MB, /dev/shm $NODES_SHM each)"
fi
rm -f "$new_conf"
write_cgroup_conf "$MULTI_STATE/etc/cgroup.conf"  # slurmd reads it beside slurm.conf
printf '%s\n' "${names[@]}" >"$MULTI_STATE/run/nodes"
for name in "${names[@]}"; do mkdir -p "$MULTI_STATE/spool/$name"; done
export SLURM_CONF="$MULTI_CONF"

# ---- daemons: each entered into its network namespace by nsenter (ip netns exec would remount /sys,
# leaving no /sys/fs/cgroup, which slurmd's cgroup plugin reads), with its own UTS namespace (host name).
in_ns_kill() { netns_kill_all "$1" || die "processes of $1 survive SIGKILL"; }
if ((conf_changed)); then
    for name in "${names[@]}" "$MULTI_CTL"; do in_ns_kill "$name"; done
    rm -rf "${MULTI_STATE:?}/ctld" && mkdir -p "$MULTI_STATE/ctld"  # no job of another shape recovered
    # Nodes of an earlier, larger shape: gone with their namespaces.
    for ns in $(ip netns list | awk '{print $1}' | grep '^alpsck-n[0-9]*$' || true); do
        [[ " ${names[*]} " == *" $ns "* ]] && continue
        in_ns_kill "$ns"
        ip link del "ack-${ns#alpsck-}" 2>/dev/null || true
        ip netns del "$ns" || true
    done
fi

multi_ctld_up() { timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; }
if ! pid_alive "$(multi_pidfile "$MULTI_CTL")" slurmctld; then
    log "starting slurmctld in $MULTI_CTL ($MULTI_NET.1)"
    nsenter --net="/run/netns/$MULTI_CTL" unshare --uts sh -c 'hostname "$1" && exec slurmctld -f "$2"' sh "$MULTI_CTL" \
        "$MULTI_CONF" 8>&- 9>&- >>"$MULTI_STATE/log/slurmctld.stderr" 2>&1 || die "slurmctld failed to start"
    wait_for 30 "slurmctld ($MULTI_CTL) to write its pid file" pid_alive "$(multi_pidfile "$MULTI_CTL")" slurmctld
fi
wait_for 30 "slurmctld ($MULTI_CTL) to answer" multi_ctld_up

for name in "${names[@]}"; do
    pid_alive "$(multi_pidfile "$name")" slurmd && continue
    in_ns_kill "$name"  # what is left of a node killed by kill-node.sh
    log "starting slurmd $name ($(getent hosts "$name" | awk '{print $1}')), /dev/shm $NODES_SHM of its own"
    nsenter --net="/run/netns/$name" unshare --uts --mount --propagation private sh -c \
        'hostname "$1" && mount -t tmpfs -o "mode=1777,size=$2" tmpfs /dev/shm && exec slurmd -N "$1" -f "$3"' \
        sh "$name" "$NODES_SHM" "$MULTI_CONF" 8>&- 9>&- >>"$MULTI_STATE/log/$name.stderr" 2>&1 \
        || die "slurmd $name failed to start"
    wait_for 30 "slurmd $name to write its pid file" pid_alive "$(multi_pidfile "$name")" slurmd
done

deadline=$((SECONDS + WAIT_TIMEOUT))
for name in "${names[@]}"; do
    resumed=0
    while :; do
        st="$(node_state "$name")"
        case "$st" in
            idle | mix | alloc) break ;;
            down | drain | drng | drained | fail | failg)
                if ((resumed < 3)); then
                    scontrol update nodename="$name" state=resume || true
                    resumed=$((resumed + 1))
                fi
                ;;
        esac
        if ((SECONDS >= deadline)); then
            scontrol show node "$name" >&2 || true
            die "node $name not idle after ${WAIT_TIMEOUT}s (state '${st:-unknown}'); its log: $MULTI_STATE/log/$name.log"
        fi
        sleep 1
    done
done
printf 'alpsck-nodes SLURM cluster up: %s nodes (%s), %s CPUs and /dev/shm %s each, controller %s (%s.1); use it with\n  export SLURM_CONF=%s\n' \
    "$NODES" "${names[*]}" "$NODES_CPUS" "$NODES_SHM" "$MULTI_CTL" "$MULTI_NET" "$MULTI_CONF"
