"""The health gate's probe on one node (``python -c ... RUN_DIR LIMITS_JSON``, one task per node, started by
:func:`alpsck.slurm.health_gate.probe_nodes`): this node's checks (:func:`alpsck.node_health.checks.node_checks`)
as one JSON line on stdout, ``{"node": NAME, "checks": [{"name", "ok", "detail", "seconds"}, ...]}``.
It only reads the node and writes a probe file it removes: the gate decides."""

from __future__ import annotations

import json
import sys

from .checks import Limits, node_checks, node_name

# The probe as srun runs it: the working directory off sys.path (a source tree there would shadow the
# installed alpsck, as in alpsck.slurm.launch), then main() with the arguments.
CODE = "import sys; del sys.path[0]; from alpsck.node_health.probe import main; sys.exit(main(sys.argv[1:]))"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: probe RUN_DIR LIMITS_JSON", file=sys.stderr)
        return 2
    run_dir, limits = argv
    checks = node_checks(run_dir, Limits.from_dict(json.loads(limits)))
    print(json.dumps({"node": node_name(), "checks": [c.as_dict() for c in checks]}), flush=True)
    return 0
