#!/usr/bin/env bash
# Run a command inside a node of the multi-node cluster (start.sh --nodes N): in its network, UTS and
# mount namespaces, so it sees the node's host name, address and /dev/shm, as the node's jobs do.
#
#   slurm/local-cluster/node.sh alpsck-n2 ls /dev/shm
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
source "$HERE/lib.sh"
(($# >= 2)) || { echo "usage: node.sh NODE COMMAND [ARGS...] (nodes: $(multi_nodes | tr '\n' ' '))" >&2; exit 2; }
node=$1; shift
multi_nodes | grep -qx -- "$node" || { echo "node.sh: no node '$node' (nodes: $(multi_nodes | tr '\n' ' '))" >&2; exit 2; }
pidfile="$(multi_pidfile "$node")"
pid_alive "$pidfile" slurmd || { echo "node.sh: node $node is down: its slurmd does not run (start.sh --nodes N starts it)" >&2; exit 1; }
exec nsenter --target "$(tr -dc '0-9' <"$pidfile")" --net --uts --mount -- "$@"
