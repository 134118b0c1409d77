"""slurm.spare_nodes (alpsck/slurm/spare_nodes.py): the config, the batch script's allocation and step options, and
the restart loop's placement function, run by bash against stand-ins for squeue, sinfo and scontrol. The real
thing, a node killed and its ranks restarted on the spare, is tests/slurm/test_slurm_nodes.py."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

from alpsck.errors import ConfigError
from alpsck.slurm import history, spare_nodes, timeline
from alpsck.slurm.config import parse_config
from alpsck.slurm.submit import sbatch_script

GOOD = """\
name: t
run_dir: /tmp/x
slurm:
  time: "00:10:00"
  nodes: 2
  tasks_per_node: 4
  spare_nodes: 1
entry:
  function: alpsck.examples.llama.train:slurm_entry
"""


def test_the_script_allocates_the_spares_with_no_kill_and_runs_each_step_on_the_nodes_it_needs() -> None:
    text = sbatch_script(parse_config(GOOD))
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text and "#SBATCH --ntasks-per-node=4\n" in text
    [srun] = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert srun.startswith('srun ${alpsck_exclude:+"--exclude=$alpsck_exclude"} ')
    assert " --nodes=2 --ntasks=8 --ntasks-per-node=4 --overlap " in srun
    loop = text[text.index("while :; do"):]
    assert loop.index(f"{spare_nodes.PLACE} || break") < loop.index("srun ")  # placed before each restart
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_without_spares_nothing_changes() -> None:
    text = sbatch_script(parse_config(GOOD.replace("  spare_nodes: 1\n", "")))
    assert "--no-kill" not in text and "#SBATCH --nodes=2\n" in text and spare_nodes.PLACE not in text
    assert "--overlap" not in text and "alpsck_exclude" not in text


def test_spares_without_in_job_restarts_are_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError, match=r"slurm\.spare_nodes: .*requeue\.in_job_restarts is 0"):
        parse_config(GOOD + "requeue:\n  in_job_restarts: 0\n")
    with pytest.raises(ConfigError, match=r"slurm\.spare_nodes: nodes \+ spare_nodes is 4294967295"):
        parse_config(GOOD.replace("  nodes: 2\n", "  nodes: 4294967293\n").replace("spare_nodes: 1", "spare_nodes: 2"))


def _place(tmp_path: Path, squeue: str, sinfo: str, need: int = 2, requeue_fails: bool = False) -> tuple[int, str, str, str]:
    """Run the batch script's placement function with stand-in SLURM commands: its status, the nodes it
    excludes, what it said, and what scontrol was asked. Its history goes to ``tmp_path/run``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    asked = tmp_path / "scontrol-args"
    stand_ins = {
        "squeue": f"printf '%s' {shlex.quote(squeue)}",
        "sinfo": f"printf '%s' {shlex.quote(sinfo)}",
        # scontrol show hostnames LIST: the stand-in knows two lists; requeue: recorded
        "scontrol": (f'echo "$@" >> {asked}\n'
                     'case "$3" in "n[1-3]") printf "n1\\nn2\\nn3\\n" ;; "n[1,3]") printf "n1\\nn3\\n" ;; esac'
                     + ('\n[ "$1" != requeue ]' if requeue_fails else "")),
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    cfg = parse_config(GOOD.replace("nodes: 2", f"nodes: {need}"))
    (tmp_path / "run").mkdir(exist_ok=True)
    script = "\n".join([*history.shell_append_lines(tmp_path / "run"), *spare_nodes.batch_lines(cfg),
                        f'{spare_nodes.PLACE}; echo "rc=$? exclude=${spare_nodes.EXCLUDE}"'])
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"})
    rc, excluded = r.stdout.split()[-2:]
    return int(rc.split("=")[1]), excluded.split("=", 1)[1], r.stderr, asked.read_text() if asked.exists() else ""


def test_a_restart_excludes_the_nodes_slurm_cannot_start_a_step_on(tmp_path: Path) -> None:
    rc, excluded, said, asked = _place(tmp_path, "n[1-3]", "n1 mix\nn2 down*\nn3 idle\n")
    assert (rc, excluded) == (0, "n2") and "excludes n2" in said and "requeue" not in asked
    # not responding (a suffix *), drained, failing: all left out; the states a step can start on: kept
    rc, excluded, said, asked = _place(tmp_path, "n[1-3]", "n1 alloc\nn2 idle*\nn3 mix\n")
    assert (rc, excluded) == (0, "n2")
    rc, excluded, _, _ = _place(tmp_path, "n[1,3]", "n1 mix\nn3 mix\n")  # SLURM dropped the dead node already
    assert (rc, excluded) == (0, "")
    # A flag that leaves the node up (a reboot pending after the jobs, a maintenance reservation) keeps it usable;
    # powered down or not responding does not.
    rc, excluded, _, _ = _place(tmp_path, "n[1-3]", "n1 mix@\nn2 alloc~\nn3 alloc$\n")
    assert (rc, excluded) == (0, "n2")


def test_too_few_nodes_left_requeues_the_job_instead_of_a_restart_and_the_history_says_so(tmp_path: Path) -> None:
    rc, excluded, said, asked = _place(tmp_path, "n[1-3]", "n1 mix\nn2 down*\nn3 drain\n")
    assert rc == 1 and excluded == "n2,n3"
    assert "1 usable node(s) left in this allocation (n[1-3]; not usable: n2,n3), the job step needs 2" in said
    assert asked.splitlines()[-1] == "requeue 77"
    [event] = history.read_log(tmp_path / "run").events  # what `alpsck status` reads: the job was requeued, and why
    assert {k: event[k] for k in ("event", "reason", "mechanism", "job_id", "host")} == {
        "event": "requeued", "reason": "nodes", "mechanism": "scontrol", "job_id": "77", "host": socket.gethostname()}
    assert abs(event["time"] - time.time()) < 60
    assert timeline.read(str(tmp_path / "run")).state == "requeued"


def test_a_requeue_that_fails_is_said_and_not_recorded(tmp_path: Path) -> None:
    rc, _, said, asked = _place(tmp_path, "n[1-3]", "n1 mix\nn2 down*\nn3 drain\n", requeue_fails=True)
    assert rc == 1 and asked.splitlines()[-1] == "requeue 77" and "the requeue failed: the job ends here" in said
    assert not (tmp_path / "run" / history.HISTORY).exists()


def test_no_answer_from_squeue_lets_slurm_place_the_step(tmp_path: Path) -> None:
    rc, excluded, said, asked = _place(tmp_path, "", "")
    assert (rc, excluded, asked) == (0, "", "")


def test_the_rendezvous_host_is_the_steps_first_node_not_the_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted step on the survivors and a spare: the job's first node (n1) is the dead one."""
    from alpsck.job_env import JobEnv
    from alpsck.slurm.runner import export_torch_distributed_env

    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3",
                        "SLURM_STEP_NODELIST": "n[2-3]", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
                        "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(name, value)
    export_torch_distributed_env("77", attempt=1, step_nodes=JobEnv.detect(dict(os.environ)).step_nodes)
    assert (os.environ["MASTER_ADDR"], os.environ["WORLD_SIZE"], os.environ["RANK"]) == ("n2", "8", "5")
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"  # submitit's own, 8 tasks over the job's 3 nodes, would be 2
