#!/usr/bin/env bash
# Kill a node of the multi-node cluster (start.sh --nodes N) as a node failure would: SIGKILL to every
# process in it (its slurmd, the job steps, their tasks), which takes its /dev/shm with its mount
# namespace; then wait until SLURM records the failure (the node DOWN, not responding: SlurmdTimeout,
# 10 s). `start.sh --nodes N` brings the node back, empty.
#
#   slurm/local-cluster/kill-node.sh alpsck-n2 [--no-wait]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"
[[ "$(id -u)" -eq 0 ]] || { echo "kill-node.sh: must run as root" >&2; exit 1; }
(($# >= 1)) || { echo "usage: kill-node.sh NODE [--no-wait] (nodes: $(multi_nodes | tr '\n' ' '))" >&2; exit 2; }
node=$1
wait_down=1
[[ "${2:-}" == --no-wait ]] && wait_down=0
multi_nodes | grep -qx -- "$node" || { echo "kill-node.sh: no node '$node' (nodes: $(multi_nodes | tr '\n' ' '))" >&2; exit 2; }
[[ -e "/run/netns/$node" ]] || { echo "kill-node.sh: node $node has no namespace (is the cluster up?)" >&2; exit 1; }

killed=$(ip netns pids "$node" 2>/dev/null | wc -l)
netns_kill_all "$node" || { echo "kill-node.sh: processes of $node survive SIGKILL" >&2; exit 1; }
echo "kill-node.sh: $node killed ($killed processes)"
((wait_down)) || exit 0
export SLURM_CONF="$MULTI_CONF"
for ((i = 0; i < 120; i++)); do
    st="$(node_state "$node")"
    if [[ "$st" == down* ]]; then  # down*: it stopped answering (idle* first, then down after SlurmdTimeout)
        echo "kill-node.sh: SLURM says $node is '$st'"
        exit 0
    fi
    sleep 0.5
done
echo "kill-node.sh: SLURM still calls $node '${st:-unknown}' after 60 s" >&2
exit 1
